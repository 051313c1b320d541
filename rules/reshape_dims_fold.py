"""Reshape(x, Concat(..., Gather(Shape(x), i), ...))  =>  Reshape(x, constant), with 0 and -1.

Exports compute Reshape targets at run time from the input's own dims (split heads:
[batch, seq, heads, head_dim] from Shape(x)), which leaves a Shape/Gather/Unsqueeze/Concat
chain per Reshape when batch and sequence are symbolic. Reshape's target 0 copies the
input's dim at the same position (allowzero=0) and one -1 takes whatever size is left, so a
target whose every entry is a constant, a dim of x read at its own position, or one other
unknown is a constant target. The chain that computed it is removed once unused.
A -1 cannot be inferred when another dim is 0, so a model with an empty dimension would fail
where the computed target did not; transformer exports never reshape empty tensors.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._common import same_dim
from fuser.rules._simplify import SIMPLIFY_PHASE, shape_entries

from fuser import Builder, Match, op, rule, var

PARTS = 8


def _inferred(m: Match, entry):
    """The size shape inference gives ('dim', tensor, axis): an int, a symbol, or None."""
    shape = m.shape_of(entry[1])
    return None if shape is None else shape[entry[2]]


def _same_dim(m: Match, entry, data: str, position: int) -> bool:
    """Whether ('dim', tensor, axis) is data's dim at `position`, provably."""
    _, tensor, axis = entry
    if tensor == data and axis == position:
        return True
    theirs, ours = m.shape_of(tensor), m.shape_of(data)
    if theirs is None or ours is None or position >= len(ours):
        return False
    return same_dim(theirs[axis], ours[position])


@rule(
    "reshape-dims-fold",
    pattern=op.Reshape(
        var("data"),
        op.Concat(var("p0"), *(var(f"p{i}", optional=True) for i in range(1, PARTS)), name="concat"),
        name="reshape",
    ),
    phase=SIMPLIFY_PHASE,
    exact=True,
)
def reshape_dims_fold(m: Match, b: Builder):
    """Reshape to a target computed from the input's own dims  =>  Reshape to a constant (0 / -1)."""
    m.require(int(m.attr("reshape", "allowzero", 0) or 0) == 0, "allowzero=1: a 0 in the target is a real 0")
    m.require(int(m.attr("concat", "axis", 0)) in (0, -1), "the target is not concatenated along its only axis")
    entries: list = []
    for i in range(PARTS):
        if not m.has(f"p{i}"):
            break
        part = shape_entries(m, m[f"p{i}"])
        m.require(part is not None, f"the length of target part {i} is unknown")
        entries.extend(part)
    data_shape = m.shape("data")
    target = []
    for position, entry in enumerate(entries):
        if isinstance(entry, int):
            target.append(entry)
        elif entry is not None and isinstance(_inferred(m, entry), int):
            target.append(_inferred(m, entry))  # a dim shape inference fixed
        elif entry is not None and _same_dim(m, entry, m["data"], position):
            target.append(0)
        else:
            target.append(None)
    unknown = target.count(None)
    m.require(unknown == 0 or (unknown == 1 and -1 not in target), f"{unknown} target dims are not known from x's own dims")
    m.require(data_shape is not None or all(t != 0 for t in target), "the input's rank is unknown")
    constant = np.array([-1 if t is None else t for t in target], np.int64)
    return b.Reshape(m["data"], constant, **m.attrs("reshape"))
