"""Advisory: a convolution left in NCHW because its layout region would not pay (onnxruntime target).

nchwc-conv declines a convolution whose region (the connected operators that could run in
the blocked layout) does fewer multiply-adds than MACS_PER_REORDER per element
reordered at the region's edges: the reorders would cost more than the blocked kernels save.
This rule says so in the report, naming the convolution, so the choice is visible.
"""

from __future__ import annotations

from fuser import Match, op, rule, var
from fuser.rules._nchwc import MACS_PER_REORDER, region_cost, region_message, require_block_size


def _advice(m: Match) -> str:
    require_block_size(m)
    cost = region_cost(m, m.node("conv").id)
    m.require(cost is not None and cost[0] < MACS_PER_REORDER * cost[1], "the blocked layout pays here")
    return f"{m.node('conv').label} stays NCHW: {region_message(*cost)}"


@rule(
    "nchwc-region",
    pattern=op.Conv(var("x"), var("w"), var("b", optional=True), name="conv"),
    target="onnxruntime",
    advisory=True,
    phase=1,
)
def nchwc_region(m: Match, b):
    """Advisory: a lone Conv for which the blocked layout would not pay stays NCHW."""
    return _advice(m)


@rule(
    "nchwc-region-fused",
    pattern=op.domain("com.microsoft").FusedConv(
        var("x"), var("w"), var("b", optional=True), var("z", optional=True), name="conv"
    ),
    target="onnxruntime",
    advisory=True,
    phase=1,
)
def nchwc_region_fused(m: Match, b):
    """Advisory: a lone FusedConv for which the blocked layout would not pay stays NCHW."""
    return _advice(m)
