"""Slice(Slice(x) along some axes) along other axes  =>  one Slice along all of them.

Strided subsampling is written one axis at a time (LeViT's queries: x[:, ::2][:, :, ::2]), so
exports chain Slices whose axes do not overlap. Each axis is sliced by one of them only, so a
single Slice with both lists of starts, ends, axes and steps reads the same elements, in one
copy instead of two.
"""

from __future__ import annotations

import numpy as np

from fuser import Builder, Match, const, op, rule, var
from fuser.rules._simplify import SIMPLIFY_PHASE


def _slice(inner, name: str):
    return op.Slice(inner, const(f"{name}_starts"), const(f"{name}_ends"), const(f"{name}_axes"), const(f"{name}_steps", optional=True), name=name)


def _parameters(m: Match, name: str, rank: int) -> list[np.ndarray]:
    """starts, ends, axes (non-negative) and steps of one Slice, each an int64 vector."""
    starts, ends, axes = (m.value(f"{name}_{part}").reshape(-1).astype(np.int64) for part in ("starts", "ends", "axes"))
    steps = m.value(f"{name}_steps") if m.has(f"{name}_steps") else None
    steps = np.ones_like(starts) if steps is None else steps.reshape(-1).astype(np.int64)
    m.require(len({starts.size, ends.size, axes.size, steps.size}) == 1, f"the {name} Slice's inputs differ in length")
    return [starts, ends, np.where(axes < 0, axes + rank, axes), steps]


@rule(
    "slice-chain",
    pattern=_slice(_slice(var("x"), "first"), "second"),
    phase=SIMPLIFY_PHASE,
    exact=True,
    opsets=(10, None),
)
def slice_chain(m: Match, b: Builder):
    """Slice(Slice(x, axes a), axes b), a and b disjoint  =>  Slice(x, axes a + b)."""
    rank = m.rank("x")
    m.require(rank is not None, "the input's rank is unknown")
    first, second = _parameters(m, "first", rank), _parameters(m, "second", rank)
    m.require(not set(first[2].tolist()) & set(second[2].tolist()), "the two Slices share an axis")
    merged = [np.concatenate([a, b_]) for a, b_ in zip(first, second)]
    return b.Slice(m["x"], *merged)
