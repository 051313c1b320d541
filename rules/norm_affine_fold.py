"""Norm(x, s, b) * g  =>  Norm(x, s*g, b*g);  LayerNorm(x, s, b) + c  =>  LayerNorm(x, s, b + c).

The learned weight and bias that follow a normalization, as exports write them when the
norm itself was written out (layer-norm and rms-norm create it with a scale of ones).
Normalizations scale and shift along their normalized (trailing) axes, so a constant that
varies only along those axes folds exactly: (n * s + b) * g = n * (s * g) + b * g. A constant
that varies along other axes, or broadcasts the result to a larger shape, does not fold.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._common import broadcast_over, require_finite, static_dims

from fuser import Builder, Match, const, op, rule, var

PRIORITY = 21
NORMS = op.LayerNormalization | op.RMSNormalization | op.SimplifiedLayerNormalization


def _normalized(m: Match) -> tuple[tuple[int, ...], int]:
    """The normalized dims and the input's rank."""
    rank = m.rank("x")
    m.require(rank is not None, "the input's rank is unknown")
    axis = int(m.attr("norm", "axis", -1))
    axis = axis - rank if axis >= 0 else axis
    return static_dims(m, "x", axis), rank


def _norm(m: Match, b: Builder, scale, bias):
    node = m.node("norm")
    return b.op(node.op_type, m["x"], b.constant(scale, "scale"), None if bias is None else b.constant(bias, "bias"),
                **node.attrs())


@rule(
    "norm-scale-fold",
    pattern=op.Mul(NORMS(var("x"), const("s"), const("b", optional=True), name="norm"), const("g"), name="mul"),
)
def norm_scale_fold(m: Match, b: Builder):
    """Normalization -> Mul(constant)  =>  Normalization with the constant in its scale (and bias)."""
    dims, rank = _normalized(m)
    scale, weight = m.value("s"), m.value("g")
    m.require(weight.dtype == scale.dtype, f"the multiplier is {weight.dtype}, the scale {scale.dtype}")
    g = broadcast_over(m, weight, dims, rank, "the multiplier").astype(np.float64)
    s = broadcast_over(m, scale, dims, rank, "the scale").astype(np.float64)
    new_scale = require_finite(m, s * g, scale.dtype, "the folded scale")
    bias = m.value("b")
    new_bias = None
    if bias is not None:
        folded = broadcast_over(m, bias, dims, rank, "the bias").astype(np.float64) * g
        new_bias = require_finite(m, folded, bias.dtype, "the folded bias")
    return _norm(m, b, new_scale, new_bias)


@rule(
    "norm-bias-fold",
    pattern=op.Add(op.LayerNormalization(var("x"), const("s"), const("b", optional=True), name="norm"), const("c"),
                   name="add"),
)
def norm_bias_fold(m: Match, b: Builder):
    """LayerNormalization -> Add(constant)  =>  LayerNormalization with the constant in its bias."""
    dims, rank = _normalized(m)
    scale, shift = m.value("s"), m.value("c")
    m.require(shift.dtype == scale.dtype, f"the addend is {shift.dtype}, the scale {scale.dtype}")
    c = broadcast_over(m, shift, dims, rank, "the addend").astype(np.float64)
    bias = m.value("b")
    base = np.zeros(dims) if bias is None else broadcast_over(m, bias, dims, rank, "the bias").astype(np.float64)
    new_bias = require_finite(m, base + c, scale.dtype, "the folded bias")
    return _norm(m, b, np.array(scale), new_bias)
