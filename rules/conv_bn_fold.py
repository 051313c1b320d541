"""Conv / ConvTranspose -> BatchNormalization  =>  Conv / ConvTranspose with folded weights.

In inference mode BatchNormalization is y = s * (x - mean) + beta, s = scale / sqrt(var + eps),
applied per output channel, so it folds into the convolution: W' = W * s along the
weight's output-channel axis and b' = (b - mean) * s + beta. Conv weights are
[C_out, C_in/group, k...] (output channels on axis 0); ConvTranspose weights are
[C_in, C_out/group, k...], so within each group the output channels sit on axis 1.
The arithmetic runs in float64 and is cast back to the weight's dtype.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._folding import cast_finite, require_float_weights

from fuser import Builder, Match, const, op, rule, var


def fold_conv_bn(weight, bias, scale, beta, mean, var_, epsilon, *, transpose=False, group=1):
    """Weights and bias of the convolution that equals conv followed by inference BN."""
    s = np.asarray(scale, np.float64) / np.sqrt(np.asarray(var_, np.float64) + epsilon)
    w = np.asarray(weight, np.float64)
    if transpose:
        c_in, c_out_per_group = w.shape[0], w.shape[1]
        grouped = w.reshape((group, c_in // group, c_out_per_group) + w.shape[2:])
        factors = s.reshape((group, 1, c_out_per_group) + (1,) * (w.ndim - 2))
        new_weight = (grouped * factors).reshape(w.shape)
    else:
        new_weight = w * s.reshape((-1,) + (1,) * (w.ndim - 1))
    mean, beta = np.asarray(mean, np.float64), np.asarray(beta, np.float64)
    if bias is None:  # beta - mean * s: the bits of (0 - mean) * s + beta, without an array of zeros
        new_bias = beta - mean * s
    else:
        new_bias = (np.asarray(bias, np.float64) - mean) * s + beta
    with np.errstate(over="ignore", invalid="ignore"):  # the rule declines values the dtype cannot hold
        return new_weight.astype(weight.dtype), new_bias.astype(weight.dtype)


@rule(
    "conv-bn-fold",
    pattern=op.BatchNormalization(
        (op.Conv | op.ConvTranspose)(var("x"), const("w"), const("b", optional=True), name="conv"),
        const("scale"),
        const("beta"),
        const("mean"),
        const("var"),
        name="bn",
    ),
)
def conv_bn_fold(m: Match, b: Builder):
    """Conv -> BatchNormalization  =>  Conv with the normalization folded into weights and bias."""
    bn = m.node("bn")
    m.require(len([o for o in bn.outputs if o]) == 1, "BatchNormalization has running-statistics outputs")
    m.require(m.attr("bn", "training_mode", 0) == 0, "BatchNormalization is in training mode")
    m.require(m.attr("bn", "spatial", 1) == 1, "BatchNormalization is not spatial (spatial=0)")
    weight = m.value("w")
    require_float_weights(m, weight)
    m.require(weight.ndim >= 3, "the convolution weight has no spatial axes")
    transpose = m.node("conv").op_type == "ConvTranspose"
    group = int(m.attr("conv", "group", 1))
    channels = weight.shape[1] * group if transpose else weight.shape[0]
    params = {name: m.value(name) for name in ("scale", "beta", "mean", "var")}
    for name, value in params.items():
        m.require(
            value.shape == (channels,), "BatchNormalization %s has shape %s, not (%d,)", name, value.shape, channels
        )
    epsilon = float(m.attr("bn", "epsilon", 1e-5))
    variance = params["var"].astype(np.float64)
    m.require(bool((variance + epsilon > 0).all()), "variance + epsilon is not positive")
    bias = m.value("b")
    m.require(bias is None or bias.shape == (channels,), "the convolution bias does not have one value per channel")
    new_weight, new_bias = fold_conv_bn(
        weight,
        bias,
        params["scale"],
        params["beta"],
        params["mean"],
        variance,
        epsilon,
        transpose=transpose,
        group=group,
    )
    new_weight = cast_finite(m, "weights", new_weight, weight.dtype)
    new_bias = cast_finite(m, "bias values", new_bias, weight.dtype)
    conv = m.node("conv")
    return b.like(conv, m["x"], b.constant(new_weight, "weight"), b.constant(new_bias, "bias"))
