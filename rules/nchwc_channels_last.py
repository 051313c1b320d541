"""Transposes between NHWC and a NCHWc tensor  =>  the reorder's channels-last form (onnxruntime target).

A ConvNeXt block runs its depthwise convolution in NCHW and the rest in NHWC, so every
block writes Transpose(ReorderOutput(conv)) and ReorderInput(Transpose(x)): two passes over
memory where one will do. onnxruntime's reorders read and write channels-last tensors
themselves (their channels_last attribute), so each pair becomes one operator.
"""

from __future__ import annotations

from fuser import Builder, Match, op, rule, var
from fuser.rules._nchwc import EMITS, NCHWC, channels_of, nchwc

TO_CHANNELS_LAST = [0, 2, 3, 1]
TO_CHANNELS_FIRST = [0, 3, 1, 2]


@rule(
    "nchwc-channels-last-output",
    pattern=op.Transpose(nchwc.ReorderOutput(var("x"), name="to_plain"), name="transpose"),
    target="onnxruntime",
    emits=EMITS,
    phase=1,
    shared_interior=True,
)
def nchwc_channels_last_output(m: Match, b: Builder):
    """Transpose(ReorderOutput(x), perm=[0, 2, 3, 1])  =>  ReorderOutput(x, channels_last=1)."""
    m.require(list(m.attr("transpose", "perm", [])) == TO_CHANNELS_LAST, "the Transpose is not NCHW to NHWC")
    return b.op("ReorderOutput", m["x"], domain=NCHWC, channels=channels_of(m, "to_plain"), channels_last=1)


@rule(
    "nchwc-channels-last-input",
    pattern=nchwc.ReorderInput(op.Transpose(var("x"), name="transpose"), name="to_blocked"),
    target="onnxruntime",
    emits=EMITS,
    phase=1,
    shared_interior=True,
)
def nchwc_channels_last_input(m: Match, b: Builder):
    """ReorderInput(Transpose(x, perm=[0, 3, 1, 2]))  =>  ReorderInput(x, channels_last=1)."""
    m.require(list(m.attr("transpose", "perm", [])) == TO_CHANNELS_FIRST, "the Transpose is not NHWC to NCHW")
    m.require(m.attr("to_blocked", "channels_last", 0) == 0, "the reorder already reads channels-last data")
    return b.op("ReorderInput", m["x"], domain=NCHWC, channels_last=1)
