"""Why a rule did or did not fire: per rule, what it matched, applied and declined, by reason.

Used by `fuser explain` and by `fuser optimize -v`. A "match" is a place where the rule's
pattern matched; it was either applied or declined (by the rule's own `m.require` or by the
engine's safety checks), so matched = applied + declined places.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from fuser.engine import Declined, EngineResult, Opportunity
from fuser.rule import Rule


@dataclass
class RuleExplanation:
    rule: str
    source: str | None
    applied: int = 0
    declined: int = 0
    reasons: Counter = field(default_factory=Counter)  # reason -> places it was the last reason of
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> first place's nodes
    skipped: str | None = None  # why the rule did not run at all
    advice: int = 0
    # Places of the input the pattern matches that other rules rewrote first: rule -> places.
    taken_by: Counter = field(default_factory=Counter)

    @property
    def matched(self) -> int:
        return self.applied + self.declined + self.advice

    def to_dict(self) -> dict:
        return {
            "rule": self.rule,
            "source": self.source,
            "matched": self.matched,
            "applied": self.applied,
            "declined": self.declined,
            "advised": self.advice,
            "skipped": self.skipped,
            "taken_by": dict(self.taken_by.most_common()),
            "reasons": [
                {"reason": reason, "count": count, "example": self.examples[reason]}
                for reason, count in self.reasons.most_common()
            ],
        }


# A dim shape inference made up ('unk__3', 'run2.unk__3' once the rewrite inferred again): a
# name the model does not have, numbered differently at each place of the same reason.
_MADE_UP_DIM = re.compile(r"'?(?<![\w.])(?:run\d+\.)?unk__\d+'?")


def readable(reason: str) -> str:
    """`reason` with the dims shape inference made up written as '?', so that places declined
    for the same reason are counted together."""
    return _MADE_UP_DIM.sub("?", reason)


def explain(result: EngineResult, rules: list[Rule]) -> list[RuleExplanation]:
    """One explanation per rule that ran (or was skipped), in rule order."""
    found = {r.name: RuleExplanation(r.name, str(r.source) if r.source else None) for r in rules}
    for name, why in result.skipped_rules.items():
        found.setdefault(name, RuleExplanation(name, None)).skipped = why
    for rewrite in result.rewrites:
        found.setdefault(rewrite.rule, RuleExplanation(rewrite.rule, None)).applied += 1
    for advice in result.advice:
        found.setdefault(advice.rule, RuleExplanation(advice.rule, None)).advice += 1
    applied_at = {(r.rule, r.scope, tuple(r.matched)) for r in result.rewrites}
    # Each place counts once, under the last reason it was declined for: the passes decline a
    # place again as shapes become known ("changes the shape (a, 32) to (a, 'unk', 8)", then
    # "... to (a, 4, 8)"), and its last reason is why it stayed (the engine records a reason once
    # per place, where it first came). A place declined once and rewritten later (after a
    # neighbour changed) counts as applied.
    last: dict[tuple, Declined] = {}
    for decline in result.declined:  # all of them, in order: unique_declines keeps each reason's first
        place = (decline.rule, decline.scope, tuple(decline.nodes) or (decline.node,))
        last.pop(place, None)  # in the order of the last declines
        last[place] = decline
    for place, decline in last.items():
        entry = found.setdefault(decline.rule, RuleExplanation(decline.rule, decline.source))
        if place in applied_at:
            continue
        reason = readable(decline.reason)
        entry.declined += 1
        entry.reasons[reason] += 1
        entry.examples.setdefault(reason, decline.nodes or [decline.node])
    return list(found.values())


def note_taken_places(
    explanations: list[RuleExplanation], opportunities: list[Opportunity], result: EngineResult
) -> None:
    """For each rule that matched nothing, the places of the input it would have rewritten
    (`opportunities`: find_opportunities of the input, with that rule) and which rules rewrote
    them first: a rule of an earlier phase (or visited first) can take a pattern another would
    have fused."""
    rewriters: dict[tuple[str, str], Counter] = {}
    for rewrite in result.rewrites:
        for label in rewrite.matched:
            rewriters.setdefault((rewrite.scope, label), Counter())[rewrite.rule] += 1
    by_rule = {entry.rule: entry for entry in explanations if not entry.matched and not entry.skipped}
    for place in opportunities:
        entry = by_rule.get(place.rule)
        if entry is None:
            continue
        takers = Counter()
        for label in place.nodes:
            takers.update(rewriters.get((place.scope, label), {}))
        if takers:
            entry.taken_by[takers.most_common(1)[0][0]] += 1


def render(explanations: list[RuleExplanation]) -> list[str]:
    lines = []
    width = max((len(e.rule) for e in explanations), default=0)
    for e in explanations:
        where = f"  ({e.source})" if e.source else ""
        if e.skipped:
            lines.append(f"{e.rule:<{width}}  skipped: {e.skipped}{where}")
            continue
        if not e.matched:
            taken = ""
            if e.taken_by:
                places = sum(e.taken_by.values())
                takers = ", ".join(f"{rule} ({count})" for rule, count in e.taken_by.most_common())
                taken = f" (it would have rewritten {places} place(s) of the input, which {takers} rewrote first)"
            lines.append(f"{e.rule:<{width}}  no match{taken}{where}")
            continue
        parts = [f"matched {e.matched}", f"applied {e.applied}", f"declined {e.declined}"]
        if e.advice:
            parts.append(f"advised {e.advice}")
        lines.append(f"{e.rule:<{width}}  {', '.join(parts)}{where}")
        for reason, count in e.reasons.most_common():
            lines.append(f"  {count:>5} x {reason}  [e.g. {', '.join(e.examples[reason])}]")
    return lines


def decline_lines(declines: list[Declined]) -> list[str]:
    """`-v` output: every decline, one line each, under a count."""
    if not declines:
        return []
    lines = [f"  declined: {len(declines)} match(es)"]
    for d in declines:
        where = f" ({d.source})" if d.source else ""
        lines.append(f"    {d.rule} [{d.scope}] {', '.join(d.nodes or [d.node])}: {readable(d.reason)}{where}")
    return lines
