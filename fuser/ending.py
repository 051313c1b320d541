"""What a process about to end keeps rather than frees.

Python frees a large graph, or onnxruntime's sessions of it, object by object: 0.2 s for the
100k-node MLP stack of bench/scale.py, 0.5 s for the check's four sessions of pieces of its
optimized model, seconds at a million nodes. The
`fuser` command and its -j workers end with os._exit once their output is out
(fuser.cli.program), and the system takes back what they kept at once, with the rest of their
memory. Until a process says it ends soon, `keep` and `hold` do nothing: a library caller, a
test, frees as usual.
"""

from __future__ import annotations

_kept: list | None = None
_held: dict[str, object] = {}


def ends_soon() -> None:
    """This process ends soon after its current job: from now on, what is kept is not freed."""
    global _kept
    if _kept is None:
        _kept = []


def keep(*objects: object) -> None:
    """Keep `objects` until the process ends, if it ends soon."""
    if _kept is not None:
        _kept.extend(objects)


def hold(slot: str, value: object) -> None:
    """Keep `value` until the process ends, if it ends soon, or until another value is held in
    `slot` (the older one is then freed): for what is made again and again, such as the check's
    session of each model blame tries, of which only the last is left at the end."""
    if _kept is not None:
        _held[slot] = value
