"""Tests for constant-fold (rules/constant_fold.py): nodes of constant inputs become initializers.

Numerics: every positive case runs both models in onnxruntime (graph optimizations off)."""

from __future__ import annotations

import numpy as np
from fuser.rules.constant_fold import constant_fed_nodes, constant_fold
from fuser.rules.identity_elimination import identity_elimination
from onnx import TensorProto, helper

import fuser
from fuser.model import Model
from tests.helpers import assert_declined, assert_rewritten, initializer_value, make_model

RULE = "constant-fold"
X = np.random.default_rng(0).standard_normal((2, 6)).astype(np.float32)


def shape_arithmetic_model(**kwargs):
    """y = Reshape(x, Concat(Constant([3]), Constant([-1])) cast through float and back)."""
    nodes = [
        helper.make_node("Constant", [], ["a"], value=helper.make_tensor("a", TensorProto.INT64, [1], [3])),
        helper.make_node("Constant", [], ["b"], value_ints=[-1]),
        helper.make_node("Concat", ["a", "b"], ["ab"], axis=0),
        helper.make_node("Cast", ["ab"], ["abf"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["abf"], ["shape"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    return make_model(nodes, [("x", np.float32, [2, 6])], [("y", np.float32, [3, 4])], **kwargs)


def test_shape_arithmetic_folds_into_one_initializer():
    after, _ = assert_rewritten(
        shape_arithmetic_model(), [constant_fold], counts={RULE: 5}, expected_ops=["Reshape"], feeds={"x": X}
    )
    np.testing.assert_array_equal(initializer_value(after, after.graph.node[0].input[1]), [3, -1])
    assert len(after.graph.initializer) == 1  # intermediate constants do not linger


def test_value_used_twice_is_folded_once_and_shared():
    nodes = [
        helper.make_node("Constant", [], ["c"], value_float=2.0),
        helper.make_node("Mul", ["x", "c"], ["m"]),
        helper.make_node("Add", ["m", "c"], ["y"]),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 6])], [("y", np.float32, [2, 6])])
    after, _ = assert_rewritten(model, [constant_fold], counts={RULE: 1}, expected_ops=["Mul", "Add"], feeds={"x": X})
    assert after.graph.node[0].input[1] == after.graph.node[1].input[1]


def test_constant_graph_output_keeps_its_name():
    nodes = [
        helper.make_node("Constant", [], ["c"], value_floats=[1.0, 2.0]),
        helper.make_node("Neg", ["c"], ["y"]),
        helper.make_node("Relu", ["x"], ["z"]),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 6])], [("y", np.float32, [2]), ("z", np.float32, [2, 6])])
    after, _ = assert_rewritten(
        model, [constant_fold, identity_elimination], counts={RULE: 2}, expected_ops=["Identity", "Relu"]
    )
    np.testing.assert_array_equal(initializer_value(after, after.graph.node[0].input[0]), [-1.0, -2.0])


def test_integer_and_fp16_values():
    nodes = [
        helper.make_node("Add", ["i", "i"], ["i2"]),
        helper.make_node("Cast", ["h"], ["h32"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "h32"], ["y"]),
        helper.make_node("Cast", ["i2"], ["i2f"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["y", "i2f"], ["z"]),
    ]
    inits = {"i": np.array([1, 2, 3, 4, 5, 6], np.int32), "h": np.full(6, 0.5, np.float16)}
    model = make_model(nodes, [("x", np.float32, [2, 6])], [("z", np.float32, [2, 6])], inits)
    assert_rewritten(model, [constant_fold], counts={RULE: 3}, expected_ops=["Mul", "Add"], feeds={"x": X})


def test_several_outputs():
    nodes = [
        helper.make_node("Split", ["c", "sizes"], ["p", "q"], axis=0),
        helper.make_node("Add", ["x", "p"], ["y"]),
        helper.make_node("Mul", ["y", "q"], ["z"]),
    ]
    inits = {"c": np.arange(12, dtype=np.float32), "sizes": np.array([6, 6], np.int64)}
    model = make_model(nodes, [("x", np.float32, [2, 6])], [("z", np.float32, [2, 6])], inits)
    assert_rewritten(model, [constant_fold], counts={RULE: 1}, expected_ops=["Add", "Mul"], feeds={"x": X})


# --------------------------------------------------------------------------- negatives


def test_large_result_stays_a_computation():
    nodes = [
        helper.make_node("ConstantOfShape", ["s"], ["big"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1])),
        helper.make_node("Add", ["x", "big"], ["y"]),
    ]
    model = make_model(
        nodes, [("x", np.float32, [512, 512])], [("y", np.float32, [512, 512])], {"s": np.array([512, 512], np.int64)}
    )
    assert_declined(model, constant_fold, "it stays a computation", check=False)


