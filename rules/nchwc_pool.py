"""Pooling of a NCHWc result  =>  NCHWc pooling (onnxruntime target).

MaxPool, AveragePool, GlobalMaxPool and GlobalAveragePool whose input just left the
blocked layout run in it instead, so the next convolution need not reorder again.
MaxPool and AveragePool also move into it from a plain input (after an LRN, say), as
the next convolution would reorder that input anyway. Only where the channel count is
a multiple of the block size, as onnxruntime requires.
"""

from __future__ import annotations

from fuser import Builder, Match, op, rule, var
from fuser.rules._nchwc import (
    EMITS,
    NCHWC,
    channel_count,
    channels_of,
    is_float32,
    nchwc,
    reorder_output,
    require_block_size,
)


def _pool(m: Match, b: Builder, x: str, channels: int) -> str:
    pool = m.node("pool")
    m.require(channels % require_block_size(m) == 0, f"{channels} channels are not a multiple of the block size")
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


@rule(
    "nchwc-pool",
    pattern=(op.MaxPool | op.AveragePool | op.GlobalMaxPool | op.GlobalAveragePool)(
        nchwc.ReorderOutput(var("x"), name="to_plain"), name="pool"
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
    return _pool(m, b, b.op("ReorderInput", m["x"], domain=NCHWC), channels)
