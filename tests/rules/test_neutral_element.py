"""Tests for neutral-element and neutral-element-right (rules/neutral_element.py): bit-identical outputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.rules.neutral_element import neutral_element, neutral_element_right
from onnx import helper

from tests.helpers import assert_declined, assert_rewritten, make_model

RULES = [neutral_element, neutral_element_right]
X = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}


def arith_model(kind, value, shape=(2, 3), dtype=np.float32, x_shape=(2, 3), out_shape=None, swap=False):
    inputs = ["c", "r"] if swap else ["r", "c"]
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node(kind, inputs, ["a"])]
    nodes.append(helper.make_node("Neg", ["a"], ["y"]))
    inits = {"c": np.full(shape, value, dtype)}
    return make_model(nodes, [("x", np.float32, list(x_shape))], [("y", np.float32, list(out_shape or x_shape))], inits)


@pytest.mark.parametrize("kind, value", [("Add", 0.0), ("Sub", 0.0), ("Mul", 1.0), ("Div", 1.0)])
def test_neutral_constant_disappears(kind, value):
    name = "neutral-element" if kind in ("Add", "Mul") else "neutral-element-right"
    assert_rewritten(arith_model(kind, value), RULES, counts={name: 1}, expected_ops=["Relu", "Neg"], feeds=X)


def test_constant_first_and_symbolic_batch():
    model = arith_model("Mul", 1.0, shape=(3,), x_shape=("n", 3), swap=True)
    assert_rewritten(model, RULES, counts={"neutral-element": 1}, expected_ops=["Relu", "Neg"], feeds=X)


# --------------------------------------------------------------------------- negatives


def test_other_value_is_left_without_a_decline():
    # Every bias matches the pattern: a decline for each would bury the ones that matter.
    assert_declined(arith_model("Add", 0.5), neutral_element, None, check=False)
    assert_declined(arith_model("Div", 2.0), neutral_element_right, None, check=False)


def test_broadcasting_to_a_larger_shape_declines():
    model = arith_model("Add", 0.0, shape=(4, 2, 3), out_shape=(4, 2, 3))
    assert_declined(model, neutral_element, "may broadcast", check=False)


def test_zero_minus_x_is_not_x():
    assert_declined(arith_model("Sub", 0.0, swap=True), neutral_element_right, None, check=False)


# --------------------------------------------------------------------------- candidates


def _nominated(model):
    from fuser.model import Model
    from fuser.rules.neutral_element import _maybe_neutral

    graph = Model(model).graph
    return sorted(graph.node(n).name for n in _maybe_neutral(graph, ("Add", "Mul", "Sub", "Div")))


def _mixed_model(dtype):
    weights = {
        "zeros": np.zeros((2, 3), dtype),
        "ones": np.ones((2, 3), dtype),
        "twos": np.full((2, 3), 2, dtype),
        "zero_first": np.array([[0, 3, 3], [3, 3, 3]], dtype),
    }
    nodes = [
        helper.make_node("Add", ["x", "zeros"], ["a"], name="add_zeros"),
        helper.make_node("Add", ["a", "twos"], ["b"], name="add_twos"),
        helper.make_node("Mul", ["ones", "b"], ["c"], name="mul_ones"),
        helper.make_node("Mul", ["c", "twos"], ["d"], name="mul_twos"),
        helper.make_node("Sub", ["d", "zero_first"], ["e"], name="sub_zero_first"),
        helper.make_node("Div", ["e", "twos"], ["f"], name="div_twos"),
        helper.make_node("Neg", ["ones"], ["minus_one"], name="computed"),
        helper.make_node("Div", ["f", "minus_one"], ["g"], name="div_computed"),
        helper.make_node("Add", ["g", "x"], ["y"], name="add_activations"),
    ]
    onnx_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    x = helper.make_tensor_value_info("x", onnx_type, [2, 3])
    y = helper.make_tensor_value_info("y", onnx_type, [2, 3])
    from onnx import numpy_helper

    inits = [numpy_helper.from_array(value, name) for name, value in weights.items()]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int64, np.int32, "bfloat16"])
def test_only_nodes_whose_constant_may_be_neutral_are_tried(dtype):
    # A weight whose first element is not neutral is turned away by its first bytes; one whose
    # first element is (the rest may not be) is tried; so is a constant computed by other nodes.
    import ml_dtypes

    dtype = getattr(ml_dtypes, dtype) if isinstance(dtype, str) else dtype
    assert _nominated(_mixed_model(dtype)) == ["add_zeros", "div_computed", "mul_ones", "sub_zero_first"]


def test_a_weight_of_a_type_not_read_element_by_element_is_always_tried():
    # float8's raw bytes are not read here: every node reading a weight is tried.
    import ml_dtypes

    tried = _nominated(_mixed_model(ml_dtypes.float8_e4m3fn))
    assert tried == ["add_twos", "add_zeros", "div_computed", "div_twos", "mul_ones", "mul_twos", "sub_zero_first"]


def test_a_neutral_constant_made_by_other_nodes_goes_too():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Sub", ["one", "one"], ["zero"]),
        helper.make_node("Add", ["r", "zero"], ["a"]),
        helper.make_node("Neg", ["a"], ["y"]),
    ]
    model = make_model(
        nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], {"one": np.ones((2, 3), np.float32)}
    )
    # The Sub, read by nothing then, goes with the Add.
    assert_rewritten(model, RULES, counts={"neutral-element": 1}, expected_ops=["Relu", "Neg"], feeds=X)


def test_a_body_tries_the_constants_it_reads_from_its_enclosing_graph():
    # Inside an If branch, a weight of the main graph is read by its first bytes like one of the
    # branch's own; a tensor the main graph computes from constants may be constant, one it
    # reads from its inputs may not.
    from fuser.model import Model
    from fuser.rules.neutral_element import _maybe_neutral

    branch_nodes = [
        helper.make_node("Add", ["x", "zeros"], ["a"], name="add_outer_zeros"),
        helper.make_node("Add", ["a", "twos"], ["b"], name="add_outer_twos"),
        helper.make_node("Mul", ["b", "computed"], ["c"], name="mul_outer_computed"),
        helper.make_node("Mul", ["c", "x"], ["d"], name="mul_activations"),
    ]
    out = helper.make_tensor_value_info("d", onnx.TensorProto.FLOAT, [2, 3])
    branch = helper.make_graph(branch_nodes, "then", [], [out])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [], [
        helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, [2, 3])
    ])
    nodes = [
        helper.make_node("Neg", ["twos"], ["computed"]),
        helper.make_node("If", ["flag"], ["y"], then_branch=branch, else_branch=other),
    ]
    model = make_model(
        nodes,
        [("x", np.float32, [2, 3]), ("flag", np.bool_, [])],
        [("y", np.float32, [2, 3])],
        {"zeros": np.zeros((2, 3), np.float32), "twos": np.full((2, 3), 2, np.float32)},
    )
    graph = Model(model).graph
    body = graph.nodes_with_subgraphs()[0].subgraphs["then_branch"][0]
    tried = sorted(body.node(n).name for n in _maybe_neutral(body, ("Add", "Mul")))
    assert tried == ["add_outer_zeros", "mul_outer_computed"]
