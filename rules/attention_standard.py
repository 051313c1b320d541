"""Multi-head attention written out (MatMul, Softmax, MatMul between head reshapes)  =>
the standard ONNX Attention operator (opset 23 and later).

Attention takes q, k and v as [B, S, N*H] with q_num_heads and kv_num_heads, applies the
scale, adds a float attn_mask, and gives [B, S, N*Hv], so the head split and merge go with
it. onnxruntime's kernel wants the mask's query dimension in full (it does not broadcast
there), so a mask that only broadcasts is expanded to [B or 1, N or 1, S, L] first. The
operator gives 0 for a query row whose mask is -inf everywhere (the spec's fully-masked-row
rule), where a model without the NaN guard of scaled_dot_product_attention gives NaN: hence
`stabilizes`. The kernel reads the dtype's lowest value as -inf too, so entries of that value
(transformers' masks) move one step up first (mask_without_lowest).

Grouped-query attention: where K and V are heads repeated from fewer (transformers'
repeat_kv: Unsqueeze, Expand, Reshape), Attention reads the heads before the repeat, which it
repeats in the same order itself: a KV cache is then not copied N/Nkv times per layer for
every token decoded.
"""

from __future__ import annotations

from dataclasses import replace

from fuser.rules._attention import (
    MERGE_HEADS,
    WALK_DEPTH,
    absorb_attention,
    full_mask,
    heads_split,
    mask_without_lowest,
    merged,
    require_fusable_dtype,
    trace_attention,
)

from fuser import Builder, Match, rule


@rule("attention-standard", pattern=MERGE_HEADS, opsets=(23, None), stabilizes=True, walks=WALK_DEPTH)
def attention_standard(m: Match, b: Builder):
    """Q·Kᵀ scaled, masked, Softmax, ·V between head reshapes  =>  Attention (opset 23)."""
    attention = trace_attention(m)
    require_fusable_dtype(m, attention)
    if attention.kv_unrepeated is not None:
        k, v = attention.kv_unrepeated
        attention = replace(attention, k=k, v=v)
    absorb_attention(m, attention, attention.reads)
    mask = full_mask(m, b, attention, mask_without_lowest(m, b, attention)) if attention.mask is not None else None
    n, h, hv = attention.num_heads, attention.head_size, attention.v_head_size
    ranks = {m.rank_of(attention.q), m.rank_of(attention.k), m.rank_of(attention.v)}
    if ranks == {3}:
        output = b.Attention(
            attention.q, attention.k, attention.v, mask, q_num_heads=n, kv_num_heads=n, scale=attention.scale
        )
        return merged(b, attention, output)
    # Heads given as [B, N, S, H] (after rotary embeddings, or repeated): all inputs 4-D; K and V
    # may have fewer heads than Q (grouped-query attention), which Attention reads from their shapes.
    q = heads_split(b, attention.q, m.rank_of(attention.q), n, h)
    k = heads_split(b, attention.k, m.rank_of(attention.k), n, h)
    v = heads_split(b, attention.v, m.rank_of(attention.v), n, hv)
    output = b.Attention(q, k, v, mask, scale=attention.scale)
    return merged(b, attention, b.Transpose(output, perm=[0, 2, 1, 3]), rank=4)
