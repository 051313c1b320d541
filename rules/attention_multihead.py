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

Only attention with that NaN guard is fused. Without it the attention is MatMul, scale, mask,
Softmax and MatMul, which onnxruntime's own kernels run as fast as the fused op, and the fused
models were slower. Measured with onnxruntime 1.32, 1 thread, sequence 128, as the latency of
the model with the fusion over the same model without it (random-weight Hugging Face exports):
without the guard 0.993 to 1.048 over 11 models (OPT eager 1.024, GPT-2 legacy eager 1.015,
ViT legacy 1.010, BERT dynamo eager 0.993; Llama, GPT-NeoX and Phi eager, whose Q is rotated as
heads and must be transposed back for the fused op, 1.009 to 1.048), with it 0.981 to 1.001
over 9 (BERT, GPT-2, Llama, OPT, GPT-NeoX and Phi exports of scaled_dot_product_attention).

Grouped-query attention at opset 23 is left to attention-standard: MultiHeadAttention needs K
and V with all N heads, so the model's repeat of them stays, and with a KV cache that copies
the cache N/Nkv times per layer for every token decoded. The standard Attention reads them
before the repeat: one decoding step after 1024 cached tokens of the 4-layer Llama dynamo export
(make_transformers.py --size real --past) ran in 0.61 of the original's time with Attention at
opset 23, against 0.75 with MultiHeadAttention at the export's opset 18 (onnxruntime 1.32,
1 thread, timed round-robin). With attention-standard off, such attention stays unfused.
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
        multihead_pays(attention),
        "the attention is MatMul, Softmax and MatMul with no NaN guard to remove: onnxruntime's own "
        "kernels run it as fast as the fused op, and the fused models were slower",
    )
    m.require(
        attention.kv_unrepeated is None or m.opset < 23,
        "grouped-query attention at opset 23 is left to attention-standard, whose Attention reads K and V "
        "before their heads are repeated (MultiHeadAttention cannot); with that rule off it stays unfused",
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
