"""com.microsoft Gelu(x + bias)  =>  BiasGelu(x, bias);  FastGelu(x + bias)  =>  FastGelu(x, bias).

The bias Add of the projection in front of a transformer MLP's GELU (MatMul -> Add -> GELU).
Both kernels add a 1-D bias along the last axis inside the activation, so the bias must be
a constant with one value per element of that axis.
"""

from __future__ import annotations

from fuser.rules._common import require_float

from fuser import Builder, Match, const, op, rule, var

MS = op.domain("com.microsoft")


@rule(
    "bias-gelu",
    pattern=(MS.Gelu | MS.FastGelu)(op.Add(var("x"), const("bias"), name="add"), name="gelu"),
    target="onnxruntime",
    emits={"com.microsoft": 1},
)
def bias_gelu(m: Match, b: Builder):
    """Add(bias) -> com.microsoft Gelu / FastGelu  =>  BiasGelu / FastGelu with the bias input."""
    fast = m.node("gelu").op_type == "FastGelu"
    m.require(not (fast and len(m.node("gelu").inputs) > 1), "FastGelu already has a bias")
    require_float(m, "x", ("float16", "float32"))
    bias, shape = m.value("bias"), m.shape("x")
    m.require(bias.ndim == 1, f"the bias has shape {bias.shape}, not one value per channel")
    m.require(shape is not None and len(shape) >= 1, "the input's shape is unknown")
    m.require(shape[-1] == bias.shape[0], f"the bias has {bias.shape[0]} values, the last axis {shape[-1]}")
    m.require(m.dtype("bias") == m.dtype("x"), "the bias and the input have different dtypes")
    return b.op("FastGelu" if fast else "BiasGelu", m["x"], m["bias"], domain="com.microsoft")
