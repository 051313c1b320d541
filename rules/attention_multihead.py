"""Multi-head attention written out (MatMul, Softmax, MatMul between head reshapes)  =>
com.microsoft MultiHeadAttention (onnxruntime target).

The projections that compute q, k and v stay as they are; the fused op takes them as
[B, S, N*H] (K and V also as heads [B, N, L, H], which is how rotary embeddings and the
repeated heads of grouped-query attention leave them) and does the head split, Q·Kᵀ, the scale, the mask, Softmax, ·V and the merge in
one kernel (float32 or float16 on the CPU). Whatever the model adds to the scores (the
padding mask (1 - mask) * -big, a Where-built causal mask, ...) becomes `attention_bias`,
which the kernel wants as [B or 1, N or 1, S, L]: a mask that only broadcasts there is
expanded first. Exporters of torch's scaled_dot_product_attention guard fully masked rows
(Where(IsNaN(p), 0, p)); the kernel gives NaN for such rows, so those rows are zeroed after it.

Q rotated as heads [B, N, S, H] (rotary embeddings) has to be transposed back to [B, S, N*H] for
the kernel. Where the attention is no more than MatMul, scale, mask, Softmax, MatMul, the fused
op saves nothing to pay for that Transpose: measured with onnxruntime 1.32 (1 thread, sequence
128 and 512) on eager-attention GPT-NeoX and Phi exports, the fused models ran 3-5% slower than
with the attention left as it was, so such an attention is declined. With the NaN guard of
scaled_dot_product_attention's exports (IsNaN and Where over every score), fusing pays (Llama,
same measurement: 1.5% faster), and Q given as [B, S, N*H] needs no Transpose.
"""

from __future__ import annotations

from fuser.rules._attention import (
    MERGE_HEADS,
    WALK_DEPTH,
    absorb_attention,
    full_mask,
    heads_merged,
    heads_split,
    merged,
    multihead_pays,
    require_fusable_dtype,
    trace_attention,
    zero_fully_masked_rows,
)

from fuser import Builder, Match, rule


@rule(
    "attention-multihead",
    pattern=MERGE_HEADS,
    target="onnxruntime",
    emits={"com.microsoft": 1},
    opsets=(13, None),  # Softmax over one axis
    walks=WALK_DEPTH,
)
def attention_multihead(m: Match, b: Builder):
    """Q·Kᵀ scaled, masked, Softmax, ·V between head reshapes  =>  MultiHeadAttention."""
    attention = trace_attention(m)
    require_fusable_dtype(m, attention)
    m.require(
        multihead_pays(m, attention),
        "Q comes as heads [B, N, S, H] and must be transposed back for the fused op, which would "
        "then run the same MatMul, Softmax and MatMul as onnxruntime's own kernels: slower, not faster",
    )
    absorb_attention(m, attention, attention.reads)
    mask = full_mask(m, b, attention) if attention.mask is not None else None
    n, h, hv = attention.num_heads, attention.head_size, attention.v_head_size
    # The kernel takes Q as [B, S, N*H], K and V both as [B, L, N*H] or both as [B, N, L, H].
    q = heads_merged(b, attention.q, m.rank_of(attention.q), n, h)
    k, v = attention.k, attention.v
    if m.rank_of(k) != m.rank_of(v):
        k, v = heads_split(b, k, m.rank_of(k), n, h), heads_split(b, v, m.rank_of(v), n, hv)
    output = b.op(
        "MultiHeadAttention",
        q,
        k,
        v,
        None,
        None,
        mask,
        domain="com.microsoft",
        num_heads=attention.num_heads,
        scale=attention.scale,
    )
    if attention.nan_guard and mask is not None:
        return merged(b, attention, zero_fully_masked_rows(m, b, attention, mask, output), rank=4)
    return merged(b, attention, output)
