"""Tests for attention-multihead (rules/attention_multihead.py, rules/_attention.py): multi-head
attention written out as MatMul/Softmax/MatMul becomes com.microsoft MultiHeadAttention.

Small models are built here in the exporters' spellings (scale on the scores, on Q, on Q and K
as square roots; Kᵀ as one Transpose, two, or torch.export's Reshape/Transpose/Reshape; a
padding mask [B, 1, 1, L], a boolean mask turned additive with Where and the NaN guard of
scaled_dot_product_attention), fused for the onnxruntime target and run in onnxruntime with its
optimizations off. The real transformer exports in tests/data/transformers/ (made by torch's
two exporters) are fused too, when present.

Runtime facts this file relies on (onnxruntime 1.32, CPU): MultiHeadAttention runs float32
and float16; its attention_bias must be [B or 1, N or 1, S, L] (dimension 2 is not
broadcast); a query row whose bias is -inf everywhere gives NaN.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

import fuser
from fuser.rules.attention_multihead import attention_multihead
from tests.helpers import assert_declined, assert_rewritten, make_model, nodes_of, opsets_of, run

RULE = "attention-multihead"
MS = "com.microsoft"
B, S, N, H = 2, 5, 4, 8
D = N * H
TRANSFORMERS = Path(__file__).resolve().parents[1] / "data" / "transformers"


def attention_model(
    *,
    dtype=np.float32,
    scale="scores_div",
    k_form="0231",
    mask=None,
    nan_guard=False,
    symbolic=False,
    kv_heads=N,
    softmax_axis=-1,
    mask_before_scale=False,
    probs_output=False,
    rotary=False,
    repeat_kv=False,
    cache_input=False,
    merge="constant",
    split="zero",
    opset=17,
    seed=0,
):
    """x [B, S, D] -> self-attention -> y [B, S, D]; returns (model, feeds).

    scale: "scores_div" (scores / sqrt(H)), "scores_mul", "q_mul" (Q * 1/sqrt(H)), "qk_sqrt"
    (Q and Kᵀ each times H**-0.25), "none". k_form: "0231" (one Transpose), "0132" (heads
    first, then the last two swapped), "3d" (torch.export's fold/transpose/unfold; static dims).
    mask: None, "padding" (float mask [B, L] -> (1 - m) * -10000 as [B, 1, 1, L]), "padding_lowest"
    (transformers' spelling: the dtype's lowest value in place of -10000, and batch row 1 padded
    everywhere, so that its query rows see no key at all) or "boolean"
    (bool [B, 1, S, L] -> Where(m, 0, -inf)). rotary: the rotate-half rotary embedding on the
    Q and K heads (k_form "0132"); repeat_kv: K and V heads repeated to N (Llama's repeat_kv)
    after projecting to kv_heads heads. symbolic: the model's batch and sequence are
    named dims (the feeds are still [2, 5]). cache_input: the rotary cos/sin are graph inputs of
    their own symbolic length [1, 1, "positions", H] (computed at run time in the legacy Llama
    export), so Q's sequence is not known to be x's. merge: the heads-merging Reshape's target
    is "constant" [0, 0, D], "input_dims" (the legacy export's Concat of x's batch and sequence
    and -1) or "runtime" (x's batch and sequence and a graph input "merge_width"). split: the
    heads-splitting Reshapes' targets are "zero" [0, 0, N, H], "inferred" [0, -1, N, H] (OPT's
    view(batch, -1, N, H): with a symbolic sequence, shape inference cannot name the -1) or
    "halved" [0, -1, N, H/2] (a valid model whose "heads" run over twice the sequence: not
    attention over x's tokens; merged back by [0, -1, D]).
    """
    rng = np.random.default_rng(seed)
    batch, seq = B, S
    dims = ("batch", "seq") if symbolic else (B, S)
    kv_dim = kv_heads * H
    inits = {
        "wq": rng.standard_normal((D, D)) / np.sqrt(D),
        "bq": rng.standard_normal(D) / 4,
        "wk": rng.standard_normal((D, kv_dim)) / np.sqrt(D),
        "bk": rng.standard_normal(kv_dim) / 4,
        "wv": rng.standard_normal((D, kv_dim)) / np.sqrt(D),
        "bv": rng.standard_normal(kv_dim) / 4,
    }
    inits = {k: v.astype(dtype) for k, v in inits.items()}
    sequence, head = {"zero": (0, H), "inferred": (-1, H), "halved": (-1, H // 2)}[split]
    inits["split_q"] = np.array([0, sequence, N, head], np.int64)
    inits["split_kv"] = np.array([0, sequence, kv_heads, head], np.int64)
    inits["merge_shape"] = np.array([0, -1 if split == "halved" else 0, D], np.int64)
    nodes = []

    def rotate(x, out):
        """x * cos + rotate_half(x) * sin, rotate_half(x) = Concat(-x2, x1) over the last axis."""
        return [
            helper.make_node("Slice", [x, "zero_1d", "half_1d", "last_axis"], [f"{x}_1"]),
            helper.make_node("Slice", [x, "half_1d", "end_1d", "last_axis"], [f"{x}_2"]),
            helper.make_node("Neg", [f"{x}_2"], [f"{x}_2_neg"]),
            helper.make_node("Concat", [f"{x}_2_neg", f"{x}_1"], [f"{x}_half_rotated"], axis=-1),
            helper.make_node("Mul", [x, "cos"], [f"{x}_cos"]),
            helper.make_node("Mul", [f"{x}_half_rotated", "sin"], [f"{x}_sin"]),
            helper.make_node("Add", [f"{x}_cos", f"{x}_sin"], [out]),
        ]

    def repeat(x, out):
        return [
            helper.make_node("Unsqueeze", [x, "axis_2"], [f"{x}_5d"]),
            helper.make_node("Expand", [f"{x}_5d", "repeat_shape"], [f"{x}_expanded"]),
            helper.make_node("Reshape", [f"{x}_expanded", "repeated_shape"], [out]),
        ]

    if rotary:
        angles = np.arange(seq)[:, None] * (10000.0 ** (-np.arange(0, H, 2) / H))[None]
        angles = np.concatenate([angles, angles], -1)[None, None]
        if not cache_input:
            inits.update(cos=np.cos(angles).astype(dtype), sin=np.sin(angles).astype(dtype))
        inits.update(
            zero_1d=np.array([0], np.int64),
            half_1d=np.array([H // 2], np.int64),
            end_1d=np.array([H], np.int64),
            last_axis=np.array([3], np.int64),
        )
    if repeat_kv:
        inits["axis_2"] = np.array([2], np.int64)
        inits["repeat_shape"] = np.array([batch, kv_heads, N // kv_heads, seq, H], np.int64)
        inits["repeated_shape"] = np.array([batch, N, seq, H], np.int64)
    for name in "qkv":
        nodes.append(helper.make_node("MatMul", ["x", f"w{name}"], [f"{name}_mm"]))
        nodes.append(helper.make_node("Add", [f"{name}_mm", f"b{name}"], [name]))
        nodes.append(helper.make_node("Reshape", [name, "split_q" if name == "q" else "split_kv"], [f"{name}_split"]))
    nodes.append(helper.make_node("Transpose", ["q_split"], ["q_heads"], perm=[0, 2, 1, 3]))
    nodes.append(helper.make_node("Transpose", ["v_split"], ["v_heads"], perm=[0, 2, 1, 3]))
    q_heads, v_heads = "q_heads", "v_heads"
    if rotary:
        nodes += rotate("q_heads", "q_rotated")
        q_heads = "q_rotated"
    if repeat_kv:
        nodes += repeat("v_heads", "v_repeated")
        v_heads = "v_repeated"
    if k_form == "0231":
        nodes.append(helper.make_node("Transpose", ["k_split"], ["k_t"], perm=[0, 2, 3, 1]))
    elif k_form == "0132":
        nodes.append(helper.make_node("Transpose", ["k_split"], ["k_heads"], perm=[0, 2, 1, 3]))
        k_heads = "k_heads"
        if rotary:
            nodes += rotate(k_heads, "k_rotated")
            k_heads = "k_rotated"
        if repeat_kv:
            nodes += repeat(k_heads, "k_repeated")
            k_heads = "k_repeated"
        nodes.append(helper.make_node("Transpose", [k_heads], ["k_t"], perm=[0, 1, 3, 2]))
    else:
        inits["fold"] = np.array([batch * kv_heads, seq, H], np.int64)
        inits["unfold"] = np.array([batch, kv_heads, H, seq], np.int64)
        nodes.append(helper.make_node("Transpose", ["k_split"], ["k_heads"], perm=[0, 2, 1, 3]))
        nodes.append(helper.make_node("Reshape", ["k_heads", "fold"], ["k_folded"]))
        nodes.append(helper.make_node("Transpose", ["k_folded"], ["k_swapped"], perm=[0, 2, 1]))
        nodes.append(helper.make_node("Reshape", ["k_swapped", "unfold"], ["k_t"]))
    q_in, k_in = q_heads, "k_t"
    if scale == "q_mul":
        inits["q_scale"] = np.array(H**-0.5, dtype)
        nodes.append(helper.make_node("Mul", [q_heads, "q_scale"], ["q_scaled"]))
        q_in = "q_scaled"
    elif scale == "qk_sqrt":
        inits["root_scale"] = np.array(H**-0.25, dtype)
        nodes.append(helper.make_node("Mul", [q_heads, "root_scale"], ["q_scaled"]))
        nodes.append(helper.make_node("Mul", ["k_t", "root_scale"], ["k_scaled"]))
        q_in, k_in = "q_scaled", "k_scaled"
    nodes.append(helper.make_node("MatMul", [q_in, k_in], ["qk"]))
    scores = "qk"
    inputs = [("x", dtype, [*dims, D])]
    feeds = {"x": rng.standard_normal((batch, seq, D)).astype(dtype)}
    if rotary and cache_input:
        inputs += [(name, dtype, [1, 1, "positions", H]) for name in ("cos", "sin")]
        feeds.update(cos=np.cos(angles).astype(dtype), sin=np.sin(angles).astype(dtype))
    mask_tensor = None
    if mask in ("padding", "padding_lowest"):
        inits["one"] = np.array(1, dtype)
        inits["big_negative"] = np.array(-10000 if mask == "padding" else np.finfo(dtype).min, dtype)
        inits["mask_axes"] = np.array([1, 2], np.int64)
        nodes += [
            helper.make_node("Unsqueeze", ["mask", "mask_axes"], ["mask4"]),
            helper.make_node("Sub", ["one", "mask4"], ["inverted"]),
            helper.make_node("Mul", ["inverted", "big_negative"], ["additive_mask"]),
        ]
        inputs.append(("mask", dtype, [dims[0], dims[1]]))
        padding = np.ones((batch, seq), dtype)
        padding[1, -2:] = 0
        if mask == "padding_lowest":
            padding[1] = 0
        feeds["mask"] = padding
        mask_tensor = "additive_mask"
    elif mask == "boolean":
        inits["zero"] = np.array(0, dtype)
        inits["minus_inf"] = np.array(-np.inf, dtype)
        nodes.append(helper.make_node("Where", ["allowed", "zero", "minus_inf"], ["additive_mask"]))
        inputs.append(("allowed", np.bool_, [dims[0], 1, dims[1], dims[1]]))
        allowed = np.tril(np.ones((seq, seq), bool))[None, None].repeat(batch, 0)
        allowed[1, 0, :, 0] = False
        allowed[1, 0, 0, :] = False  # a query row that sees no key at all
        feeds["allowed"] = allowed
        mask_tensor = "additive_mask"
    if mask_tensor is not None and mask_before_scale:
        nodes.append(helper.make_node("Add", [scores, mask_tensor], ["masked"]))
        scores = "masked"
    if scale in ("scores_div", "scores_mul"):
        inits["score_scale"] = np.array(np.sqrt(H) if scale == "scores_div" else H**-0.5, dtype)
        nodes.append(helper.make_node("Div" if scale == "scores_div" else "Mul", [scores, "score_scale"], ["scaled"]))
        scores = "scaled"
    if mask_tensor is not None and not mask_before_scale:
        nodes.append(helper.make_node("Add", [scores, mask_tensor], ["masked"]))
        scores = "masked"
    nodes.append(helper.make_node("Softmax", [scores], ["probs"], axis=softmax_axis))
    probs = "probs"
    if nan_guard:
        inits["guard_zero"] = np.array(0, dtype)
        nodes.append(helper.make_node("IsNaN", ["probs"], ["probs_nan"]))
        nodes.append(helper.make_node("Where", ["probs_nan", "guard_zero", "probs"], ["probs_guarded"]))
        probs = "probs_guarded"
    merge_shape = "merge_shape"
    if merge != "constant":
        inits.update(first_two=np.array([0, 1], np.int64), minus_one=np.array([-1], np.int64))
        nodes += [
            helper.make_node("Shape", ["x"], ["x_shape"]),
            helper.make_node("Gather", ["x_shape", "first_two"], ["batch_seq"], axis=0),
            helper.make_node(
                "Concat",
                ["batch_seq", "minus_one" if merge == "input_dims" else "merge_width"],
                ["computed_merge_shape"],
                axis=0,
            ),
        ]
        merge_shape = "computed_merge_shape"
        if merge == "runtime":
            inputs.append(("merge_width", np.int64, [1]))
            feeds["merge_width"] = np.array([D], np.int64)
    nodes += [
        helper.make_node("MatMul", [probs, v_heads], ["context"]),
        helper.make_node("Transpose", ["context"], ["context_t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["context_t", merge_shape], ["y"], name="merge"),
    ]
    # A computed merge's result is not a graph output in the exports: its shape is not declared.
    outputs = [("y", dtype, [*dims, D] if merge == "constant" else [None, None, None])]
    if probs_output:
        outputs.append(("probs", dtype, [*dims[:1], N, *dims[1:], dims[1]]))
    model = make_model(nodes, inputs, outputs, inits, opset=opset, ir_version=10 if opset >= 21 else 8, check=False)
    onnx.checker.check_model(model)
    return model, feeds


def fuse(model, feeds, *, expected_ops, tol=None):
    """Fuse for onnxruntime with attention-multihead alone; check ops, validity, numerics."""
    dtype = feeds["x"].dtype
    tol = tol or (dict(rtol=1e-4, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-2, atol=1e-2))
    after, report = assert_rewritten(
        model,
        [attention_multihead],
        counts={RULE: 1},
        expected_ops=expected_ops,
        target="onnxruntime",
        inputs=feeds,
        feeds=feeds,
        **tol,
    )
    assert opsets_of(after).get(MS) == 1
    assert all(n.domain == MS for n in nodes_of(after, "MultiHeadAttention"))
    assert not nodes_of(after, "Softmax")
    return after, report


PROJECTIONS = ["MatMul", "Add"] * 3


def zeroing(dtype=np.float32) -> list[str]:
    """The ops that zero the fused output's fully masked rows (the NaN guard's part), and the merge."""
    return ["ReduceMax", *(["Cast"] if dtype == np.float16 else []), "IsInf", "Transpose", "Reshape", "Where", "Reshape"]


@pytest.mark.parametrize("scale", ["scores_div", "scores_mul", "q_mul", "qk_sqrt", "none"])
@pytest.mark.parametrize("k_form", ["0231", "0132", "3d"])
def test_scales_and_key_transpositions_fuse(scale, k_form):
    model, feeds = attention_model(scale=scale, k_form=k_form, nan_guard=True)
    after, _ = fuse(model, feeds, expected_ops=PROJECTIONS + ["MultiHeadAttention"])
    (mha,) = nodes_of(after, "MultiHeadAttention")
    attrs = {a.name: helper.get_attribute_value(a) for a in mha.attribute}
    expected_scale = 1.0 if scale == "none" else H**-0.5
    assert attrs["num_heads"] == N
    assert attrs["scale"] == pytest.approx(expected_scale, rel=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_padding_mask_is_expanded_to_the_attention_bias(dtype):
    model, feeds = attention_model(dtype=dtype, mask="padding", nan_guard=True)
    after, _ = fuse(
        model,
        feeds,
        expected_ops=PROJECTIONS
        + ["Unsqueeze", "Sub", "Mul", "Shape", "Shape", "Concat", "Expand"]
        + ["MultiHeadAttention", *zeroing(dtype)],
    )
    (mha,) = nodes_of(after, "MultiHeadAttention")
    (expand,) = nodes_of(after, "Expand")
    assert mha.input[5] == expand.output[0]


def test_symbolic_batch_and_sequence():
    model, feeds = attention_model(mask="padding", symbolic=True, nan_guard=True)
    fuse(
        model,
        feeds,
        expected_ops=PROJECTIONS
        + ["Unsqueeze", "Sub", "Mul", "Shape", "Shape", "Concat", "Expand"]
        + ["MultiHeadAttention", *zeroing()],
    )
    after, _ = fuser.optimize(model, rules=[attention_multihead], target="onnxruntime", inputs=feeds)
    longer = {"x": np.random.default_rng(1).standard_normal((3, 7, D)).astype(np.float32)}
    longer["mask"] = np.ones((3, 7), np.float32)
    np.testing.assert_allclose(run(after, longer)[0], run(model, longer)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_boolean_mask_with_nan_guard_keeps_fully_masked_rows_zero(dtype):
    model, feeds = attention_model(dtype=dtype, mask="boolean", nan_guard=True)
    cast = ["Cast"] if dtype == np.float16 else []
    after, _ = fuse(
        model,
        feeds,
        expected_ops=PROJECTIONS
        + ["Where", "MultiHeadAttention", "ReduceMax", *cast, "IsInf", "Transpose", "Reshape", "Where", "Reshape"],
    )
    expected = run(model, feeds)[0]
    assert np.all(expected[1, 0] == 0) and np.isfinite(expected).all()
    np.testing.assert_array_equal(run(after, feeds)[0][1, 0], 0)


def test_full_mask_needs_no_expand():
    model, feeds = attention_model(mask="boolean", nan_guard=True)
    after, _ = fuse(model, feeds, expected_ops=PROJECTIONS + ["Where", "MultiHeadAttention", *zeroing()])
    (mha,) = nodes_of(after, "MultiHeadAttention")
    assert mha.input[5] == "additive_mask"


ROTARY = ["Slice", "Slice", "Neg", "Concat", "Mul", "Mul", "Add"]
REPEAT = ["Unsqueeze", "Expand", "Reshape"]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rotary_heads_and_repeated_kv_heads_fuse(dtype):
    """Llama's layout as scaled_dot_product_attention exports it: Q and K rotated as heads
    [B, N, S, H], K and V heads repeated from 2 to 4, the NaN guard over the probabilities."""
    model, feeds = attention_model(
        dtype=dtype, k_form="0132", rotary=True, repeat_kv=True, kv_heads=2, mask="boolean", nan_guard=True
    )
    after, _ = fuse(
        model,
        feeds,
        expected_ops=["MatMul", "Add", "Reshape"] * 3
        + ["Transpose", "Transpose", *ROTARY, *REPEAT, "Transpose", *ROTARY, *REPEAT]
        + ["Where", "Transpose", "Reshape", "MultiHeadAttention", *zeroing(dtype)],
    )
    (mha,) = nodes_of(after, "MultiHeadAttention")
    assert list(mha.input[1:3]) == ["k_repeated", "v_repeated"]


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("mask", [None, "padding"])
def test_attention_without_the_nan_guard_is_declined(rotary, mask):
    """Eager attention: nothing but MatMul, Softmax and MatMul to fuse, which onnxruntime runs as
    fast itself (see the rule's docstring for the measurement); with Q rotated as heads the fused
    op would need a Transpose as well."""
    model, feeds = attention_model(k_form="0132" if rotary else "0231", rotary=rotary, mask=mask)
    run(model, feeds)
    assert_declined(model, attention_multihead, "with no NaN guard to remove", target="onnxruntime")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_merge_to_the_inputs_dims_is_kept_where_shapes_cannot_show_what_it_gives(dtype):
    """The legacy Llama export: the rotary cos/sin come with a length of their own, so Q's
    sequence is not known to be x's, and the merge target Concat(x's batch, x's sequence, -1)
    cannot be shown to give [B, S, D]. The fused output is reshaped by that same target, which
    is the same reshape (row-major order, no 0 copying a dim past the second)."""
    model, feeds = attention_model(
        dtype=dtype,
        k_form="0132",
        rotary=True,
        repeat_kv=True,
        kv_heads=2,
        mask="boolean",
        nan_guard=True,
        symbolic=True,
        cache_input=True,
        merge="input_dims",
    )
    after, _ = fuse(
        model,
        feeds,
        expected_ops=["MatMul", "Add", "Reshape"] * 3
        + ["Transpose", "Transpose", *ROTARY, *REPEAT, "Transpose", *ROTARY, *REPEAT]
        + ["Where", "Shape", "Gather", "Concat", "Shape", "Shape", "Concat", "Expand", "Transpose", "Reshape"]
        + ["MultiHeadAttention", *zeroing(dtype)],
    )
    (merge,) = [n for n in after.graph.node if n.output[0] == "y"]
    assert merge.op_type == "Reshape" and merge.input[1] == "computed_merge_shape"


def test_merge_to_a_width_known_only_at_run_time_is_declined():
    """The target's last entry is a graph input: it could be 0, copying N of [B, S, N, Hv]
    where the fused op's output has N*Hv."""
    model, _ = attention_model(
        k_form="0132", rotary=True, repeat_kv=True, kv_heads=2, symbolic=True, cache_input=True, merge="runtime"
    )
    assert_declined(
        model,
        attention_multihead,
        "nor that its target [?, ?, ?] leaves the dims past the second uncopied",
        target="onnxruntime",
    )


def test_heads_split_with_the_sequence_left_to_minus_one():
    """OPT's view(batch, -1, N, H): the split keeps the hidden size, and the batch is the
    input's, so the -1 can only be the sequence, though shape inference leaves it unnamed."""
    model, feeds = attention_model(split="inferred", symbolic=True, mask="padding", nan_guard=True)
    after, _ = fuse(
        model,
        feeds,
        expected_ops=PROJECTIONS + ["Unsqueeze", "Sub", "Mul", "Shape", "Shape", "Concat", "Expand"]
        + ["MultiHeadAttention", *zeroing()],
    )
    longer = {"x": np.random.default_rng(1).standard_normal((3, 7, D)).astype(np.float32)}
    longer["mask"] = np.ones((3, 7), np.float32)
    longer["mask"][2, 4:] = 0
    np.testing.assert_allclose(run(after, longer)[0], run(model, longer)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("symbolic", [False, True])
def test_heads_split_that_changes_the_sequence_is_declined(symbolic):
    """[0, -1, N, H/2] keeps the batch but not the hidden size: the -1 is twice the sequence."""
    model, feeds = attention_model(split="halved", symbolic=symbolic, scale="none", nan_guard=True)
    run(model, feeds)  # a valid model, just not attention over x's tokens
    assert_declined(model, attention_multihead, "Reshape keeps batch and sequence", target="onnxruntime")


def test_grouped_query_attention_is_declined():
    model, _ = attention_model(kv_heads=2, nan_guard=True)
    assert_declined(
        model, attention_multihead, "grouped-query attention without the heads repeated", target="onnxruntime"
    )


def test_softmax_over_another_axis_is_declined():
    model, _ = attention_model(softmax_axis=2)
    assert_declined(model, attention_multihead, "the Softmax is over axis 2", target="onnxruntime")


def test_mask_added_before_the_scaling_is_declined():
    model, _ = attention_model(mask="padding", mask_before_scale=True)
    assert_declined(model, attention_multihead, "the mask is added before the scores are scaled", target="onnxruntime")


def test_probabilities_used_elsewhere_are_declined():
    model, _ = attention_model(probs_output=True, nan_guard=True)
    assert_declined(model, attention_multihead, "'probs' (output of", target="onnxruntime")


def test_float64_is_declined():
    model, _ = attention_model(dtype=np.float64)
    assert_declined(model, attention_multihead, "the fused kernels take float32/float16", target="onnxruntime")


def test_not_on_the_onnx_target():
    model, _ = attention_model()
    _, report = fuser.optimize(model, target="onnx", rules=[attention_multihead])
    assert report.counts == {}


# ------------------------------------------------------------------- real exports


def export_feeds(model: onnx.ModelProto, batch: int = 2, seq: int = 8, past: int = 5) -> dict:
    """Realistic inputs: token ids within the vocabulary, token types in [0, 2), masks of ones;
    a KV cache (past_key_values.*) of `past` tokens, which the mask then spans too."""
    rng = np.random.default_rng(0)
    vocab = min(
        (
            onnx.numpy_helper.to_array(t).shape[0]
            for t in model.graph.initializer
            if any(n.op_type == "Gather" and n.input[0] == t.name for n in model.graph.node)
        ),
        default=2,
    )
    feeds = {}
    for value in model.graph.input:
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        dims = [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]
        if value.name == "input_ids":
            feeds[value.name] = rng.integers(0, vocab, (batch, seq)).astype(dtype)
        elif value.name == "token_type_ids":
            feeds[value.name] = rng.integers(0, 2, (batch, seq)).astype(dtype)
        elif value.name == "attention_mask":
            cached = any(v.name.startswith("past_key_values") for v in model.graph.input)
            feeds[value.name] = np.ones((batch, past + seq if cached else seq), dtype)
        elif value.name.startswith("past_key_values"):
            feeds[value.name] = rng.standard_normal((batch, dims[1], past, dims[3])).astype(dtype)
        elif value.name == "position_ids":
            feeds[value.name] = np.arange(seq, dtype=dtype)[None].repeat(batch, 0)
        else:
            shape = [batch if i == 0 and d is None else (d or seq) for i, d in enumerate(dims)]
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


# torch.onnx.export's two exporters, scaled_dot_product_attention (default) or eager attention,
# and some older-opset / float16 variants.
EXPORTS = [
    f"{arch}_{exporter}{variant}"
    for arch in ("bert", "gpt2", "vit")
    for exporter in ("legacy", "dynamo")
    for variant in ("", "_eager")
] + ["bert_legacy_fp16", "bert_legacy_opset14", "gpt2_legacy_opset14", "llama_dynamo", "llama_dynamo_eager"]
EXPORTS += ["gpt2_legacy_past", "gpt2_dynamo_past", "llama_dynamo_past"]  # with a KV cache


@pytest.mark.parametrize("name", EXPORTS)
def test_real_exports_fuse_the_attention_that_has_the_nan_guard(name):
    """Exports of scaled_dot_product_attention (its NaN guard: IsNaN) leave no Softmax; the
    others (eager attention, ViT's legacy export) are left as they are."""
    path = TRANSFORMERS / f"{name}.onnx"
    assert path.exists(), f"{path}: the committed export is missing (tests/data/make_transformers.py makes it)"
    model = onnx.load(os.fspath(path))
    feeds = export_feeds(model)
    softmaxes = len(nodes_of(model, "Softmax"))
    guarded = len(nodes_of(model, "IsNaN")) == softmaxes
    after, report = fuser.optimize(model, target="onnxruntime", rules=[attention_multihead], inputs=feeds, trace=True)
    if not guarded:
        assert report.counts == {} and len(nodes_of(after, "Softmax")) == softmaxes
        assert [d for d in report.engine.declined if "no NaN guard to remove" in d.reason]
        return
    assert report.counts == {RULE: softmaxes}
    assert not [n for n in after.graph.node if n.op_type == "Softmax" and n.domain in ("", "ai.onnx")]
    assert report.verdict.passed
    tol = 1e-2 if name.endswith("fp16") else 1e-4
    for expected, actual in zip(run(model, feeds), run(after, feeds)):
        np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "name", [f"{arch}_{exporter}_past" for arch in ("gpt2", "llama") for exporter in ("legacy", "dynamo")]
)
def test_kv_cache_exports_fuse_with_every_rule_and_decode_the_same(name):
    """With a KV cache the attention reads the past keys and values concatenated with the new
    ones; fused, a prompt after a cache and a single decoding step give the original's outputs."""
    model = onnx.load(os.fspath(TRANSFORMERS / f"{name}.onnx"))
    after, report = fuser.optimize(model, target="onnxruntime", inputs=export_feeds(model))
    assert report.counts[RULE] == 2 and report.verdict.passed
    assert not [n for n in after.graph.node if n.op_type == "Softmax"]
    for batch, seq, past in ((2, 8, 5), (3, 1, 9), (1, 1, 1)):
        feeds = export_feeds(model, batch, seq, past)
        feeds["attention_mask"][0, :1] = 0  # the first row's oldest token is padding
        for expected, actual in zip(run(model, feeds), run(after, feeds), strict=True):
            np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)
