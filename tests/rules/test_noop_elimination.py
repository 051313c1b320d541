"""Tests for the no-op rules in rules/noop_elimination.py; outputs bit-identical."""

from __future__ import annotations

import numpy as np
from fuser.rules.noop_elimination import concat_single, expand_noop, slice_noop, squeeze_unsqueeze, tile_noop
from onnx import helper

from tests.helpers import assert_declined, assert_rewritten, make_model

RULES = [concat_single, expand_noop, slice_noop, squeeze_unsqueeze, tile_noop]
X = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}


def around(op_type, extra_inputs=(), inits=None, out_shape=(2, 3), x_shape=(2, 3), **attrs):
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node(op_type, ["r", *extra_inputs], ["o"], **attrs),
        helper.make_node("Neg", ["o"], ["y"]),
    ]
    return make_model(nodes, [("x", np.float32, list(x_shape))], [("y", np.float32, list(out_shape))], inits or {})


def test_single_concat():
    assert_rewritten(
        around("Concat", axis=0), RULES, counts={"concat-single": 1}, expected_ops=["Relu", "Neg"], feeds=X
    )


def test_expand_to_own_shape():
    model = around("Expand", ["s"], {"s": np.array([1, 3], np.int64)}, x_shape=("n", 3), out_shape=("n", 3))
    assert_rewritten(model, RULES, counts={"expand-noop": 1}, expected_ops=["Relu", "Neg"], feeds=X)


def test_expand_that_grows_declines():
    model = around("Expand", ["s"], {"s": np.array([4, 2, 3], np.int64)}, out_shape=(4, 2, 3))
    assert_declined(model, expand_noop, "may add axes", rules=RULES, check=False)


def test_tile_of_ones():
    model = around("Tile", ["t"], {"t": np.array([1, 1], np.int64)})
    assert_rewritten(model, RULES, counts={"tile-noop": 1}, expected_ops=["Relu", "Neg"], feeds=X)


def test_tile_that_repeats_declines():
    model = around("Tile", ["t"], {"t": np.array([2, 1], np.int64)}, out_shape=(4, 3))
    assert_declined(model, tile_noop, "repeats x", rules=RULES, check=False)


def test_full_slice():
    inits = {"s": np.array([0], np.int64), "e": np.array([2**62], np.int64), "a": np.array([1], np.int64)}
    model = around("Slice", ["s", "e", "a"], inits)
    assert_rewritten(model, RULES, counts={"slice-noop": 1}, expected_ops=["Relu", "Neg"], feeds=X)


def test_partial_slice_declines():
    inits = {"s": np.array([0], np.int64), "e": np.array([2], np.int64), "a": np.array([1], np.int64)}
    model = around("Slice", ["s", "e", "a"], inits, out_shape=(2, 2))
    assert_declined(model, slice_noop, "may leave elements out", rules=RULES, check=False)


def test_squeeze_of_unsqueeze():
    nodes = [
        helper.make_node("Unsqueeze", ["x", "a"], ["u"]),
        helper.make_node("Squeeze", ["u", "b"], ["s"]),
        helper.make_node("Neg", ["s"], ["y"]),
    ]
    inits = {"a": np.array([1], np.int64), "b": np.array([-2], np.int64)}
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], inits)
    assert_rewritten(model, RULES, counts={"squeeze-unsqueeze": 1}, expected_ops=["Neg"], feeds=X)


def test_squeeze_of_other_axis_declines():
    nodes = [
        helper.make_node("Unsqueeze", ["x", "a"], ["u"]),
        helper.make_node("Squeeze", ["u", "b"], ["s"]),
        helper.make_node("Neg", ["s"], ["y"]),
    ]
    inits = {"a": np.array([0, 2], np.int64), "b": np.array([0], np.int64)}
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 1, 3])], inits)
    assert_declined(model, squeeze_unsqueeze, "removes axes", rules=RULES, check=False)
