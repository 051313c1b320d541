"""Tests for norm-scale-fold and norm-bias-fold (rules/norm_affine_fold.py):
Norm(x, s, b) * g  =>  Norm(x, s*g, b*g) for LayerNormalization, RMSNormalization and
SimplifiedLayerNormalization;  LayerNormalization(x, s, b) + c  =>  LayerNormalization(x, s, b + c).

The multiplier/addend may be a scalar, a [H] vector or [1, 1, H]; either Mul/Add operand order.
Both models run in onnxruntime (CPU, graph optimizations off) on seeded inputs, and the folded
parameters are checked against the products/sums computed in float64 numpy.

Tolerances (|after - before| <= atol + rtol * |before|; see transformer_models.TOL):
  float32  rtol 1e-4, atol 1e-5;  float16 rtol 1e-2, atol 1e-2;  float64 rtol 1e-9, atol 1e-12.

Declines: a constant that varies along a non-normalized axis, that has more dimensions than
the norm's output (it would broadcast the result larger), a float16 fold that overflows
65504, the norm's output read elsewhere, symbolic normalized dims.
SimplifiedLayerNormalization is unknown to onnx.checker, so its test checks fuser's verdict.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.rules.layer_norm import layer_norm
from fuser.rules.norm_affine_fold import norm_bias_fold, norm_scale_fold
from onnx import helper

import fuser
from tests.helpers import (
    assert_declined,
    assert_rewritten,
    assert_same_outputs,
    initializer_value,
    make_model,
    nodes_of,
    op_types,
)
from tests.rules.transformer_models import TOL, feeds_for, layer_norm_nodes

SHAPE = ["batch", "sequence", 8]
FEED_SHAPE = (2, 3, 8)
RULES = [norm_scale_fold, norm_bias_fold]
RNG = np.random.default_rng(7)
S = RNG.uniform(0.5, 1.5, 8)
B = RNG.normal(0, 0.5, 8)
G = RNG.uniform(-2, 2, 8)
C = RNG.normal(0, 1, 8)


def norm_model(
    *,
    op="LayerNormalization",
    after=(("Mul", "g"),),
    constants=None,
    dtype=np.float32,
    opset=17,
    shape=SHAPE,
    bias=True,
    axis=-1,
    swapped=False,
    y="y",
    extra_nodes=(),
    extra_outputs=(),
    check=True,
):
    """x -> Norm(x, s[, b]) -> the `after` ops (Mul/Add by named constants) -> y."""
    constants = {"s": S, "b": B, "g": G, "c": C, **(constants or {})}
    inits = {k: np.asarray(v, dtype) for k, v in constants.items() if k != "b" or bias}
    norm_inputs = ["x", "s", "b"] if bias and op == "LayerNormalization" else ["x", "s"]
    if op != "LayerNormalization":
        inits.pop("b", None)
    nodes = [helper.make_node(op, norm_inputs, ["n"], name="norm", axis=axis, epsilon=1e-5)]
    current = "n"
    for index, (kind, constant) in enumerate(after):
        out = y if index == len(after) - 1 else f"t{index}"
        inputs = [constant, current] if swapped else [current, constant]
        nodes.append(helper.make_node(kind, inputs, [out], name=f"{kind.lower()}{index}"))
        current = out
    outputs = [(o, dtype, [None] * len(shape)) for o in (y, *extra_outputs)]
    inits = {k: v for k, v in inits.items() if any(k in n.input for n in nodes)}
    return make_model(nodes + list(extra_nodes), [("x", dtype, shape)], outputs, inits, opset=opset, check=check)


def folded(model, name_in_norm):
    (node,) = [n for n in model.graph.node if n.op_type.endswith("Normalization")]
    return initializer_value(model, node.input[{"scale": 1, "bias": 2}[name_in_norm]])


# -------------------------------------------------------------------------- positives


@pytest.mark.parametrize("g", [G, G.reshape(1, 1, 8), np.array(1.7)], ids=["vector", "1x1xH", "scalar"])
@pytest.mark.parametrize("swapped", [False, True], ids=["norm-first", "constant-first"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_scale_fold_layer_norm(g, swapped, bias):
    model = norm_model(constants={"g": g}, swapped=swapped, bias=bias)
    feeds = feeds_for(FEED_SHAPE)
    after, _ = assert_rewritten(
        model,
        RULES,
        counts={"norm-scale-fold": 1},
        expected_ops=["LayerNormalization"],
        feeds=feeds,
        **TOL[np.float32],
    )
    multiplier = np.broadcast_to(np.asarray(g, np.float64).reshape(-1), (8,))
    np.testing.assert_allclose(folded(after, "scale"), S * multiplier, rtol=1e-6)
    if bias:
        np.testing.assert_allclose(folded(after, "bias"), B * multiplier, rtol=1e-6, atol=1e-7)
    else:
        assert len(nodes_of(after, "LayerNormalization")[0].input) == 2
    assert list(after.graph.node[0].output) == ["y"]


@pytest.mark.parametrize("c", [C, C.reshape(1, 1, 8), np.array(-0.3)], ids=["vector", "1x1xH", "scalar"])
@pytest.mark.parametrize("swapped", [False, True], ids=["norm-first", "constant-first"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_bias_fold(c, swapped, bias):
    model = norm_model(after=(("Add", "c"),), constants={"c": c}, swapped=swapped, bias=bias)
    feeds = feeds_for(FEED_SHAPE)
    after, _ = assert_rewritten(
        model,
        RULES,
        counts={"norm-bias-fold": 1},
        expected_ops=["LayerNormalization"],
        feeds=feeds,
        **TOL[np.float32],
    )
    addend = np.broadcast_to(np.asarray(c, np.float64).reshape(-1), (8,))
    np.testing.assert_allclose(folded(after, "bias"), (B if bias else 0) + addend, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(folded(after, "scale"), S.astype(np.float32))


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["fp16", "fp64"])
def test_scale_then_bias_fold_into_one_norm(dtype):
    model = norm_model(after=(("Mul", "g"), ("Add", "c")), dtype=dtype)
    feeds = feeds_for(FEED_SHAPE, dtype)
    after, _ = assert_rewritten(
        model,
        RULES,
        counts={"norm-scale-fold": 1, "norm-bias-fold": 1},
        expected_ops=["LayerNormalization"],
        feeds=feeds,
        **TOL[dtype],
    )
    assert folded(after, "scale").dtype == dtype


def test_two_normalized_axes():
    """axis=-2 on [B, 3, 8]: a [8] multiplier broadcasts over the normalized [3, 8]."""
    s = RNG.uniform(0.5, 1.5, (3, 8))
    b = RNG.normal(0, 0.5, (3, 8))
    model = norm_model(shape=["batch", 3, 8], axis=-2, constants={"s": s, "b": b})
    after, _ = assert_rewritten(
        model,
        RULES,
        counts={"norm-scale-fold": 1},
        expected_ops=["LayerNormalization"],
        feeds=feeds_for(FEED_SHAPE),
        **TOL[np.float32],
    )
    np.testing.assert_allclose(folded(after, "scale"), s * G, rtol=1e-6)


def test_rms_normalization_scale_fold():
    model = norm_model(op="RMSNormalization", opset=23)
    after, _ = assert_rewritten(
        model,
        RULES,
        counts={"norm-scale-fold": 1},
        expected_ops=["RMSNormalization"],
        feeds=feeds_for(FEED_SHAPE),
        **TOL[np.float32],
    )
    np.testing.assert_allclose(folded(after, "scale"), S * G, rtol=1e-6)


def test_simplified_layer_normalization_scale_fold():
    model = norm_model(op="SimplifiedLayerNormalization", opset=17, check=False)
    after, report = fuser.optimize(model, rules=RULES, target="onnxruntime")
    assert report.counts == {"norm-scale-fold": 1} and report.verdict.passed
    assert op_types(after) == ["SimplifiedLayerNormalization"]
    np.testing.assert_allclose(folded(after, "scale"), S * G, rtol=1e-6)
    assert_same_outputs(model, after, feeds_for(FEED_SHAPE), **TOL[np.float32])


def test_rms_normalization_bias_is_not_folded():
    """RMSNormalization has no bias input: an Add after it stays."""
    model = norm_model(op="RMSNormalization", opset=23, after=(("Add", "c"),))
    assert_declined(model, norm_bias_fold, None)


def test_shared_scale_initializer_is_not_modified():
    """Two norms read ONE scale initializer; each folds its own multiplier into a new one."""
    g2 = RNG.uniform(-2, 2, 8)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "s", "b"], ["n1"], name="norm1"),
        helper.make_node("Mul", ["n1", "g"], ["y1"], name="mul1"),
        helper.make_node("LayerNormalization", ["x", "s", "b"], ["n2"], name="norm2"),
        helper.make_node("Mul", ["n2", "g2"], ["y2"], name="mul2"),
        helper.make_node("LayerNormalization", ["x", "s", "b"], ["y3"], name="norm3"),
    ]
    inits = {k: np.asarray(v, np.float32) for k, v in {"s": S, "b": B, "g": G, "g2": g2}.items()}
    outputs = [(o, np.float32, [None] * 3) for o in ("y1", "y2", "y3")]
    model = make_model(nodes, [("x", np.float32, SHAPE)], outputs, inits)
    after, _ = assert_rewritten(
        model,
        RULES,
        counts={"norm-scale-fold": 2},
        expected_ops=["LayerNormalization"] * 3,
        feeds=feeds_for(FEED_SHAPE),
        **TOL[np.float32],
    )
    np.testing.assert_array_equal(initializer_value(after, "s"), S.astype(np.float32))
    assert list(nodes_of(after, "LayerNormalization")[2].input) == ["x", "s", "b"]


def test_after_layer_norm_rule_gives_one_node():
    """The written-out norm, its weight and its bias: one LayerNormalization."""
    nodes, inits = layer_norm_nodes(y="n")
    nodes += [
        helper.make_node("Mul", ["n", "g"], ["scaled"], name="weight"),
        helper.make_node("Add", ["scaled", "c"], ["y"], name="bias"),
    ]
    inits.update({"g": G.astype(np.float32), "c": C.astype(np.float32)})
    model = make_model(nodes, [("x", np.float32, SHAPE)], [("y", np.float32, [None] * 3)], inits)
    after, _ = assert_rewritten(
        model,
        [layer_norm, *RULES],
        counts={"layer-norm": 1, "norm-scale-fold": 1, "norm-bias-fold": 1},
        expected_ops=["LayerNormalization"],
        feeds=feeds_for(FEED_SHAPE),
        **TOL[np.float32],
    )
    np.testing.assert_allclose(folded(after, "scale"), G, rtol=1e-6)
    np.testing.assert_allclose(folded(after, "bias"), C, rtol=1e-6)


def test_graph_output_name_survives():
    extra = [helper.make_node("Neg", ["ln/out:0"], ["z"], name="neg")]
    model = norm_model(y="ln/out:0", extra_nodes=extra, extra_outputs=["z"])
    after, _ = assert_rewritten(
        model,
        RULES,
        counts={"norm-scale-fold": 1},
        expected_ops=["LayerNormalization", "Neg"],
        feeds=feeds_for(FEED_SHAPE),
        **TOL[np.float32],
    )
    assert list(nodes_of(after, "LayerNormalization")[0].output) == ["ln/out:0"]


# --------------------------------------------------------------------------- declines


@pytest.mark.parametrize("g_shape", [(3, 1), (2, 1, 1)], ids=["sequence", "batch"])
def test_multiplier_varying_along_other_axis_declined(g_shape):
    model = norm_model(shape=[2, 3, 8], constants={"g": RNG.uniform(0.5, 2, g_shape)})
    assert_declined(model, norm_scale_fold, "varies outside the normalized axes")


def test_multiplier_broadcasting_the_output_larger_declined():
    """[1, 1, 1, 8] turns the [B, S, 8] result into [1, B, S, 8]."""
    model = norm_model(constants={"g": G.reshape(1, 1, 1, 8)}, check=False)
    model.graph.output[0].type.tensor_type.shape.dim.add()
    onnx.checker.check_model(model, full_check=True)
    assert_declined(model, norm_scale_fold, "has more dimensions than the tensor it multiplies")


def test_addend_varying_along_other_axis_declined():
    model = norm_model(shape=[2, 3, 8], after=(("Add", "c"),), constants={"c": RNG.normal(0, 1, (3, 8))})
    assert_declined(model, norm_bias_fold, "the addend of shape (3, 8) varies outside the normalized axes")


def test_float16_scale_overflow_declined():
    """300 * 300 = 90000 is beyond float16's 65504: the folded scale would be inf."""
    model = norm_model(dtype=np.float16, constants={"s": np.full(8, 300.0), "g": np.full(8, 300.0)}, bias=False)
    assert_declined(model, norm_scale_fold, "the folded scale values are not finite in float16")


