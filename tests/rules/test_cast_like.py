"""Tests for cast-like (rules/cast_like.py); outputs bit-identical."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.rules.cast_like import cast_like
from onnx import helper, numpy_helper

import fuser
from tests.helpers import assert_declined, assert_rewritten, assert_same_outputs, make_model, op_types

RNG = np.random.default_rng(0)
BFLOAT16 = helper.tensor_dtype_to_np_dtype(onnx.TensorProto.BFLOAT16)
FLOAT8 = helper.tensor_dtype_to_np_dtype(onnx.TensorProto.FLOAT8E4M3FN)


@pytest.mark.parametrize(
    "value_dtype,like_dtype",
    [
        (np.float32, np.float16),
        (np.float64, np.float32),
        (np.int64, np.float32),
        (np.float32, np.int32),
        (np.float32, np.float64),
        (np.float32, np.float32),
    ],
)
def test_cast_like_becomes_a_cast_to_the_type_of_its_second_input(value_dtype, like_dtype):
    value = (RNG.standard_normal((2, 3)) * 10).astype(value_dtype)
    nodes = [
        helper.make_node("CastLike", ["v", "like"], ["c"]),
        helper.make_node("Add", ["c", "like"], ["y"]),
    ]
    model = make_model(nodes, [("v", value_dtype, [2, 3]), ("like", like_dtype, [2, 3])], [("y", like_dtype, [2, 3])])
    after, _ = assert_rewritten(
        model,
        [cast_like],
        counts={"cast-like": 1},
        expected_ops=["Cast", "Add"],
        feeds={"v": value, "like": (RNG.standard_normal((2, 3)) * 10).astype(like_dtype)},
    )
    (cast,) = [n for n in after.graph.node if n.op_type == "Cast"]
    assert helper.get_attribute_value(cast.attribute[0]) == helper.np_dtype_to_tensor_dtype(np.dtype(like_dtype))


def test_bfloat16_target():
    nodes = [helper.make_node("CastLike", ["v", "like"], ["y"])]
    model = make_model(nodes, [("v", np.float32, [4]), ("like", BFLOAT16, [4])], [("y", BFLOAT16, [4])])
    after, _ = assert_rewritten(model, [cast_like], counts={"cast-like": 1}, expected_ops=["Cast"], check=False)
    assert after.graph.node[0].attribute[0].i == onnx.TensorProto.BFLOAT16


def test_a_constant_hidden_behind_cast_like_folds_and_a_conv_bias_appears():
    """The dynamo exporter's (optimize=False) zero bias: Expand(CastLike(0, x), Shape(w)[0:1]).
    Once it is a Cast of a constant, it folds, and the BatchNormalization after the Conv folds
    into it."""
    weight = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
    channels = {
        "scale": RNG.uniform(0.5, 1.5, 4),
        "shift": RNG.normal(0, 0.5, 4),
        "mean": RNG.normal(0, 0.5, 4),
        "var": RNG.uniform(0.5, 1.5, 4),
    }
    nodes = [
        helper.make_node("Shape", ["w"], ["w_shape"], end=1),
        helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array(0.0, np.float32))),
        helper.make_node("CastLike", ["zero", "x"], ["zero_like"]),
        helper.make_node("Expand", ["zero_like", "w_shape"], ["bias"]),
        helper.make_node("Conv", ["x", "w", "bias"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["y"]),
    ]
    inits = {"w": weight, **{k: v.astype(np.float32) for k, v in channels.items()}}
    model = make_model(nodes, [("x", np.float32, [1, 3, 6, 6])], [("y", np.float32, [1, 4, 6, 6])], inits, opset=18)
    after, report = fuser.optimize(model)
    assert report.counts.get("cast-like") == 1 and report.counts.get("conv-bn-fold") == 1
    assert op_types(after) == ["Conv"]
    assert report.verdict is not None and report.verdict.passed
    assert_same_outputs(model, after, {"x": RNG.standard_normal((1, 3, 6, 6)).astype(np.float32)}, rtol=1e-5, atol=1e-5)
    # Without it the bias stays a computation and the BatchNormalization stays.
    kept, _ = fuser.optimize(model, disable=["cast-like"])
    assert "BatchNormalization" in op_types(kept)


def test_graph_output_keeps_its_name():
    nodes = [helper.make_node("CastLike", ["v", "like"], ["y"])]
    model = make_model(nodes, [("v", np.float64, [3]), ("like", np.float32, [3])], [("y", np.float32, [3])])
    after, _ = assert_rewritten(model, [cast_like], counts={"cast-like": 1}, expected_ops=["Cast"])
    assert [o.name for o in after.graph.output] == ["y"] and after.graph.node[0].output[0] == "y"


def test_saturate_is_kept():
    nodes = [helper.make_node("CastLike", ["v", "like"], ["y"], saturate=0)]
    model = make_model(
        nodes,
        [("v", np.float32, [3]), ("like", FLOAT8, [3])],
        [("y", FLOAT8, [3])],
        opset=19,
    )
    after, _ = assert_rewritten(model, [cast_like], counts={"cast-like": 1}, expected_ops=["Cast"], check=False)
    attrs = {a.name: helper.get_attribute_value(a) for a in after.graph.node[0].attribute}
    assert attrs == {"to": onnx.TensorProto.FLOAT8E4M3FN, "saturate": 0}


def test_unknown_second_type_declines():
    """The second input comes from an operator of a domain shape inference does not know."""
    nodes = [
        helper.make_node("Mystery", ["like"], ["opaque"], domain="com.example"),
        helper.make_node("CastLike", ["v", "opaque"], ["y"]),
    ]
    model = make_model(
        nodes,
        [("v", np.float32, [3]), ("like", np.float16, [3])],
        [("y", np.float16, [3])],
        extra_opsets={"com.example": 1},
        check=False,
    )
    assert_declined(model, cast_like, "element type of the second input is unknown", check=False)
