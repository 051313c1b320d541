"""Tests for bias-gelu (rules/bias_gelu.py):
com.microsoft Gelu(x + bias)  =>  BiasGelu(x, bias);  FastGelu(x + bias)  =>  FastGelu(x, bias).

The bias must be a 1-D constant with one value per element of x's last axis (either Add
operand order). Both models run in onnxruntime (CPU, graph optimizations off) on seeded inputs.
Tolerances: float32 rtol 1e-4, atol 1e-5; float16 rtol 1e-2, atol 1e-2 (transformer_models.TOL).
Also composed with gelu-ort on a written-out GELU after a MatMul + Add, as transformer MLPs are.
BiasGelu has no float64 kernel (onnxruntime 1.32, checked): float64 declines.
"""

from __future__ import annotations

import numpy as np
import pytest
from fuser.rules.bias_gelu import bias_gelu
from fuser.rules.gelu import gelu_ort
from onnx import helper

from tests.helpers import assert_declined, assert_rewritten, make_model, nodes_of
from tests.rules.transformer_models import TOL, feeds_for, gelu_nodes

SHAPE = ["batch", "sequence", 16]
FEED_SHAPE = (2, 3, 16)
MS = {"com.microsoft": 1}
BIAS = np.random.default_rng(3).normal(0, 1, 16)


def biased_gelu_model(
    op="Gelu",
    dtype=np.float32,
    bias=BIAS,
    swapped=False,
    y="y",
    extra_nodes=(),
    extra_outputs=(),
    check=True,
    shape=SHAPE,
):
    add_inputs = ["bias", "x"] if swapped else ["x", "bias"]
    nodes = [
        helper.make_node("Add", add_inputs, ["biased"], name="add"),
        helper.make_node(op, ["biased"], [y], name="gelu", domain="com.microsoft"),
        *extra_nodes,
    ]
    outputs = [(o, dtype, [None] * len(shape)) for o in (y, *extra_outputs)]
    return make_model(
        nodes, [("x", dtype, shape)], outputs, {"bias": np.asarray(bias, dtype)}, extra_opsets=MS, check=check
    )


@pytest.mark.parametrize("swapped", [False, True], ids=["x-first", "bias-first"])
@pytest.mark.parametrize("op,fused", [("Gelu", "BiasGelu"), ("FastGelu", "FastGelu")])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_bias_moves_into_the_activation(op, fused, swapped, dtype):
    model = biased_gelu_model(op, dtype, swapped=swapped)
    after, _ = assert_rewritten(
        model,
        [bias_gelu],
        counts={"bias-gelu": 1},
        expected_ops=[fused],
        target="onnxruntime",
        feeds=feeds_for(FEED_SHAPE, dtype, scale=2.0),
        **TOL[dtype],
    )
    (node,) = nodes_of(after, fused)
    assert node.domain == "com.microsoft" and list(node.input) == ["x", "bias"] and list(node.output) == ["y"]


@pytest.mark.parametrize("kind", ["erf-div", "tanh"])
def test_with_gelu_ort_after_matmul(kind):
    """MatMul -> Add(bias) -> written-out GELU: gelu-ort then bias-gelu leave MatMul + one op."""
    nodes, inits = gelu_nodes(x="h", kind=kind, form=1)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["proj"], name="matmul"),
        helper.make_node("Add", ["proj", "bias"], ["h"], name="add"),
        *nodes,
    ]
    rng = np.random.default_rng(0)
    inits.update({"w": rng.normal(0, 0.3, (16, 16)).astype(np.float32), "bias": BIAS.astype(np.float32)})
    model = make_model(nodes, [("x", np.float32, SHAPE)], [("y", np.float32, [None] * 3)], inits)
    fused = "FastGelu" if kind.startswith("tanh") else "BiasGelu"
    assert_rewritten(
        model,
        [gelu_ort, bias_gelu],
        counts={"gelu-ort": 1, "bias-gelu": 1},
        expected_ops=["MatMul", fused],
        target="onnxruntime",
        feeds=feeds_for(FEED_SHAPE),
        **TOL[np.float32],
    )


def test_graph_output_name_survives():
    extra = [helper.make_node("Neg", ["mlp/act:0"], ["z"], name="neg")]
    model = biased_gelu_model(y="mlp/act:0", extra_nodes=extra, extra_outputs=["z"])
    after, _ = assert_rewritten(
        model,
        [bias_gelu],
        counts={"bias-gelu": 1},
        expected_ops=["BiasGelu", "Neg"],
        target="onnxruntime",
        feeds=feeds_for(FEED_SHAPE),
        **TOL[np.float32],
    )
    assert list(after.graph.node[0].output) == ["mlp/act:0"]


# --------------------------------------------------------------------------- declines


def test_bias_not_one_dimensional_declined():
    model = biased_gelu_model(bias=BIAS.reshape(1, 1, 16))
    assert_declined(model, bias_gelu, "the bias has shape (1, 1, 16), not one value per channel", target="onnxruntime")


def test_scalar_bias_declined():
    model = biased_gelu_model(bias=np.array(0.5))
    assert_declined(model, bias_gelu, "not one value per channel", target="onnxruntime")


def test_bias_not_matching_the_last_axis_declined():
    """A [3] bias on [B, 3, 1]: Add broadcasts it along the last axis of size 1."""
    model = biased_gelu_model(bias=BIAS[:3], shape=["batch", 3, 1])
    model.graph.output[0].type.tensor_type.shape.dim[2].dim_value = 3
    assert_declined(model, bias_gelu, "the bias has 3 values, the last axis 1", target="onnxruntime")


def test_fast_gelu_with_a_bias_already_is_no_match():
    """The pattern is FastGelu with one input: one with its own bias is not matched at all."""
    nodes = [
        helper.make_node("Add", ["x", "bias"], ["biased"], name="add"),
        helper.make_node("FastGelu", ["biased", "bias2"], ["y"], name="gelu", domain="com.microsoft"),
    ]
    inits = {"bias": BIAS.astype(np.float32), "bias2": BIAS.astype(np.float32)}
    model = make_model(nodes, [("x", np.float32, SHAPE)], [("y", np.float32, [None] * 3)], inits, extra_opsets=MS)
    assert_declined(model, bias_gelu, None, target="onnxruntime")


def test_float64_declined():
    model = biased_gelu_model("FastGelu", np.float64)
    assert_declined(model, bias_gelu, "the input is float64", target="onnxruntime")


def test_biased_tensor_used_elsewhere_declined():
    extra = [helper.make_node("Neg", ["biased"], ["z"], name="neg")]
    model = biased_gelu_model(extra_nodes=extra, extra_outputs=["z"])
    assert_declined(model, bias_gelu, "'biased' (output of add) is used outside the match", target="onnxruntime")


def test_runtime_bias_is_no_match():
    nodes = [
        helper.make_node("Add", ["x", "bias"], ["biased"], name="add"),
        helper.make_node("Gelu", ["biased"], ["y"], name="gelu", domain="com.microsoft"),
    ]
    model = make_model(
        nodes,
        [("x", np.float32, SHAPE), ("bias", np.float32, [16])],
        [("y", np.float32, [None] * 3)],
        extra_opsets=MS,
    )
    assert_declined(model, bias_gelu, None, target="onnxruntime")
