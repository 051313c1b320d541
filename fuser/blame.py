"""Finding the rewrites that break numerics, by bisecting the rewrite log.

The engine is deterministic, so "the first k rewrites" names the same model every time.
If applying all n rewrites fails the check, a binary search over k finds the first
prefix that fails: its last rewrite is guilty. That rewrite is vetoed (the engine skips
exactly that match), the prefix before it is known to be good, and the search goes on
from there until the whole run passes. Each guilty rewrite costs about log2(n) checks,
all against one onnxruntime session of the original and one set of inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import onnx

from fuser.context import Context
from fuser.engine import Engine, EngineResult, Rewrite
from fuser.model import Model
from fuser.progress import Progress, silent
from fuser.rule import Rule
from fuser.verify import Checker, Verdict

# What a run does with the rewrites a failed check blames: fail (write nothing), or drop them.
MISMATCH_ACTIONS = ("fail", "drop")


@dataclass
class Attempt:
    model: onnx.ModelProto
    result: EngineResult
    verdict: Verdict


@dataclass
class Blame:
    guilty: list[Rewrite] = field(default_factory=list)
    final: Attempt | None = None
    checks: int = 0


def rewrite_and_check(
    original: onnx.ModelProto,
    base_dir,
    rules: list[Rule],
    checker: Checker,
    limit: int | None,
    vetoed: dict[tuple, str],
    context: Context | None = None,
) -> Attempt:
    model = Model(original, base_dir=base_dir)
    result = Engine(model, rules, limit=limit, vetoed=vetoed, context=context).run()
    candidate = model.to_proto(in_place=True)
    applied = set(result.counts())
    exact = all(r.exact for r in rules if r.name in applied)
    stabilizing = any(r.stabilizes for r in rules if r.name in applied)
    return Attempt(candidate, result, checker.check(candidate, exact, stabilizing))


def find_guilty(
    original: onnx.ModelProto,
    base_dir,
    rules: list[Rule],
    checker: Checker,
    failing: Attempt,
    progress: Progress | None = None,
    context: Context | None = None,
) -> Blame:
    """Veto guilty rewrites one at a time until the remaining ones pass the check; `progress` is
    told the checks made, out of those known to be needed (more follow for each further guilty rewrite)."""
    progress = progress or silent
    blame = Blame()
    vetoed: dict[tuple, str] = {}
    known_good = 0  # a prefix of this many rewrites passes
    attempt = failing
    while not attempt.verdict.passed:
        low, high = known_good, len(attempt.result.rewrites)
        if high == 0:
            break  # nothing left to blame: the mismatch is not caused by a rewrite
        failed = attempt.verdict  # of the shortest prefix known to fail
        while high - low > 1:
            progress("blame", blame.checks, blame.checks + (high - low - 1).bit_length() + 1)
            middle = (low + high) // 2
            probe = rewrite_and_check(original, base_dir, rules, checker, middle, vetoed, context)
            blame.checks += 1
            if probe.verdict.passed:
                low = middle
            else:
                high, failed = middle, probe.verdict
        failure = (
            "onnxruntime could not load or run the model with it"
            if failed.load_error
            else "it failed the numerics check"
        )
        culprit = replace(attempt.result.rewrites[high - 1], failure=failure)
        blame.guilty.append(culprit)
        vetoed[culprit.key] = failure
        known_good = high - 1
        progress("blame", blame.checks, blame.checks + 1)
        attempt = rewrite_and_check(original, base_dir, rules, checker, None, vetoed, context)
        blame.checks += 1
    progress("blame", blame.checks, blame.checks)
    blame.final = attempt
    return blame
