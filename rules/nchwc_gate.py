"""x * gate, one gate value per channel, x a NCHWc result  =>  NCHWc depthwise 1x1 Conv whose
filter is the gate (onnxruntime target).

Squeeze-and-excitation blocks (MobileNetV3, EfficientNet, RegNetY, PP-LCNet, PP-OCRv4) scale
every channel of a feature map by a gate computed from the map itself. A [1, C, 1, 1] gate read
against a blocked tensor would meet the wrong channels, so the product left the blocked layout:
a reorder out and one back in around every gate. onnxruntime's NCHWc Conv takes its filter as
an input at every run, not only as a stored weight, so a depthwise convolution whose [C, 1, 1, 1]
filter is the gate scales the blocked tensor as it is (0.35 to 0.88 of the reorders' time on
feature maps of EfficientNet's sizes). Broadcasting the gate over a 5-D view of the blocked
tensor instead ran slower than the reorders: onnxruntime multiplies it in pieces of one block.
One filter serves every image of a batch, so the batch must be 1.
"""

from __future__ import annotations

import numpy as np

from fuser import Builder, Match, op, rule, var
from fuser.rules._nchwc import EMITS, NCHWC, channels_of, guarded, nchwc, padded, reorder_output, require_block_size


@rule(
    "nchwc-gate",
    pattern=op.Mul(nchwc.ReorderOutput(var("x"), name="to_plain"), var("gate"), name="mul"),
    target="onnxruntime",
    emits=EMITS,
    phase=1,
    shared_interior=True,
)
def nchwc_gate(m: Match, b: Builder):
    """x * gate[1, C, 1, 1] after a NCHWc result  =>  ReorderOutput(NCHWc Conv(x, gate, group=C))."""
    channels = channels_of(m, "to_plain")
    block = require_block_size(m)
    shape = m.shape("to_plain")
    m.require(
        shape is not None and len(shape) == 4 and all(isinstance(d, int) for d in shape),
        f"the feature map's shape {shape} is not known",
    )
    m.require(shape[0] == 1, f"a batch of {shape[0]}: one filter serves every image")
    m.require(m.shape("mul") == shape, "the product is larger than the feature map")
    gate_shape = m.shape("gate")
    m.require(
        gate_shape is not None and tuple(gate_shape)[-3:] == (channels, 1, 1) and all(d == 1 for d in gate_shape[:-3]),
        f"the gate's shape {gate_shape} is not one value per channel",
    )
    m.require(shape[2] * shape[3] > 1, "a 1x1 feature map times its gate is an element-wise product")
    m.require(m.dtype("mul") == np.float32, f"NCHWc kernels take float32, the product is {m.dtype('mul')}")
    filter_ = b.Reshape(m["gate"], np.array([channels, 1, 1, 1], np.int64))
    channels_padded = padded(channels, block)
    if channels_padded > channels:
        # The padding channels of the result are zero: a later convolution's zero filter entries meet a finite value.
        filter_ = b.Concat(filter_, np.zeros((channels_padded - channels, 1, 1, 1), np.float32), axis=0)
    # Its group count is the padded channel count, right only for this block size.
    filter_ = guarded(b, filter_, block)
    blocked = b.op("Conv", m["x"], filter_, domain=NCHWC, group=channels_padded, kernel_shape=[1, 1])
    return reorder_output(b, blocked, channels)
