"""Tests for transpose-reshape (rules/transpose_reshape.py); outputs bit-identical."""

from __future__ import annotations

import numpy as np
from fuser.rules.reshape_chain import reshape_chain
from fuser.rules.transpose_reshape import transpose_reshape
from onnx import helper

from tests.helpers import assert_declined, assert_rewritten, make_model

RULE = "transpose-reshape"


def lstm_head(shape=(5, 2, 1, 8), perm=(0, 2, 1, 3)):
    """An LSTM's output [sequence, directions, batch 1, hidden], heads moved past the batch axis
    and flattened (CRNN text recognizers)."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=list(perm)),
        helper.make_node("Reshape", ["t", "flat"], ["y"]),
    ]
    flat = np.array([shape[0], -1], np.int64)
    out = [shape[0], int(np.prod(shape)) // shape[0]]
    return make_model(nodes, [("x", np.float32, list(shape))], [("y", np.float32, out)], {"flat": flat})


def feeds(shape):
    return {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}


def test_a_transpose_of_a_length_1_axis_becomes_a_reshape_and_merges_with_the_next():
    after, _ = assert_rewritten(
        lstm_head(),
        [transpose_reshape, reshape_chain],
        counts={RULE: 1, "reshape-chain": 1},
        expected_ops=["Reshape"],
        feeds=feeds((5, 2, 1, 8)),
    )
    assert after.graph.node[0].input[0] == "x"


def test_the_default_perm_on_a_tensor_with_one_long_axis():
    after, _ = assert_rewritten(
        lstm_head(shape=(1, 6, 1), perm=(2, 1, 0)), [transpose_reshape], counts={RULE: 1}, feeds=feeds((1, 6, 1))
    )
    assert "Transpose" not in [n.op_type for n in after.graph.node]


def test_a_transpose_that_reorders_long_axes_declines():
    assert_declined(lstm_head(perm=(1, 0, 2, 3)), transpose_reshape, "reorders axes longer than 1", check=False)


def test_a_symbolic_shape_declines():
    model = lstm_head()
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "batch"
    assert_declined(model, transpose_reshape, "not fixed", check=False)


def test_an_empty_tensor_declines():
    """Transpose(x[0, 1]) as Reshape(x, [1, 0]) would keep x's first axis for the 0: [1, 1]."""
    nodes = [helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0])]
    model = make_model(nodes, [("x", np.float32, [0, 1])], [("y", np.float32, [1, 0])])
    assert_declined(model, transpose_reshape, "x is empty", check=False)
