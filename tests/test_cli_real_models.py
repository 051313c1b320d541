"""Real models with default settings: check inputs that run, checks that mean something.

Small stand-ins of the shapes real exports have: a BERT-like graph (embedding tables indexed
by the inputs, a 2-row token-type table, an attention mask, a sequence length the position
table fixes) and a YOLO-like detector (symbolic height and width, a stride-2 Conv and a Resize
back up, which cannot run on a 1x1 image). The tiny torch exports in tests/data/transformers
are used when present.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from fuser.verify import (
    Checker,
    CheckOptions,
    dims_read_by_weights,
    index_ranges,
    session,
    shape_candidates,
    synthesize_inputs,
)
from tests.helpers import in_process_cli, make_model

EXPORTS = Path(__file__).parent / "data" / "transformers"
HIDDEN = 8
POSITIONS = 16


def bert_like(vocabulary: int = 50) -> onnx.ModelProto:
    """Embeddings of input_ids and token_type_ids plus a [POSITIONS, HIDDEN] position table, masked,
    then MatMul + Add (a rewrite for the check to verify)."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Gather", ["words", "input_ids"], ["word_embedding"]),
        helper.make_node("Cast", ["token_type_ids"], ["types_int32"], to=onnx.TensorProto.INT32),
        helper.make_node("Gather", ["token_types", "types_int32"], ["type_embedding"]),
        helper.make_node("Add", ["word_embedding", "type_embedding"], ["summed"]),
        helper.make_node("Add", ["summed", "positions"], ["embedded"]),  # only broadcasts for POSITIONS tokens
        helper.make_node("Cast", ["attention_mask"], ["mask_float"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_float", "last_axis"], ["mask_column"]),
        helper.make_node("Mul", ["embedded", "mask_column"], ["masked"]),
        helper.make_node("Reshape", ["masked", "rows"], ["flat"]),
        helper.make_node("MatMul", ["flat", "dense_w"], ["projected"]),
        helper.make_node("Add", ["projected", "dense_b"], ["logits"]),
    ]
    return make_model(
        nodes,
        [
            ("input_ids", np.int64, ["batch", "sequence"]),
            ("token_type_ids", np.int64, ["batch", "sequence"]),
            ("attention_mask", np.int64, ["batch", "sequence"]),
        ],
        [("logits", np.float32, [None, HIDDEN])],
        {
            "words": rng.standard_normal((vocabulary, HIDDEN)).astype(np.float32),
            "token_types": rng.standard_normal((2, HIDDEN)).astype(np.float32),
            "positions": rng.standard_normal((POSITIONS, HIDDEN)).astype(np.float32),
            "last_axis": np.array([-1], np.int64),
            "rows": np.array([-1, HIDDEN], np.int64),
            "dense_w": rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32),
            "dense_b": rng.standard_normal(HIDDEN).astype(np.float32),
        },
    )


