"""x / sqrt(mean(x^2) + eps)  =>  RMSNormalization(x, 1, axis, eps) (opset 23), or onnxruntime's
SimplifiedLayerNormalization on the onnxruntime target below opset 23.

Llama/T5-style root-mean-square normalization as exports write it: the square is
Pow(x, 2) or x * x, the mean is over the trailing axes with kept dims, and the division
is Div, Mul by Reciprocal, or Mul by 1 / sqrt (torch's rsqrt). Both fused ops compute
x / sqrt(mean(x^2) + eps) * scale over the axes from `axis` on; the learned weight that
follows is folded into the scale by norm-scale-fold.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._common import require_float, written_out_norm

from fuser import Builder, Match, const, op, rule, var


def _patterns():
    x = var("x")
    squares = (op.Pow(x, const("two"), name="square"), op.Mul(x, x, name="square"))
    for square in squares:
        mean = op.ReduceMean(square, const("axes", optional=True), name="mean")
        std = op.Sqrt(op.Add(mean, const("eps"), name="add_eps"), name="sqrt")
        yield op.Div(x, std, name="div")
        yield op.Mul(x, op.Reciprocal(std, name="reciprocal"), name="div")
        yield op.Mul(x, op.Div(const("one"), std, name="reciprocal"), name="div")


PATTERNS = tuple(_patterns())


@rule("rms-norm", pattern=PATTERNS, opsets=(23, None))
def rms_norm(m: Match, b: Builder):
    """Written-out RMS normalization  =>  RMSNormalization (scale 1)."""
    dtype, axis, dims, epsilon = written_out_norm(m, {"mean": "axes"})
    return b.RMSNormalization(m["x"], np.ones(dims, dtype), axis=axis, epsilon=epsilon)


@rule(
    "rms-norm-ort",
    pattern=PATTERNS,
    target="onnxruntime",
    opsets=(1, 22),
    note=(
        "RMS norms became onnxruntime's SimplifiedLayerNormalization, which onnxruntime runs but "
        "onnx.checker does not know; --opset 23 writes the standard RMSNormalization instead"
    ),
)
def rms_norm_ort(m: Match, b: Builder):
    """Written-out RMS normalization  =>  SimplifiedLayerNormalization (onnxruntime, below opset 23)."""
    dtype, axis, dims, epsilon = written_out_norm(m, {"mean": "axes"})
    require_float(m, "x", ("float16", "float32", "float64"))
    return b.SimplifiedLayerNormalization(m["x"], np.ones(dims, dtype), axis=axis, epsilon=epsilon)
