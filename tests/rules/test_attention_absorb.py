"""Tests for Match.absorb, the engine support the attention rules use to take nodes found by
walking the graph beyond their pattern: absorbed nodes are removed with the match, checked like
the pattern's own nodes, and are part of the rewrite's identity (so blame can drop it)."""

from __future__ import annotations

import numpy as np
from onnx import helper

import fuser
from fuser import Builder, Match, op, rule, var
from tests.helpers import assert_declined, assert_rewritten, make_model


def _abs_under(m: Match):
    producer = m.graph.producer(m["x"])
    m.require(producer is not None and m.graph.node(producer).op_type == "Abs", "x is not an Abs")
    return m.graph.node(producer)


@rule("relu-of-abs", pattern=op.Relu(var("x"), name="relu"))
def relu_of_abs(m: Match, b: Builder):
    """Relu(Abs(a)) => Abs(a), the Abs found by walking and absorbed."""
    absolute = _abs_under(m)
    m.absorb([absolute.id])
    return b.Abs(absolute.inputs[0])


@rule("wrong-relu-of-abs", pattern=op.Relu(var("x"), name="relu"))
def wrong_relu_of_abs(m: Match, b: Builder):
    """Relu(Abs(a)) => Neg(a): wrong on purpose, for the numerics check to catch."""
    absolute = _abs_under(m)
    m.absorb([absolute.id])
    return b.Neg(absolute.inputs[0])


def model(abs_is_output=False):
    outputs = [("y", np.float32, [2, 3])] + ([("t", np.float32, [2, 3])] if abs_is_output else [])
    return make_model(
        [helper.make_node("Abs", ["a"], ["t"], name="abs"), helper.make_node("Relu", ["t"], ["y"], name="relu")],
        [("a", np.float32, [2, 3])],
        outputs,
    )


def test_absorbed_nodes_are_removed_with_the_match():
    after, report = assert_rewritten(model(), [relu_of_abs], counts={"relu-of-abs": 1}, expected_ops=["Abs"])
    assert report.rewrites[0].matched == ["relu", "abs"]


def test_an_absorbed_node_used_outside_the_match_declines_it():
    assert_declined(model(abs_is_output=True), relu_of_abs, "'t' (output of abs) is a graph output")


def test_a_rewrite_with_absorbed_nodes_can_be_dropped():
    after, report = fuser.optimize(model(), rules=[wrong_relu_of_abs], on_mismatch="drop")
    assert [n.op_type for n in after.graph.node] == ["Abs", "Relu"]
    assert report.counts == {}
    assert len(report.dropped) == 1
