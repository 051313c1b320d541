"""The Python entry point: ``fuser.optimize(model_or_path, ...)`` -> (optimized model, report)."""

from __future__ import annotations

import dataclasses
import os
import time
from contextlib import contextmanager
from pathlib import Path

import onnx

from fuser.blame import MISMATCH_ACTIONS, Attempt, find_guilty
from fuser.context import machine_nchwc_block, resolve_context
from fuser.engine import Engine, Rewrite
from fuser.errors import InputError, NumericsMismatch, UsageError
from fuser.graph import ModelParts, all_graph_protos, as_proto
from fuser.measure import LEVELS as MEASURE_LEVELS
from fuser.measure import compare as compare_latency
from fuser.model import Model, count_op_types
from fuser.nchwc import has_nchwc
from fuser.nchwc import lower as lower_nchwc
from fuser.opset import upgrade
from fuser.progress import Progress, silent
from fuser.registry import all_rules, left_out, select
from fuser.report import Report
from fuser.rule import Rule
from fuser.specialize import fix_shapes as specialize
from fuser.tensors import uses_external_data
from fuser.verify import Checker, CheckOptions, PreparedChecker, Verdict, random_nodes, with_inline_weights


def load(model_or_path: onnx.ModelProto | str | os.PathLike | Model, progress: Progress | None = None) -> Model:
    """A model from a path (checked as Model.load checks it), a ModelProto or its serialized bytes."""
    if isinstance(model_or_path, Model):
        return model_or_path
    if isinstance(model_or_path, (bytes, bytearray)):
        try:
            model_or_path = onnx.load_model_from_string(bytes(model_or_path))
        except Exception as error:  # protobuf's DecodeError, or onnx's own
            raise InputError(f"the bytes given are not an ONNX model: {error}") from error
        if not model_or_path.HasField("graph"):  # protobuf reads empty bytes as an empty message
            raise InputError("the bytes given are not an ONNX model: they hold no graph")
    if isinstance(model_or_path, onnx.ModelProto):
        return Model(model_or_path, progress=progress)
    if not isinstance(model_or_path, (str, os.PathLike)):
        raise UsageError(
            "the model must be a path, an onnx.ModelProto, its serialized bytes or a fuser Model, "
            f"not {type(model_or_path).__name__}"
        )
    return Model.load(Path(model_or_path), progress=progress)


def resolve_rules(rules: list[Rule] | None, target: str, enable=(), disable=(), rule_files=()) -> list[Rule]:
    """The rules to run, chosen for `target` as enable/disable leave them (fuser.registry.select):
    from every registered one (with `rule_files`' rules), or from `rules` alone. A name or a path
    given as a string, not in a list, counts as one."""
    enable, disable, rule_files = (_names(value) for value in (enable, disable, rule_files))
    if rules is None:
        return select(all_rules(rule_files), target, enable, disable)
    if rule_files:
        raise UsageError("give either rules= or rule_files=, not both")
    rules = [rules] if isinstance(rules, (str, Rule)) else list(rules)
    for given in rules:
        if not isinstance(given, Rule):
            raise UsageError(
                f"rules= takes rules made with @fuser.rule or @fuser.sweep, not {given!r} "
                "(built-in rules are chosen by name with enable= and disable=)"
            )
    return select(rules, target, enable, disable)


def _names(value) -> list[str]:
    names = [value] if isinstance(value, (str, os.PathLike)) else list(value) if _iterable(value) else [value]
    for name in names:
        if not isinstance(name, (str, os.PathLike)):
            raise UsageError(f"rule names and rule files are strings (or paths), not {name!r}")
    return names


