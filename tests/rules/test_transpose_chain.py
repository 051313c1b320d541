"""Tests for transpose-chain (rules/transpose_chain.py); outputs bit-identical."""

from __future__ import annotations

import numpy as np
from fuser.rules.transpose_chain import transpose_chain
from onnx import TensorProto, helper

from tests.helpers import assert_rewritten, attrs_of, make_model

RULE = "transpose-chain"
X = {"x": np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)}


def chain(first, second, out_shape):
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], **({"perm": first} if first else {})),
        helper.make_node("Transpose", ["t"], ["u"], **({"perm": second} if second else {})),
        helper.make_node("Neg", ["u"], ["y"]),
    ]
    return make_model(nodes, [("x", np.float32, ["n", 3, 4, 5])], [("y", np.float32, out_shape)])


def test_nchw_nhwc_round_trip_cancels():
    assert_rewritten(
        chain([0, 2, 3, 1], [0, 3, 1, 2], ["n", 3, 4, 5]),
        [transpose_chain],
        counts={RULE: 1},
        expected_ops=["Neg"],
        feeds=X,
    )


def test_two_transposes_compose_into_one():
    after, _ = assert_rewritten(
        chain([0, 2, 3, 1], [0, 2, 1, 3], ["n", 5, 4, 3]),
        [transpose_chain],
        counts={RULE: 1},
        expected_ops=["Transpose", "Neg"],
        feeds=X,
    )
    assert attrs_of(after.graph.node[0])["perm"] == [0, 3, 2, 1]


def test_default_perms_reverse_and_cancel():
    assert_rewritten(
        chain(None, None, ["n", 3, 4, 5]), [transpose_chain], counts={RULE: 1}, expected_ops=["Neg"], feeds=X
    )


def test_intermediate_used_elsewhere_declines():
    from tests.helpers import assert_declined

    model = chain([0, 2, 3, 1], [0, 3, 1, 2], ["n", 3, 4, 5])
    model.graph.output.append(helper.make_tensor_value_info("t", 1, ["n", 4, 5, 3]))
    assert_declined(model, transpose_chain, "graph output", check=False)


def cast_chain(first, second, out_shape, to=TensorProto.FLOAT):
    """GPT-J's float16 attention: Transpose -> Cast up -> Transpose."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=first),
        helper.make_node("Cast", ["t"], ["c"], to=to),
        helper.make_node("Transpose", ["c"], ["u"], perm=second),
        helper.make_node("Neg", ["u"], ["y"]),
    ]
    dtype = helper.tensor_dtype_to_np_dtype(to)
    return make_model(nodes, [("x", np.float16, ["n", 3, 4, 5])], [("y", dtype, out_shape)])


X16 = {"x": X["x"].astype(np.float16)}


def test_a_cast_between_moves_after_and_the_transposes_cancel():
    after, _ = assert_rewritten(
        cast_chain([0, 2, 1, 3], [0, 2, 1, 3], ["n", 3, 4, 5]),
        [transpose_chain],
        counts={RULE: 1},
        expected_ops=["Cast", "Neg"],
        feeds=X16,
    )
    assert after.graph.node[0].input[0] == "x" and attrs_of(after.graph.node[0])["to"] == TensorProto.FLOAT


def test_a_cast_between_moves_after_one_transpose():
    # The heads permuted, upcast, and their last two axes swapped: GPT-J's keys before Q.K^T.
    after, _ = assert_rewritten(
        cast_chain([0, 2, 1, 3], [0, 1, 3, 2], ["n", 4, 5, 3], to=TensorProto.DOUBLE),
        [transpose_chain],
        counts={RULE: 1},
        expected_ops=["Transpose", "Cast", "Neg"],
        feeds=X16,
    )
    assert attrs_of(after.graph.node[0])["perm"] == [0, 2, 3, 1]
    assert attrs_of(after.graph.node[1])["to"] == TensorProto.DOUBLE


def test_a_cast_read_elsewhere_declines():
    from tests.helpers import assert_declined

    model = cast_chain([0, 2, 1, 3], [0, 2, 1, 3], ["n", 3, 4, 5])
    model.graph.output.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, ["n", 4, 3, 5]))
    assert_declined(model, transpose_chain, "graph output", check=False)
