"""Conv / FusedConv  =>  ReorderOutput(NCHWc Conv(ReorderInput(X))) (onnxruntime target, CPU).

onnxruntime's NCHWc convolution kernels are its fastest on x86 CPUs, but it only uses
them when its own layout optimization runs at session start. This rewrite does it
ahead of time, so a session with graph optimizations off runs them too. The filter is
reordered once, here; the reorders around each convolution cancel between neighbours
(nchwc-reorder-cancel), so a chain of convolutions stays in the blocked layout.

Runs in phase 1, after every fusion, because NCHWc convolutions hide the Conv patterns
the fusion rules look for. Which convolutions have a NCHWc kernel: 2-D, float32,
constant filter and bias; for grouped ones, channels per group a multiple of the block
size; depthwise ones (one filter per channel) any channel count, padded like the data.
"""

from __future__ import annotations

from fuser import Builder, Match, const, op, rule, var
from fuser.rules._nchwc import (
    EMITS,
    NCHWC,
    blocked_filter,
    guarded_bias,
    is_float32,
    machine_note,
    pad_channels,
    padded,
    reorder_output,
    require_block_size,
    require_region_pays,
    require_reorderable,
)


def _nchwc_conv(m: Match, b: Builder, residual: str | None, **fused) -> str:
    block = require_block_size(m)
    is_float32(m, m["x"])
    require_region_pays(m, "conv")
    weight = m.value("w")
    m.require(weight.ndim == 4, f"NCHWc kernels are 2-D; this is a {weight.ndim - 2}-D convolution")
    out_channels, in_channels = weight.shape[:2]
    group = int(m.attr("conv", "group", 1))
    depthwise = group > 1 and in_channels == 1 and out_channels == group
    if group > 1 and not depthwise:
        m.require(
            in_channels % block == 0 and (out_channels // group) % block == 0,
            f"grouped: channels per group are not a multiple of the block size {block}",
        )
    # Few input channels (an image's 3) are read straight from NCHW; all others blocked.
    blocked_input = group > 1 or in_channels >= block
    if blocked_input:
        require_reorderable(m, in_channels * group, "input channels")
    if residual is not None:
        require_reorderable(m, out_channels, "residual channels")
    bias = m.value("b")
    m.require(bias is None or bias.shape == (out_channels,), "the bias is not one value per output channel")
    filter_layout = blocked_filter(weight, block, blocked_input=blocked_input and not depthwise)
    new_bias = guarded_bias(b, None if bias is None else pad_channels(bias, block), block, out_channels)
    x = b.op("ReorderInput", m["x"], domain=NCHWC) if blocked_input else m["x"]
    inputs = [x, filter_layout, new_bias]
    if residual is not None:
        inputs.append(b.op("ReorderInput", residual, domain=NCHWC))
    attrs = {k: v for k, v in m.attrs("conv").items() if k not in ("activation", "activation_params")}
    if depthwise:  # the padding channels are convolved too, each with its zero filter
        attrs["group"] = padded(out_channels, block)
    blocked = b.op("Conv", *inputs, domain=NCHWC, **attrs, **fused)
    return reorder_output(b, blocked, out_channels)


def _may_equal(shape: tuple, other: tuple) -> bool:
    """Equal wherever both dimensions are known numbers."""
    return len(shape) == len(other) and all(
        a == b or not isinstance(a, int) or not isinstance(b, int) for a, b in zip(shape, other)
    )


@rule(
    "nchwc-conv",
    pattern=op.Conv(var("x"), const("w"), const("b", optional=True), name="conv"),
    target="onnxruntime",
    emits=EMITS,
    note=machine_note,
    opsets=(7, None),  # the block-size guard's Reshape takes its shape as an input from opset 5
    phase=1,
)
def nchwc_conv(m: Match, b: Builder):
    """Conv  =>  NCHWc Conv between reorders (blocked filter, computed here)."""
    return _nchwc_conv(m, b, None)


@rule(
    "nchwc-fused-conv",
    pattern=op.domain("com.microsoft").FusedConv(
        var("x"), const("w"), const("b", optional=True), var("z", optional=True), name="conv"
    ),
    target="onnxruntime",
    emits=EMITS,
    note=machine_note,
    opsets=(7, None),  # the block-size guard's Reshape takes its shape as an input from opset 5
    phase=1,
)
def nchwc_fused_conv(m: Match, b: Builder):
    """FusedConv(activation, Z)  =>  NCHWc Conv with the same activation and Z as its Sum input."""
    residual_shape, output_shape = m.shape("z"), m.shape("conv")
    m.require(
        residual_shape is None or output_shape is None or _may_equal(residual_shape, output_shape),
        f"the residual {residual_shape} does not have the output's shape {output_shape}",
    )
    activation = m.node("conv").attr("activation")
    params = m.node("conv").attr("activation_params")
    return _nchwc_conv(m, b, m["z"], activation=activation, activation_params=list(params) if params else None)
