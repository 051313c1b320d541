"""The transformer export corpus is valid, small, dynamic and spelled as its notes say, and
bench/patterns_left counts what it should."""

from __future__ import annotations

import glob
import os

import numpy as np
import onnx
import pytest
from onnx import helper

from bench.patterns_left import patterns_left
from tests.data.make_transformers import SIZES
from tests.helpers import make_model, run

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformers")
ALL_FILES = sorted(os.path.basename(p)[: -len(".onnx")] for p in glob.glob(os.path.join(CORPUS, "*.onnx")))
PAST_FILES = [name for name in ALL_FILES if name.endswith("_past")]  # with a KV cache
FILES = [name for name in ALL_FILES if name not in PAST_FILES]

# (layernorm, rmsnorm, gelu, silu, attention) decomposed in each family's export: two layers;
# LayerNorm is one operator from opset 17 on, so only the opset-14 files decompose it.
EXPECTED = {
    "bert": (0, 0, 2, 0, 2, 0),
    "gpt2": (0, 0, 2, 0, 2, 0),
    "vit": (0, 0, 2, 0, 2, 0),
    "llama": (0, 5, 0, 2, 2, 4),  # rotary: Q and K in each of two layers
}


def feeds_for(model: onnx.ModelProto, batch: int, sequence: int) -> dict:
    rng = np.random.default_rng(1)
    vocabulary = SIZES["tiny"]["bert"]["vocab_size"]
    feeds = {}
    for value in model.graph.input:
        if value.name == "pixel_values":
            feeds[value.name] = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
        elif value.name == "token_type_ids":
            feeds[value.name] = rng.integers(0, 2, (batch, sequence), dtype=np.int64)
        elif value.name == "attention_mask":
            mask = np.ones((batch, sequence), dtype=np.int64)
            mask[0, -2:] = 0  # padding on the right of the first row
            feeds[value.name] = mask
        else:
            feeds[value.name] = rng.integers(0, vocabulary, (batch, sequence), dtype=np.int64)
    return feeds


def test_the_corpus_is_complete():
    for kind in EXPECTED:
        for variant in ("legacy", "dynamo", "legacy_eager", "dynamo_eager"):
            assert f"{kind}_{variant}" in FILES
    assert {"bert_legacy_fp16", "llama_legacy_fp16", "bert_legacy_opset14", "gpt2_legacy_opset14"} <= set(FILES)
    assert PAST_FILES == ["gpt2_dynamo_past", "gpt2_legacy_past", "llama_dynamo_past", "llama_legacy_past"]


def small_valid_single_file(name: str) -> onnx.ModelProto:
    path = os.path.join(CORPUS, f"{name}.onnx")
    assert os.path.getsize(path) < 1_000_000
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    assert not any(init.data_location == onnx.TensorProto.EXTERNAL for init in model.graph.initializer)
    return model


@pytest.mark.parametrize("name", FILES)
def test_export_is_a_small_valid_single_file_with_dynamic_dims(name):
    model = small_valid_single_file(name)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    assert opset == (14 if name.endswith("opset14") else 18)
    dynamic = [[d.dim_param for d in value.type.tensor_type.shape.dim][:2] for value in model.graph.input]
    expected = [["batch", ""]] if name.startswith("vit") else [["batch", "sequence"]] * len(dynamic)
    assert dynamic == expected
    # Two different shapes run: the dimensions really are dynamic.
    for batch, sequence in ((1, 5), (3, 12)):
        (output,) = run(model, feeds_for(model, batch, sequence))
        assert output.shape[0] == batch
        assert np.isfinite(output.astype(np.float32)).all()


def past_feeds(model: onnx.ModelProto, batch: int, past: int, sequence: int) -> dict:
    feeds = feeds_for(model, batch, sequence)
    feeds["attention_mask"] = np.ones((batch, past + sequence), np.int64)
    feeds["attention_mask"][0, :2] = 0  # the first row's oldest tokens are padding
    rng = np.random.default_rng(2)
    for value in model.graph.input[2:]:
        heads, size = (d.dim_value for d in value.type.tensor_type.shape.dim[1::2])
        feeds[value.name] = rng.standard_normal((batch, heads, past, size)).astype(np.float32)
    return feeds


@pytest.mark.parametrize("name", PAST_FILES)
def test_kv_cache_export_takes_and_returns_the_cache(name):
    model = small_valid_single_file(name)
    params = SIZES["tiny"][name.split("_")[0]]
    layers = params.get("n_layer") or params["num_hidden_layers"]
    caches = [f"past_key_values.{layer}.{part}" for layer in range(layers) for part in ("key", "value")]
    names = ["input_ids", "attention_mask", *caches]
    assert [value.name for value in model.graph.input] == names
    past_dims = {tuple(d.dim_param for d in value.type.tensor_type.shape.dim[::2]) for value in model.graph.input[2:]}
    assert past_dims == {("batch", "past_sequence")}
    mask_length = model.graph.input[1].type.tensor_type.shape.dim[1].dim_param
    # The legacy export spells the sum out; the dynamo one names it with a symbol of its own.
    assert mask_length == "past_sequence + sequence" if "legacy" in name else mask_length not in ("", "sequence")
    for batch, past, sequence in ((1, 4, 3), (3, 6, 1)):  # a prompt after a cache, and one decoding step
        outputs = run(model, past_feeds(model, batch, past, sequence))
        assert outputs[0].shape[:2] == (batch, sequence) and len(outputs) == 1 + 2 * layers
        assert all(present.shape[2] == past + sequence for present in outputs[1:])
        assert all(np.isfinite(output).all() for output in outputs)


