"""activation(ReorderOutput(NCHWc Conv))  =>  ReorderOutput(NCHWc Conv(activation)) (onnxruntime target).

The NCHWc convolution applies Relu, LeakyRelu, Sigmoid, Tanh, HardSigmoid and Clip as
it writes its output, after adding its Sum input: one pass over memory fewer. Newer
onnxruntimes apply HardSwish too (MobileNetV3's activation, which onnxruntime's CPU runs as a
HardSigmoid and a Mul otherwise); the rule asks the installed one (conv_activations). That
HardSigmoid and Mul, x * HardSigmoid(x, 1/6, 0.5), go in as HardSwish too: it is the form
HardSwish takes before opset 14 (hardswish-clip-regroup).
"""

from __future__ import annotations

from fuser import Builder, Match, op, rule, var
from fuser.rules._activations import activation, activation_params
from fuser.rules._hard_activations import close_to
from fuser.rules._nchwc import EMITS, NCHWC, channels_of, conv_activations, nchwc, reorder_output


def _convolution_result():
    return nchwc.ReorderOutput(
        nchwc.Conv(var("x"), var("w"), var("b", optional=True), var("sum", optional=True), name="conv"),
        name="to_plain",
    )


@rule(
    "nchwc-activation",
    pattern=(
        activation(_convolution_result()),
        op.HardSwish(_convolution_result(), name="act"),
        op.Mul(_convolution_result(), op.HardSigmoid(_convolution_result(), name="hsig"), name="act"),
    ),
    target="onnxruntime",
    emits=EMITS,
    phase=1,
)
def nchwc_activation(m: Match, b: Builder):
    """activation after a NCHWc Conv  =>  the Conv's own activation."""
    m.require(m.node("conv").attr("activation") is None, "the convolution already applies an activation")
    if m.has("hsig"):
        alpha, beta = float(m.attr("hsig", "alpha", 0.2)), float(m.attr("hsig", "beta", 0.5))
        m.require(close_to(alpha, 1 / 6) and beta == 0.5, f"x * HardSigmoid(x, {alpha:g}, {beta:g}) is not HardSwish")
        kind, params = "HardSwish", []
    else:
        kind, params = m.node("act").op_type, None
    m.require(kind in conv_activations(), f"the installed onnxruntime's NCHWc Conv cannot apply {kind}")
    if params is None:
        kind, params = activation_params(m)
    inputs = [m["x"], m["w"], m["b"] if m.has("b") else None, m["sum"] if m.has("sum") else None]
    blocked = b.op("Conv", *inputs, domain=NCHWC, activation=kind, activation_params=params or None, **m.attrs("conv"))
    return reorder_output(b, blocked, channels_of(m, "to_plain"))