def yolo_like() -> onnx.ModelProto:
    """Conv -> BatchNormalization, a stride-2 branch resized back up and concatenated: on a 1x1 image
    the halves are 1x1 and 2x2 and Concat refuses them."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Conv", ["images", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "scale", "shift", "mean", "var"], ["b1"]),
        helper.make_node("Conv", ["b1", "w2"], ["down"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Resize", ["down", "", "factors"], ["up"], mode="nearest"),
        helper.make_node("Concat", ["b1", "up"], ["features"], axis=1),
    ]
    return make_model(
        nodes,
        [("images", np.float32, ["batch", 3, "height", "width"])],
        [("features", np.float32, ["batch", 8, "height", "width"])],
        {
            "w1": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
            "scale": rng.uniform(0.5, 1.5, 4).astype(np.float32),
            "shift": rng.standard_normal(4).astype(np.float32),
            "mean": rng.standard_normal(4).astype(np.float32),
            "var": rng.uniform(0.5, 1.5, 4).astype(np.float32),
            "w2": rng.standard_normal((4, 4, 3, 3)).astype(np.float32),
            "factors": np.array([1, 1, 2, 2], np.float32),
        },
    )


@pytest.fixture
def cli(monkeypatch, capfd):
    return in_process_cli(monkeypatch, capfd)


# --------------------------------------------------------------------------- inputs that run


def test_embedding_indices_stay_inside_the_smallest_table():
    model = bert_like()
    assert index_ranges(model) == {"input_ids": (0, 50), "token_type_ids": (0, 2)}
    feeds = synthesize_inputs(
        session(model),
        shapes={n: (1, 64) for n in ("input_ids", "token_type_ids", "attention_mask")},
        ranges=index_ranges(model),
    )
    assert set(np.unique(feeds["token_type_ids"])) <= {0, 1} and feeds["input_ids"].max() < 50
    assert feeds["input_ids"].max() >= 10  # the whole table, not the old [0, 10)
    assert (feeds["attention_mask"] == 1).all()


def test_an_index_reaching_two_tables_is_bounded_by_the_smaller():
    model = make_model(
        [
            helper.make_node("Gather", ["big", "ids"], ["a"]),
            helper.make_node("Unsqueeze", ["ids", "axes"], ["ids2"]),
            helper.make_node("Gather", ["small", "ids2"], ["b"]),
        ],
        [("ids", np.int64, [4])],
        [("a", np.float32, [4, 2]), ("b", np.float32, [1, 4, 2])],
        {"big": np.zeros((100, 2), np.float32), "small": np.zeros((3, 2), np.float32), "axes": np.array([0])},
    )
    assert index_ranges(model) == {"ids": (0, 3)}


def test_codes_offset_into_one_shared_table_stay_inside_it():
    """Audio codebooks (and recommenders) share one table: book k's codes are offset by k * 64
    before the lookup, so the codes themselves go up to 64 of its 256 rows."""
    model = make_model(
        [
            helper.make_node("Add", ["codes", "offsets"], ["shifted"]),
            helper.make_node("Gather", ["table", "shifted"], ["embedded"]),
            helper.make_node("Sub", ["codes", "minus_one"], ["plus_one"]),
            helper.make_node("Gather", ["small", "plus_one"], ["other"]),
        ],
        [("codes", np.int64, [1, 4, "frames"])],
        [("embedded", np.float32, None), ("other", np.float32, None)],
        {
            "offsets": (np.arange(4, dtype=np.int64) * 64).reshape(1, 4, 1),
            "table": np.zeros((256, 2), np.float32),
            "minus_one": np.array(-1, np.int64),
            "small": np.zeros((300, 2), np.float32),
        },
        check=False,
    )
    assert index_ranges(model) == {"codes": (0, 64)}
    assert Checker(model).input_shapes == {"codes": (1, 4, 128)}


def embedding_in_a_branch() -> onnx.ModelProto:
    """token ids read by an If's branches by name, each gathering from a table of 2 rows (kept in
    the main graph, and in the branch's own initializers)."""

    def branch(name: str, table: str, initializers=()) -> onnx.GraphProto:
        return helper.make_graph(
            [
                helper.make_node("Gather", [table, "ids"], [f"{name}_rows"]),
                helper.make_node("Identity", [f"{name}_rows"], [f"{name}_y"]),
            ],
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_y", onnx.TensorProto.FLOAT, [1, 8, 4])],
            list(initializers),
        )

    own = onnx.numpy_helper.from_array(np.ones((2, 4), np.float32), "own_table")
    model = make_model(
        [
            helper.make_node(
                "If",
                ["cond"],
                ["y"],
                then_branch=branch("then", "table"),
                else_branch=branch("else", "own_table", [own]),
            )
        ],
        [("ids", np.int64, [1, 8]), ("cond", np.bool_, [])],
        [("y", np.float32, [1, 8, 4])],
        {"table": np.arange(8, dtype=np.float32).reshape(2, 4)},
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def test_indices_read_inside_a_branch_stay_inside_its_table(cli, tmp_path):
    """The check drew token ids from [0, 10) for a table of 2 rows and could not run the original."""
    model = embedding_in_a_branch()
    assert index_ranges(model) == {"ids": (0, 2)}
    onnx.save(model, tmp_path / "m.onnx")
    result = cli(tmp_path, "optimize", "m.onnx")
    assert result.returncode == 0, result.stderr
    assert "identity-output" in result.stderr and "numerics check: passed" in result.stderr


def test_a_body_s_own_input_of_the_same_name_is_another_tensor():
    """A Loop body's input named like the outer ids, gathering from a table of 2 rows: the outer
    ids index a table of 1000, and only those 2 would have been drawn."""
    body = helper.make_graph(
        [
            helper.make_node("Gather", ["small", "ids"], ["rows"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Identity", ["ids"], ["ids_out"]),
            helper.make_node("ReduceSum", ["rows"], ["total"], keepdims=0),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", onnx.TensorProto.BOOL, []),
            helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1, 8]),
        ],
        [
            helper.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []),
            helper.make_tensor_value_info("ids_out", onnx.TensorProto.INT64, [1, 8]),
            helper.make_tensor_value_info("total", onnx.TensorProto.FLOAT, []),
        ],
    )
    model = make_model(
        [
            helper.make_node("Gather", ["big", "ids"], ["y"]),
            helper.make_node("Loop", ["trip", "", "zeros"], ["final", "totals"], body=body),
        ],
        [("ids", np.int64, [1, 8])],
        [("y", np.float32, [1, 8, 4]), ("totals", np.float32, [2])],
        {
            "big": np.ones((1000, 4), np.float32),
            "small": np.ones((2, 4), np.float32),
            "trip": np.array(2, np.int64),
            "zeros": np.zeros((1, 8), np.int64),
        },
    )
    onnx.checker.check_model(model, full_check=True)
    assert index_ranges(model) == {"ids": (0, 1000)}


