"""activation(ReorderOutput(NCHWc Conv))  =>  ReorderOutput(NCHWc Conv(activation)) (onnxruntime target).

The NCHWc convolution applies Relu, LeakyRelu, Sigmoid, Tanh, HardSigmoid and Clip as
it writes its output, after adding its Sum input: one pass over memory fewer. Newer
onnxruntimes apply HardSwish too (MobileNetV3's activation, which onnxruntime's CPU runs as a
HardSigmoid and a Mul otherwise); the rule asks the installed one (conv_activations).
"""

from __future__ import annotations

from fuser import Builder, Match, op, rule, var
from fuser.rules._activations import activation, activation_params
from fuser.rules._nchwc import EMITS, NCHWC, channels_of, conv_activations, nchwc, reorder_output


def _convolution_result():
    return nchwc.ReorderOutput(
        nchwc.Conv(var("x"), var("w"), var("b", optional=True), var("sum", optional=True), name="conv"),
        name="to_plain",
    )


@rule(
    "nchwc-activation",
    pattern=(activation(_convolution_result()), op.HardSwish(_convolution_result(), name="act")),
    target="onnxruntime",
    emits=EMITS,
    phase=1,
)
def nchwc_activation(m: Match, b: Builder):
    """activation after a NCHWc Conv  =>  the Conv's own activation."""
    m.require(m.node("conv").attr("activation") is None, "the convolution already applies an activation")
    kind = m.node("act").op_type
    m.require(kind in conv_activations(), f"the installed onnxruntime's NCHWc Conv cannot apply {kind}")
    kind, params = activation_params(m)
    inputs = [m["x"], m["w"], m["b"] if m.has("b") else None, m["sum"] if m.has("sum") else None]
    blocked = b.op("Conv", *inputs, domain=NCHWC, activation=kind, activation_params=params or None, **m.attrs("conv"))
    return reorder_output(b, blocked, channels_of(m, "to_plain"))