def _iterable(value) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


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
    check_options: CheckOptions | None = None,
    trace: bool = False,
    progress: Progress | None = None,
    opset: int | None = None,
    measure: str | None = None,
    measure_threads: int = 1,
    nchwc_block: str | int = "auto",
    fix_shapes: bool = False,
    weights_apart: bool = False,
    **check_settings,
) -> tuple[onnx.ModelProto | ModelParts, Report]:
    """Rewrite a model with the selected rules and (by default) verify it in onnxruntime.

    `rules` defaults to every registered rule; a list given is chosen from in the same way: the
    rules of `target` (onnxruntime's only for target="onnxruntime") that are on by default or
    named by `enable`, less those `disable` names; `report.notes` names any other of the list left out.
    The check's settings are a `fuser.CheckOptions` (`check_options=`), or its fields as
    keywords: `seed` (0), `runs` (1 input set), `dims` ({name: size} of symbolic dimensions),
    `shapes` ({input: shape}), `ranges` ({input: (low, high)}), `inputs` (real inputs by name),
    `rtol` and `atol` (override the per-dtype tolerances).
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
    progress: `progress(stage, done, total)` (fuser/progress.py) as the stages go;
    `report.timings` has the seconds each stage took.
    weights_apart: return the model as a fuser.graph.ModelParts, whose main-graph weights are the
    loaded model's own tensors rather than a copy of them in the returned ModelProto: for
    writing it (fuser.model.write_model) or checking it without that copy.
    """
    if on_mismatch not in MISMATCH_ACTIONS:
        raise UsageError(f"on_mismatch must be 'fail' or 'drop', not '{on_mismatch}'")
    if measure is not None and measure not in MEASURE_LEVELS:
        raise UsageError(f"measure must be one of {', '.join(MEASURE_LEVELS)} (or None), not {measure!r}")
    if not (isinstance(measure_threads, int) and not isinstance(measure_threads, bool) and measure_threads >= 1):
        raise UsageError(f"measure_threads must be a whole number, 1 or more, not {measure_threads!r}")
    options = _check_options(check_options, check_settings)
    context = resolve_context(nchwc_block)
    foreign_block = context.nchwc_block not in (0, machine_nchwc_block())
    if foreign_block and measure:
        raise UsageError(
            f"--measure times the model on this machine, whose NCHWc block is {machine_nchwc_block() or 'none'}: "
            f"it cannot time a model written for --nchwc-block {context.nchwc_block}"
        )
    stage = _Stages(progress)
    if isinstance(model_or_path, Model):
        model = model_or_path
    else:
        with stage("load"):
            model = load(model_or_path, progress=stage.progress)
    original = None
    if check:
        with stage("check", announce=False):
            # The file's own model when nothing changed it yet: a copy would double its weights.
            original = model.unchanged_proto()
            if original is None:
                original = model.to_proto(in_place=True)
    # Read once: an iterator given would be empty for the report's notes.
    enable, disable = _names(enable), _names(disable)
    if rules is not None and not isinstance(rules, (str, Rule)):
        rules = list(rules)
    chosen = resolve_rules(rules, target, enable, disable, rule_files)
    nodes_before = model.node_count()
    op_types_before = model.op_counts()
    opset_before = model.opsets.get("", 1)
    if opset is not None:
        with stage("upgrade"):
            model.validate()  # the converted model is another, whose end would not wait for this verdict
            model = upgrade(model, opset)
    upgraded = model.opsets.get("", 1) != opset_before
    fixed = None
    if fix_shapes:
        with stage("fix-shapes"):
            model, fixed, bound = specialize(model, options.dims, options.shapes)
        # the check feeds the original the sizes the output is fixed at
        options = options.replace(dims={**bound, **options.dims})
    base = model.to_proto(in_place=True) if check and (upgraded or fixed is not None) else original
    measured = None
    if measure:
        with stage("measure"):
            measured = _measure_phases(model, chosen, measure, measure_threads, options, stage.say, context)
        chosen, measure_notes, unoptimized, feeds = measured
    # The original's side of the check is prepared while the rewrite runs (after any --measure,
    # which a busy core would disturb), from a copy taken before any rule runs; it is thrown
    # away if nothing needs checking.
    prepared = PreparedChecker(original, options, base_dir=model.base_dir) if check else None
    try:
        with stage("rewrite"):
            result = Engine(model, chosen, trace=trace, progress=stage.progress, context=context).run(apply=True)
            model.validate()  # nothing comes of a model onnx's check refuses (Model.load's validated=False)
        with stage("write", announce=False):
            optimized = model.parts()
        report = Report(
            target=target,
            rules=[r.name for r in chosen],
            nodes_before=nodes_before,
            nodes_after=model.node_count(),
            op_types_before=op_types_before,
            op_types_after=model.op_counts(),
            engine=result,
            timings=stage.timings,
            input_path=str(model.path) if model.path else None,
            context=context,
            fixed_shapes=fixed,
        )
        report.notes.extend(_rule_notes(chosen, report.counts))
        report.notes.extend(_left_out_notes(rules, target, enable, disable))
        applied = set(report.counts)
        report.exact = all(r.exact for r in chosen if r.name in applied)
        report.stabilizing = any(r.stabilizes for r in chosen if r.name in applied)
        if upgraded:
            report.notes.append(f"upgraded from opset {opset_before} to {opset} with onnx's version converter")
        if fixed is not None:
            report.notes.append(_fixed_shapes_note(fixed))
        if measured is not None:
            report.notes.extend(measure_notes)

        def handed_out(proto: onnx.ModelProto) -> onnx.ModelProto:
            """A model the caller gets: without weights_apart, one that holds its weights inline
            rather than references into the input's files (a copy, `proto` left as it was)."""
            held = (t for graph in all_graph_protos(proto.graph) for t in graph.initializer)
            if weights_apart or not any(uses_external_data(t) for t in held):
                return proto
            copy = onnx.ModelProto()
            copy.CopyFrom(proto)
            return model.self_contained(copy)

        def finished(written: onnx.ModelProto | ModelParts) -> tuple[onnx.ModelProto | ModelParts, Report]:
            """`written` and its report, timed against the original when --measure asks: the model
            returned, after any rewrites the check dropped, is the one timed."""
            if measured is not None and report.rewrites:
                with stage("measure"):
                    report.latency = compare_latency(
                        unoptimized,
                        as_proto(written),
                        feeds,
                        level=measure,
                        threads=measure_threads,
                        base_dir=model.base_dir,
                    )
                report.notes.append(f"--measure: {report.latency.summary()}")
            return (written if weights_apart else model.self_contained(as_proto(written))), report

        if not (check and (result.rewrites or upgraded or fixed)):
            return finished(optimized)
        options = options_for_bodies(options, report)
        with stage("check"):
            # Progress in model runs: the original's input sets, then the optimized model's.
            runs = 1 if options.inputs is not None else options.runs
            stage.progress("check", 0, 2 * runs)
            started = None
            if prepared is not None and prepared.options is options:
                if not (foreign_block or upgraded):  # what those check is not `optimized` as it is
                    started = prepared.start_beside(optimized)
                checker = prepared.get()
            else:
                checker = Checker(original, options, base_dir=model.base_dir)
            runs = len(checker.feeds)  # the padded-mask set, if any, is one more
            stage.progress("check", runs, 2 * runs)
            if foreign_block:
                checker = ForeignBlockChecker(checker, context.nchwc_block)
                if has_nchwc(optimized.proto):
                    report.notes.append(
                        f"the model is written for NCHWc block {context.nchwc_block}, this machine's is "
                        f"{machine_nchwc_block() or 'none'}: the check ran its NCHWc operators as standard ones "
                        "(fuser/nchwc.py)"
                    )
            if upgraded:
                # Checked on its own first, so a converter error is not blamed on a rewrite.
                converted = checker.check(base, exact=False)
                if not converted.passed:
                    _require_steady(checker, original)
                    raise NumericsMismatch(
                        f"{converted.summary()}; caused by the upgrade to opset {opset} (onnx's version converter)",
                        evidence={"original": handed_out(original), "optimized": handed_out(base), "report": report},
                    )
            report.verdict = checker.check(
                optimized,
                report.exact,
                report.stabilizing,
                progress=lambda name, done, total: stage.progress(name, runs + done, 2 * runs),
                started=started,
            )
            started = None  # its session is the check's to keep or let go (blame makes its own)
        if report.verdict.passed:
            return finished(optimized)
        _require_steady(checker, original)
        optimized = as_proto(optimized)
        first = Attempt(optimized, result, report.verdict)
        with stage("blame"):
            blame = find_guilty(base, model.base_dir, chosen, checker, first, progress=stage.progress, context=context)
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
            evidence={"original": handed_out(original), "optimized": handed_out(optimized), "report": report},
        )

    except BaseException as error:
        if not isinstance(error, Exception):
            # Interrupted (Ctrl-C, a worker told to end): the process ends, and onnxruntime's start
            # of the original's session, which nothing can cut short, is not waited for.
            prepared = None
        raise
    finally:
        if prepared is not None:
            prepared.discard()  # the thread is done by now, unless an error cut the run short


