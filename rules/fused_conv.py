"""Conv -> activation  =>  com.microsoft FusedConv(activation) (onnxruntime target).

FusedConv computes act(Conv(X, W, B)) in one kernel; the activation's parameters move
into `activation_params` (LeakyRelu alpha, HardSigmoid alpha and beta, Clip min and max).
"""

from __future__ import annotations

from fuser.rules._activations import activation, activation_params, fusable_dtype

from fuser import Builder, Match, op, rule, var


@rule(
    "fused-conv",
    pattern=activation(op.Conv(var("x"), var("w"), var("b", optional=True), name="conv")),
    target="onnxruntime",
    emits={"com.microsoft": 1},
)
def fused_conv(m: Match, b: Builder):
    """Conv -> Relu/LeakyRelu/Sigmoid/Tanh/HardSigmoid/Clip  =>  FusedConv(activation)."""
    fusable_dtype(m, m["x"])
    kind, params = activation_params(m)
    return b.op(
        "FusedConv",
        m["x"],
        m["w"],
        m["b"],
        domain="com.microsoft",
        activation=kind,
        activation_params=params or None,
        **m.attrs("conv"),
    )