def test_initializer_a_graph_input_can_override_is_not_folded():
    nodes = [helper.make_node("Neg", ["c"], ["n"]), helper.make_node("Add", ["x", "n"], ["y"])]
    model = make_model(
        nodes,
        [("x", np.float32, [2, 6]), ("c", np.float32, [6])],
        [("y", np.float32, [2, 6])],
        {"c": np.ones(6, np.float32)},
    )
    assert_declined(model, constant_fold, None, check=False)


def test_random_ops_are_not_folded():
    nodes = [helper.make_node("RandomNormal", [], ["r"], shape=[2, 6]), helper.make_node("Add", ["x", "r"], ["y"])]
    model = make_model(nodes, [("x", np.float32, [2, 6])], [("y", np.float32, [2, 6])])
    _, report = fuser.optimize(model, rules=[constant_fold], check=False)
    assert report.counts == {}


def test_symbolic_input_is_not_constant():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["y"])]
    model = make_model(nodes, [("x", np.float32, ["batch", 6])], [("y", np.float32, ["batch", 6])])
    assert_declined(model, constant_fold, None, check=False)


def test_a_pass_tries_only_the_nodes_whose_inputs_may_be_constant():
    # "late" reads a tensor made further down the list: perhaps constant, so it is tried.
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="of_input"),
        helper.make_node("Neg", ["w"], ["n"], name="of_weight"),
        helper.make_node("Add", ["n", "w"], ["a"], name="of_folded"),
        helper.make_node("Mul", ["a", "r"], ["m"], name="of_both"),
        helper.make_node("Abs", ["c"], ["late"], name="late"),
        helper.make_node("Constant", [], ["c"], name="const", value_float=2.0),
        helper.make_node("Add", ["m", "late"], ["y"], name="below_both"),
    ]
    graph = helper.make_graph(
        nodes,
        "out_of_order",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [helper.make_tensor("w", TensorProto.FLOAT, [3], [1.0, 1.0, 1.0])],
    )
    graph = Model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])).graph
    tried = sorted(graph.node(i).name for i in constant_fed_nodes(graph))
    assert tried == ["const", "late", "of_folded", "of_weight"]


def test_a_pass_over_activations_asks_no_tensor_whether_it_is_constant(monkeypatch):
    # Deciding it evaluates constant subgraphs: a pass over a long chain must not ask at every node.
    import fuser.graph

    asked = []
    constant_value = fuser.graph.Graph.constant_value

    def recording(graph, tensor, *args, **kwargs):
        asked.append(tensor)
        return constant_value(graph, tensor, *args, **kwargs)

    monkeypatch.setattr(fuser.graph.Graph, "constant_value", recording)
    nodes = [helper.make_node("Relu", [f"h{i}"], [f"h{i + 1}"]) for i in range(50)]
    model = make_model(nodes, [("h0", np.float32, [3])], [("h50", np.float32, [3])])
    _, report = fuser.optimize(model, rules=[constant_fold], check=False)
    assert report.counts == {} and asked == []
