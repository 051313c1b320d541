"""The Casts around a float32 normalization of float16 data go into the norm.

Mixed-precision exports normalize in float32 between a Cast up from float16 and a Cast back:
a float16 Llama's RMSNorm (x.to(float32), normalized, .to(float16), then its float16 weight),
autocast's layer norms. The norms compute in float32 themselves (stash_type 1, the default).

norm-cast-fold-ort (onnxruntime target, on): Cast(x, float32) -> SimplifiedLayerNormalization
becomes one SimplifiedLayerNormalization reading x as float16 with its float32 scale and result
(onnxruntime's kernel takes the input's type and the scale's apart). Casting float16 up is
exact and the kernel reads it in float32, so the result is the same, bit for bit; the Cast back
stays, and the float16 weight after it folds into the scale (norm-scale-through-cast).

norm-cast-fold (any target, off by default): Cast(Norm(Cast(x, float32), s, b), float16)
becomes Norm(x, s, b) on float16. The ONNX function of a norm on float16 with stash_type 1 casts
x up, normalizes, and casts back before the scale and bias, so with a scale of ones and no bias
(as layer-norm and rms-norm create them) this is the model's own computation. It is off because
onnxruntime's CPU runs float16 models partly in float32: it has no float16 kernel for most
operators, computes the stretches between float16 kernels in float32 and drops the Casts down
and up again inside them. The model's norm result then reaches the next MatMul unrounded; the
fused norm has a float16 kernel and rounds it. One rounding per norm, but over the layers of a
real-size float16 Llama (4 layers, hidden 512) it takes the output past the float16 tolerance
of fuser's check. Enable it for runtimes that compute float16 as float16. The scale and bias
must convert to float16 exactly; bfloat16 (no onnxruntime RMSNormalization kernel) and float64
(float32 would lose precision) are left alone.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from fuser import Builder, Match, const, op, rule, var

NORMS = op.LayerNormalization | op.RMSNormalization | op.SimplifiedLayerNormalization
CAST_UP = op.Cast(var("x"), name="up")


def _require_float16_up(m: Match) -> None:
    dtype = m.dtype("x")
    m.require(dtype == np.float16, "the norm's input is cast from %s, not from float16", dtype)
    m.require(m.attr("up", "to") == TensorProto.FLOAT, "the input is not cast to float32")
    m.require(m.attr("norm", "stash_type", 1) == TensorProto.FLOAT, "the norm does not compute in float32")


def _in_float16(m: Match, name: str, what: str) -> np.ndarray:
    value = m.value(name)
    m.require(value.dtype == np.float32, "the %s is %s, not float32 like the norm's input", what, value.dtype)
    with np.errstate(over="ignore"):
        converted = value.astype(np.float16)
    m.require(
        bool(np.array_equal(converted.astype(np.float32), value)),
        f"the {what} does not convert to float16 exactly",
    )
    return converted


@rule(
    "norm-cast-fold-ort",
    pattern=op.SimplifiedLayerNormalization(CAST_UP, const("s"), name="norm"),
    target="onnxruntime",
)
def norm_cast_fold_ort(m: Match, b: Builder):
    """SimplifiedLayerNormalization(Cast(x, float32))  =>  SimplifiedLayerNormalization(x), float32 result."""
    _require_float16_up(m)
    m.require(m.dtype("s") == np.float32, f"the scale is {m.dtype('s')}, not float32")
    return b.SimplifiedLayerNormalization(m["x"], m["s"], **m.attrs("norm"))


@rule(
    "norm-cast-fold",
    pattern=op.Cast(NORMS(CAST_UP, const("s"), const("b", optional=True), name="norm"), name="down"),
    enabled=False,
)
def norm_cast_fold(m: Match, b: Builder):
    """Cast(Norm(Cast(x, float32)), float16)  =>  Norm(x) on float16 (it computes in float32)."""
    _require_float16_up(m)
    m.require(m.attr("down", "to") == TensorProto.FLOAT16, "the result is not cast back to float16")
    node = m.node("norm")
    scale = b.constant(_in_float16(m, "s", "scale"), "scale")
    bias = b.constant(_in_float16(m, "b", "bias"), "bias") if m.has("b") else None
    return b.like(node, m["x"], scale, bias)