def test_a_sequence_length_the_model_fixes_is_found_and_the_batch_stays_1():
    checker = Checker(bert_like())
    assert checker.input_shapes == {
        "input_ids": (1, POSITIONS),
        "token_type_ids": (1, POSITIONS),
        "attention_mask": (1, POSITIONS),
    }
    assert checker.warnings == []


def test_symbolic_image_dims_get_a_size_the_detector_runs_on():
    model = yolo_like()
    candidates = shape_candidates(session(model), model)
    assert candidates[0] == {"images": (1, 3, 224, 224)} and candidates[-1] == {"images": (1, 3, 1, 1)}
    with pytest.raises(Exception, match="Concat|concat"):
        Checker(model, CheckOptions(shapes={"images": (1, 3, 1, 1)}))  # what fuser used to try
    assert Checker(model).input_shapes == {"images": (1, 3, 224, 224)}


def test_a_free_channel_axis_takes_the_channels_the_first_convolution_reads():
    """transformers' vision exports leave axis 1 free (`num_channels`); normalized (Sub, Div)
    and read by a Conv of 3 input channels, it is 3, not a sequence length."""
    rng = np.random.default_rng(2)
    model = make_model(
        [
            helper.make_node("Sub", ["pixel_values", "mean"], ["centred"]),
            helper.make_node("Div", ["centred", "std"], ["normalized"]),
            helper.make_node("Conv", ["normalized", "w"], ["features"], strides=[4, 4]),
            helper.make_node("MatMul", ["tokens", "proj"], ["projected"]),
        ],
        [
            ("pixel_values", np.float32, ["batch", "num_channels", "height", "width"]),
            ("tokens", np.float32, ["batch", "sequence", None]),
        ],
        [("features", np.float32, None), ("projected", np.float32, None)],
        {
            "mean": np.full((1, 3, 1, 1), 0.5, np.float32),
            "std": np.full((1, 3, 1, 1), 0.25, np.float32),
            "w": rng.standard_normal((8, 3, 4, 4)).astype(np.float32),
            "proj": rng.standard_normal((12, 5)).astype(np.float32),
        },
        check=False,
    )
    assert dims_read_by_weights(model) == {"num_channels": 3, "tokens:2": 12}
    assert Checker(model).input_shapes == {"pixel_values": (1, 3, 224, 224), "tokens": (1, 128, 12)}
    assert Checker(model, CheckOptions(dims={"num_channels": 3, "height": 32, "width": 32})).input_shapes[
        "pixel_values"
    ] == (1, 3, 32, 32)


