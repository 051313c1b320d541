"""Tests for attention-standard (rules/attention_standard.py): multi-head attention written out
becomes the standard ONNX Attention operator at opset 23 and later.

The models are those of test_attention_multihead.py, at opset 23; the optimized models run
in onnxruntime (optimizations off). onnxruntime 1.32's CPU Attention runs float32 and float16,
wants attn_mask's query dimension in full, and gives 0 for a fully masked query row.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import fuser
from fuser.rules.attention_multihead import attention_multihead
from fuser.rules.attention_standard import attention_standard
from tests.helpers import assert_declined, assert_rewritten, make_model, nodes_of, run
from tests.rules.test_attention_multihead import H, N, PROJECTIONS, TRANSFORMERS, attention_model, export_feeds

RULE = "attention-standard"


def fuse(model, feeds, *, expected_ops):
    dtype = feeds["x"].dtype
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == np.float32 else {"rtol": 1e-2, "atol": 1e-2}
    after, report = assert_rewritten(
        model, [attention_standard], counts={RULE: 1}, expected_ops=expected_ops, inputs=feeds, feeds=feeds, **tol
    )
    assert not nodes_of(after, "Softmax")
    return after, report


@pytest.mark.parametrize("scale", ["scores_div", "q_mul", "qk_sqrt"])
@pytest.mark.parametrize("k_form", ["0231", "3d"])
def test_fuses_into_attention(scale, k_form):
    model, feeds = attention_model(scale=scale, k_form=k_form, opset=23)
    after, _ = fuse(model, feeds, expected_ops=PROJECTIONS + ["Attention"])
    (node,) = nodes_of(after, "Attention")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["q_num_heads"] == N and attrs["kv_num_heads"] == N
    assert attrs["scale"] == pytest.approx(H**-0.5, rel=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_padding_mask(dtype):
    model, feeds = attention_model(dtype=dtype, mask="padding", symbolic=True, opset=23)
    after, _ = fuse(
        model,
        feeds,
        expected_ops=PROJECTIONS
        + ["Unsqueeze", "Sub", "Mul", "Equal", "Where", "Shape", "Shape", "Concat", "Expand", "Attention"],
    )


def test_heads_split_with_the_sequence_left_to_minus_one():
    model, feeds = attention_model(split="inferred", symbolic=True, opset=23)
    after, _ = fuse(model, feeds, expected_ops=PROJECTIONS + ["Attention"])
    longer = {"x": np.random.default_rng(1).standard_normal((3, 7, N * H)).astype(np.float32)}
    np.testing.assert_allclose(run(after, longer)[0], run(model, longer)[0], rtol=1e-4, atol=1e-5)


def test_heads_split_that_changes_the_sequence_is_declined():
    model, _ = attention_model(split="halved", symbolic=True, scale="none", opset=23)
    assert_declined(model, attention_standard, "Reshape keeps batch and sequence")


def test_a_row_masked_everywhere_with_the_lowest_value_stays_uniform():
    """onnxruntime's kernel reads the dtype's lowest value as -inf, and would give 0 where the
    original's softmax over a row of equal scores is uniform: those entries move one step up."""
    model, feeds = attention_model(mask="padding_lowest", symbolic=True, opset=23)
    after, _ = fuse(
        model,
        feeds,
        expected_ops=PROJECTIONS
        + ["Unsqueeze", "Sub", "Mul", "Equal", "Where", "Shape", "Shape", "Concat", "Expand", "Attention"],
    )
    padded_row = run(after, feeds)[0][1]
    np.testing.assert_allclose(padded_row, run(model, feeds)[0][1], rtol=1e-2, atol=1e-2)
    assert np.abs(padded_row).max() > 0.01


def test_fully_masked_rows_give_zero_like_the_nan_guard():
    model, feeds = attention_model(mask="boolean", nan_guard=True, opset=23)
    after, _ = fuse(model, feeds, expected_ops=PROJECTIONS + ["Where", "Equal", "Where", "Attention"])
    np.testing.assert_array_equal(run(after, feeds)[0][1, 0], 0)


