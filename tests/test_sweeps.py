"""The engine's side of sweeps (rules that look at a whole graph): checks, log, blame, errors."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

import fuser
from fuser import Change, sweep
from fuser.errors import NumericsMismatch, RuleError
from fuser.pattern import PatternError
from fuser.rule import Rule
from fuser.selftest import selftest_rule
from tests.helpers import make_model, op_types

W = np.arange(6, dtype=np.float32).reshape(2, 3)
FEEDS = {"x": np.ones((2, 3), np.float32)}


def _model():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Add", ["r", "a"], ["y"], name="add"),
        helper.make_node("Mul", ["r", "b"], ["z"], name="mul"),
    ]
    return make_model(
        nodes,
        [("x", np.float32, [2, 3])],
        [("y", np.float32, [2, 3]), ("z", np.float32, [2, 3])],
        {"a": W, "b": W + 1},
    )


def test_a_change_removing_a_node_still_read_is_declined_with_the_reason():
    @sweep("remove-relu")
    def remove_relu(graph):
        """Removes the Relu, wrongly: the Add and Mul read it."""
        yield Change(nodes=tuple(info.id for info in graph.nodes() if info.op_type == "Relu"))

    after, report = fuser.optimize(_model(), rules=[remove_relu], trace=True)
    assert report.rewrites == [] and op_types(after) == ["Relu", "Add", "Mul"]
    (decline,) = report.engine.declined
    assert decline.rule == "remove-relu" and "is read by add, which stays" in decline.reason


def test_a_change_redirecting_a_graph_input_is_declined():
    @sweep("redirect-input")
    def redirect_input(graph):
        """Makes the readers of x read a weight, which no sweep may do."""
        yield Change(redirects=(("x", "a"),))

    _, report = fuser.optimize(_model(), rules=[redirect_input], trace=True)
    assert report.rewrites == []
    assert "'x' is not an initializer of this graph" in report.engine.declined[0].reason


def test_a_change_that_breaks_numerics_is_blamed_and_can_be_dropped():
    @sweep("wrong-merge")
    def wrong_merge(graph):
        """Merges two initializers whose values differ."""
        yield Change(redirects=(("b", "a"),))

    with pytest.raises(NumericsMismatch, match="wrong-merge on b"):
        fuser.optimize(_model(), rules=[wrong_merge])
    after, report = fuser.optimize(_model(), rules=[wrong_merge], on_mismatch="drop")
    assert [r.rule for r in report.dropped] == ["wrong-merge"] and report.rewrites == []
    assert sorted(t.name for t in after.graph.initializer) == ["a", "b"]


def test_a_crashing_sweep_is_the_rules_bug():
    @sweep("crashes")
    def crashes(graph):
        """Raises."""
        raise KeyError("oops")
        yield

    with pytest.raises(RuleError, match="crashes"):
        fuser.optimize(_model(), rules=[crashes])


def test_a_sweep_yielding_what_is_not_a_change_is_the_rules_bug():
    @sweep("yields-a-tuple")
    def yields_a_tuple(graph):
        """Yields the parts of a change, not a Change."""
        yield ("nodes", 1)

    with pytest.raises(RuleError, match=r"yields-a-tuple.*its sweep yielded \('nodes', 1\), not a fuser.Change"):
        fuser.optimize(_model(), rules=[yields_a_tuple])


def test_a_rule_needs_a_pattern_or_a_sweep():
    with pytest.raises(PatternError, match="either a pattern or a sweep"):
        Rule(name="nothing", description="does nothing", pattern=None, build=lambda m, b: None)


def test_selftest_says_a_sweep_has_no_pattern():
    from fuser.rules.dead_code import dead_code

    result = selftest_rule(dead_code)
    assert result.tried == 0 and result.passed
    assert list(result.unsynthesizable) == ["a sweep has no pattern to draw instances of"]
