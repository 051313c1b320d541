"""The Python entry point: ``fuser.optimize(model_or_path, ...)`` -> (optimized model, report)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from fuser.engine import Engine, EngineResult
from fuser.errors import NumericsMismatch, UsageError
from fuser.model import Model
from fuser.registry import all_rules, select
from fuser.rule import Rule
from fuser.verify import Verdict, verify


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
            "input": self.input_path,
            "output": self.output_path,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "rule_counts": self.counts,
            "rewrites": [r.to_dict() for r in self.rewrites],
            "skipped_rules": self.engine.skipped_rules,
            "numerics": None if self.verdict is None else {
                "passed": self.verdict.passed,
                "outputs": [o.to_dict() for o in self.verdict.outputs],
            },
            "timings": self.timings,
        }


def load(model_or_path: onnx.ModelProto | str | os.PathLike | Model) -> Model:
    if isinstance(model_or_path, Model):
        return model_or_path
    if isinstance(model_or_path, onnx.ModelProto):
        return Model(model_or_path)
    return Model.load(Path(model_or_path))


def resolve_rules(
    rules: list[Rule] | None, target: str, enable=(), disable=(), rule_files=()
) -> list[Rule]:
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
    seed: int = 0,
    dims: dict[str, int] | None = None,
    shapes: dict[str, tuple] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    trace: bool = False,
) -> tuple[onnx.ModelProto, Report]:
    """Rewrite a model with the selected rules and (by default) verify it in onnxruntime.

    `rules` defaults to every registered rule for `target`; pass a list to use exactly those.
    Raises NumericsMismatch when the optimized model disagrees with the original.
    """
    timings: dict[str, float] = {}
    started = time.perf_counter()
    model = load(model_or_path)
    timings["load"] = time.perf_counter() - started
    original = model.to_proto() if check else None
    chosen = resolve_rules(rules, target, enable, disable, rule_files)
    nodes_before = model.node_count()
    engine = Engine(model, chosen, trace=trace)
    result = engine.run(apply=True)
    timings["rewrite"] = result.seconds
    optimized = model.to_proto()
    report = Report(
        target=target,
        rules=[r.name for r in chosen],
        nodes_before=nodes_before,
        nodes_after=model.node_count(),
        engine=result,
        timings=timings,
        input_path=str(model.path) if model.path else None,
    )
    if check and result.rewrites:
        started = time.perf_counter()
        exact = all(r.exact for r in chosen if r.name in report.counts)
        report.verdict = verify(
            original, optimized, exact=exact, seed=seed, dims=dims, shapes=shapes, rtol=rtol, atol=atol
        )
        timings["verify"] = time.perf_counter() - started
        if not report.verdict.passed:
            worst = report.verdict.failures()[0]
            raise NumericsMismatch(
                f"output '{worst.name}' differs after optimization: max abs error {worst.max_abs_error:.3g}, "
                f"{worst.fraction_out_of_tolerance:.1%} of elements out of tolerance "
                f"(rtol={worst.rtol:g}, atol={worst.atol:g})"
            )
    return optimized, report


def find_opportunities(model_or_path, *, rules=None, target="onnx", enable=(), disable=(), rule_files=()):
    """The rewrites the selected rules would make, without changing anything."""
    model = load(model_or_path)
    chosen = resolve_rules(rules, target, enable, disable, rule_files)
    return Engine(model, chosen).run(apply=False)
