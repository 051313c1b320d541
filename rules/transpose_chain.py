"""Transpose(Transpose(x, p), q)  =>  Transpose(x, p[q]), or x when the two cancel.

Layout conversions in exported graphs come in pairs (NHWC <-> NCHW around an op that was
removed or folded); two transposes are one data movement at most, and none when they cancel.
A Cast between them (GPT-J's float16 attention upcasts its heads between the two) moves
after them: it converts each element wherever it stands.
"""

from __future__ import annotations

from fuser.rules._simplify import SIMPLIFY_PHASE

from fuser import Builder, Match, op, rule, var


def _perm(m: Match, node: str, rank: int | None) -> list[int]:
    perm = m.attr(node, "perm", None)
    if perm is None:  # the default reverses the axes
        m.require(rank is not None, "a Transpose without perm on an input of unknown rank")
        return list(reversed(range(rank)))
    return [int(p) for p in perm]


@rule(
    "transpose-chain",
    pattern=(
        op.Transpose(op.Transpose(var("x"), name="first"), name="second"),
        op.Transpose(op.Cast(op.Transpose(var("x"), name="first"), name="cast"), name="second"),
    ),
    phase=SIMPLIFY_PHASE,
    exact=True,
)
def transpose_chain(m: Match, b: Builder):
    """Transpose([Cast](Transpose(x, p)), q)  =>  [Cast](Transpose(x, [p[i] for i in q]) or x)."""
    first = _perm(m, "first", m.rank("x"))
    second = _perm(m, "second", len(first))
    m.require(len(first) == len(second), "the permutations have different lengths")
    combined = [first[i] for i in second]
    moved = m["x"] if combined == list(range(len(combined))) else b.Transpose(m["x"], perm=combined)
    return b.Cast(moved, **m.attrs("cast")) if m.has("cast") else moved
