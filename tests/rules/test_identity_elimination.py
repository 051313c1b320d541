"""Tests for identity-elimination (rules/identity_elimination.py); outputs must be bit-identical."""

from __future__ import annotations

import numpy as np
from fuser.rules.identity_elimination import identity_elimination
from onnx import helper

from tests.helpers import assert_declined, assert_rewritten, make_model

RULE = "identity-elimination"
FEEDS = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}


def test_identity_between_ops_disappears():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Identity", ["r"], ["i"]),
        helper.make_node("Neg", ["i"], ["y"]),
        helper.make_node("Abs", ["i"], ["z"]),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3]), ("z", np.float32, [2, 3])])
    after, _ = assert_rewritten(
        model, [identity_elimination], counts={RULE: 1}, expected_ops=["Relu", "Neg", "Abs"], feeds=FEEDS
    )
    assert [n.input[0] for n in after.graph.node[1:]] == ["r", "r"]


def test_identity_of_shared_weight_reads_the_weight():
    nodes = [helper.make_node("Identity", ["w"], ["w2"]), helper.make_node("MatMul", ["x", "w2"], ["y"])]
    model = make_model(
        nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], {"w": np.eye(3, dtype=np.float32)}
    )
    after, _ = assert_rewritten(model, [identity_elimination], counts={RULE: 1}, expected_ops=["MatMul"], feeds=FEEDS)
    assert after.graph.node[0].input[1] == "w"


def test_identity_producing_a_graph_output_stays():
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["y"])]
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])])
    assert_declined(model, identity_elimination, "identical to the match", check=False)
