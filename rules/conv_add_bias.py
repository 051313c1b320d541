"""Conv -> Add(constant per-channel c)  =>  Conv with bias b + c.

An Add of a constant that broadcasts over the output channels only (shape [C, 1, ...],
[1, C, 1, ...], a single value, or fewer leading dims) adds the same number to every
element of a channel, which is what a convolution bias does. Folding it leaves a clean
Conv chain for BatchNormalization folding and activation fusion.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._folding import cast_finite, per_channel, require_float_weights

from fuser import Builder, Match, const, op, rule, var


@rule(
    "conv-add-bias",
    pattern=op.Add(
        (op.Conv | op.ConvTranspose)(var("x"), const("w"), const("b", optional=True), name="conv"),
        const("c"),
        name="add",
    ),
)
def conv_add_bias(m: Match, b: Builder):
    """Conv -> Add(per-channel constant)  =>  Conv whose bias absorbs the constant."""
    weight, addend = m.value("w"), m.value("c")
    require_float_weights(m, weight)
    m.require(addend.dtype == weight.dtype, "the added constant is %s, the weights %s", addend.dtype, weight.dtype)
    conv = m.node("conv")
    group = int(m.attr("conv", "group", 1))
    channels = weight.shape[1] * group if conv.op_type == "ConvTranspose" else weight.shape[0]
    values = per_channel(addend, weight.ndim, channels)
    m.require(values is not None, f"the added constant of shape {addend.shape} is not one value per channel")
    bias = m.value("b")
    total = values.astype(np.float64) + (0.0 if bias is None else bias.astype(np.float64))
    new_bias = cast_finite(m, "bias values", total, weight.dtype)
    return b.like(conv, m["x"], m["w"], b.constant(new_bias, "bias"))