def test_fully_masked_rows_without_the_guard_are_stabilized():
    model, feeds = attention_model(mask="boolean", opset=23)
    _, report = assert_rewritten(
        model, [attention_standard], counts={RULE: 1}, expected_ops=PROJECTIONS + ["Where", "Equal", "Where", "Attention"], inputs=feeds
    )
    assert {o.status for o in report.verdict.outputs} == {"stabilized"}


def test_not_before_opset_23():
    model, _ = attention_model(opset=22)
    _, report = fuser.optimize(model, rules=[attention_standard])
    assert report.counts == {}
    assert "attention-standard" in report.engine.skipped_rules


def test_grouped_query_attention_is_declined():
    model, _ = attention_model(kv_heads=2, opset=23)
    assert_declined(model, attention_standard, "grouped-query")


# Not bert_dynamo and vit_dynamo: once converted, their torch.export Kᵀ (Reshape/Transpose/Reshape)
# has no shapes left that prove it a transposition (the exporter's annotations are gone).
@pytest.mark.parametrize("name", ["bert_legacy", "gpt2_legacy", "gpt2_dynamo", "vit_legacy"])
def test_real_exports_upgraded_to_opset_23(name):
    path = TRANSFORMERS / f"{name}.onnx"
    assert path.exists(), f"{path}: the committed export is missing (tests/data/make_transformers.py makes it)"
    model = onnx.version_converter.convert_version(onnx.load(str(path)), 23)
    # The converter annotates every tensor from its own shape inference, without the symbolic
    # dims that data propagation finds; left in, they would hide the shapes the rule checks.
    del model.graph.value_info[:]
    model.ir_version = 10
    feeds = export_feeds(model)
    after, report = fuser.optimize(model, rules=[attention_standard], inputs=feeds)
    assert report.counts == {RULE: len(nodes_of(model, "Softmax"))}
    assert not nodes_of(after, "Softmax")
    for expected, actual in zip(run(model, feeds), run(after, feeds)):
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rotary_heads_and_repeated_kv_heads_take_four_dimensional_inputs(dtype):
    """Grouped-query attention: Attention reads K and V before repeat_kv (it repeats each head
    in turn itself), so the Unsqueeze, Expand and Reshape of both go."""
    model, feeds = attention_model(dtype=dtype, k_form="0132", rotary=True, repeat_kv=True, kv_heads=2, opset=23)
    after, report = fuser.optimize(model, rules=[attention_standard], inputs=feeds)
    assert report.counts == {RULE: 1} and report.verdict.passed
    (node,) = nodes_of(after, "Attention")
    assert list(node.input[1:3]) == ["k_rotated", "v_heads"]  # [B, 2, S, H] each
    assert "q_num_heads" not in {a.name for a in node.attribute}  # only for 3-D inputs
    assert not nodes_of(after, "Softmax") and not nodes_of(after, "Expand") and not nodes_of(after, "Unsqueeze")
    tol = 1e-5 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(
        run(after, feeds)[0].astype(np.float64), run(model, feeds)[0].astype(np.float64), rtol=1e-4, atol=tol
    )


