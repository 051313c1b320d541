"""The Python entry point: ``fuser.optimize(model_or_path, ...)`` -> (optimized model, report)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from fuser.blame import Attempt, find_guilty
from fuser.context import Context, machine_nchwc_block, resolve_context
from fuser.engine import Engine, EngineResult, Rewrite
from fuser.errors import NumericsMismatch, UsageError
from fuser.graph import all_graph_protos
from fuser.measure import Timing
from fuser.measure import compare as compare_latency
from fuser.model import Model, count_op_types
from fuser.nchwc import has_nchwc
from fuser.nchwc import lower as lower_nchwc
from fuser.opset import upgrade
from fuser.registry import all_rules, select
from fuser.rule import Rule
from fuser.specialize import fix_shapes as specialize
from fuser.verify import Checker, Verdict


@dataclass
class Report:
    """What an optimization did: rewrites, per-rule counts, node counts, numerics, timings."""

    target: str
    rules: list[str]
    nodes_before: int
    nodes_after: int
    engine: EngineResult
    verdict: Verdict | None = None
    timings: dict[str, float] = field(default_factory=dict)
    input_path: str | None = None
    output_path: str | None = None
    blamed: list[Rewrite] = field(default_factory=list)
    dropped: list[Rewrite] = field(default_factory=list)
    blame_checks: int = 0
    notes: list[str] = field(default_factory=list)
    op_types_before: dict[str, int] = field(default_factory=dict)
    op_types_after: dict[str, int] = field(default_factory=dict)
    latency: Timing | None = None
    context: Context = field(default_factory=Context)
    fixed_shapes: dict[str, list] | None = None  # --fix-shapes: input -> the dims written into the model

    @property
    def rewrites(self):
        return self.engine.rewrites

    @property
    def counts(self) -> dict[str, int]:
        return self.engine.counts()

    @property
    def checked(self) -> bool:
        return self.verdict is not None

    def to_dict(self) -> dict:
        return {
            "target": self.target,
            "rules": self.rules,
            **self.context.to_dict(),
            "input": self.input_path,
            "output": self.output_path,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "op_types_before": self.op_types_before,
            "op_types_after": self.op_types_after,
            "rule_counts": self.counts,
            "rewrites": [r.to_dict() for r in self.rewrites],
            "skipped_rules": self.engine.skipped_rules,
            "advice": [a.to_dict() for a in self.engine.advice],
            "declines": [d.to_dict() for d in self.engine.unique_declines()],
            "notes": self.notes,
            "numerics": None if self.verdict is None else self.verdict.to_dict(),
            "blamed": [r.to_dict() for r in self.blamed],
            "dropped": [r.to_dict() for r in self.dropped],
            "timings": self.timings,
            "latency": None if self.latency is None else self.latency.to_dict(),
            "fixed_shapes": self.fixed_shapes,
        }


def load(model_or_path: onnx.ModelProto | str | os.PathLike | Model) -> Model:
    if isinstance(model_or_path, Model):
        return model_or_path
    if isinstance(model_or_path, onnx.ModelProto):
        return Model(model_or_path)
    return Model.load(Path(model_or_path))


def resolve_rules(rules: list[Rule] | None, target: str, enable=(), disable=(), rule_files=()) -> list[Rule]:
    if rules is None:
        rules = all_rules(list(rule_files))
    elif rule_files:
        raise UsageError("give either rules= or rule_files=, not both")
    return select(rules, target, list(enable), list(disable))


def optimize(
    model_or_path,
    *,
    rules: list[Rule] | None = None,
    target: str = "onnx",
    enable=(),
    disable=(),
    rule_files=(),
    check: bool = True,
    on_mismatch: str = "fail",
    seed: int = 0,
    runs: int = 1,
    dims: dict[str, int] | None = None,
    shapes: dict[str, tuple] | None = None,
    ranges: dict[str, tuple[float, float]] | None = None,
    inputs: dict | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    trace: bool = False,
    progress: Callable[[str], None] | None = None,
    opset: int | None = None,
    measure: str | None = None,
    measure_threads: int = 1,
    nchwc_block: str | int = "auto",
    fix_shapes: bool = False,
) -> tuple[onnx.ModelProto, Report]:
    """Rewrite a model with the selected rules and (by default) verify it in onnxruntime.

    `rules` defaults to every registered rule for `target`; pass a list to use exactly those.
    When the check fails, the guilty rewrites are found by bisection; with
    on_mismatch="fail" NumericsMismatch is raised naming them (its `evidence` holds both
    models and the verdict), with on_mismatch="drop" they are left out and the rest is
    verified again and returned, `report.dropped` listing what was left out.
    `opset` upgrades the model to that default-domain opset first (onnx's version
    converter), so that newer standard ops can be emitted; the check covers the upgrade.
    measure: an onnxruntime optimization level ("off", "basic", "extended", "all") to time the
    models at (fuser/measure.py): a phase of rules whose output is slower than its input
    beyond noise is left out, and `report.latency` compares the result with the original.
    nchwc_block: the block of onnxruntime's NCHWc layout to write the model for: "auto" (this
    machine's), 8 or 16 (fuser/context.py); recorded in `report.context`.
    fix_shapes: write the sizes `dims` and `shapes` give into the model's inputs first
    (fuser/specialize.py), so shape arithmetic depending on them folds; the result accepts only
    those sizes, and `report.fixed_shapes` lists them.
    """
    if on_mismatch not in ("fail", "drop"):
        raise UsageError(f"on_mismatch must be 'fail' or 'drop', not '{on_mismatch}'")
    context = resolve_context(nchwc_block)
    foreign_block = context.nchwc_block not in (0, machine_nchwc_block())
    if foreign_block and measure:
        raise UsageError(
            f"--measure times the model on this machine, whose NCHWc block is {machine_nchwc_block() or 'none'}: "
            f"it cannot time a model written for --nchwc-block {context.nchwc_block}"
        )
    say = progress or (lambda message: None)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    say("loading the model")
    model = load(model_or_path)
    timings["load"] = time.perf_counter() - started
    original = model.to_proto() if check else None
    chosen = resolve_rules(rules, target, enable, disable, rule_files)
    nodes_before = model.node_count()
    op_types_before = model.op_counts()
    opset_before = model.opsets.get("", 1)
    if opset is not None:
        say(f"upgrading to opset {opset}")
        model = upgrade(model, opset)
    upgraded = model.opsets.get("", 1) != opset_before
    fixed = None
    if fix_shapes:
        say("fixing the input sizes")
        model, fixed, bound = specialize(model, dims or {}, shapes or {})
        dims = {**bound, **(dims or {})}  # the check feeds the original the sizes the output is fixed at
    base = model.to_proto() if check and (upgraded or fixed is not None) else original
    measured = (
        _measure_phases(model, chosen, measure, measure_threads, dims, shapes, inputs, say, context)
        if measure
        else None
    )
    if measured is not None:
        chosen, measure_notes, unoptimized, feeds = measured
    say(f"rewriting with {len(chosen)} rules")
    result = Engine(model, chosen, trace=trace, context=context).run(apply=True)
    timings["rewrite"] = result.seconds
    optimized = model.to_proto()
    report = Report(
        target=target,
        rules=[r.name for r in chosen],
        nodes_before=nodes_before,
        nodes_after=model.node_count(),
        op_types_before=op_types_before,
        op_types_after=model.op_counts(),
        engine=result,
        timings=timings,
        input_path=str(model.path) if model.path else None,
        context=context,
        fixed_shapes=fixed,
    )
    report.notes.extend(_rule_notes(chosen, report.counts))
    if upgraded:
        report.notes.append(f"upgraded from opset {opset_before} to {opset} with onnx's version converter")
    if fixed is not None:
        report.notes.append(_fixed_shapes_note(fixed))
    if measured is not None:
        report.notes.extend(measure_notes)

    def finished(written: onnx.ModelProto) -> tuple[onnx.ModelProto, Report]:
        """`written` and its report, timed against the original when --measure asks: the model
        returned, after any rewrites the check dropped, is the one timed."""
        if measured is not None and report.rewrites:
            report.latency = compare_latency(unoptimized, written, feeds, level=measure, threads=measure_threads)
            report.notes.append(f"--measure: {report.latency.summary()}")
        return written, report

    if not (check and (result.rewrites or upgraded or fixed)):
        return finished(optimized)
    if any(r.scope != "main" for r in result.rewrites):
        # A branch the check inputs never take is not verified: widen the inputs, and say so.
        if inputs is None and runs == 1:
            runs = 3
        report.notes.append(
            "some rewrites are inside If/Loop/Scan bodies; the check verifies only the branches and "
            f"iterations its inputs reach ({runs} input set{'s' if runs > 1 else ''}): "
            "use --check-runs or --inputs to cover the others"
        )
    started = time.perf_counter()
    say(f"checking numerics in onnxruntime ({runs} input set{'s' if runs > 1 else ''})")
    checker = Checker(
        original,
        seed=seed,
        runs=runs,
        dims=dims,
        shapes=shapes,
        ranges=ranges,
        inputs=inputs,
        rtol=rtol,
        atol=atol,
        base_dir=model.base_dir,
    )
    if foreign_block:
        checker = ForeignBlockChecker(checker, context.nchwc_block)
        if has_nchwc(optimized):
            report.notes.append(
                f"the model is written for NCHWc block {context.nchwc_block}, this machine's is "
                f"{machine_nchwc_block() or 'none'}: the check ran its NCHWc operators as standard ones (fuser/nchwc.py)"
            )
    if upgraded:
        # Checked on its own first, so a converter error is not blamed on a rewrite.
        converted = checker.check(base, exact=False)
        if not converted.passed:
            raise NumericsMismatch(
                f"{converted.summary()}; caused by the upgrade to opset {opset} (onnx's version converter)",
                evidence={"original": original, "optimized": base, "report": report},
            )
    applied = set(report.counts)
    exact = all(r.exact for r in chosen if r.name in applied)
    stabilizing = any(r.stabilizes for r in chosen if r.name in applied)
    report.verdict = checker.check(optimized, exact, stabilizing)
    timings["verify"] = time.perf_counter() - started
    if report.verdict.passed:
        return finished(optimized)
    started = time.perf_counter()
    say("numerics check failed: bisecting the rewrite log to find the guilty rewrites")
    first = Attempt(optimized, result, report.verdict)
    blame = find_guilty(base, model.base_dir, chosen, checker, first, progress=say, context=context)
    timings["blame"] = time.perf_counter() - started
    report.blamed = blame.guilty
    report.blame_checks = blame.checks
    final = blame.final
    if on_mismatch == "drop" and final.verdict.passed:
        stale = set(_rule_notes(chosen, report.counts))
        report.engine = final.result
        report.notes = [n for n in report.notes if n not in stale] + _rule_notes(chosen, report.counts)
        report.dropped = blame.guilty
        report.verdict = final.verdict
        report.nodes_after = sum(len(g.node) for g in all_graph_protos(final.model.graph))
        report.op_types_after = count_op_types(n for g in all_graph_protos(final.model.graph) for n in g.node)
        return finished(final.model)
    raise NumericsMismatch(
        _mismatch_message(report.verdict, blame.guilty),
        evidence={"original": original, "optimized": optimized, "report": report},
    )


class ForeignBlockChecker:
    """Checks models written for another machine's NCHWc block with their NCHWc operators
    lowered to standard ones, which onnxruntime runs at any block size."""

    def __init__(self, checker: Checker, block: int):
        self.checker = checker
        self.block = block

    def check(self, candidate: onnx.ModelProto, exact: bool, stabilizing: bool = True, base_dir=None) -> Verdict:
        return self.checker.check(lower_nchwc(candidate, self.block), exact, stabilizing, base_dir)


def _measure_phases(model: Model, chosen, level, threads, dims, shapes, inputs, say, context):
    """The rules of the phases that do not slow the model down, their notes, the unoptimized
    model and the inputs it is timed on."""
    from fuser.measure import paying_rules, session
    from fuser.verify import synthesize_inputs

    unoptimized = model.to_proto()
    feeds = inputs if inputs is not None else synthesize_inputs(session(unoptimized, "off"), dims=dims, shapes=shapes)
    say(f"timing each phase of rules in onnxruntime (optimizations {level})")
    kept, notes = paying_rules(
        unoptimized, chosen, feeds, base_dir=model.base_dir, level=level, threads=threads, progress=say, context=context
    )
    return kept, notes, unoptimized, feeds


def _fixed_shapes_note(fixed: dict[str, list]) -> str:
    if not fixed:
        return "--fix-shapes: the inputs already had these sizes; nothing was fixed"
    shapes = ", ".join(f"{name}[{','.join(str(d) for d in dims)}]" for name, dims in fixed.items())
    return f"--fix-shapes: written for inputs {shapes}; the model accepts only these sizes"


def _rule_notes(chosen: list[Rule], counts: dict[str, int]) -> list[str]:
    """The notes of the rules that rewrote something, each once."""
    return list(dict.fromkeys(r.note_text() for r in chosen if counts.get(r.name) and r.note))


def _mismatch_message(verdict: Verdict, guilty: list[Rewrite]) -> str:
    if not guilty:
        return f"{verdict.summary()}; no single rewrite could be blamed"
    named = "; ".join(f"{r.rule} on {', '.join(r.matched)}" for r in guilty[:5])
    more = f" and {len(guilty) - 5} more" if len(guilty) > 5 else ""
    return f"{verdict.summary()}; caused by {len(guilty)} rewrite(s): {named}{more}"


def find_opportunities(
    model_or_path, *, rules=None, target="onnx", enable=(), disable=(), rule_files=(), opset=None, nchwc_block="auto"
):
    """The rewrites the selected rules would make (after the upgrade to `opset`), without changing anything."""
    model = load(model_or_path)
    if opset is not None:
        model = upgrade(model, opset)
    chosen = resolve_rules(rules, target, enable, disable, rule_files)
    return Engine(model, chosen, context=resolve_context(nchwc_block)).run(apply=False)
