"""Pooling of a NCHWc result  =>  NCHWc pooling (onnxruntime target).

MaxPool, AveragePool, GlobalMaxPool and GlobalAveragePool whose input just left the
blocked layout run in it instead, so the next convolution need not reorder again. So do
ReduceMean and ReduceMax over both spatial axes, keeping them: torch's dynamo exporter writes
a squeeze-and-excitation block's global pooling that way (a ReduceMean only over at most
MAX_AVERAGED_PIXELS pixels).
MaxPool and AveragePool also move into it from a plain input (after an LRN, say), as
the next convolution would reorder that input anyway: when something that runs blocked reads
the pool (a lone pool would pay two reorders for nothing), and its channel count is a multiple of
4 (what onnxruntime's ReorderInput takes: not an image's 3) and at least a block (fewer, the
convolution reads them plain). The channel count need not be a
multiple of the block size (onnxruntime's own layout pass asks that it be): the kernels pool
the padding channels like the others, finite values into finite values, and the reorder out
drops them (MobileNetV3 pools 72 and 120 channels).
"""

from __future__ import annotations

from fuser import Builder, Match, const, op, rule, var
from fuser.rules._nchwc import (
    EMITS,
    NCHWC,
    channel_count,
    channels_of,
    is_float32,
    nchwc,
    read_by_region,
    reorder_output,
    require_block_size,
    require_reorderable,
)


# Reductions over H and W that keep them: the global pooling of the same kind.
GLOBAL_POOL_OF = {"ReduceMean": "GlobalAveragePool", "ReduceMax": "GlobalMaxPool"}
# The most pixels a ReduceMean averages in the blocked layout. Its NCHWc global pooling sums in
# float32 with 5 to 10 times the rounding error of ReduceMean (1.6e-6 against 1.6e-7 over 64x64
# pixels, 3.4e-6 against 4.6e-7 over 160x160, values of spread 3). PP-OCRv6's tiny detector
# averages its input's size / 4 in its first gate: with blocked pooling its check passed at
# 224x224 (56x56 pixels, max abs error 1.5e-5) and failed from 256x256 (64x64: 5e-4 on the
# text map; 1.6e-3 at 640x640). onnxruntime's own layout pass leaves ReduceMean as it is; its
# GlobalAveragePool it pools blocked at any size, as here.
MAX_AVERAGED_PIXELS = 56 * 56


def _pool(m: Match, b: Builder, x: str, channels: int) -> str:
    pool = m.node("pool")
    if pool.op_type in GLOBAL_POOL_OF:
        return _global_pool(m, b, x, channels)
    require_block_size(m)
    m.require(len([o for o in pool.outputs if o]) == 1, "MaxPool's indices output is used")
    m.require(m.rank("pool") == 4, "NCHWc pooling is 2-D")
    m.require(all(d == 1 for d in m.attr("pool", "dilations", [1, 1]) or [1, 1]), "dilated pooling")
    # A ceil_mode window reaching past the padding: the NCHWc kernel divides by the whole
    # window where AveragePool counts only the padded input's part.
    m.require(
        not (
            pool.op_type == "AveragePool" and m.attr("pool", "ceil_mode", 0) and m.attr("pool", "count_include_pad", 0)
        ),
        "AveragePool with both ceil_mode and count_include_pad averages edge windows differently in NCHWc",
    )
    attrs = {k: v for k, v in m.attrs("pool").items() if k not in ("storage_order", "dilations")}
    blocked = b.op(pool.op_type, x, domain=NCHWC, **attrs)
    return reorder_output(b, blocked, channels)


def _global_pool(m: Match, b: Builder, x: str, channels: int) -> str:
    """ReduceMean/ReduceMax over axes 2 and 3 with keepdims, as NCHWc global pooling."""
    m.require(m.attr("pool", "keepdims", 1) == 1, "the reduction drops the spatial axes")
    axes = m.value("axes").ravel().tolist() if m.has("axes") else m.attr("pool", "axes")
    m.require(
        axes is not None and sorted(a % 4 for a in axes) == [2, 3], f"the reduction is over axes {axes}, not H and W"
    )
    if m.node("pool").op_type == "ReduceMean":
        shape = m.shape("to_plain")
        pixels = shape[2] * shape[3] if shape is not None and all(isinstance(d, int) for d in shape[2:]) else None
        m.require(
            pixels is not None and pixels <= MAX_AVERAGED_PIXELS,
            f"it averages {'an unknown number of' if pixels is None else pixels} pixels, more than "
            f"{MAX_AVERAGED_PIXELS}: the blocked pooling would round their sum more coarsely",
        )
    require_block_size(m)
    blocked = b.op(GLOBAL_POOL_OF[m.node("pool").op_type], x, domain=NCHWC)
    return reorder_output(b, blocked, channels)


@rule(
    "nchwc-pool",
    pattern=(
        (op.MaxPool | op.AveragePool | op.GlobalMaxPool | op.GlobalAveragePool)(
            nchwc.ReorderOutput(var("x"), name="to_plain"), name="pool"
        ),
        (op.ReduceMean | op.ReduceMax)(
            nchwc.ReorderOutput(var("x"), name="to_plain"), const("axes", optional=True), name="pool"
        ),
    ),
    target="onnxruntime",
    emits=EMITS,
    phase=1,
    shared_interior=True,
)
def nchwc_pool(m: Match, b: Builder):
    """Pool(ReorderOutput(x))  =>  ReorderOutput(NCHWc Pool(x))."""
    return _pool(m, b, m["x"], channels_of(m, "to_plain"))


@rule(
    "nchwc-pool-input",
    pattern=(op.MaxPool | op.AveragePool)(var("x"), name="pool"),
    target="onnxruntime",
    emits=EMITS,
    phase=1,
)
def nchwc_pool_input(m: Match, b: Builder):
    """MaxPool/AveragePool(x)  =>  ReorderOutput(NCHWc Pool(ReorderInput(x)))."""
    is_float32(m, m["x"])
    channels = channel_count(m, m["x"])
    require_reorderable(m, channels)
    pooled = _pool(m, b, b.op("ReorderInput", m["x"], domain=NCHWC), channels)
    # Whether it pays comes last, after what the kernels cannot take. Fewer channels than a
    # block: a convolution after the pool reads them plain (nchwc-conv), and the blocked pool
    # would pad them to a block and reorder twice for nothing (a lone MaxPool of 4 channels ran
    # 3 times slower).
    block = m.context.nchwc_block
    m.require(channels >= block, f"{channels} channels are fewer than the block of {block}: pooled plain")
    m.require(
        read_by_region(m.graph, m.node("pool").outputs[0]),
        "nothing that runs blocked reads the pool: two reorders would cost more than the blocked pool saves",
    )
    return pooled
