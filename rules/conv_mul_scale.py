"""Conv -> Mul(constant per-channel s)  =>  Conv with weights W * s and bias b * s.

Scaling a channel of the convolution's output is scaling that channel's filter and
bias. Exporters write inference BatchNormalization this way (Mul then Add of per-channel
constants); with conv-add-bias after it, the whole affine folds into the Conv.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._folding import cast_finite, per_channel, require_float_weights

from fuser import Builder, Match, const, op, rule, var


@rule(
    "conv-mul-scale",
    pattern=op.Mul(op.Conv(var("x"), const("w"), const("b", optional=True), name="conv"), const("s"), name="mul"),
)
def conv_mul_scale(m: Match, b: Builder):
    """Conv -> Mul(per-channel constant)  =>  Conv with rescaled weights and bias."""
    weight, scale = m.value("w"), m.value("s")
    require_float_weights(m, weight)
    m.require(scale.dtype == weight.dtype, "the scale is %s, the weights %s", scale.dtype, weight.dtype)
    channels = weight.shape[0]
    values = per_channel(scale, weight.ndim, channels)
    m.require(values is not None, f"the scale of shape {scale.shape} is not one value per channel")
    factors = values.astype(np.float64)
    new_weight = cast_finite(
        m, "weights", weight.astype(np.float64) * factors.reshape((-1,) + (1,) * (weight.ndim - 1)), weight.dtype
    )
    bias = m.value("b")
    new_bias = None if bias is None else cast_finite(m, "bias values", bias.astype(np.float64) * factors, weight.dtype)
    conv = m.node("conv")
    return b.like(
        conv, m["x"], b.constant(new_weight, "weight"), None if new_bias is None else b.constant(new_bias, "bias")
    )
