"""Tests for cast-chain and cast-noop (rules/cast_chain.py); outputs bit-identical."""

from __future__ import annotations

import numpy as np
from fuser.rules.cast_chain import cast_chain, cast_noop
from onnx import TensorProto, helper

from tests.helpers import assert_declined, assert_rewritten, make_model

RULES = [cast_chain, cast_noop]
X = {"x": (np.random.default_rng(0).standard_normal((2, 3)) * 100).astype(np.float16)}


def casts(middle, last, out_dtype):
    nodes = [
        helper.make_node("Cast", ["x"], ["c"], to=middle),
        helper.make_node("Cast", ["c"], ["d"], to=last),
        helper.make_node("Neg", ["d"], ["y"]),
    ]
    return make_model(nodes, [("x", np.float16, ["n", 3])], [("y", out_dtype, ["n", 3])])


def test_widening_round_trip_is_one_cast():
    assert_rewritten(
        casts(TensorProto.FLOAT, TensorProto.DOUBLE, np.float64),
        RULES,
        counts={"cast-chain": 1},
        expected_ops=["Cast", "Neg"],
        feeds=X,
    )


def test_round_trip_to_own_type_disappears():
    assert_rewritten(
        casts(TensorProto.FLOAT, TensorProto.FLOAT16, np.float16),
        RULES,
        counts={"cast-chain": 1, "cast-noop": 1},
        expected_ops=["Neg"],
        feeds=X,
    )


def test_narrowing_middle_declines():
    model = casts(TensorProto.INT8, TensorProto.FLOAT, np.float32)
    assert_declined(model, cast_chain, "does not hold every float16 value", rules=RULES, check=False)


def test_cast_to_another_type_is_kept():
    model = make_model(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)],
        [("x", np.float16, [2, 3])],
        [("y", np.float32, [2, 3])],
    )
    assert_declined(model, cast_noop, "changes float16 to float32", check=False)


def test_the_last_cast_s_saturate_survives():
    """Cast(Cast(x, double), float8e4m3fn, saturate=0): values beyond the float8's range become
    NaN, not +-448 as the default saturate=1 would make them."""
    model = make_model(
        [
            helper.make_node("Cast", ["x"], ["d"], to=TensorProto.DOUBLE),
            helper.make_node("Cast", ["d"], ["f8"], to=TensorProto.FLOAT8E4M3FN, saturate=0),
            helper.make_node("Cast", ["f8"], ["y"], to=TensorProto.FLOAT),
        ],
        [("x", np.float32, [6])],
        [("y", np.float32, [6])],
        opset=19,
    )
    feeds = {"x": np.array([1.0, -2.5, 1000.0, -1e4, 448.0, 500.0], np.float32)}
    after, _ = assert_rewritten(model, RULES, counts={"cast-chain": 1}, expected_ops=["Cast", "Cast"], feeds=feeds)
    (fused, _) = after.graph.node
    assert {a.name: helper.get_attribute_value(a) for a in fused.attribute} == {
        "to": TensorProto.FLOAT8E4M3FN,
        "saturate": 0,
    }
