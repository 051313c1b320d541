"""Tests for dropout-elimination (rules/dropout_elimination.py) and for the engine's support
of replacements that drop an unused output (None in the returned outputs).

Dropout at inference is the identity: every positive case checks the rewritten model gives
bit-identical outputs in onnxruntime (graph optimizations disabled)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

import fuser
from fuser.rules.dropout_elimination import dropout_elimination
from tests.helpers import assert_declined, assert_rewritten, make_model, op_types

RULE = "dropout-elimination"
FEEDS = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}


def dropout_model(opset: int, *, mask: str | None = None, mask_is_output=False, extra_inputs=(), inits=None, **attrs):
    outputs = ["d"] + ([mask] if mask else [])
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Dropout", ["r", *extra_inputs], outputs, **attrs),
        helper.make_node("Neg", ["d"], ["y"]),
    ]
    graph_outputs = [("y", np.float32, [2, 3])] + ([(mask, np.bool_, [2, 3])] if mask_is_output else [])
    return make_model(nodes, [("x", np.float32, [2, 3])], graph_outputs, inits or {}, opset=opset)


@pytest.mark.parametrize("opset", [7, 10, 12, 13, 17])
def test_dropout_removed(opset):
    """Dropout between two ops disappears; the consumer reads Dropout's input."""
    model = dropout_model(opset)
    after, _ = assert_rewritten(
        model, [dropout_elimination], counts={RULE: 1}, expected_ops=["Relu", "Neg"], feeds=FEEDS
    )
    assert after.graph.node[1].input[0] == "r"


@pytest.mark.parametrize("opset", [10, 13])
def test_unused_mask_is_dropped_with_it(opset):
    model = dropout_model(opset, mask="mask")
    assert_rewritten(model, [dropout_elimination], counts={RULE: 1}, expected_ops=["Relu", "Neg"], feeds=FEEDS)


def test_constant_false_training_mode_and_ratio():
    inits = {"ratio": np.array(0.5, np.float32), "training": np.array(False)}
    model = dropout_model(13, extra_inputs=["ratio", "training"], inits=inits)
    assert_rewritten(model, [dropout_elimination], counts={RULE: 1}, expected_ops=["Relu", "Neg"], feeds=FEEDS)


def test_old_opset_with_is_test():
    model = dropout_model(6, is_test=1)
    after, report = fuser.optimize(model, rules=[dropout_elimination], check=False)
    assert report.counts == {RULE: 1} and op_types(after) == ["Relu", "Neg"]


def test_dropout_output_that_is_a_graph_output_keeps_its_name():
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Dropout", ["r"], ["y"])]
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], opset=13)
    after, _ = assert_rewritten(model, [dropout_elimination], counts={RULE: 1}, expected_ops=["Relu", "Identity"])
    assert after.graph.output[0].name == "y"


# --------------------------------------------------------------------------- negatives


def test_training_mode_true_is_kept():
    inits = {"ratio": np.array(0.5, np.float32), "training": np.array(True)}
    model = dropout_model(13, extra_inputs=["ratio", "training"], inits=inits)
    assert_declined(model, dropout_elimination, "training mode", check=False)


def test_training_mode_fed_at_run_time_is_kept():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Dropout", ["r", "", "training"], ["y"]),
    ]
    model = make_model(
        nodes,
        [("x", np.float32, [2, 3]), ("training", np.bool_, [])],
        [("y", np.float32, [2, 3])],
        opset=13,
    )
    assert_declined(model, dropout_elimination, None, check=False)


def test_old_opset_without_is_test_is_kept():
    model = dropout_model(6)
    assert_declined(model, dropout_elimination, "training mode", check=False)


def test_used_mask_is_kept():
    """The mask is a graph output: dropping it would lose an output, so nothing changes."""
    model = dropout_model(13, mask="mask", mask_is_output=True)
    assert_declined(model, dropout_elimination, "which the replacement drops, is still used", check=False)


def test_ratio_fed_at_run_time_does_not_matter():
    """At inference the ratio is unused, so a ratio that is a graph input does not block the rewrite."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Dropout", ["r", "ratio"], ["d"])]
    nodes.append(helper.make_node("Neg", ["d"], ["y"]))
    model = make_model(
        nodes, [("x", np.float32, [2, 3]), ("ratio", np.float32, [])], [("y", np.float32, [2, 3])], opset=13
    )
    after, report = fuser.optimize(model, rules=[dropout_elimination], check=False)
    assert report.counts == {RULE: 1} and op_types(after) == ["Relu", "Neg"]