def test_an_image_size_in_the_metadata_comes_first():
    model = yolo_like()
    helper.set_model_props(model, {"imgsz": "[64, 64]"})
    assert Checker(model).input_shapes == {"images": (1, 3, 64, 64)}


def test_user_dims_and_shapes_win():
    model = yolo_like()
    assert Checker(model, CheckOptions(dims={"height": 32, "width": 64})).input_shapes == {"images": (1, 3, 32, 64)}
    assert Checker(model, CheckOptions(shapes={"images": (2, 3, 16, 16)})).input_shapes == {"images": (2, 3, 16, 16)}


def test_a_dim_written_as_a_sum_follows_its_parts():
    model = make_model(
        [helper.make_node("Concat", ["past", "new"], ["all"], axis=1), helper.make_node("Mul", ["all", "mask"], ["y"])],
        [
            ("past", np.float32, ["batch", "past_len"]),
            ("new", np.float32, ["batch", "seq"]),
            ("mask", np.float32, ["batch", "past_len + seq"]),
        ],
        [("y", np.float32, ["batch", None])],
    )
    shapes = Checker(model).input_shapes
    assert shapes["mask"][1] == shapes["past"][1] + shapes["new"][1] == 256


def kv_mask_model(mask_dim: str, total: str | None) -> onnx.ModelProto:
    """A KV cache [batch, 2, past_len, 4] concatenated with new keys [batch, 2, seq, 4], summed
    over the last axis and times a mask [batch, mask_dim] whose length must be past_len + seq;
    token ids [batch, seq] as well. The output's length is named `total` (None: not stated)."""
    return make_model(
        [
            helper.make_node("Concat", ["past", "new"], ["all"], axis=2),
            helper.make_node("ReduceSum", ["all", "last"], ["summed"], keepdims=0),
            helper.make_node("Unsqueeze", ["mask", "heads_axis"], ["mask_3d"]),
            helper.make_node("Mul", ["summed", "mask_3d"], ["y"]),
            helper.make_node("Cast", ["ids"], ["ids_float"], to=onnx.TensorProto.FLOAT),
            helper.make_node("ReduceSum", ["ids_float"], ["id_sum"], keepdims=0),
        ],
        [
            ("ids", np.int64, ["batch", "seq"]),
            ("mask", np.float32, ["batch", mask_dim]),
            ("past", np.float32, ["batch", 2, "past_len", 4]),
            ("new", np.float32, ["batch", 2, "seq", 4]),
        ],
        [("y", np.float32, ["batch", 2, total]), ("id_sum", np.float32, [])],
        {"last": np.array([-1], np.int64), "heads_axis": np.array([1], np.int64)},
    )


def test_a_lone_dim_takes_the_sum_the_outputs_state():
    model = kv_mask_model("s53", "past_len + seq")
    candidates = shape_candidates(session(model), model, dims={"past_len": 5})
    first = {"ids": (1, 128), "mask": (1, 128), "past": (1, 2, 5, 4), "new": (1, 2, 128, 4)}
    assert candidates[:2] == [first, {**first, "mask": (1, 133)}]  # the same sizes, then the stated sum
    shapes = Checker(model, CheckOptions(dims={"past_len": 5})).input_shapes
    assert shapes == {**first, "mask": (1, 133)}


def test_a_lone_dim_no_output_explains_tries_sums_of_other_sizes():
    model = kv_mask_model("s53", None)
    with pytest.raises(Exception, match="cannot run"):
        Checker(
            model,
            CheckOptions(shapes={"ids": (1, 128), "mask": (1, 128), "past": (1, 2, 224, 4), "new": (1, 2, 128, 4)}),
        )
    # the cache's length is an image-like axis 2 of a 4-D input (224), the new tokens' 128
    shapes = Checker(model).input_shapes
    assert shapes == {"ids": (1, 128), "mask": (1, 352), "past": (1, 2, 224, 4), "new": (1, 2, 128, 4)}


