"""Tests for shape-fold and shape-gather-fold (rules/shape_fold.py), with constant-fold
folding what is computed from the shapes. Outputs compared in onnxruntime, optimizations off."""

from __future__ import annotations

import numpy as np
from fuser.rules.constant_fold import constant_fold
from fuser.rules.shape_fold import shape_fold, shape_gather_fold
from onnx import helper

from tests.helpers import assert_declined, assert_rewritten, initializer_value, make_model

RULES = [constant_fold, shape_fold, shape_gather_fold]


def flatten_model(batch):
    """y = Reshape(x, [Shape(x)[0], -1]): the export of x.view(x.size(0), -1)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = {"zero": np.array(0, np.int64), "axes": np.array([0], np.int64), "minus_one": np.array([-1], np.int64)}
    return make_model(nodes, [("x", np.float32, [batch, 3, 4])], [("y", np.float32, [batch, 12])], inits)


def test_static_shape_folds_to_a_constant_reshape():
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)}
    after, _ = assert_rewritten(
        flatten_model(2),
        RULES,
        counts={"shape-fold": 1, "constant-fold": 3},  # the whole shape is fixed
        expected_ops=["Reshape"],
        feeds=feeds,
    )
    np.testing.assert_array_equal(initializer_value(after, after.graph.node[0].input[1]), [2, -1])


def test_whole_shape_of_static_tensor():
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=1), helper.make_node("Cast", ["s"], ["y"], to=1)]
    model = make_model(nodes, [("x", np.float32, [2, 3, 4])], [("y", np.float32, [2])], opset=15)
    after, _ = assert_rewritten(
        model, RULES, counts={"shape-fold": 1, "constant-fold": 1}, expected_ops=["Identity"], check=False
    )
    np.testing.assert_array_equal(initializer_value(after, after.graph.node[0].input[0]), [3, 4])


def test_fixed_dims_of_a_partly_symbolic_shape_fold():
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "last"], ["d"], axis=0),
        helper.make_node("Cast", ["d"], ["df"], to=1),
        helper.make_node("Div", ["x", "df"], ["y"]),
        helper.make_node("Shape", ["x"], ["s2"]),
        helper.make_node("Gather", ["s2", "first"], ["n"], axis=0),
        helper.make_node("Cast", ["n"], ["nf"], to=1),
        helper.make_node("Mul", ["y", "nf"], ["z"]),
    ]
    inits = {"last": np.array(-1, np.int64), "first": np.array(0, np.int64)}
    model = make_model(nodes, [("x", np.float32, ["batch", 4])], [("z", np.float32, ["batch", 4])], inits)
    feeds = {"x": np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)}
    assert_rewritten(
        model,
        RULES,
        counts={"shape-gather-fold": 1, "constant-fold": 1},
        expected_ops=["Div", "Shape", "Gather", "Cast", "Mul"],
        feeds=feeds,
        dims={"batch": 3},
    )


def test_symbolic_dim_is_not_folded():
    assert_declined(flatten_model("batch"), shape_gather_fold, "are symbolic", rules=RULES, check=False)


def test_symbolic_shape_is_not_folded():
    assert_declined(flatten_model("batch"), shape_fold, "symbolic dimensions", rules=RULES, check=False)
