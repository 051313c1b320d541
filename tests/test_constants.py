"""Constant evaluation (fuser/constants.py): what a scope knows is constant, and how that
knowledge follows the rewrites the graph makes."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import fuser
from fuser.constants import _estimated_bytes
from fuser.model import Model
from tests.helpers import make_model

F32 = np.float32


def _ids_by_name(graph) -> dict[str, int]:
    return {info.name: info.id for info in graph.nodes()}


def test_source_kind_names_what_produces_each_tensor():
    nodes = [helper.make_node("Add", ["x", "w"], ["y"], name="add")]
    g = Model(make_model(nodes, [("x", F32, [2])], [("y", F32, [2])], {"w": np.ones(2, F32)})).graph
    assert [g.source_kind(t) for t in ("x", "w", "y", "nowhere")] == ["input", "initializer", "op", None]


W = np.array([1.0, -2.0], F32)


def test_an_initializers_value_is_decoded_at_each_ask_and_not_held():
    """A large model has hundreds of thousands of small weights: their values are read from
    their TensorProtos when asked, equal each time and read-only, and never kept beside them.
    What is computed from them is kept."""
    nodes = [helper.make_node("Neg", ["w"], ["n"], name="neg"), helper.make_node("Add", ["x", "n"], ["y"])]
    g = Model(make_model(nodes, [("x", F32, [2])], [("y", F32, [2])], {"w": W})).graph
    first, again = g.constant_value("w"), g.constant_value("w")
    assert first is not again and np.array_equal(first, again) and np.array_equal(first, W)
    assert not first.flags.writeable
    assert np.array_equal(g.constant_value("n"), -W)
    assert set(g._constants._cache) == {"n"}


def _negated_relu():
    """Neg(Relu(x)), added to x; w waits as an initializer nothing reads."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Neg", ["r"], ["n"], name="neg"),
        helper.make_node("Add", ["x", "n"], ["y"], name="use"),
    ]
    g = Model(make_model(nodes, [("x", F32, [2])], [("y", F32, [2])], {"w": W})).graph
    assert g.constant_value("n") is None
    return g


def test_a_node_redirected_to_a_constant_becomes_constant():
    """Relu(x) is not constant; once its consumer reads w instead, what it computes is,
    although it was remembered as not constant before the redirect."""
    g = _negated_relu()
    g.redirect("r", "w")
    np.testing.assert_array_equal(g.constant_value("n"), -W)


def test_an_absent_optional_input_asked_about_leaves_what_has_one_constant():
    """An empty name (a Slice without axes) is no tensor: asking for its value first must not
    make the search take every node with an absent input for one that is not constant."""
    ints = {name: np.array(value, np.int64) for name, value in (("starts", [0]), ("ends", [4]), ("steps", [1]))}
    nodes = [
        helper.make_node("Slice", ["d", "starts", "ends", "", "steps"], ["s"], name="slice"),
        helper.make_node("Neg", ["s"], ["n"], name="neg"),
        helper.make_node("Add", ["x", "n"], ["y"], name="use"),
    ]
    d = np.array([1, 2, 3, 4, 5], np.int64)
    g = Model(make_model(nodes, [("x", np.int64, [4])], [("y", np.int64, [4])], {"d": d, **ints})).graph
    assert g.constant_value("") is None
    np.testing.assert_array_equal(g.constant_value("n"), -d[:4])


def test_a_removed_node_forgets_its_value_and_its_replacement_is_evaluated():
    nodes = [
        helper.make_node("Neg", ["w"], ["c"], name="neg"),
        helper.make_node("Add", ["x", "c"], ["y"], name="use"),
    ]
    w = np.array([1.0, -2.0], F32)
    g = Model(make_model(nodes, [("x", F32, [2])], [("y", F32, [2])], {"w": w})).graph
    np.testing.assert_array_equal(g.constant_value("c"), -w)
    neg = _ids_by_name(g)["neg"]
    g.replace_nodes([neg], [helper.make_node("Abs", ["w"], ["c"], name="abs")], [], g.sort_key(neg), "test")
    np.testing.assert_array_equal(g.constant_value("c"), np.abs(w))


def test_a_node_replaced_under_its_name_by_a_constant_one_makes_what_follows_constant():
    """Neg(Relu(x)) is not constant; once the Relu's replacement, keeping its output's name,
    computes from w alone, the Neg's output is, though it was remembered as not constant."""
    g = _negated_relu()
    relu = _ids_by_name(g)["relu"]
    g.replace_nodes([relu], [helper.make_node("Relu", ["w"], ["r"], name="relu_w")], [], g.sort_key(relu), "test")
    np.testing.assert_array_equal(g.constant_value("n"), -np.maximum(W, 0))


def test_cached_values_are_read_only():
    nodes = [
        helper.make_node("Neg", ["w"], ["c"], name="neg"),
        helper.make_node("Add", ["x", "c"], ["y"], name="use"),
    ]
    g = Model(make_model(nodes, [("x", F32, [2])], [("y", F32, [2])], {"w": np.ones(2, F32)})).graph
    assert not g.constant_value("c").flags.writeable
    assert not g.constant_value("w").flags.writeable


@pytest.mark.parametrize(
    "node, inputs, expected",
    [
        # float16 fill: 2 bytes an element, not the 8 of the widest type.
        (
            helper.make_node(
                "ConstantOfShape", ["s"], ["y"], value=helper.make_tensor("v", TensorProto.FLOAT16, [1], [1])
            ),
            [np.array([4, 4], np.int64)],
            32,
        ),
        # onnx's reference Range counts in float64 before it casts: 8 + 4 bytes an element at its peak.
        (
            helper.make_node("Range", ["a", "b", "c"], ["y"]),
            [np.array(0, np.float32), np.array(10, np.float32), np.array(1, np.float32)],
            120,
        ),
        # An unbounded Range: no estimate, and no crash.
        (
            helper.make_node("Range", ["a", "b", "c"], ["y"]),
            [np.array(0, np.float32), np.array(np.inf, np.float32), np.array(1, np.float32)],
            None,
        ),
    ],
    ids=["fill-float16", "range-float32", "range-to-infinity"],
)
def test_the_size_of_a_growing_result_is_estimated_before_evaluating(node, inputs, expected):
    assert _estimated_bytes(node, inputs) == expected


def test_an_unbounded_range_stays_a_computation():
    nodes = [
        helper.make_node("Range", ["start", "limit", "delta"], ["r"]),
        helper.make_node("ReduceSum", ["r"], ["total"], keepdims=0),
        helper.make_node("Add", ["x", "total"], ["y"]),
    ]
    constants = {
        "start": np.array(0, np.float32),
        "limit": np.array(np.inf, np.float32),
        "delta": np.array(1, np.float32),
    }
    model = make_model(nodes, [("x", np.float32, [2])], [("y", np.float32, [2])], constants)
    after, _ = fuser.optimize(model, check=False)
    assert "Range" in [n.op_type for n in after.graph.node]
