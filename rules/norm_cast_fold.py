"""Cast(Norm(Cast(x, float32), s, b), float16)  =>  Norm(x, s, b) on float16, computing in float32.

Mixed-precision exports normalize in float32 between two Casts: a float16 Llama's RMSNorm
(x.to(float32), normalized, .to(float16), then its float16 weight), autocast's layer norms.
The norms take float16 themselves and compute in float32: with stash_type 1 (the default) the
ONNX function casts x to float32, normalizes, and casts back to x's type before the scale and
bias. So the Casts go into the norm, with its scale and bias in float16. Those must convert to
float16 exactly, so the fused norm applies the same numbers; with the scale of ones that
layer-norm and rms-norm create, and no bias, it computes what the model did (onnxruntime gives
the same bits), and otherwise it differs by float16 rounding (once in the model, after the
scale and bias; the fused kernel may round before them too). The learned weight that follows
in float16 is then folded by norm-scale-fold. Only float16: onnxruntime's CPU kernels lack
bfloat16 RMSNormalization, and a float64 x would lose precision in float32.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from fuser import Builder, Match, const, op, rule, var

NORMS = op.LayerNormalization | op.RMSNormalization | op.SimplifiedLayerNormalization

PATTERN = op.Cast(
    NORMS(op.Cast(var("x"), name="up"), const("s"), const("b", optional=True), name="norm"),
    name="down",
)


def _in_float16(m: Match, name: str, what: str) -> np.ndarray:
    value = m.value(name)
    m.require(value.dtype == np.float32, f"the {what} is {value.dtype}, not float32 like the norm's input")
    with np.errstate(over="ignore"):
        converted = value.astype(np.float16)
    m.require(
        bool(np.array_equal(converted.astype(np.float32), value)),
        f"the {what} does not convert to float16 exactly",
    )
    return converted


@rule("norm-cast-fold", pattern=PATTERN)
def norm_cast_fold(m: Match, b: Builder):
    """Cast(Norm(Cast(x, float32)), float16)  =>  Norm(x) on float16 (it computes in float32)."""
    dtype = m.dtype("x")
    m.require(dtype == np.float16, f"the norm's input is cast from {dtype}, not from float16")
    m.require(m.attr("up", "to") == TensorProto.FLOAT, "the input is not cast to float32")
    m.require(m.attr("down", "to") == TensorProto.FLOAT16, "the result is not cast back to float16")
    m.require(m.attr("norm", "stash_type", 1) == TensorProto.FLOAT, "the norm does not compute in float32")
    node = m.node("norm")
    scale = b.constant(_in_float16(m, "s", "scale"), "scale")
    bias = b.constant(_in_float16(m, "b", "bias"), "bias") if m.has("b") else None
    return b.op(node.op_type, m["x"], scale, bias, domain=node.domain, **node.attrs())
