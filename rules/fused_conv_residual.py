"""Conv -> Add or two-input Sum (residual Z) -> activation  =>  com.microsoft FusedConv(X, W, B, Z, activation).

onnxruntime's FusedConv adds its fourth input Z to the convolution before the activation,
which is exactly a ResNet block's residual Add + Relu. Z must have the convolution
output's shape: FusedConv does not broadcast it.
"""

from __future__ import annotations

from fuser.rules._activations import activation, activation_params, fusable_dtype

from fuser import Builder, Match, op, rule, var


@rule(
    "fused-conv-residual",
    pattern=activation(
        (op.Add | op.Sum)(op.Conv(var("x"), var("w"), var("b", optional=True), name="conv"), var("z"), name="add")
    ),
    target="onnxruntime",
    emits={"com.microsoft": 1},
)
def fused_conv_residual(m: Match, b: Builder):
    """Conv -> Add(residual) -> activation  =>  FusedConv with Z = the residual."""
    fusable_dtype(m, m["x"])
    conv_shape, z_shape = m.shape("conv"), m.shape("z")
    m.require(conv_shape is not None and z_shape is not None, "the shapes of the convolution and residual are unknown")
    m.require(
        conv_shape == z_shape and "?" not in conv_shape,
        f"the residual {z_shape} does not have the convolution's shape {conv_shape}",
    )
    m.require(m.dtype("z") == m.dtype("x"), "the residual's dtype differs from the convolution's")
    kind, params = activation_params(m)
    bias = m["b"]
    return b.op(
        "FusedConv",
        m["x"],
        m["w"],
        bias if bias is not None else "",
        m["z"],
        domain="com.microsoft",
        activation=kind,
        activation_params=params or None,
        **m.attrs("conv"),
    )