def test_dims_that_repeat_or_name_a_sum_are_not_lone():
    model = kv_mask_model("s53", "past_len + seq")
    candidates = shape_candidates(session(model), model)
    assert {c["new"][2] for c in candidates} == {c["ids"][1] for c in candidates} == {128, 64, 32, 16, 512, 1}
    assert all(c["new"][2] == c["ids"][1] for c in candidates)  # seq is in two inputs: never varied alone
    assert {c["past"][2] for c in candidates} == {224, 640, 320, 64, 32, 1}  # image-like, and a part of the sum
    assert (1, 352) in {c["mask"] for c in candidates}
    unstated = kv_mask_model("s53", None)
    # With no sum stated, past_len is still not lone: an image-like axis (2 of a 4-D input).
    assert {c["past"][2] for c in shape_candidates(session(unstated), unstated)} == {224, 640, 320, 64, 32, 1}


def raw_audio_model(batch: str = "batch", state_batch: str = "batch", width: int = 256) -> onnx.ModelProto:
    """Samples [batch, samples] through a `width`-wide strided convolution (a learned STFT), and a
    recurrent state [2, batch, 4] whose first layer is concatenated to the frames' features."""
    rng = np.random.default_rng(0)
    return make_model(
        [
            helper.make_node("Unsqueeze", ["input", "one"], ["channels"]),
            helper.make_node("Conv", ["channels", "basis"], ["frames"], strides=[128]),
            helper.make_node("ReduceMean", ["frames"], ["features"], axes=[2], keepdims=0),
            helper.make_node("Gather", ["state", "zero"], ["layer"], axis=0),
            helper.make_node("Concat", ["features", "layer"], ["y"], axis=1),
        ],
        [("input", np.float32, [batch, "samples"]), ("state", np.float32, [2, state_batch, 4])],
        [("y", np.float32, [batch, 8])],
        {
            "one": np.array([1], np.int64),
            "basis": rng.standard_normal((4, 1, width)).astype(np.float32),
            "zero": np.array(0, np.int64),
        },
    )


def test_raw_audio_gets_a_window_the_convolution_fits():
    # Token counts (128 down to 16) are shorter than the convolution: 512 samples come next.
    assert Checker(raw_audio_model()).input_shapes == {"input": (1, 512), "state": (2, 1, 4)}


def test_an_unnamed_dim_of_a_recurrent_state_may_be_its_batch():
    # Silero VAD names no dim: state [2, ?, 4] is read as a sequence first, and fits only as 1.
    model = raw_audio_model(batch="", state_batch="")
    assert Checker(model).input_shapes == {"input": (1, 512), "state": (2, 1, 4)}


def test_when_no_shape_fits_the_error_says_how_to_give_them():
    model = raw_audio_model(width=1024)  # longer than every size tried
    with pytest.raises(Exception, match=r"input shapes fuser tried; give the sizes the model takes with --dim"):
        Checker(model)
    assert Checker(model, CheckOptions(dims={"samples": 1024})).input_shapes["input"] == (1, 1024)
    with pytest.raises(Exception, match=r"cannot run on these inputs \(input\[1,100\], state\[2,1,4\]\): [^(]*$"):
        Checker(model, CheckOptions(shapes={"input": (1, 100), "state": (2, 1, 4)}))


def test_a_shape_given_binds_its_symbols_for_the_others():
    model = kv_mask_model("s53", "past_len + seq")
    given = {"ids": (1, 1)}
    shapes = Checker(model, CheckOptions(shapes=given)).input_shapes
    assert shapes["new"] == (1, 2, 1, 4) and shapes["mask"] == (1, shapes["past"][2] + 1)


def test_a_stated_dim_that_is_not_a_sum_is_not_tried():
    model = kv_mask_model("s53", "past_len - seq - 1")
    assert Checker(model).input_shapes["mask"] == (1, 352)  # the sums of the other sizes


def test_optimize_a_detector_with_symbolic_image_dims_by_default(cli, tmp_path):
    onnx.save(yolo_like(), tmp_path / "detector.onnx")
    result = cli(tmp_path, "optimize", "detector.onnx", "--report", "r.json")
    assert result.returncode == 0, result.stderr
    assert "numerics check: passed on images[1,3,224,224], 1 outputs" in result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["numerics"]["input_shapes"] == {"images": [1, 3, 224, 224]}
    assert report["op_types_before"]["BatchNormalization"] == 1 and "BatchNormalization" not in report["op_types_after"]
    assert report["size_before"] == (tmp_path / "detector.onnx").stat().st_size
    assert report["size_after"] == (tmp_path / "detector.fused.onnx").stat().st_size
    assert "  BatchNormalization       1 -> 0" in result.stderr and "size on disk: " in result.stderr


