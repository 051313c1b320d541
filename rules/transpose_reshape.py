"""Transpose(x) that moves only axes of length 1  =>  Reshape(x) to the same shape.

Where every axis longer than 1 keeps its place relative to the others, the elements stay in
the same order in memory and only the shape changes: a view instead of a copy, which
reshape-chain then merges with the Reshape exporters put next to it (an LSTM's output
[sequence, directions, 1, hidden] read as [sequence, 1, directions, hidden]). Needs x's
shape fixed. It runs after the fusions (phase 1): at one token, the Transposes of attention
heads move only axes of length 1, and the attention rules look for them.
"""

from __future__ import annotations

import numpy as np

from fuser import Builder, Match, op, rule, var


@rule("transpose-reshape", pattern=op.Transpose(var("x"), name="transpose"), phase=1, exact=True)
def transpose_reshape(m: Match, b: Builder):
    """Transpose(x, perm) keeping the order of x's axes longer than 1  =>  Reshape(x)."""
    shape = m.shape("x")
    m.require(shape is not None and all(isinstance(d, int) for d in shape), "x's shape is not fixed")
    # Reshape would read a 0 in the new shape as "keep that axis"; an empty x costs nothing to move.
    m.require(0 not in shape, f"x is empty: {tuple(shape)}")
    perm = m.attr("transpose", "perm")
    perm = list(reversed(range(len(shape)))) if perm is None else [int(p) for p in perm]
    m.require(perm != list(range(len(shape))), "the Transpose keeps every axis in place")
    moved = [axis for axis in perm if shape[axis] != 1]
    m.require(moved == sorted(moved), "it reorders axes longer than 1")
    return b.Reshape(m["x"], np.array([shape[axis] for axis in perm], np.int64))
