"""Add(ReorderOutput(NCHWc Conv(x)), z)  =>  ReorderOutput(NCHWc Conv(x, Sum=ReorderInput(z))).

The residual Add after a convolution without activation (MobileNetV2's linear bottleneck)
is what the NCHWc convolution's Sum input computes: it adds z as it writes its output,
before any activation. Without this the Add runs in NCHW, and every block pays a
ReorderOutput and a ReorderInput around it; with it, z's own reorder cancels against the
ReorderOutput that produced it (nchwc-reorder-cancel) and the chain stays blocked.
z must have the sum's shape: the Sum input does not broadcast.
"""

from __future__ import annotations

from fuser import Builder, Match, op, rule, var
from fuser.rules._nchwc import EMITS, NCHWC, channels_of, is_float32, nchwc, reorder_output, require_reorderable


@rule(
    "nchwc-conv-add",
    pattern=op.Add(
        nchwc.ReorderOutput(nchwc.Conv(var("x"), var("w"), var("b", optional=True), name="conv"), name="to_plain"),
        var("z"),
        name="add",
    ),
    target="onnxruntime",
    emits=EMITS,
    phase=1,
)
def nchwc_conv_add(m: Match, b: Builder):
    """Add(NCHWc Conv result, z)  =>  NCHWc Conv with z as its Sum input."""
    m.require(m.node("conv").attr("activation") is None, "the convolution applies an activation before the Add")
    channels = channels_of(m, "to_plain")
    is_float32(m, m["z"])
    conv_shape, z_shape = m.shape("to_plain"), m.shape("z")
    m.require(
        conv_shape is not None and conv_shape == z_shape and "?" not in conv_shape,
        f"the addend {z_shape} does not have the convolution's shape {conv_shape}",
    )
    require_reorderable(m, channels)
    summed = b.op("ReorderInput", m["z"], domain=NCHWC)
    blocked = b.op("Conv", m["x"], m["w"], m["b"], summed, domain=NCHWC, **m.attrs("conv"))
    return reorder_output(b, blocked, channels)