def options_for_bodies(options: CheckOptions, report: Report) -> CheckOptions:
    """The check's options for the rewrites of `report`: a branch the check's inputs never take
    is not verified, so where a rewrite is inside an If/Loop/Scan body the inputs are widened (one
    input set becomes three), and the report says so."""
    if not any(r.scope != "main" for r in report.rewrites):
        return options
    if options.inputs is None and options.runs == 1:
        options = options.replace(runs=3)
    report.notes.append(
        "some rewrites are inside If/Loop/Scan bodies; the check verifies only the branches and "
        f"iterations its inputs reach ({_input_sets(options.runs)}): "
        "use --check-runs or --inputs to cover the others"
    )
    return options


def _require_steady(checker: Checker | ForeignBlockChecker, original: onnx.ModelProto) -> None:
    """Before a mismatch is blamed on rewrites: stop with the reason if the original itself
    gives other outputs when run again on the same inputs."""
    unsteady = checker.unsteady_outputs()
    if not unsteady:
        return
    random = random_nodes(original)
    because = f" ({', '.join(random[:3])}{', ...' if len(random) > 3 else ''})" if random else ""
    raise InputError(
        f"the original model gives other values of output '{unsteady[0]}' when run again on the same inputs"
        f"{because}: no check can compare it; export it for inference (model.eval() in torch), "
        "or pass --no-check"
    )


