"""Tests for identity-output (rules/identity_output.py): a graph output written through a final
Identity is written by its producer directly; outputs bit-identical in onnxruntime."""

from __future__ import annotations

import numpy as np
from onnx import helper

from fuser.rules.identity_output import identity_output
from tests.helpers import assert_declined, assert_rewritten, attrs_of, make_model

RULE = "identity-output"
X = {"x": np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32)}


def softmax_output_model(extra_output=False):
    nodes = [helper.make_node("Softmax", ["x"], ["s"], axis=-1), helper.make_node("Identity", ["s"], ["y"])]
    outputs = [("y", np.float32, ["n", 5])] + ([("s", np.float32, ["n", 5])] if extra_output else [])
    return make_model(nodes, [("x", np.float32, ["n", 5])], outputs)


def test_producer_writes_the_output():
    after, _ = assert_rewritten(
        softmax_output_model(), [identity_output], counts={RULE: 1}, expected_ops=["Softmax"], feeds=X
    )
    assert list(after.graph.node[0].output) == ["y"] and attrs_of(after.graph.node[0]) == {"axis": -1}


def test_identity_inside_the_graph_declines():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Identity", ["r"], ["i"]),
        helper.make_node("Neg", ["i"], ["y"]),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 5])], [("y", np.float32, [2, 5])])
    assert_declined(model, identity_output, "not a graph output", check=False)


def test_producer_output_that_is_also_an_output_declines():
    assert_declined(softmax_output_model(extra_output=True), identity_output, "graph output", check=False)


def test_identity_of_a_graph_input_is_left_alone():
    model = make_model(
        [helper.make_node("Identity", ["x"], ["y"])], [("x", np.float32, [2, 5])], [("y", np.float32, [2, 5])]
    )
    assert_declined(model, identity_output, None, check=False)
