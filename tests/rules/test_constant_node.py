"""Tests for constant-node (rules/constant_node.py): a Constant node becomes an initializer of the
same name, so outputs must be bit-identical and the readers keep their inputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.rules.constant_fold import constant_fold
from fuser.rules.constant_node import constant_node
from onnx import TensorProto, helper, numpy_helper

import fuser
from fuser.engine import Engine
from fuser.model import Model
from fuser.rule import Change, sweep
from tests.helpers import assert_declined, assert_rewritten, make_model

RULE = "constant-node"
RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3)).astype(np.float32)
W = RNG.standard_normal((2, 3)).astype(np.float32)


def _reading(constant: onnx.NodeProto, reader: str = "Add") -> onnx.ModelProto:
    nodes = [constant, helper.make_node(reader, ["x", constant.output[0]], ["y"], name="use")]
    return make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])])


@pytest.mark.parametrize(
    "attribute",
    [
        {"value": numpy_helper.from_array(W, "ignored")},
        {"value_float": 1.5},
        {"value_floats": [1.0, -2.0, 0.5]},
    ],
    ids=["value", "value_float", "value_floats"],
)
def test_a_constant_becomes_an_initializer_of_its_name(attribute):
    model = _reading(helper.make_node("Constant", [], ["c"], name="const", **attribute))
    after, report = assert_rewritten(model, constant_node, counts={RULE: 1}, feeds={"x": X})
    assert [n.op_type for n in after.graph.node] == ["Add"]
    assert list(after.graph.node[0].input) == ["x", "c"]
    assert [t.name for t in after.graph.initializer] == ["c"]
    assert (report.rewrites[0].matched, report.rewrites[0].created) == (["const"], ["c"])


def test_integer_constants_keep_their_dtype():
    shape = helper.make_node("Constant", [], ["shape"], value_ints=[3, 2])
    nodes = [shape, helper.make_node("Reshape", ["x", "shape"], ["y"], name="use")]
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [3, 2])])
    after, _ = assert_rewritten(model, constant_node, counts={RULE: 1}, feeds={"x": X})
    (initializer,) = after.graph.initializer
    assert initializer.data_type == TensorProto.INT64
    np.testing.assert_array_equal(numpy_helper.to_array(initializer), [3, 2])


def test_a_constant_read_by_several_nodes_is_one_initializer():
    nodes = [
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(W)),
        helper.make_node("Add", ["x", "c"], ["a"]),
        helper.make_node("Mul", ["a", "c"], ["y"]),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])])
    after, _ = assert_rewritten(model, constant_node, counts={RULE: 1}, feeds={"x": X})
    assert [list(n.input) for n in after.graph.node] == [["x", "c"], ["a", "c"]]


def test_a_constant_that_is_a_graph_output_stays_for_constant_fold():
    nodes = [
        helper.make_node("Constant", [], ["c"], name="const", value=numpy_helper.from_array(W)),
        helper.make_node("Add", ["x", "c"], ["y"]),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3]), ("c", np.float32, [2, 3])])
    assert_declined(model, constant_node, None, check=False)
    after, report = fuser.optimize(model, rules=[constant_node, constant_fold], check=True)
    assert report.counts == {"constant-fold": 1} and report.verdict.passed
    assert [o.name for o in after.graph.output] == ["y", "c"]


def test_a_sparse_constant_stays():
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(np.array([5.0], np.float32), "values"),
        numpy_helper.from_array(np.array([4], np.int64), "indices"),
        [2, 3],
    )
    model = _reading(helper.make_node("Constant", [], ["c"], sparse_value=sparse))
    assert_declined(model, constant_node, None, check=False)


def test_a_constant_inside_a_branch_becomes_the_branchs_initializer():
    def branch(name: str, value: float) -> onnx.GraphProto:
        return helper.make_graph(
            [
                helper.make_node("Constant", [], [f"{name}_c"], value_float=value),
                helper.make_node("Mul", ["x", f"{name}_c"], [f"{name}_y"]),
            ],
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, [2, 3])],
        )

    nodes = [helper.make_node("If", ["flag"], ["y"], then_branch=branch("then", 2.0), else_branch=branch("else", -1.0))]
    model = make_model(nodes, [("flag", np.bool_, []), ("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])])
    after, _ = assert_rewritten(model, constant_node, counts={RULE: 2}, feeds={"flag": np.array(True), "x": X})
    for attribute in after.graph.node[0].attribute:
        assert [n.op_type for n in attribute.g.node] == ["Mul"]
        assert [t.name for t in attribute.g.initializer] == [attribute.g.node[0].input[1]]


def test_in_ir_3_the_new_initializer_is_listed_as_an_input_too():
    model = _reading(helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(W)))
    model.ir_version = 3
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("", 8))
    after, report = fuser.optimize(model, rules=[constant_node])
    assert report.counts == {RULE: 1} and report.verdict.passed
    assert [i.name for i in after.graph.input] == ["x", "c"] and [t.name for t in after.graph.initializer] == ["c"]
    onnx.checker.check_model(after, full_check=True)


def test_a_value_named_after_no_output_of_the_nodes_is_declined():
    @sweep("misnamed-value", description="a test sweep")
    def misnamed_value(graph):
        for node_id in graph.nodes_of_type("Constant"):
            yield Change(nodes=(node_id,), values=(numpy_helper.from_array(W, "elsewhere"),))

    model = _reading(helper.make_node("Constant", [], ["c"], name="const", value=numpy_helper.from_array(W)))
    result = Engine(Model(model), [misnamed_value], trace=True).run()
    assert result.rewrites == []
    assert [d.reason for d in result.declined] == ["'c' (output of const) is read by use, which stays"]


def test_two_values_of_one_name_are_declined():
    @sweep("doubled-value", description="a test sweep")
    def doubled_value(graph):
        for node_id in graph.nodes_of_type("Constant"):
            yield Change(nodes=(node_id,), values=(numpy_helper.from_array(W, "c"), numpy_helper.from_array(W, "c")))

    model = _reading(helper.make_node("Constant", [], ["c"], name="const", value=numpy_helper.from_array(W)))
    result = Engine(Model(model), [doubled_value], trace=True).run()
    assert result.rewrites == []
    assert [d.reason for d in result.declined] == ["two of its initializers have the same name"]


def test_a_change_whose_nodes_are_gone_is_declined_naming_nothing():
    # Proposed twice, the second change finds its Constant gone: a decline, not a crash.
    @sweep("twice-proposed", description="a test sweep")
    def twice_proposed(graph):
        (node_id,) = graph.nodes_of_type("Constant")
        return [Change(nodes=(node_id,), values=(numpy_helper.from_array(W, "c"),))] * 2

    model = _reading(helper.make_node("Constant", [], ["c"], name="const", value=numpy_helper.from_array(W)))
    result = Engine(Model(model), [twice_proposed], trace=True).run()
    assert len(result.rewrites) == 1
    (declined,) = result.declined
    assert (declined.node, declined.nodes) == ("", []) and declined.reason.endswith("is not in this graph")