def test_optimize_a_bert_like_model_by_default(cli, tmp_path):
    onnx.save(bert_like(vocabulary=30), tmp_path / "bert.onnx")
    result = cli(tmp_path, "optimize", "bert.onnx")
    assert result.returncode == 0, result.stderr
    assert (
        "numerics check: passed on input_ids[1,16], token_type_ids[1,16], attention_mask[1,16] "
        "(again with the last row of attention_mask half padded), 1 outputs" in result.stderr
    )
    assert "warning" not in result.stderr


@pytest.mark.parametrize(
    "name",
    ["bert_legacy", "bert_dynamo", "gpt2_legacy", "gpt2_dynamo", "vit_legacy", "vit_dynamo", "llama_legacy"]
    + [f"{kind}_{exporter}_past" for kind in ("gpt2", "llama") for exporter in ("legacy", "dynamo")],
)
def test_tiny_torch_exports_get_inputs_they_run_on(name):
    path = EXPORTS / f"{name}.onnx"
    assert path.exists(), f"{path}: the committed export is missing (tests/data/make_transformers.py makes it)"
    model = onnx.load(path)
    checker = Checker(model, base_dir=path.parent)
    assert checker.check(model, exact=True).passed
    assert checker.warnings == []
    if "token_type_ids" in checker.input_shapes:
        assert set(np.unique(checker.feeds[0]["token_type_ids"])) <= {0, 1}
    if "attention_mask" in checker.input_shapes:
        assert (checker.feeds[0]["attention_mask"] == 1).all()
    assert all(d > 1 for shape in checker.input_shapes.values() for d in shape[1:])
    if name.endswith("_past"):  # the mask spans the cache and the new tokens
        past, sequence = checker.input_shapes["past_key_values.0.key"][2], checker.input_shapes["input_ids"][1]
        assert checker.input_shapes["attention_mask"] == (1, past + sequence)


def test_optimize_a_dynamo_kv_cache_export_by_default(cli, tmp_path):
    """The dynamo exporter names a KV-cache mask's length with a symbol of its own (s53); the
    check still finds inputs it runs on, and the attention with the cache is fused."""
    source = EXPORTS / "llama_dynamo_past.onnx"
    assert [d.dim_param for d in onnx.load(source).graph.input[1].type.tensor_type.shape.dim][1].startswith("s")
    (tmp_path / "llama.onnx").write_bytes(source.read_bytes())
    result = cli(tmp_path, "optimize", "llama.onnx", "--target", "onnxruntime", "--report", "r.json")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    shapes = report["numerics"]["input_shapes"]
    assert shapes["attention_mask"][1] == shapes["input_ids"][1] + shapes["past_key_values.1.value"][2]
    assert report["numerics"]["passed"] and report["rule_counts"]["attention-multihead"] == 2


# --------------------------------------------------------------------------- checks that mean something


def test_outputs_blind_to_the_inputs_and_non_finite_outputs_are_warned_about(cli, tmp_path):
    model = make_model(
        [
            helper.make_node("MatMul", ["x", "w"], ["product"]),
            helper.make_node("Add", ["product", "b"], ["y"]),
            helper.make_node("Shape", ["x"], ["size"]),
            helper.make_node("Abs", ["x"], ["magnitude"]),
            helper.make_node("Neg", ["magnitude"], ["negative"]),
            helper.make_node("Sub", ["negative", "b"], ["below"]),
            helper.make_node("Log", ["below"], ["nan"]),
        ],
        [("x", np.float32, [2, 3])],
        [("y", np.float32, [2, 3]), ("size", np.int64, [2]), ("nan", np.float32, [2, 3])],
        {"w": np.eye(3, dtype=np.float32), "b": np.ones(3, np.float32)},
    )
    blind = "is the same for different inputs (constant or independent of them)"
    warnings = Checker(model).warnings
    assert len(warnings) == 3, warnings
    assert warnings[0] == "output 'nan' is entirely inf/NaN on the check inputs"
    assert f"output 'size' {blind}" in warnings[1] and f"output 'nan' {blind}" in warnings[2]
    assert not Checker(model, CheckOptions(runs=2)).warnings[0].startswith("output 'y'")
    onnx.save(model, tmp_path / "m.onnx")
    result = cli(tmp_path, "optimize", "m.onnx", "--report", "r.json")
    assert result.returncode == 0, result.stderr
    assert "numerics check: passed on x[2,3]" in result.stderr
    assert f"  warning: output 'size' {blind}" in result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["numerics"]["warnings"] == warnings