def test_float16_bias_overflow_declined():
    model = norm_model(
        dtype=np.float16, after=(("Add", "c"),), constants={"b": np.full(8, 60000.0), "c": np.full(8, 60000.0)}
    )
    assert_declined(model, norm_bias_fold, "the folded bias values are not finite in float16")


def test_float16_folded_bias_overflow_in_scale_fold_declined():
    model = norm_model(dtype=np.float16, constants={"b": np.full(8, 1000.0), "g": np.full(8, 100.0)})
    assert_declined(model, norm_scale_fold, "the folded bias values are not finite in float16")


def test_norm_output_used_elsewhere_declined():
    extra = [helper.make_node("Neg", ["n"], ["z"], name="neg")]
    model = norm_model(extra_nodes=extra, extra_outputs=["z"])
    assert_declined(model, norm_scale_fold, "'n' (output of norm) is used outside the match")


def test_norm_output_is_graph_output_declined():
    model = norm_model(after=(("Add", "c"),), extra_outputs=["n"])
    assert_declined(model, norm_bias_fold, "'n' (output of norm) is a graph output")


def test_symbolic_normalized_dim_declined():
    model = norm_model(shape=["batch", "sequence", "hidden"])
    assert_declined(model, norm_scale_fold, "are not fixed sizes")


def test_runtime_multiplier_is_no_match():
    nodes = [
        helper.make_node("LayerNormalization", ["x", "s", "b"], ["n"], name="norm"),
        helper.make_node("Mul", ["n", "g"], ["y"], name="mul"),
    ]
    inits = {"s": S.astype(np.float32), "b": B.astype(np.float32)}
    model = make_model(
        nodes, [("x", np.float32, SHAPE), ("g", np.float32, [8])], [("y", np.float32, [None] * 3)], inits
    )
    assert_declined(model, norm_scale_fold, None)
