"""Cast(Norm(x, s, b), T) * g  =>  Cast(Norm(x, s*g, b*g), T), for a float32 norm cast to float16.

A float16 Llama's RMSNorm normalizes in float32, casts the result to float16 and multiplies it
by its float16 weight, so norm-scale-fold does not see the weight: the Cast is in the way. The
weight varies along the normalized axes only (as norm-scale-fold requires), so it goes into the
float32 scale and bias, and the Cast moves after it.

The model multiplies the float16-rounded norm and rounds again; the rewrite rounds once, after
the product. That is what onnxruntime computes for the model anyway: its CPU has no float16 Mul,
so it multiplies in float32 and drops the Cast down and up again around it.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._common import broadcast_over, static_dims
from onnx import TensorProto

from fuser import Builder, Match, const, op, rule, var

NORMS = op.LayerNormalization | op.RMSNormalization | op.SimplifiedLayerNormalization

PATTERN = op.Mul(
    op.Cast(NORMS(var("x"), const("s"), const("b", optional=True), name="norm"), name="down"),
    const("g"),
    name="mul",
)


@rule("norm-scale-through-cast", pattern=PATTERN)
def norm_scale_through_cast(m: Match, b: Builder):
    """Cast(Norm, float16) -> Mul(float16 constant)  =>  Norm with the constant in its float32 scale -> Cast."""
    m.require(m.dtype("s") == np.float32, f"the norm's scale is {m.dtype('s')}, not float32")
    m.require(m.attr("down", "to") == TensorProto.FLOAT16, "the norm's result is not cast to float16")
    m.require(m.dtype("g") == np.float16, f"the multiplier is {m.dtype('g')}, not float16")
    rank = m.rank("x")
    m.require(rank is not None, "the input's rank is unknown")
    axis = int(m.attr("norm", "axis", -1))
    dims = static_dims(m, "x", axis - rank if axis >= 0 else axis)
    g = broadcast_over(m, m.value("g"), dims, rank, "the multiplier").astype(np.float64)
    scale = broadcast_over(m, m.value("s"), dims, rank, "the scale").astype(np.float64) * g
    bias = None
    if m.has("b"):
        bias = b.constant((broadcast_over(m, m.value("b"), dims, rank, "the bias") * g).astype(np.float32), "bias")
    node = m.node("norm")
    norm = b.like(node, m["x"], b.constant(scale.astype(np.float32), "scale"), bias)
    return b.Cast(norm, to=TensorProto.FLOAT16)
