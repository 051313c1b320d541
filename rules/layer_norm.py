"""(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps)  =>  LayerNormalization(x, 1, axis, eps).

The written-out layer norm of exports and hand-written modules: mean and variance over
the trailing axes, kept dims, the epsilon added inside the square root. LayerNormalization
(opset 17) normalizes from `axis` to the last axis with the biased variance, the same
computation, with a scale of ones; a following Mul/Add by the learned weight and bias is
folded in by norm-scale-fold / norm-bias-fold. The square is Pow(d, 2) or d * d; the
division is Div, or Mul by Reciprocal.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._common import written_out_norm

from fuser import Builder, Match, const, op, rule, var


def _patterns():
    x = var("x")
    centered = op.Sub(x, op.ReduceMean(x, const("mean_axes", optional=True), name="mean"), name="sub")
    squares = (op.Pow(centered, const("two"), name="square"), op.Mul(centered, centered, name="square"))
    for square in squares:
        variance = op.ReduceMean(square, const("var_axes", optional=True), name="var")
        std = op.Sqrt(op.Add(variance, const("eps"), name="add_eps"), name="sqrt")
        yield op.Div(centered, std, name="div")
        yield op.Mul(centered, op.Reciprocal(std, name="reciprocal"), name="div")


PATTERNS = tuple(_patterns())


@rule("layer-norm", pattern=PATTERNS, opsets=(17, None))
def layer_norm(m: Match, b: Builder):
    """Written-out layer normalization  =>  LayerNormalization (scale 1, no bias)."""
    dtype, axis, dims, epsilon = written_out_norm(m, {"mean": "mean_axes", "var": "var_axes"})
    return b.LayerNormalization(m["x"], np.ones(dims, dtype), axis=axis, epsilon=epsilon)


@rule(
    "layer-norm-ort",
    pattern=PATTERNS,
    target="onnxruntime",
    opsets=(1, 16),
    note=(
        "layer norms became LayerNormalization below its standard opset 17: onnxruntime runs it, "
        "onnx.checker rejects it; --opset 17 writes a standard model instead"
    ),
)
def layer_norm_ort(m: Match, b: Builder):
    """Written-out layer normalization  =>  LayerNormalization (onnxruntime, below opset 17)."""
    dtype, axis, dims, epsilon = written_out_norm(m, {"mean": "mean_axes", "var": "var_axes"})
    return b.LayerNormalization(m["x"], np.ones(dims, dtype), axis=axis, epsilon=epsilon)
