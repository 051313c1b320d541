"""A Softmax between two MatMuls that no attention rule fused: the report says which part of
the pattern did not fit (advisory; nothing is rewritten).

It runs in a late phase, after every fusion, so only what is left is reported; the reason is
the first check of the attention rules (rules/_attention.py) that failed, such as a mask
added before the scaling, grouped-query heads, or shapes that cannot be verified.
"""

from __future__ import annotations

from fuser.rules._attention import FUSABLE_DTYPES, merge_after_softmax, multihead_pays, trace_attention

from fuser import Decline, Match, op, rule, var


@rule("attention-advice", pattern=op.Softmax(var("scores"), name="softmax"), advisory=True, phase=2)
def attention_advice(m: Match, _):
    """Reports attention (Softmax between Q·Kᵀ and ·V) that stayed unfused, and why."""
    merge = merge_after_softmax(m, m.node("softmax"))
    try:
        attention = trace_attention(m, merge)
    except Decline as reason:
        return f"attention left unfused: {reason}"
    if attention.dtype not in FUSABLE_DTYPES:
        return f"attention left unfused: it computes in {attention.dtype}; the fused operators take float32/float16"
    if m.opset < 23 and not multihead_pays(attention):
        return (
            f"attention left unfused: the standard Attention operator needs opset 23 (the model has {m.opset}); "
            "onnxruntime's MultiHeadAttention would run no faster than the attention as it is "
            "(nothing but MatMul, Softmax and MatMul to fuse)"
        )
    if m.opset < 23:
        # The advice serves both targets: on onnxruntime's, MultiHeadAttention declined it already.
        return (
            f"attention left unfused: the standard Attention operator needs opset 23 (the model has {m.opset}); "
            "--target onnxruntime fuses it into MultiHeadAttention where nothing inside it is used elsewhere "
            "(fuser explain MODEL --target onnxruntime --rule attention-multihead tells why not)"
        )
    return "attention left unfused: a tensor inside it is used elsewhere, or the attention rules are disabled"