class ForeignBlockChecker:
    """Checks models written for another machine's NCHWc block with their NCHWc operators
    lowered to standard ones, which onnxruntime runs at any block size."""

    def __init__(self, checker: Checker, block: int):
        self.checker = checker
        self.block = block

    def check(
        self,
        candidate: onnx.ModelProto | ModelParts,
        exact: bool,
        stabilizing: bool = True,
        base_dir=None,
        progress=None,
        started: None = None,  # never started ahead: the session is of the lowered model
    ) -> Verdict:
        model = as_proto(candidate)
        folder = base_dir or self.checker.base_dir
        if folder is not None and any(uses_external_data(t) for t in model.graph.initializer):
            model = with_inline_weights(model, folder)  # the lowering reads NCHWc filters as arrays
        return self.checker.check(lower_nchwc(model, self.block), exact, stabilizing, base_dir, progress)

    def unsteady_outputs(self) -> list[str]:
        return self.checker.unsteady_outputs()  # the original is run as it is


class _Stages:
    """Times each stage into `timings` (a stage entered twice adds up) and tells `progress` when one
    starts, unless it is a short step of its stage done out of turn (announce=False)."""

    def __init__(self, progress: Progress | None):
        self.progress = progress or silent
        self.timings: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str, announce: bool = True):
        if announce:
            self.progress(name, 0, None)
        started = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - started

    def say(self, message: str) -> None:
        """For the parts that narrate in sentences (fuser/measure.py): their stage goes on."""
        self.progress("measure", 0, None)


def _check_options(options: CheckOptions | None, settings: dict) -> CheckOptions:
    """`check_options=` or its fields as keywords, not both; a misspelled keyword is an error."""
    known = {f.name for f in dataclasses.fields(CheckOptions)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(f"optimize() got unexpected keyword argument(s) {', '.join(unknown)}")
    if options is not None and settings:
        raise UsageError(
            f"give the check settings either as check_options= or as keywords, not both: {sorted(settings)}"
        )
    if options is not None:
        return options
    return CheckOptions(**{k: v for k, v in settings.items() if v is not None})


def _input_sets(runs: int) -> str:
    return f"{runs} input set{'s' if runs > 1 else ''}"


def _measure_phases(model: Model, chosen, level, threads, options: CheckOptions, say, context):
    """The rules of the phases that do not slow the model down, their notes, the unoptimized
    model and the inputs it is timed on."""
    from fuser.measure import paying_rules, session
    from fuser.verify import index_ranges, synthesize_inputs

    unoptimized = model.to_proto(in_place=True)
    feeds = options.inputs
    if feeds is None:
        # Timed on inputs the check would take: embedding indices within their tables (the check's
        # own ranges), or a Gather fails on a BERT's token types.
        feeds = synthesize_inputs(
            session(unoptimized, "off", base_dir=model.base_dir),
            seed=options.seed,
            dims=options.dims,
            shapes=options.shapes,
            ranges={**index_ranges(unoptimized), **(options.ranges or {})},
        )
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


def _left_out_notes(rules, target: str, enable, disable) -> list[str]:
    """A rule given in rules= that the run leaves out, not by disable=, is said to be left out."""
    if rules is None:
        return []
    given = [rules] if isinstance(rules, Rule) else list(rules)
    reasons = left_out(given, target, _names(enable), _names(disable))
    return [f"rule '{name}' given in rules= did not run: {reason}" for name, reason in reasons.items()]


def _mismatch_message(verdict: Verdict, guilty: list[Rewrite]) -> str:
    if not guilty:
        return f"{verdict.summary()}; no single rewrite could be blamed"
    named = "; ".join(f"{r.rule} on {', '.join(r.matched)}" for r in guilty[:5])
    more = f" and {len(guilty) - 5} more" if len(guilty) > 5 else ""
    return f"{verdict.summary()}; caused by {len(guilty)} rewrite(s): {named}{more}"


def find_opportunities(
    model_or_path,
    *,
    rules=None,
    target="onnx",
    enable=(),
    disable=(),
    rule_files=(),
    opset=None,
    nchwc_block="auto",
    progress: Progress | None = None,
):
    """The rewrites the selected rules would make (after the upgrade to `opset`), without changing
    anything: an EngineResult whose `opportunities` lists them (`opportunity_counts()` per rule;
    `counts()` counts rewrites made, none here). progress: told of the load, and of the nodes the
    rules are tried at as stage "match"."""
    progress = progress or silent
    model = load(model_or_path, progress=progress)
    if opset is not None:
        progress("upgrade", 0, None)
        model = upgrade(model, opset)
    chosen = resolve_rules(rules, target, enable, disable, rule_files)

    def matching(stage: str, done: int, total: int | None) -> None:  # the engine's visits rewrite nothing here
        progress("match" if stage == "rewrite" else stage, done, total)

    return Engine(model, chosen, context=resolve_context(nchwc_block), progress=matching).run(apply=False)
