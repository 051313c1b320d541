"""Tests for shape-where-fold (rules/shape_where_fold.py): torch's legacy spelling of expand,
Expand(x, Where(Equal(s, -1), ones, s)), keeps s when no entry of s can be -1.

The shapes are the legacy exporter's: s concatenated from dims of a tensor read at run time
(Unsqueeze(Gather(Shape(k), i))) and constants; here the repeat of grouped-query attention's
K heads, [B, 2, L, 8] -> [B, 2, 3, L, 8]. Numerics at batch 3 and length 5; the rewiring is
bit-exact.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from fuser.rules.shape_where_fold import shape_where_fold
from tests.helpers import assert_declined, assert_rewritten, make_model
from tests.rules.test_reshape_dims_fold import dim_of, index

RULE = "shape-where-fold"
FEEDS = {"k": np.random.default_rng(0).normal(size=(3, 2, 5, 8)).astype(np.float32)}


def repeat(middle=(2, 3), sentinel=-1, fill_shape=(5,), first="dim") -> onnx.ModelProto:
    """y = Expand(Unsqueeze(k, 2), Where(Equal(s, sentinel), ones, s)), s = [B, *middle, L, 8];
    with a 2-D fill, the Where's [2, 5] result is the output."""
    nodes = [helper.make_node("Unsqueeze", ["k", "two"], ["k5"])]
    inits = {
        "zero_axis": np.array([0], np.int64),
        "two": np.array([2], np.int64),
        "middle": np.array(middle, np.int64),
        "last": np.array([8], np.int64),
        "sentinel": np.full(5, sentinel, np.int64) if sentinel != "scalar" else np.array(-1, np.int64),
        "fill": np.ones(fill_shape, np.int64),
        **index("b", 0),
        **index("l", 2),
    }
    parts = []
    if first == "dim":
        nodes += dim_of("k", 0, "b")
        parts.append("b")
    else:
        parts.append("batch_input")
    nodes += dim_of("k", 2, "l")
    parts += ["middle", "l", "last"]
    nodes += [
        helper.make_node("Concat", parts, ["s"], axis=0),
        helper.make_node("Equal", ["s", "sentinel"], ["is_minus_one"]),
        helper.make_node("Where", ["is_minus_one", "fill", "s"], ["shape"]),
    ]
    inputs = [("k", np.float32, ["batch", 2, "length", 8])]
    if first != "dim":
        inputs.append(("batch_input", np.int64, [1]))
    if len(fill_shape) > 1:  # no longer a shape Expand could take: the Where's result is the output
        return make_model(nodes, inputs, [("shape", np.int64, [None] * len(fill_shape))], inits, opset=18)
    nodes.append(helper.make_node("Expand", ["k5", "shape"], ["y"]))
    return make_model(nodes, inputs, [("y", np.float32, [None] * 5)], inits, opset=18)


@pytest.mark.parametrize("sentinel", [-1, "scalar"])
def test_the_shape_is_used_as_it_is(sentinel):
    model = repeat(sentinel=sentinel)
    after, _ = assert_rewritten(model, [shape_where_fold], counts={RULE: 1}, feeds=FEEDS)
    (expand,) = [n for n in after.graph.node if n.op_type == "Expand"]
    assert expand.input[1] == "s"
    assert not [n for n in after.graph.node if n.op_type in ("Where", "Equal")]


def test_a_constant_entry_of_minus_one_keeps_the_where():
    assert_declined(repeat(middle=(2, -1)), shape_where_fold, "an entry of the shape is -1")


def test_an_entry_not_known_keeps_the_where():
    assert_declined(repeat(first="input"), shape_where_fold, "not every entry of the shape is known")


@pytest.mark.parametrize("sentinel", [0, 1])
def test_a_value_a_dim_can_take_keeps_the_where(sentinel):
    assert_declined(repeat(sentinel=sentinel), shape_where_fold, f"a dim read at run time may be {sentinel}")


def test_a_fill_that_broadcasts_wider_keeps_the_where():
    assert_declined(repeat(fill_shape=(2, 5)), shape_where_fold, "the Where gives shape")


def test_a_dim_of_a_scalar_is_declined_not_an_error():
    """Gather(Shape(scalar), 0) names no dim (the model would fail there): a decline, not a crash."""
    nodes = [
        helper.make_node("Shape", ["s"], ["scalar_shape"]),
        helper.make_node("Gather", ["scalar_shape", "zero"], ["dim"], axis=0),
        helper.make_node("Unsqueeze", ["dim", "zero_axis"], ["dim_1d"]),
        helper.make_node("Concat", ["dim_1d", "rest"], ["shape"], axis=0),
        helper.make_node("Equal", ["shape", "minus_one"], ["is_minus_one"]),
        helper.make_node("Where", ["is_minus_one", "ones", "shape"], ["y"]),
    ]
    inits = {
        "zero": np.array(0, np.int64),
        "zero_axis": np.array([0], np.int64),
        "rest": np.array([3], np.int64),
        "minus_one": np.array(-1, np.int64),
        "ones": np.ones(2, np.int64),
    }
    model = make_model(nodes, [("s", np.float32, [])], [("y", np.int64, [2])], inits, opset=18, check=False)
    assert_declined(model, shape_where_fold, "not every entry of the shape is known", check=False)
