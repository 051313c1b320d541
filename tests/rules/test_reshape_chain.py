"""Tests for reshape-chain and reshape-noop (rules/reshape_chain.py); outputs bit-identical."""

from __future__ import annotations

import numpy as np
from fuser.rules.reshape_chain import reshape_chain, reshape_noop
from onnx import helper

from tests.helpers import assert_declined, assert_rewritten, make_model

RULES = [reshape_chain, reshape_noop]
X = {"x": np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)}


def reshapes(first, second, out_shape, x_shape=(2, 3, 4)):
    nodes = [
        helper.make_node("Reshape", ["x", "s1"], ["r"]),
        helper.make_node("Reshape", ["r", "s2"], ["q"]),
        helper.make_node("Neg", ["q"], ["y"]),
    ]
    inits = {"s1": np.array(first, np.int64), "s2": np.array(second, np.int64)}
    return make_model(nodes, [("x", np.float32, list(x_shape))], [("y", np.float32, out_shape)], inits)


def test_two_reshapes_become_one():
    assert_rewritten(
        reshapes([6, 4], [4, -1], [4, 6]), RULES, counts={"reshape-chain": 1}, expected_ops=["Reshape", "Neg"], feeds=X
    )


def test_reshape_back_to_the_input_shape_disappears():
    assert_rewritten(
        reshapes([6, 4], [2, 3, 4], [2, 3, 4]),
        RULES,
        counts={"reshape-chain": 1, "reshape-noop": 1},
        expected_ops=["Neg"],
        feeds=X,
    )


def test_zero_copying_a_dimension_of_the_first_result_declines():
    model = reshapes([6, 4], [0, 2, 2], [6, 2, 2])
    assert_declined(model, reshape_chain, "copies a dimension", rules=[reshape_chain], check=False)


def test_symbolic_shape_is_not_a_noop():
    nodes = [helper.make_node("Reshape", ["x", "s"], ["y"])]
    model = make_model(
        nodes, [("x", np.float32, ["n", 12])], [("y", np.float32, ["n", 12])], {"s": np.array([-1, 12], np.int64)}
    )
    assert_declined(model, reshape_noop, "not fixed", check=False)