def tiled_kv_heads(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with K and V repeated as a whole (heads 0, 1, 0, 1, ...: Unsqueeze at axis 1,
    Expand to [B, R, Nkv, L, H]) rather than each head in turn as repeat_kv does."""
    tiled = onnx.ModelProto()
    tiled.CopyFrom(model)
    for tensor in tiled.graph.initializer:
        if tensor.name == "axis_2":
            tensor.CopyFrom(onnx.numpy_helper.from_array(np.array([1], np.int64), "axis_2"))
        if tensor.name == "repeat_shape":
            batch, kv_heads, repeats, seq, head = onnx.numpy_helper.to_array(tensor)
            shape = np.array([batch, repeats, kv_heads, seq, head], np.int64)
            tensor.CopyFrom(onnx.numpy_helper.from_array(shape, "repeat_shape"))
    return tiled


def test_heads_repeated_in_another_order_stay_repeated():
    model, feeds = attention_model(k_form="0132", rotary=True, repeat_kv=True, kv_heads=2, opset=23)
    tiled = tiled_kv_heads(model)
    assert not np.allclose(run(tiled, feeds)[0], run(model, feeds)[0], atol=1e-3)  # another function
    after, report = fuser.optimize(tiled, rules=[attention_standard], inputs=feeds)
    assert report.counts == {RULE: 1} and report.verdict.passed
    (node,) = nodes_of(after, "Attention")
    assert list(node.input[1:3]) == ["k_repeated", "v_repeated"]
    np.testing.assert_allclose(run(after, feeds)[0], run(tiled, feeds)[0], rtol=1e-4, atol=1e-5)


def repeated_heads_model(q_shape, k_shape, expand_to, reshape_to):
    """Q given as heads; K [k_shape] and V [2, 2, 5, 8] each Unsqueezed at axis 2, Expanded to
    `expand_to` and Reshaped to `reshape_to` before Q·Kᵀ/√8, Softmax, ·V and the heads' merge."""
    rng = np.random.default_rng(3)
    nodes = []
    for name in ("k", "v"):
        nodes += [
            helper.make_node("Unsqueeze", [name, "axis_2"], [f"{name}_5d"]),
            helper.make_node("Expand", [f"{name}_5d", "expand_to"], [f"{name}_expanded"]),
            helper.make_node("Reshape", [f"{name}_expanded", "reshape_to"], [f"{name}_repeated"]),
        ]
    nodes += [
        helper.make_node("Transpose", ["k_repeated"], ["k_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "k_t"], ["scores"]),
        helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
        helper.make_node("Softmax", ["scaled"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v_repeated"], ["context"]),
        helper.make_node("Transpose", ["context"], ["context_t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["context_t", "merge_to"], ["y"]),
    ]
    v_shape = (2, 2, 5, 8)
    model = make_model(
        nodes,
        [("q", np.float32, list(q_shape)), ("k", np.float32, list(k_shape)), ("v", np.float32, list(v_shape))],
        [("y", np.float32, [None, None, None])],
        {
            "axis_2": np.array([2], np.int64),
            "expand_to": np.array(expand_to, np.int64),
            "reshape_to": np.array(reshape_to, np.int64),
            "scale": np.array(8**-0.5, np.float32),
            "merge_to": np.array([0, 0, 32], np.int64),
        },
        opset=23,
    )
    feeds = {
        name: rng.standard_normal(shape).astype(np.float32) for name, shape in zip("qkv", (q_shape, k_shape, v_shape))
    }
    return model, feeds


def fused_kv_inputs(model, feeds) -> list[str]:
    after, report = fuser.optimize(model, rules=[attention_standard], inputs=feeds)
    assert report.counts == {RULE: 1} and report.verdict.passed
    np.testing.assert_allclose(run(after, feeds)[0], run(model, feeds)[0], rtol=1e-4, atol=1e-5)
    (node,) = nodes_of(after, "Attention")
    return list(node.input[1:3])


def test_heads_repeated_each_in_turn_are_read_before_the_repeat():
    model, feeds = repeated_heads_model((2, 4, 5, 8), (2, 2, 5, 8), [2, 2, 2, 5, 8], [2, 4, 5, 8])
    assert fused_kv_inputs(model, feeds) == ["k", "v"]


def test_an_expand_that_broadcasts_another_axis_too_keeps_the_repeat():
    """K's length 1 broadcast to 5 by the same Expand: K before the repeat is not K's heads."""
    model, feeds = repeated_heads_model((2, 4, 5, 8), (2, 2, 1, 8), [2, 2, 2, 5, 8], [2, 4, 5, 8])
    assert fused_kv_inputs(model, feeds) == ["k_repeated", "v_repeated"]


def test_a_reshape_other_than_the_heads_merge_keeps_the_repeat():
    """[2, 2, 2, 5, 8] reshaped to [5, 4, 2, 8]: four "heads", but batch and length mixed up."""
    model, feeds = repeated_heads_model((5, 4, 5, 8), (2, 2, 5, 8), [2, 2, 2, 5, 8], [5, 4, 2, 8])
    assert fused_kv_inputs(model, feeds) == ["k_repeated", "v_repeated"]


@pytest.mark.parametrize("name", ["llama_dynamo", "llama_dynamo_past", "llama_legacy", "llama_legacy_past"])
def test_real_grouped_query_exports_read_the_heads_before_the_repeat(name):
    """The Llama exports (2 of 4 heads for K and V) upgraded to opset 23 (the legacy ones' repeat
    spelled out with shape-where-fold's Where): each Attention
    reads the rotated K (or the KV cache's present.L.key) and V as they are, not repeated, and a
    decoding step after a cache gives the original's outputs."""
    model = onnx.load(str(TRANSFORMERS / f"{name}.onnx"))
    after, report = fuser.optimize(model, opset=23, inputs=export_feeds(model))
    assert report.counts[RULE] == 2 and report.verdict.passed
    assert report.counts.get("shape-where-fold", 0) == (4 if "legacy" in name else 0)  # K and V, 2 layers
    producers = {o: n for n in after.graph.node for o in n.output}
    for node in nodes_of(after, "Attention"):
        for tensor in node.input[1:3]:
            assert tensor.startswith("present.") or producers[tensor].op_type in ("RotaryEmbedding", "Transpose")
    for batch, seq, past in ((2, 8, 5), (1, 1, 9)):
        feeds = export_feeds(model, batch, seq, past)
        for expected, actual in zip(run(model, feeds), run(after, feeds), strict=True):
            np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)


def test_merge_to_the_inputs_dims_is_kept_where_shapes_cannot_show_what_it_gives():
    """As in test_attention_multihead.py (the legacy Llama export's merge): the 4-D output of
    Attention goes through the model's own Transpose and merge, so no Reshape is added."""
    model, feeds = attention_model(
        k_form="0132",
        rotary=True,
        repeat_kv=True,
        kv_heads=2,
        symbolic=True,
        cache_input=True,
        merge="input_dims",
        opset=23,
    )
    rotary = ["Slice", "Slice", "Neg", "Concat", "Mul", "Mul", "Add"]
    repeat = ["Unsqueeze", "Expand", "Reshape"]
    after, _ = fuse(
        model,
        feeds,
        expected_ops=["MatMul", "Add", "Reshape"] * 3
        + ["Transpose", "Transpose", *rotary, *repeat, "Transpose", *rotary, *repeat]
        + ["Shape", "Gather", "Concat", "Attention", "Transpose", "Reshape"],
    )
    (merge,) = [n for n in after.graph.node if n.output[0] == "y"]
    assert merge.op_type == "Reshape" and merge.input[1] == "computed_merge_shape"
    assert len(nodes_of(after, "Reshape")) == len(nodes_of(model, "Reshape"))


def test_on_the_onnxruntime_target_grouped_query_attention_takes_the_standard_operator():
    """At opset 23 MultiHeadAttention leaves grouped-query attention to Attention, which reads K
    and V before their repeat; below 23 (no Attention) it still fuses it, repeat and all."""
    model, feeds = attention_model(
        k_form="0132", rotary=True, repeat_kv=True, kv_heads=2, mask="boolean", nan_guard=True, opset=23
    )
    rules = [attention_multihead, attention_standard]
    after, report = fuser.optimize(model, target="onnxruntime", rules=rules, inputs=feeds, trace=True)
    assert report.counts == {RULE: 1} and report.verdict.passed
    assert [d for d in report.engine.declined if "grouped-query attention at opset 23" in d.reason]
    (node,) = nodes_of(after, "Attention")
    assert list(node.input[1:3]) == ["k_rotated", "v_heads"]
    older, _ = attention_model(k_form="0132", rotary=True, repeat_kv=True, kv_heads=2, mask="boolean", nan_guard=True)
    _, report = fuser.optimize(older, target="onnxruntime", rules=rules, inputs=feeds)
    assert report.counts == {"attention-multihead": 1}