@pytest.mark.parametrize("name", ALL_FILES)
def test_patterns_left_counts_each_exports_decomposed_patterns(name):
    layernorm, rmsnorm, gelu, silu, attention, rotary = EXPECTED[name.split("_")[0]]
    if name.endswith("opset14"):
        layernorm = 5
    counts = patterns_left(onnx.load(os.path.join(CORPUS, f"{name}.onnx")))
    expected = {"layernorm": layernorm, "rmsnorm": rmsnorm, "gelu": gelu, "silu": silu, "attention": attention}
    assert counts == {**expected, "rotary": rotary}


def test_both_exporters_give_the_same_function():
    """Same weights, same inputs: the legacy and dynamo exports of a model agree."""
    for kind in EXPECTED:
        legacy = onnx.load(os.path.join(CORPUS, f"{kind}_legacy.onnx"))
        dynamo = onnx.load(os.path.join(CORPUS, f"{kind}_dynamo.onnx"))
        feeds = feeds_for(legacy, 2, 7)
        np.testing.assert_allclose(run(legacy, feeds)[0], run(dynamo, feeds)[0], rtol=1e-4, atol=1e-5)
    for kind in ("gpt2", "llama"):
        legacy = onnx.load(os.path.join(CORPUS, f"{kind}_legacy_past.onnx"))
        dynamo = onnx.load(os.path.join(CORPUS, f"{kind}_dynamo_past.onnx"))
        feeds = past_feeds(legacy, 2, 5, 3)
        for expected, actual in zip(run(legacy, feeds), run(dynamo, feeds), strict=True):
            np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)


X = ("x", np.float32, [2, 8])
Y = ("y", np.float32, [2, 8])
MEAN = [np.array([-1], dtype=np.int64)]


def counts_of(nodes, initializers=None, outputs=(Y,), extra_opsets=None):
    inits = {"axes": MEAN[0], "two": np.array(2.0, np.float32), **(initializers or {})}
    return patterns_left(make_model(nodes, [X], list(outputs), inits, opset=18, extra_opsets=extra_opsets))


def test_decomposed_layernorm_is_a_layernorm_not_an_rmsnorm():
    nodes = [
        helper.make_node("ReduceMean", ["x", "axes"], ["m"]),
        helper.make_node("Sub", ["x", "m"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["p"]),
        helper.make_node("ReduceMean", ["p", "axes"], ["v"]),
        helper.make_node("Add", ["d", "v"], ["y"]),
    ]
    assert counts_of(nodes) == {"layernorm": 1, "rmsnorm": 0, "gelu": 0, "silu": 0, "attention": 0, "rotary": 0}


def test_rmsnorm_squares_by_pow_2_or_by_mul_with_itself():
    by_pow = [helper.make_node("Pow", ["x", "two"], ["p"]), helper.make_node("ReduceMean", ["p", "axes"], ["v"])]
    by_mul = [helper.make_node("Mul", ["x", "x"], ["p"]), helper.make_node("ReduceMean", ["p", "axes"], ["v"])]
    for nodes in (by_pow, by_mul):
        nodes = nodes + [helper.make_node("Mul", ["x", "v"], ["y"])]
        assert counts_of(nodes)["rmsnorm"] == 1
    cube = [
        helper.make_node("Pow", ["x", "three"], ["p"]),
        helper.make_node("ReduceMean", ["p", "axes"], ["v"]),
        helper.make_node("Mul", ["x", "v"], ["y"]),
    ]
    assert counts_of(cube, {"three": np.array(3.0, np.float32)})["rmsnorm"] == 0


def test_silu_needs_the_sigmoids_own_input_in_the_mul():
    silu = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["s", "x"], ["y"])]
    gate = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["s", "w"], ["y"])]
    assert counts_of(silu)["silu"] == 1
    assert counts_of(gate, {"w": np.ones((2, 8), np.float32)})["silu"] == 0


def test_rotary_is_a_negated_half_first_in_a_concat():
    halves = {"zero": np.array([0], np.int64), "four": np.array([4], np.int64), "eight": np.array([8], np.int64)}
    split = [
        helper.make_node("Slice", ["x", "zero", "four", "last"], ["first"]),
        helper.make_node("Slice", ["x", "four", "eight", "last"], ["second"]),
        helper.make_node("Neg", ["second"], ["negated"]),
    ]
    inits = {**halves, "last": np.array([-1], np.int64)}
    rotate_half = split + [helper.make_node("Concat", ["negated", "first"], ["y"], axis=-1)]
    other_order = split + [helper.make_node("Concat", ["first", "negated"], ["y"], axis=-1)]
    assert counts_of(rotate_half, inits)["rotary"] == 1
    assert counts_of(other_order, inits)["rotary"] == 0


def test_fused_operators_in_other_domains_are_not_counted():
    nodes = [
        helper.make_node("Erf", ["x"], ["e"]),
        helper.make_node("Softmax", ["e"], ["s"]),
        helper.make_node("Gelu", ["s"], ["y"], domain="com.microsoft"),
    ]
    model = make_model(nodes, [X], [Y], opset=18, extra_opsets={"com.microsoft": 1}, check=False)
    assert patterns_left(model) == {"layernorm": 0, "rmsnorm": 0, "gelu": 1, "silu": 0, "attention": 1, "rotary": 0}


def test_patterns_inside_subgraphs_are_counted():
    branch = helper.make_graph(
        [helper.make_node("Tanh", ["x"], ["t"])], "branch", [], [helper.make_tensor_value_info("t", 1, [2, 8])]
    )
    nodes = [helper.make_node("If", ["b"], ["y"], then_branch=branch, else_branch=branch)]
    model = make_model(nodes, [X, ("b", np.bool_, [])], [Y], opset=18)
    assert patterns_left(model)["gelu"] == 2
