"""Tests for neutral-element and neutral-element-right (rules/neutral_element.py): bit-identical outputs."""

from __future__ import annotations

import numpy as np
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
