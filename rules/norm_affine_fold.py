"""Norm(x, s, b) * g  =>  Norm(x, s*g, b*g);  LayerNorm(x, s, b) + c  =>  LayerNorm(x, s, b + c).

The learned weight and bias that follow a normalization, as exports write them when the
norm itself was written out (layer-norm and rms-norm create it with a scale of ones).
Normalizations scale and shift along their normalized (trailing) axes, so a constant that
varies only along those axes folds exactly: (n * s + b) * g = n * (s * g) + b * g. A constant
that varies along other axes, or broadcasts the result to a larger shape, does not fold.
onnxruntime's Skip* norms (created first where a residual Add feeds the norm) fold the same
way through their gamma and beta; their other outputs (the residual sum) do not change.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._common import broadcast_over, static_dims
from fuser.rules._folding import cast_finite

from fuser import Builder, Match, const, op, rule, var

NORMS = op.LayerNormalization | op.RMSNormalization | op.SimplifiedLayerNormalization
MS = op.domain("com.microsoft")


def _norms(with_bias: bool):
    """The normalization patterns, binding x, s (scale) and b (bias) alike for every op."""
    b = const("b", optional=True)
    skip_bias = const("skip_bias", optional=True)
    skip = (var("x"), var("skip"), const("s"))
    if with_bias:
        yield op.LayerNormalization(var("x"), const("s"), b, name="norm")
        yield MS.SkipLayerNormalization(*skip, b, skip_bias, name="norm")
    else:
        yield NORMS(var("x"), const("s"), b, name="norm")
        yield MS.SkipLayerNormalization(*skip, b, skip_bias, name="norm")
        yield MS.SkipSimplifiedLayerNormalization(*skip, skip_bias, name="norm")


def _normalized(m: Match) -> tuple[tuple[int, ...], int]:
    """The normalized dims and the input's rank."""
    rank = m.rank("x")
    m.require(rank is not None, "the input's rank is unknown")
    axis = int(m.attr("norm", "axis", -1))
    axis = axis - rank if axis >= 0 else axis
    return static_dims(m, "x", axis), rank


def _norm(m: Match, b: Builder, scale, bias):
    """The matched norm with a new scale and bias; its other used outputs stand in for the old ones."""
    node = m.node("norm")
    scale, bias = b.constant(scale, "scale"), None if bias is None else b.constant(bias, "bias")
    if node.domain == "com.microsoft":
        inputs = [m["x"], m["skip"], scale, bias, m["skip_bias"]]
        if node.op_type == "SkipSimplifiedLayerNormalization":
            inputs = [m["x"], m["skip"], scale, m["skip_bias"]]
    else:
        inputs = [m["x"], scale, bias]
    outputs = b.like(node, *inputs, outputs=len(node.outputs))
    if isinstance(outputs, str):
        return outputs
    for old, new in zip(node.outputs[1:], outputs[1:]):
        if old and (m.consumers_of(old) or m.graph.is_graph_output(old)):
            b.replaces(old, new)
    return outputs[0]


@rule("norm-scale-fold", pattern=tuple(op.Mul(norm, const("g"), name="mul") for norm in _norms(with_bias=False)))
def norm_scale_fold(m: Match, b: Builder):
    """Normalization -> Mul(constant)  =>  Normalization with the constant in its scale (and bias)."""
    dims, rank = _normalized(m)
    scale, weight = m.value("s"), m.value("g")
    m.require(weight.dtype == scale.dtype, "the multiplier is %s, the scale %s", weight.dtype, scale.dtype)
    g = broadcast_over(m, weight, dims, rank, "the multiplier").astype(np.float64)
    s = broadcast_over(m, scale, dims, rank, "the scale").astype(np.float64)
    new_scale = cast_finite(m, "scale values", s * g, scale.dtype)
    bias = m.value("b") if m.has("b") else None
    new_bias = None
    if bias is not None:
        folded = broadcast_over(m, bias, dims, rank, "the bias").astype(np.float64) * g
        new_bias = cast_finite(m, "bias values", folded, bias.dtype)
    return _norm(m, b, new_scale, new_bias)


@rule("norm-bias-fold", pattern=tuple(op.Add(norm, const("c"), name="add") for norm in _norms(with_bias=True)))
def norm_bias_fold(m: Match, b: Builder):
    """LayerNormalization -> Add(constant)  =>  LayerNormalization with the constant in its bias."""
    dims, rank = _normalized(m)
    scale, shift = m.value("s"), m.value("c")
    m.require(shift.dtype == scale.dtype, "the addend is %s, the scale %s", shift.dtype, scale.dtype)
    c = broadcast_over(m, shift, dims, rank, "the addend").astype(np.float64)
    bias = m.value("b") if m.has("b") else None
    base = np.zeros(dims) if bias is None else broadcast_over(m, bias, dims, rank, "the bias").astype(np.float64)
    new_bias = cast_finite(m, "bias values", base + c, scale.dtype)
    return _norm(m, b, np.array(scale), new_bias)
