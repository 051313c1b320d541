"""How long stages say where they are: `progress(stage, done, total)`, called by the api, the
engine, the check and blame; the command line draws it (a bar on a terminal, nothing in CI logs).

stage: "load", "upgrade", "fix-shapes", "measure", "rewrite", "check", "blame" or "write" (and "match",
the visits of `fuser check`, which rewrites nothing); done and total count that stage's own units
(nodes read into the graph; nodes visited, with those still queued; models run on an input set;
checks made; tensors written), total None while unknown. A stage's last call has done == total. Callers
report every so many units, not each one, so the hook costs nothing measurable even on a
million nodes.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str, int, "int | None"], None]

# The stages in the order a run goes through them (report timings are listed in this order).
STAGES = ("load", "upgrade", "fix-shapes", "measure", "rewrite", "check", "blame", "write")

# What each stage counts, for a rate shown next to its bar.
UNITS = {
    "load": "nodes",
    "rewrite": "nodes",
    "match": "nodes",
    "write": "tensors",
    "check": "model runs",
    "blame": "checks",
    "models": "models",
}


def silent(stage: str, done: int, total: int | None) -> None:
    """The hook when nobody is watching."""


class Ticker:
    """Counts units of one stage and passes every `every`-th to `progress`: a loop over a million
    nodes pays an increment and a comparison per node."""

    __slots__ = ("progress", "stage", "every", "total", "done", "_next")

    def __init__(self, progress: Progress | None, stage: str, every: int = 1000, total: int | None = None):
        self.progress = progress or silent
        self.stage = stage
        self.every = every
        self.total = total
        self.done = 0
        self._next = every

    def tick(self, pending: int | None = None) -> None:
        """One more unit; `pending` is how many are known to remain (the total grows with it),
        else the total is the one given at the start, if any."""
        self.done += 1
        if self.done >= self._next:
            self._next += self.every
            self.progress(self.stage, self.done, self.total if pending is None else self.done + pending)

    def finish(self) -> None:
        self.progress(self.stage, self.done, self.done)
