"""Tests for rotary-embedding and rotary-embedding-ort (rules/rotary_embedding.py): x * cos +
rotate_half(x) * sin on heads [B, N, S, H] becomes the standard RotaryEmbedding (opset 23), or
com.microsoft RotaryEmbedding on the onnxruntime target, checked in onnxruntime with its
optimizations off. cos and sin are computed in the model, as Hugging Face's Llama
does: Unsqueeze(Cos(Concat(freqs, freqs)), 1) with freqs = positions x inverse frequencies.

onnxruntime 1.32's RotaryEmbedding wants 3-D caches with x's batch size (a batch-1 cache is
an error), which is why the rule expands them.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import fuser
from fuser.rules.attention_standard import attention_standard
from fuser.rules.rotary_embedding import rotary_embedding, rotary_embedding_ort
from tests.helpers import assert_declined, make_model, nodes_of, run
from tests.rules.test_attention_multihead import TRANSFORMERS, export_feeds

RULE = "rotary-embedding"
B, N, S, H = 2, 3, 5, 8


def rotary_model(
    *,
    dtype=np.float32,
    symbolic=False,
    second_freqs="freqs",
    first_slice=(0, H // 2),
    second_slice=(H // 2, 2**62),
    constant_cos=False,
    opset=23,
    positions=None,
    batch_positions=False,
    sin_batch_positions=False,
    tensor_names=False,
    cos_scale=None,
    flat_positions=False,
    x_batch=B,
):
    """x [B, N, S, H], position_ids [1, S] -> x * cos + rotate_half(x) * sin; (model, feeds).

    second_freqs: "freqs" builds Concat(freqs, freqs); "other" Concat(freqs, 2 * freqs), whose
    halves differ. first_slice/second_slice: the rotate_half Slices' [start, end).
    constant_cos: cos and sin as initializers instead of computed.
    positions: the length of position_ids (default S; 1 rotates every position alike).
    batch_positions: position_ids [B, S], one row of positions per batch row.
    sin_batch_positions: sin from positions of its own, [B, S]; cos from position_ids [1, S].
    tensor_names: the [1, S, H] caches named "cos" and "sin" (as the dynamo exporter names
    them), which are also names in the rules' pattern (bound to the [1, 1, S, H] Unsqueezes).
    cos_scale: an [H] constant that multiplies Cos(...) from the left, Mul(cos_scale, Cos(...)).
    flat_positions: position_ids [positions], so that the caches are [positions, H].
    x_batch: x's batch, when it is not position_ids' (with batch_positions).
    """
    rng = np.random.default_rng(0)
    batch, seq = ("batch", "seq") if symbolic else (B, S)
    inits = {
        "inv_freq": (10000.0 ** (-np.arange(0, H, 2) / H))[None].astype(np.float32),
        "axis_last": np.array([-1], np.int64),
        "axis_1": np.array([1], np.int64),
        "two": np.array(2, np.float32),
        "first_start": np.array([first_slice[0]], np.int64),
        "first_end": np.array([first_slice[1]], np.int64),
        "second_start": np.array([second_slice[0]], np.int64),
        "second_end": np.array([second_slice[1]], np.int64),
    }
    to = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = []
    if constant_cos:
        angles = np.arange(S)[:, None] * inits["inv_freq"]
        angles = np.concatenate([angles, angles], -1)[None, None]
        inits["cos"] = np.cos(angles).astype(dtype)
        inits["sin"] = np.sin(angles).astype(dtype)
    else:
        nodes += [
            helper.make_node("Cast", ["position_ids"], ["positions"], to=onnx.TensorProto.FLOAT),
            helper.make_node("Unsqueeze", ["positions", "axis_last"], ["positions_3d"]),
            helper.make_node("MatMul", ["positions_3d", "inv_freq"], ["freqs"]),
            helper.make_node("Mul", ["freqs", "two"], ["freqs_doubled"]),
            helper.make_node(
                "Concat", ["freqs", "freqs" if second_freqs == "freqs" else "freqs_doubled"], ["emb"], axis=-1
            ),
        ]
        if sin_batch_positions:
            nodes += [
                helper.make_node("Cast", ["sin_position_ids"], ["sin_positions"], to=onnx.TensorProto.FLOAT),
                helper.make_node("Unsqueeze", ["sin_positions", "axis_last"], ["sin_positions_3d"]),
                helper.make_node("MatMul", ["sin_positions_3d", "inv_freq"], ["sin_freqs"]),
                helper.make_node("Concat", ["sin_freqs", "sin_freqs"], ["sin_emb"], axis=-1),
            ]
        for function, name in (("Cos", "cos"), ("Sin", "sin")):
            emb = "sin_emb" if sin_batch_positions and name == "sin" else "emb"
            if cos_scale is not None and name == "cos":
                inits["cos_scale"] = np.asarray(cos_scale, np.float32)
                nodes.append(helper.make_node(function, [emb], ["cos_unscaled"]))
                function, emb = "Mul", "cos_unscaled"
            nodes += [
                helper.make_node(function, ["cos_scale", emb] if function == "Mul" else [emb], [f"{name}_3d"]),
                helper.make_node("Cast", [f"{name}_3d"], [name if tensor_names else f"{name}_typed"], to=to),
                helper.make_node(
                    "Unsqueeze",
                    [name if tensor_names else f"{name}_typed", "axis_1"],
                    [f"{name}_heads" if tensor_names else name],
                ),
            ]
    nodes += [
        helper.make_node("Slice", ["x", "first_start", "first_end", "axis_last"], ["x1"], name="first"),
        helper.make_node("Slice", ["x", "second_start", "second_end", "axis_last"], ["x2"], name="second"),
        helper.make_node("Neg", ["x2"], ["x2_negated"]),
        helper.make_node("Concat", ["x2_negated", "x1"], ["x_rotated"], axis=-1),
        helper.make_node("Mul", ["x", "cos_heads" if tensor_names else "cos"], ["x_cos"]),
        helper.make_node("Mul", ["x_rotated", "sin_heads" if tensor_names else "sin"], ["x_sin"]),
        helper.make_node("Add", ["x_cos", "x_sin"], ["y"], name="sum"),
    ]
    x_rows = batch if x_batch == B else x_batch
    inputs = [("x", dtype, [x_rows, N, seq, H])]
    feeds = {"x": rng.standard_normal((x_batch, N, S, H)).astype(dtype)}
    if not constant_cos:
        rows, length = (batch, seq) if batch_positions else (1, seq if positions is None else positions)
        inputs.append(("position_ids", np.int64, [length] if flat_positions else [rows, length]))
        feeds["position_ids"] = np.arange(S if positions is None else positions, dtype=np.int64)[None]
        if batch_positions:
            feeds["position_ids"] = np.tile(feeds["position_ids"], (B, 1)) + np.arange(B)[:, None]
        if flat_positions:
            feeds["position_ids"] = feeds["position_ids"][0]
        if sin_batch_positions:
            inputs.append(("sin_position_ids", np.int64, [batch, seq]))
            feeds["sin_position_ids"] = np.arange(S, dtype=np.int64)[None] + np.arange(B)[:, None]
    rows_out = x_rows if x_batch == B or not batch_positions else batch
    model = make_model(nodes, inputs, [("y", dtype, [rows_out, N, seq, H])], inits, opset=opset, ir_version=10)
    return model, feeds


def fuse(model, feeds, tol):
    after, report = fuser.optimize(model, rules=[rotary_embedding], inputs=feeds)
    assert report.counts == {RULE: 1} and report.verdict.passed
    onnx.checker.check_model(after, full_check=True)
    assert len(nodes_of(after, "RotaryEmbedding")) == 1
    assert not nodes_of(after, "Neg")
    assert [n.input[0] for n in nodes_of(after, "Slice")] == ["cos_typed", "sin_typed"]  # the half-width caches
    np.testing.assert_allclose(run(after, feeds)[0].astype(np.float64), run(model, feeds)[0].astype(np.float64), **tol)
    return after


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rotate_half_becomes_rotary_embedding(dtype):
    model, feeds = rotary_model(dtype=dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == np.float32 else {"rtol": 1e-2, "atol": 1e-2}
    after = fuse(model, feeds, tol)
    (rotary,) = nodes_of(after, "RotaryEmbedding")
    assert rotary.input[0] == "x"
    assert len(nodes_of(after, "Expand")) == 2  # the batch-1 caches, expanded to x's batch


def test_symbolic_batch_and_sequence():
    model, feeds = rotary_model(symbolic=True)
    after = fuse(model, feeds, {"rtol": 1e-5, "atol": 1e-5})
    longer = {"x": np.ones((3, N, 7, H), np.float32), "position_ids": np.arange(7, dtype=np.int64)[None]}
    np.testing.assert_allclose(run(after, longer)[0], run(model, longer)[0], rtol=1e-5, atol=1e-5)
    # A symbolic length is taken for x's: the caches are expanded over the batch only.
    (shape,) = nodes_of(after, "Shape")
    assert {a.name: a.i for a in shape.attribute} == {"start": 0, "end": 1}


def test_cos_with_different_halves_is_declined():
    model, _ = rotary_model(second_freqs="other")
    assert_declined(model, rotary_embedding, "its halves may differ")


def test_constant_cos_is_declined():
    model, _ = rotary_model(constant_cos=True)
    assert_declined(model, rotary_embedding, "cos is not Unsqueeze(..., axis 1)")


def test_slices_at_other_offsets_are_declined():
    model, _ = rotary_model(first_slice=(0, 2), second_slice=(2, 2**62))
    assert_declined(model, rotary_embedding, "first_half Slice is [0:2] of a head of 8")


def test_not_before_opset_23():
    model, _ = rotary_model(opset=22)
    _, report = fuser.optimize(model, rules=[rotary_embedding])
    assert report.counts == {} and RULE in report.engine.skipped_rules


@pytest.mark.parametrize("name", ["llama_legacy", "llama_dynamo"])
def test_llama_exports_upgraded_to_opset_23(name):
    path = TRANSFORMERS / f"{name}.onnx"
    assert path.exists(), f"{path}: the committed export is missing (tests/data/make_transformers.py makes it)"
    original = onnx.load(str(path))
    model = onnx.version_converter.convert_version(original, 23)
    # The converter's annotations lack the symbolic dims the rules check; the exporter's are kept.
    del model.graph.value_info[:]
    model.graph.value_info.extend(original.graph.value_info)
    model.ir_version = 10
    feeds = export_feeds(model)
    after, report = fuser.optimize(model, rules=[rotary_embedding, attention_standard], inputs=feeds)
    assert report.counts[RULE] == 4  # Q and K in each of two layers
    if name == "llama_dynamo":
        assert report.counts["attention-standard"] == 2
        assert not nodes_of(after, "Softmax")
    for expected, actual in zip(run(model, feeds), run(after, feeds)):
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ com.microsoft RotaryEmbedding

RULE_ORT = "rotary-embedding-ort"
TOLERANCES = {np.float32: {"rtol": 1e-5, "atol": 1e-5}, np.float16: {"rtol": 1e-2, "atol": 1e-2}}


def fuse_ort(model, feeds, dtype=np.float32):
    after, report = fuser.optimize(model, rules=[rotary_embedding_ort], target="onnxruntime", inputs=feeds)
    assert report.counts == {RULE_ORT: 1} and report.verdict.passed
    (rotary,) = nodes_of(after, "RotaryEmbedding")
    assert rotary.domain == "com.microsoft" and rotary.input[0] == "x"
    assert not nodes_of(after, "Neg") and not nodes_of(after, "Add")
    expected, actual = run(model, feeds)[0], run(after, feeds)[0]
    np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64), **TOLERANCES[dtype])
    return after


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("opset", [14, 18, 23])
def test_ort_rotate_half_becomes_com_microsoft_rotary_embedding(dtype, opset):
    model, feeds = rotary_model(dtype=dtype, opset=opset)
    after = fuse_ort(model, feeds, dtype)
    # shape inference shows the cache has x's sequence length: it is read as it is
    assert not nodes_of(after, "Expand")
    assert [n.input[0] for n in nodes_of(after, "Slice")] == ["cos_typed", "sin_typed"]


def test_ort_symbolic_batch_and_sequence():
    model, feeds = rotary_model(symbolic=True, opset=18)
    after = fuse_ort(model, feeds)
    longer = {"x": np.ones((3, N, 7, H), np.float32), "position_ids": np.arange(7, dtype=np.int64)[None]}
    np.testing.assert_allclose(run(after, longer)[0], run(model, longer)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opset", [14, 18])
def test_ort_one_position_for_the_whole_sequence_is_expanded_to_it(opset):
    # cos [1, 1, 1, H] broadcasts over x's S positions: the fused op reads a row per position
    model, feeds = rotary_model(positions=1, opset=opset)
    after = fuse_ort(model, feeds)
    assert len(nodes_of(after, "Expand")) == 2


def test_ort_positions_per_batch_row_are_declined():
    model, _ = rotary_model(batch_positions=True, opset=18)
    assert_declined(model, rotary_embedding_ort, "not [1, positions, H]", target="onnxruntime")


def test_ort_sin_with_positions_per_batch_row_is_declined_though_cos_has_one_row():
    model, _ = rotary_model(sin_batch_positions=True, opset=18)
    assert_declined(model, rotary_embedding_ort, "sin is computed as", target="onnxruntime")


def test_sin_with_positions_per_batch_row_on_the_standard_op():
    model, feeds = rotary_model(sin_batch_positions=True)
    after, report = fuser.optimize(model, rules=[rotary_embedding], inputs=feeds)
    assert report.counts == {RULE: 1} and report.verdict.passed


def test_ort_cos_with_different_halves_is_declined():
    model, _ = rotary_model(second_freqs="other", opset=18)
    assert_declined(model, rotary_embedding_ort, "its halves may differ", target="onnxruntime")


def test_ort_float64_is_declined():
    model, _ = rotary_model(dtype=np.float64, opset=18)
    assert_declined(model, rotary_embedding_ort, "takes float32/float16", target="onnxruntime")


@pytest.mark.parametrize("rule", [rotary_embedding, rotary_embedding_ort])
def test_tensors_named_like_the_patterns_names(rule):
    # The dynamo exporter names the cache tensors "cos" and "sin", which are names in the
    # pattern too: the rule must read the tensors' shapes, not those of what "cos" binds.
    model, feeds = rotary_model(tensor_names=True, opset=23)
    after, report = fuser.optimize(model, rules=[rule], target=rule.target, inputs=feeds)
    assert report.counts == {rule.name: 1} and report.verdict.passed


@pytest.mark.parametrize("name", ["llama_legacy", "llama_dynamo", "llama_legacy_fp16"])
def test_llama_exports_on_the_onnxruntime_target(name):
    model = onnx.load(str(TRANSFORMERS / f"{name}.onnx"))
    feeds = export_feeds(model)
    after, report = fuser.optimize(model, target="onnxruntime", inputs=feeds)
    assert report.counts[RULE_ORT] == 4 and report.verdict.passed  # Q and K in each of two layers
    assert not nodes_of(after, "Neg")
    if name == "llama_legacy_fp16":  # eager attention, no NaN guard: attention-multihead leaves it (see there)
        assert len(nodes_of(after, "Softmax")) == 2 and not nodes_of(after, "MultiHeadAttention")
    else:
        assert not nodes_of(after, "Softmax")
        assert len(nodes_of(after, "MultiHeadAttention")) == 2  # attention takes the rotated heads


@pytest.mark.parametrize("rule", [rotary_embedding, rotary_embedding_ort])
def test_a_per_element_scale_written_first_is_declined(rule):
    """Mul(s, Cos(Concat(f, f))) with s of H values: the halves differ, whichever side s is on."""
    model, _ = rotary_model(cos_scale=np.arange(1, H + 1), opset=23 if rule is rotary_embedding else 18)
    target = "onnx" if rule is rotary_embedding else "onnxruntime"
    assert_declined(model, rule, "cos is scaled per element", target=target)


def test_a_scalar_written_first_is_fused():
    model, feeds = rotary_model(cos_scale=np.float32(1.5), opset=18)
    fuse_ort(model, feeds)


@pytest.mark.parametrize("rule", [rotary_embedding, rotary_embedding_ort])
def test_a_table_of_positions_unsqueezed_onto_the_heads_axis_is_declined(rule):
    """position_ids [N] make [N, H] caches, unsqueezed to [N, 1, H]: the original rotates x
    [B, N, S, H] along its heads axis, which the fused op cannot."""
    model, feeds = rotary_model(flat_positions=True, positions=N, opset=23 if rule is rotary_embedding else 18)
    run(model, feeds)  # the original runs
    target = "onnx" if rule is rotary_embedding else "onnxruntime"
    assert_declined(model, rule, "not [batch, positions, H]", target=target)


def test_caches_with_a_batch_larger_than_x_s_are_declined():
    """Caches of batch 2 broadcast x of batch 1 to 2 rows: the fused op would give one."""
    model, feeds = rotary_model(batch_positions=True, x_batch=1)
    assert run(model, feeds)[0].shape[0] == B
    assert_declined(model, rotary_embedding, "the original broadcasts x to it")


def test_one_position_for_the_whole_sequence_is_expanded_for_the_standard_op():
    """cos [1, 1, 1, H] broadcast over S positions: onnxruntime's RotaryEmbedding wants [B, S, H/2]."""
    model, feeds = rotary_model(positions=1)
    after, report = fuser.optimize(model, rules=[rotary_embedding], inputs=feeds)
    assert report.counts == {RULE: 1} and report.verdict.passed
    np.testing.assert_allclose(run(after, feeds)[0], run(model, feeds)[0], rtol=1e-5, atol=1e-5)