def test_a_model_that_computes_nothing_on_normal_values_is_checked_on_positive_ones():
    """The log of a power spectrogram is NaN for every negative input: on standard-normal values
    every output is NaN and a wrong rewrite would compare equal. Positive values are tried next."""
    model = make_model(
        [helper.make_node("Log", ["power"], ["logged"]), helper.make_node("ReduceSum", ["logged"], ["y"])],
        [("power", np.float32, [1, 64])],
        [("y", np.float32, [1, 1])],
    )
    checker = Checker(model)
    assert checker.warnings == []
    assert (checker.feeds[0]["power"] >= 0).all() and np.isfinite(checker.expected[0]["y"]).all()


def test_a_count_of_zero_that_empties_every_output_is_tried_from_1():
    """TopK's k drawn from [0, 10) may be 0, which leaves both outputs empty."""
    model = make_model(
        [helper.make_node("TopK", ["x", "k"], ["values", "indices"])],
        [("x", np.float32, [1, 32]), ("k", np.int64, [1])],
        [("values", np.float32, [1, None]), ("indices", np.int64, [1, None])],
    )
    for seed in range(4):
        checker = Checker(model, CheckOptions(seed=seed))
        assert checker.expected[0]["values"].size and checker.warnings == [], seed


def test_a_model_no_typical_size_fits_is_checked_at_size_1_with_a_warning():
    """A positional table of exactly 3 rows: none of the sizes tried fits, size 1 broadcasts."""
    model = make_model(
        [helper.make_node("Add", ["frames", "positions"], ["y"])],
        [("frames", np.float32, ["batch", "length", 4])],
        [("y", np.float32, ["batch", 3, 4])],
        {"positions": np.zeros((3, 4), np.float32)},
    )
    checker = Checker(model)
    assert checker.input_shapes == {"frames": (1, 1, 4)}
    assert checker.warnings[0].startswith("every free size but the batch is 1 on the check inputs")
    assert Checker(model, CheckOptions(dims={"length": 3})).warnings == []


def test_a_first_axis_named_like_a_sequence_is_not_a_batch():
    """nn.LSTM's default layout is [time, batch, features]: time is a sequence, checked at length."""
    model = make_model(
        [helper.make_node("ReduceSum", ["features", "axes"], ["y"], keepdims=0)],
        [("features", np.float32, ["time", "batch", 16])],
        [("y", np.float32, None)],
        {"axes": np.array([0], np.int64)},
        check=False,
    )
    assert Checker(model).input_shapes == {"features": (128, 1, 16)}


def test_a_float_attention_mask_is_ones_and_then_padded_and_a_uint8_image_spans_its_pixels():
    model = make_model(
        [
            helper.make_node("Mul", ["hidden", "attention_mask"], ["masked"]),
            helper.make_node("Cast", ["image"], ["pixels"], to=onnx.TensorProto.FLOAT),
            helper.make_node("ReduceMax", ["pixels"], ["brightest"], keepdims=0),
        ],
        [
            ("hidden", np.float32, [1, 16]),
            ("attention_mask", np.float32, [1, 16]),
            ("image", np.uint8, [1, 3, 32, 32]),
        ],
        [("masked", np.float32, [1, 16]), ("brightest", np.float32, [])],
    )
    checker = Checker(model)
    assert (checker.feeds[0]["attention_mask"] == 1).all() and checker.padded_masks == ["attention_mask"]
    assert checker.feeds[1]["attention_mask"][0, 8:].max() == 0
    assert checker.feeds[0]["image"].max() > 200


