"""Tests for cast-elimination (rules/cast_noop.py): Cast(x, to=T) where x is already T  =>  x.

An exact rule: outputs must be bit-identical (assert_rewritten with rtol=atol=0). A Cast that
changes the dtype is kept, with the reason; so is one whose input type is unknown. A Cast
whose output is a graph output keeps that name (an Identity copies the value into it).
"""

from __future__ import annotations

import numpy as np
import pytest
from fuser.rules.cast_chain import cast_noop
from onnx import TensorProto, helper

from tests.helpers import assert_declined, assert_rewritten, make_model
from tests.rules.transformer_models import feeds_for

SHAPE = ["batch", 4]
TYPES = {
    np.float32: TensorProto.FLOAT,
    np.float16: TensorProto.FLOAT16,
    np.float64: TensorProto.DOUBLE,
    np.int64: TensorProto.INT64,
}


def cast_model(dtype=np.float32, to=None, out_dtype=None, cast_is_output=False):
    """x -> Abs -> Cast(to) -> Neg -> y (or the Cast's output is y itself)."""
    to = TYPES[dtype] if to is None else to
    out_dtype = out_dtype or dtype
    nodes = [
        helper.make_node("Abs", ["x"], ["r"], name="abs"),
        helper.make_node("Cast", ["r"], ["y" if cast_is_output else "c"], name="cast", to=to),
    ]
    if not cast_is_output:
        nodes.append(helper.make_node("Neg", ["c"], ["y"], name="neg"))
    return make_model(nodes, [("x", dtype, SHAPE)], [("y", out_dtype, SHAPE)])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int64], ids=["fp32", "fp16", "fp64", "i64"])
def test_no_op_cast_removed(dtype):
    model = cast_model(dtype)
    feeds = {"x": (feeds_for((3, 4))["x"] * 10).astype(dtype)}
    after, _ = assert_rewritten(
        model, [cast_noop], counts={"cast-noop": 1}, expected_ops=["Abs", "Neg"], feeds=feeds
    )
    assert list(after.graph.node[1].input) == ["r"]


def test_cast_output_is_graph_output():
    model = cast_model(cast_is_output=True)
    after, _ = assert_rewritten(
        model,
        [cast_noop],
        counts={"cast-noop": 1},
        expected_ops=["Abs", "Identity"],
        feeds=feeds_for((3, 4)),
    )
    assert list(after.graph.node[1].output) == ["y"]


@pytest.mark.parametrize(
    "dtype,to,reason",
    [
        (np.float32, TensorProto.FLOAT16, "changes float32 to float16"),
        (np.float16, TensorProto.FLOAT, "changes float16 to float32"),
        (np.float32, TensorProto.INT64, "changes float32 to int64"),
    ],
)
def test_cast_that_changes_dtype_is_kept(dtype, to, reason):
    out_dtype = {TensorProto.FLOAT16: np.float16, TensorProto.FLOAT: np.float32, TensorProto.INT64: np.int64}[to]
    model = cast_model(dtype, to=to, out_dtype=out_dtype)
    assert_declined(model, cast_noop, reason)


def test_unknown_input_type_is_kept():
    """x comes from a graph input with no type information for the Cast to compare."""
    nodes = [helper.make_node("Cast", ["x"], ["y"], name="cast", to=TensorProto.FLOAT)]
    graph = helper.make_graph(
        nodes,
        "test",
        [helper.make_value_info("x", helper.TypeProto())],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert_declined(model, cast_noop, "the input's element type is unknown", check=False)


def test_two_casts_in_a_row():
    """float32 -> float32 -> float32: both go; Neg reads the Abs directly."""
    nodes = [
        helper.make_node("Abs", ["x"], ["r"], name="abs"),
        helper.make_node("Cast", ["r"], ["c1"], name="cast1", to=TensorProto.FLOAT),
        helper.make_node("Cast", ["c1"], ["c2"], name="cast2", to=TensorProto.FLOAT),
        helper.make_node("Neg", ["c2"], ["y"], name="neg"),
    ]
    model = make_model(nodes, [("x", np.float32, SHAPE)], [("y", np.float32, SHAPE)])
    assert_rewritten(
        model,
        [cast_noop],
        counts={"cast-noop": 2},
        expected_ops=["Abs", "Neg"],
        feeds=feeds_for((3, 4)),
    )


def test_round_trip_cast_pair_is_kept():
    """float32 -> float16 -> float32 rounds: neither Cast is a no-op."""
    nodes = [
        helper.make_node("Cast", ["x"], ["h"], name="to_half", to=TensorProto.FLOAT16),
        helper.make_node("Cast", ["h"], ["y"], name="to_float", to=TensorProto.FLOAT),
    ]
    model = make_model(nodes, [("x", np.float32, SHAPE)], [("y", np.float32, SHAPE)])
    assert_declined(model, cast_noop, "changes")
