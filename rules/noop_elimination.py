"""Operators that return their input unchanged  =>  the input.

Exports keep them where a general code path met a special case: a Concat of one part, an
Expand or Tile to the shape the tensor already has, a Slice of the whole range, an Unsqueeze
undone by a Squeeze of the same axes. Each is a copy of the tensor, and each hides its input's
producer from the rules that fuse across it.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._simplify import SIMPLIFY_PHASE, same_shape

from fuser import Builder, Match, const, op, rule, var


@rule("concat-single", pattern=op.Concat(var("x"), name="concat"), phase=SIMPLIFY_PHASE, exact=True)
def concat_single(m: Match, b: Builder):
    """Concat of one input  =>  the input."""
    return m["x"]


@rule("expand-noop", pattern=op.Expand(var("x"), const("shape"), name="expand"), phase=SIMPLIFY_PHASE, exact=True)
def expand_noop(m: Match, b: Builder):
    """Expand(x, s) that leaves x's shape as it is  =>  x."""
    shape, target = m.shape("x"), [int(d) for d in m.value("shape").reshape(-1)]
    m.require(shape is not None and len(target) <= len(shape), "the Expand may add axes")
    m.require(
        all(t == 1 or t == d for t, d in zip(reversed(target), reversed(shape))),
        f"the Expand to {target} may grow x's shape {shape}",
    )
    return m["x"]


@rule("tile-noop", pattern=op.Tile(var("x"), const("repeats"), name="tile"), phase=SIMPLIFY_PHASE, exact=True)
def tile_noop(m: Match, b: Builder):
    """Tile(x, all ones)  =>  x."""
    m.require(bool(np.all(m.value("repeats") == 1)), "the Tile repeats x")
    return m["x"]


@rule(
    "slice-noop",
    pattern=op.Slice(
        var("x"),
        const("starts"),
        const("ends"),
        const("axes", optional=True),
        const("steps", optional=True),
        name="slice",
    ),
    phase=SIMPLIFY_PHASE,
    exact=True,
    opsets=(10, None),
)
def slice_noop(m: Match, b: Builder):
    """Slice of every element, in order  =>  x."""
    steps = m.value("steps")
    m.require(steps is None or bool(np.all(steps == 1)), "the Slice steps over elements")
    m.require(bool(np.all(m.value("starts") == 0)), "the Slice starts after the first element")
    m.require(same_shape(m, "x", "slice"), "the Slice may leave elements out")
    return m["x"]


@rule(
    "squeeze-unsqueeze",
    pattern=op.Squeeze(
        op.Unsqueeze(var("x"), const("unsqueeze_axes", optional=True), name="unsqueeze"),
        const("squeeze_axes", optional=True),
        name="squeeze",
    ),
    phase=SIMPLIFY_PHASE,
    exact=True,
)
def squeeze_unsqueeze(m: Match, b: Builder):
    """Squeeze(Unsqueeze(x, axes), axes)  =>  x."""
    if m.opset < 13:
        added, removed = m.attr("unsqueeze", "axes", None), m.attr("squeeze", "axes", None)
    else:
        added, removed = m.value("unsqueeze_axes"), m.value("squeeze_axes")
    m.require(added is not None and removed is not None, "the Squeeze or Unsqueeze has no explicit axes")
    rank = m.rank("unsqueeze")
    m.require(rank is not None, "the rank is unknown")
    added = sorted(int(a) % rank for a in np.asarray(added).reshape(-1))
    removed = sorted(int(a) % rank for a in np.asarray(removed).reshape(-1))
    m.require(added == removed, f"the Squeeze removes axes {removed}, the Unsqueeze added {added}")
    return m["x"]
