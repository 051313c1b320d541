"""Shape(x) with x's shape fixed  =>  a constant; Gather(Shape(x), i) of fixed dims  =>  a constant.

Exporters read shapes at run time to compute pads, Reshape targets and Resize sizes. Where
shape inference fixes the dimensions read, the answer is a constant, and what is computed
from it folds too (constant-fold). A symbolic dimension (a batch size, say) is never folded:
only the fixed dimensions a Gather picks out of a partly symbolic shape are.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._simplify import SIMPLIFY_PHASE

from fuser import Builder, Match, const, op, rule, var


def _read_dims(m: Match) -> list:
    """The dimensions Shape reports, honouring its start/end attributes (opset 15)."""
    shape = m.shape("x")
    m.require(shape is not None, "the input's shape is unknown")
    start, end = m.attr("shape", "start", 0), m.attr("shape", "end", None)
    return list(shape)[slice(start, end)]


def _fixed(dims: list) -> bool:
    return all(isinstance(d, int) for d in dims)


@rule("shape-fold", pattern=op.Shape(var("x"), name="shape"), phase=SIMPLIFY_PHASE, exact=True)
def shape_fold(m: Match, b: Builder):
    """Shape(x) of a fixed shape  =>  that shape, as an int64 initializer."""
    dims = _read_dims(m)
    m.require(_fixed(dims), f"the shape {tuple(dims)} has symbolic dimensions")
    return b.constant(np.array(dims, np.int64), "shape")


@rule(
    "shape-gather-fold",
    pattern=op.Gather(op.Shape(var("x"), name="shape"), const("indices"), name="gather"),
    phase=SIMPLIFY_PHASE,
    exact=True,
    shared_interior=True,
)
def shape_gather_fold(m: Match, b: Builder):
    """Gather(Shape(x), i) of fixed dimensions  =>  those dimensions, as an int64 initializer."""
    dims = _read_dims(m)
    indices = m.value("indices")
    m.require(np.issubdtype(indices.dtype, np.integer), "the indices are not integers")
    m.require(bool(np.all((indices >= -len(dims)) & (indices < len(dims)))), "an index is out of range")
    picked = [dims[int(i)] for i in indices.reshape(-1)]
    m.require(_fixed(picked), f"the dimensions picked, {picked}, are symbolic")
    return b.constant(np.array(picked, np.int64).reshape(indices.shape), "dims")
