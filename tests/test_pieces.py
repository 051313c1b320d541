"""The check's session of a large model, started in pieces side by side (fuser/pieces.py).

The limit on a piece's size is lowered here so that small models are cut. Every property the
check relies on is run in onnxruntime: the pieces give the whole model's outputs bit for bit,
the element types read from the schemas are the ones shape inference finds, a wrong rewrite is
still caught and blamed, and what is not cut, or fails in pieces, is the whole model's to tell.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import fuser
from fuser import pieces, verify
from fuser.errors import InputError, NumericsMismatch
from fuser.graph import opset_versions, split_parts
from fuser.pieces import PiecewiseSession, Wiring, element_types, started_in_pieces
from fuser.rules.conv_bn_fold import conv_bn_fold
from fuser.verify import CheckOptions, Checker, FedSession, WeightFeeds, run, session
from tests.helpers import make_model
from tests.test_blame import BAD_BLOCKS, chain_model, wrong_rule  # noqa: F401 - wrong_rule is a fixture

ROOT = Path(__file__).resolve().parent.parent
TRANSFORMERS = ROOT / "tests" / "data" / "transformers"
FLOAT16_MODEL = TRANSFORMERS / "bert_legacy_fp16.onnx"
CUT_MODELS = [
    ROOT / "models" / "resnet_small.onnx",
    TRANSFORMERS / "bert_legacy.onnx",
    TRANSFORMERS / "gpt2_dynamo.onnx",
    TRANSFORMERS / "gpt2_legacy_past.onnx",
    TRANSFORMERS / "llama_legacy.onnx",
    TRANSFORMERS / "vit_dynamo.onnx",
]
MODELS = [*CUT_MODELS, FLOAT16_MODEL]


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(pieces, "PIECE_NODES", 10)


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_element_types_are_the_ones_shape_inference_finds(path):
    original = onnx.load(path)
    optimized, _ = fuser.optimize(path, check=False)
    for model in (original, optimized):
        types = element_types(model.graph, opset_versions(model))
        inferred = onnx.shape_inference.infer_shapes(model)
        found = {
            v.name: v.type.tensor_type.elem_type
            for v in [*inferred.graph.value_info, *inferred.graph.output]
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type
        }
        outputs = [o for node in model.graph.node for o in node.output if o]
        assert sum(o in types for o in outputs) >= 0.9 * len(outputs)  # they type nearly every tensor
        assert {name: types[name] for name in found if name in types} == {
            name: found[name] for name in found if name in types
        }


@pytest.mark.parametrize("count", [2, 3, 4, 7, 16])
@pytest.mark.parametrize("path", CUT_MODELS, ids=lambda p: p.stem)
def test_the_pieces_give_the_whole_models_outputs_bit_for_bit(small_pieces, monkeypatch, path, count):
    monkeypatch.setattr(pieces, "MAX_PIECES", count)
    candidate, _ = fuser.optimize(path, check=False, weights_apart=True)
    checker = Checker(onnx.load(path), CheckOptions(runs=2), base_dir=path.parent)
    in_pieces = session(candidate, path.parent, in_pieces=True)
    whole = session(candidate, path.parent)
    nodes = len(split_parts(candidate)[0].graph.node)
    assert isinstance(in_pieces, PiecewiseSession) and in_pieces.pieces == min(count, nodes // pieces.PIECE_NODES)
    assert [s.name for s in in_pieces.get_inputs()] == [s.name for s in whole.get_inputs()]
    assert [s.name for s in in_pieces.get_outputs()] == [s.name for s in whole.get_outputs()]
    for feeds in checker.feeds:
        cut, expected = run(in_pieces, feeds), run(whole, feeds)
        assert list(cut) == list(expected)
        for name, value in expected.items():
            assert cut[name].dtype == value.dtype and cut[name].tobytes() == value.tobytes(), name
    assert not in_pieces.handed_over


def test_the_check_in_pieces_passes_a_correct_rewrite_and_blames_a_wrong_one(small_pieces, wrong_rule):  # noqa: F811
    model = chain_model()
    optimized, report = fuser.optimize(model, rules=[conv_bn_fold])
    assert report.verdict.passed and report.rewrites
    with pytest.raises(NumericsMismatch) as raised:
        fuser.optimize(model, rules=[wrong_rule[1], conv_bn_fold])
    assert {r.rule for r in raised.value.evidence["report"].blamed} == {"bn-fold-wrong-epsilon"}
    assert len(raised.value.evidence["report"].blamed) == BAD_BLOCKS


def chain(length: int, shared: bool = False, dtype=np.float32) -> onnx.ModelProto:
    """Add nodes in a chain, each adding its own constant, or all the same one."""
    nodes = [
        helper.make_node("Add", ["x" if i == 0 else f"r{i - 1}", "c" if shared else f"c{i}"], [f"r{i}"])
        for i in range(length)
    ]
    weights = {"c": np.ones(4, dtype)} if shared else {f"c{i}": np.full(4, i, dtype) for i in range(length)}
    return make_model(nodes, [("x", dtype, [2, 4])], [(f"r{length - 1}", dtype, [2, 4])], weights)


def cut(model: onnx.ModelProto):
    proto, initializers = split_parts(model)
    return started_in_pieces(proto, initializers, lambda piece: session(piece), lambda: session(model))


def test_a_chain_is_cut_into_as_many_pieces_as_its_size_allows(small_pieces, monkeypatch):
    assert cut(chain(15)) is None  # one piece's worth
    assert cut(chain(30)).pieces == 3
    # Past 64 pieces they stay as small: onnxruntime starts many small pieces sooner than fewer large ones.
    assert cut(chain(pieces.PIECE_NODES * 70)).pieces == 70
    monkeypatch.setattr(pieces, "MAX_PIECES", 8)
    assert cut(chain(pieces.PIECE_NODES * (pieces.MAX_PIECES + 4))).pieces == pieces.MAX_PIECES


@pytest.mark.parametrize("at_once", [1, 3])
def test_no_more_pieces_start_at_once_than_at_once_allows(small_pieces, monkeypatch, at_once):
    monkeypatch.setattr(pieces, "AT_ONCE", at_once)
    model = chain(120)
    proto, initializers = split_parts(model)
    starting, most, threads, lock = [0], [0], [], threading.Lock()
    before = threading.active_count()

    def start(piece):
        with lock:
            starting[0] += 1
            most[0] = max(most[0], starting[0])
            threads.append(threading.active_count() - before)
        try:
            time.sleep(0.1)  # long enough for the other workers to take their pieces
            return session(piece)
        finally:
            with lock:
                starting[0] -= 1

    cut_up = started_in_pieces(proto, initializers, start, lambda: session(model))
    assert cut_up.pieces == 12 and most[0] == at_once
    assert max(threads) <= at_once  # a thread for each piece starting at once, not one for each piece
    feeds = {"x": np.ones((2, 4), np.float32)}
    assert np.array_equal(cut_up.run(["r119"], feeds)[0], session(model).run(["r119"], feeds)[0])


def test_a_weight_read_on_both_sides_of_a_cut_is_copied_only_while_small(small_pieces, monkeypatch):
    assert cut(chain(40, shared=True)).pieces == 4
    monkeypatch.setattr(pieces, "SHARED_BYTES", 0)
    assert cut(chain(40, shared=True)) is None
    assert cut(chain(40)).pieces == 4
    # Room for one copy of the 16-byte weight: four pieces would copy it three times, two once.
    monkeypatch.setattr(pieces, "SHARED_BYTES", 16)
    assert cut(chain(40, shared=True)).pieces == 2
    assert cut(chain(30, shared=True)).pieces == 2  # three pieces were too many, and half of three is two


def in_pieces_differs(model: onnx.ModelProto, count: int) -> bool:
    """Whether `model` run in `count` pieces gives other bytes than the whole model."""
    proto, initializers = split_parts(model)
    graph = proto.graph
    wiring = Wiring(graph, initializers)
    types = element_types(graph, opset_versions(proto), wiring)
    feeds = Checker(model, CheckOptions()).feeds[0]
    expected = run(session(model), feeds)
    values = dict(feeds)
    for piece, reads, hands_on in pieces._pieces(
        proto, pieces.cut_positions(graph, count, types, wiring), types, wiring
    ):
        values.update(zip(hands_on, session(piece).run(hands_on, {n: values[n] for n in reads})))
    return any(values[name].tobytes() != value.tobytes() for name, value in expected.items())


def test_a_float16_model_is_not_cut_as_its_pieces_would_round_what_it_does_not(small_pieces, monkeypatch):
    model = onnx.load(FLOAT16_MODEL)
    assert session(model, FLOAT16_MODEL.parent, in_pieces=True).__class__ is not PiecewiseSession
    # onnxruntime computes some of the model's float16 operators in float32 and rounds to float16
    # only where a tensor leaves the graph, as each cut tensor does.
    monkeypatch.setattr(pieces, "_CUT_TYPES", pieces._CUT_TYPES | {TensorProto.FLOAT16})
    assert any(in_pieces_differs(model, count) for count in (2, 5, 7))


def test_a_cut_through_a_tensor_numpy_cannot_hold_is_not_made(small_pieces):
    assert cut(chain(40)).pieces == 4
    assert cut(chain(40, dtype=np.float16)) is None
    # A bfloat16 copy of the input, made first and read last, crosses every cut there could be.
    model = chain(40)
    last = model.graph.output[0].name
    model.graph.node[-1].output[0] = "pre"
    model.graph.node.insert(0, helper.make_node("Cast", ["x"], ["kept"], to=TensorProto.BFLOAT16))
    model.graph.node.append(helper.make_node("Cast", ["kept"], ["back"], to=TensorProto.FLOAT))
    model.graph.node.append(helper.make_node("Add", ["pre", "back"], [last]))
    onnx.checker.check_model(model, full_check=True)
    types = element_types(model.graph, opset_versions(model))
    assert types["kept"] == TensorProto.BFLOAT16 and types["back"] == TensorProto.FLOAT
    assert pieces.cut_positions(model.graph, 4, types) is None
    assert cut(model) is None


def test_models_with_bodies_or_overridable_weights_are_not_cut(small_pieces):
    model = chain(40)
    model.graph.input.append(helper.make_tensor_value_info("c3", TensorProto.FLOAT, [4]))
    assert cut(model) is None
    model = chain(40)
    output = helper.make_tensor_value_info("t", TensorProto.FLOAT, None)
    branch = helper.make_graph([helper.make_node("Identity", ["r0"], ["t"])], "b", [], [output])
    model.graph.node.append(helper.make_node("If", ["flag"], ["z"], then_branch=branch, else_branch=branch))
    assert cut(model) is None


def test_an_input_nothing_reads_is_still_an_input_of_the_pieces(small_pieces):
    model = chain(40)
    model.graph.input.append(helper.make_tensor_value_info("unused", TensorProto.FLOAT, [3]))
    in_pieces, whole = cut(model), session(model)
    assert [s.name for s in in_pieces.get_inputs()] == [s.name for s in whole.get_inputs()] == ["x", "unused"]
    feeds = {"x": np.ones((2, 4), np.float32), "unused": np.zeros(3, np.float32)}
    assert run(in_pieces, feeds)["r39"].tobytes() == run(whole, feeds)["r39"].tobytes()


def test_nodes_out_of_order_are_not_cut(small_pieces):
    model = chain(40)
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    assert pieces.cut_positions(model.graph, 4, element_types(model.graph, opset_versions(model))) is None


def test_a_run_that_fails_in_pieces_is_the_whole_models_to_report(small_pieces):
    # Reshape to a shape the model's input decides: a wrong size fails at run time, in a piece.
    model = chain(40)
    model.graph.input.append(helper.make_tensor_value_info("shape", TensorProto.INT64, [2]))
    last = model.graph.node[-1].output[0]
    model.graph.node[-1].output[0] = "pre"
    model.graph.node.append(helper.make_node("Reshape", ["pre", "shape"], [last]))
    in_pieces, whole = cut(model), session(model)
    x = np.ones((2, 4), np.float32)
    good = {"x": x, "shape": np.array([4, 2], np.int64)}
    assert run(in_pieces, good)[last].tobytes() == run(whole, good)[last].tobytes()
    assert not in_pieces.handed_over
    bad = {"x": x, "shape": np.array([3, 3], np.int64)}
    with pytest.raises(Exception) as expected:
        run(whole, bad)
    with pytest.raises(Exception) as raised:
        run(in_pieces, bad)
    assert in_pieces.handed_over
    assert str(raised.value) == str(expected.value)


def test_wiring_reads_the_initializers_given_apart(small_pieces):
    model = chain(40)
    proto, initializers = split_parts(model)
    assert Wiring(proto.graph, list(initializers)).weights.keys() == {t.name for t in model.graph.initializer}


def test_weights_fed_as_inputs_reach_every_piece_that_reads_them(small_pieces, monkeypatch):
    # One large weight, fed from one array (WeightFeeds), read by the first node and the last.
    rng = np.random.default_rng(0)
    model = chain(40)
    nodes = list(model.graph.node)
    nodes[0].input[0] = "h"
    last = nodes[-1].output[0]
    nodes[-1].output[0] = "pre"
    del model.graph.node[:]
    model.graph.node.extend(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), *nodes, helper.make_node("MatMul", ["pre", "w"], [last])]
    )
    model.graph.initializer.append(numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "w"))
    monkeypatch.setattr(verify, "FEED_BYTES", 64)  # the 64-byte weight counts as large here
    weights = WeightFeeds()
    in_pieces = session(model, None, weights, in_pieces=True)
    whole = session(model, None, weights)
    assert isinstance(in_pieces, FedSession) and isinstance(in_pieces._inner, PiecewiseSession)
    assert list(in_pieces.weights) == ["w"]
    feeds = {"x": rng.standard_normal((2, 4)).astype(np.float32)}
    assert run(in_pieces, feeds)[last].tobytes() == run(whole, feeds)[last].tobytes()
    assert Checker(model, CheckOptions()).check(model, exact=True).passed


def test_a_constant_read_across_a_cut_stays_a_constant_in_the_piece_reading_it(small_pieces):
    # onnxruntime makes a Constant's value a weight, and packs a constant MatMul operand: fed as an
    # input instead, the product's sums come out differently (up to 0.02 here).
    rng = np.random.default_rng(0)
    value = numpy_helper.from_array(rng.standard_normal((512, 256)).astype(np.float32), "b")
    model = chain(40)
    nodes = [helper.make_node("Constant", [], ["b"], value=value), *model.graph.node]
    last = nodes[-1].output[0]
    nodes[-1].output[0] = "pre"
    nodes.append(helper.make_node("Tile", ["pre", "repeats"], ["wide"]))
    nodes.append(helper.make_node("MatMul", ["wide", "b"], [last]))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.append(numpy_helper.from_array(np.array([1, 128], np.int64), "repeats"))
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info(last, TensorProto.FLOAT, [2, 256]))
    in_pieces, whole = cut(model), session(model)
    assert in_pieces.pieces == 4
    feeds = {"x": rng.standard_normal((2, 4)).astype(np.float32)}
    assert run(in_pieces, feeds)[last].tobytes() == run(whole, feeds)[last].tobytes()
    assert Checker(model, CheckOptions()).check(model, exact=True).passed


@pytest.mark.parametrize("tensor", ["r15", "r19"], ids=["inside-a-piece", "across-a-cut"])
def test_an_annotation_the_whole_model_refuses_is_refused_in_pieces_too(small_pieces, monkeypatch, tensor):
    original = chain(40)
    candidate = chain(40)
    assert pieces.cut_positions(candidate.graph, 4, element_types(candidate.graph, opset_versions(candidate))) == [
        10,
        20,
        30,
    ]
    candidate.graph.value_info.append(helper.make_tensor_value_info(tensor, TensorProto.DOUBLE, None))
    in_pieces = Checker(original, CheckOptions()).check(candidate, exact=True)
    monkeypatch.setattr(pieces, "PIECE_NODES", 10**9)
    whole = Checker(original, CheckOptions()).check(candidate, exact=True)
    assert not whole.passed and not in_pieces.passed
    assert in_pieces.load_error == whole.load_error and "double" in whole.load_error


def test_a_name_defined_twice_is_left_to_the_whole_model_to_refuse(small_pieces):
    twice = chain(40)
    twice.graph.node[35].output[0] = "r5"  # node 5 writes it too
    twice.graph.node[36].input[0] = "r5"
    assert cut(twice) is None
    shadowing = chain(40)
    shadowing.graph.input.append(helper.make_tensor_value_info("r20", TensorProto.FLOAT, [2, 4]))
    assert cut(shadowing) is None
    for model in (twice, shadowing):
        verdict = Checker(chain(40), CheckOptions()).check(model, exact=True)
        assert not verdict.passed and "Duplicate definition" in verdict.load_error


def test_a_whole_model_that_cannot_load_after_the_pieces_ran_is_reported_as_a_load_error(small_pieces):
    # Pieces that start and then fail hand over to the whole model; its load error is a load error.
    model = chain(40)
    proto, initializers = split_parts(model)
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    broken.graph.node[0].op_type = "NoSuchOp"

    def whole():
        return session(broken)

    in_pieces = started_in_pieces(proto, initializers, lambda piece: session(piece), whole)
    with pytest.raises(InputError, match="cannot load the model"):
        run(in_pieces, {"x": np.ones((3, 3), np.float32)})  # a wrong shape fails the first piece
