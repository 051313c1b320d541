"""Concat along channels of NCHWc results  =>  Concat of the blocked tensors (onnxruntime target).

When every part's channel count is a multiple of the block size, no part carries
padding, and the blocked tensors concatenate exactly as their plain forms do, so
Inception and DenseNet blocks stay in the NCHWc layout. Up to 64 parts: DenseNet's
layers each join every earlier layer's output (25 parts in DenseNet-121, 49 in DenseNet-264).
"""

from __future__ import annotations

from fuser import Builder, Match, op, rule, var
from fuser.rules._nchwc import EMITS, channels_of, guarded, machine_note, nchwc, reorder_output, require_block_size


MAX_PARTS = 64


def _part(index: int):
    return nchwc.ReorderOutput(var(f"x{index}"), name=f"part{index}", optional=index >= 2)


@rule(
    "nchwc-concat",
    pattern=op.Concat(*(_part(i) for i in range(MAX_PARTS)), name="concat", axis=1),
    target="onnxruntime",
    emits=EMITS,
    note=machine_note,
    opsets=(7, None),
    phase=1,
    shared_interior=True,
)
def nchwc_concat(m: Match, b: Builder):
    """Concat(axis=1) of ReorderOutputs  =>  ReorderOutput(Concat of the blocked tensors)."""
    parts = [i for i in range(MAX_PARTS) if m.has(f"part{i}")]
    channels = [channels_of(m, f"part{i}") for i in parts]
    block = require_block_size(m)
    m.require(all(c % block == 0 for c in channels), f"part channels {channels} are not multiples of {block}")
    m.require(m.rank("concat") == 4, "the parts are not 4-D")
    # Exact only where every part is a multiple of B: on a machine with another B, fail.
    blocked = guarded(b, b.Concat(*(m[f"x{i}"] for i in parts), axis=1), block)
    return reorder_output(b, blocked, sum(channels))