def test_an_input_of_a_type_no_input_is_made_of_is_said_to_be_so_at_once():
    model = make_model(
        [helper.make_node("SequenceLength", ["pieces"], ["count"])],
        [],
        [("count", np.int64, [])],
        check=False,
    )
    model.graph.input.append(helper.make_tensor_sequence_value_info("pieces", onnx.TensorProto.FLOAT, ["n", 4]))
    with pytest.raises(
        Exception,
        match=r"^input 'pieces' has type seq\(tensor\(float\)\), which fuser cannot make up: run with --no-check",
    ) as refused:
        Checker(model)
    assert "input shapes fuser tried" not in str(refused.value)


def test_a_key_padding_mask_marks_no_padding_and_then_the_last_row_s_second_half():
    """torch's key_padding_mask is True where a position is padding (nn.TransformerEncoder):
    all True would mask every key and leave the attention NaN."""
    model = make_model(
        [
            helper.make_node("Cast", ["src_key_padding_mask"], ["padding"], to=onnx.TensorProto.FLOAT),
            helper.make_node("Add", ["scores", "padding"], ["y"]),
        ],
        [("scores", np.float32, [2, 8]), ("src_key_padding_mask", np.bool_, [2, 8])],
        [("y", np.float32, [2, 8])],
    )
    checker = Checker(model)
    first, padded = (feeds["src_key_padding_mask"] for feeds in checker.feeds)
    assert not first.any() and padded[-1, 4:].all() and not padded[-1, :4].any() and not padded[0].any()


def test_an_unnamed_first_axis_of_an_input_named_like_time_is_a_batch():
    """SDXL's `time_ids` [unnamed, 6]: the input's name says nothing of its first axis."""
    model = make_model(
        [helper.make_node("Relu", ["time_ids"], ["y"])],
        [("time_ids", np.float32, [None, 6])],
        [("y", np.float32, [None, 6])],
    )
    checker = Checker(model)
    assert checker.input_shapes == {"time_ids": (1, 6)} and checker.warnings == []


def test_a_label_that_picks_from_computed_logits_stays_inside_them():
    """A loss's GatherElements(logits, label): the logits are computed, 5 classes by inference."""
    model = make_model(
        [
            helper.make_node("MatMul", ["x", "w"], ["logits"]),
            helper.make_node("Unsqueeze", ["label", "axes"], ["picked_at"]),
            helper.make_node("GatherElements", ["logits", "picked_at"], ["picked"], axis=1),
        ],
        [("x", np.float32, [1, 16]), ("label", np.int64, [1])],
        [("picked", np.float32, [1, 1])],
        {"w": np.ones((16, 5), np.float32), "axes": np.array([1], np.int64)},
    )
    assert index_ranges(model) == {"label": (0, 5)}
    for seed in range(4):
        assert Checker(model, CheckOptions(seed=seed, runs=3)).feeds[2]["label"].max() < 5


def test_a_length_at_which_every_output_overflows_gives_way_to_the_next():
    """Exp of a sum over the sequence: inf at 128 tokens (|x| sums to about 100), finite at 64."""
    model = make_model(
        [
            helper.make_node("Abs", ["x"], ["magnitude"]),
            helper.make_node("ReduceSum", ["magnitude", "axes"], ["total"], keepdims=0),
            helper.make_node("Exp", ["total"], ["y"]),
        ],
        [("x", np.float32, [1, "sequence"])],
        [("y", np.float32, [1])],
        {"axes": np.array([1], np.int64)},
    )
    checker = Checker(model)
    assert checker.input_shapes == {"x": (1, 64)} and checker.warnings == []


def test_an_unnamed_axis_of_an_input_named_like_a_batch_is_not_one():
    model = make_model(
        [helper.make_node("Relu", ["batch_tokens"], ["y"])],
        [("batch_tokens", np.float32, [None, None])],
        [("y", np.float32, [None, None])],
    )
    assert Checker(model).input_shapes == {"batch_tokens": (1, 128)}
