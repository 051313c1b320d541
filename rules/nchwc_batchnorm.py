"""BatchNormalization of a NCHWc result  =>  NCHWc depthwise 1x1 Conv (onnxruntime target).

A BatchNormalization no convolution absorbed (DenseNet's pre-activation ones, after a
Concat) is a per-channel scale and shift: a depthwise 1x1 convolution. As one it stays
in the blocked layout and takes the following activation into its kernel.
"""

from __future__ import annotations

import numpy as np

from fuser import Builder, Match, const, op, rule, var
from fuser.rules._nchwc import (
    EMITS,
    NCHWC,
    channels_of,
    guarded_bias,
    machine_note,
    nchwc,
    pad_channels,
    padded,
    reorder_output,
    require_block_size,
)


@rule(
    "nchwc-batchnorm",
    pattern=op.BatchNormalization(
        nchwc.ReorderOutput(var("x"), name="to_plain"),
        const("scale"),
        const("shift"),
        const("mean"),
        const("var"),
        name="bn",
    ),
    target="onnxruntime",
    emits=EMITS,
    note=machine_note,
    opsets=(7, None),
    phase=1,
    shared_interior=True,
)
def nchwc_batchnorm(m: Match, b: Builder):
    """BatchNormalization(ReorderOutput(x))  =>  ReorderOutput(NCHWc Conv(x, group=channels))."""
    channels = channels_of(m, "to_plain")
    block = require_block_size(m)
    m.require(len([o for o in m.node("bn").outputs if o]) == 1, "BatchNormalization's training outputs are used")
    m.require(m.attr("bn", "training_mode", 0) == 0, "BatchNormalization is in training mode")
    m.require(m.attr("bn", "spatial", 1) == 1, "BatchNormalization is not spatial")
    params = [m.value(name).astype(np.float64) for name in ("scale", "shift", "mean", "var")]
    m.require(all(p.shape == (channels,) for p in params), "the parameters are not one value per channel")
    scale, shift, mean, variance = params
    factor = scale / np.sqrt(variance + float(m.attr("bn", "epsilon", 1e-5)))
    weight = pad_channels(factor.astype(np.float32), block).reshape(-1, 1, 1, 1)
    bias = guarded_bias(b, pad_channels((shift - mean * factor).astype(np.float32), block), block, channels)
    blocked = b.op("Conv", m["x"], weight, bias, domain=NCHWC, group=padded(channels, block), kernel_shape=[1, 1])
    return reorder_output(b, blocked, channels)
