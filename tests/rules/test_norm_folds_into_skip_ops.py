"""The projection bias and the learned weight/bias going into onnxruntime's Skip* norms.

skip-layer-norm / skip-rms-norm (rules/skip_norm.py) take a constant 1-D bias added to an
addend into the kernel's bias input; norm-scale-fold / norm-bias-fold
(rules/norm_affine_fold.py) fold a following Mul/Add into the Skip* op's gamma/beta, and
the fused op's residual-sum output still stands in for the residual Add.
Numerics: float32, onnxruntime with optimizations off, rtol 1e-4 / atol 1e-5 (the kernels
normalize in one pass; the written-out graph in several).
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from fuser.rules.norm_affine_fold import norm_bias_fold, norm_scale_fold
from fuser.rules.skip_norm import skip_layer_norm, skip_rms_norm
from tests.helpers import assert_rewritten, attrs_of, make_model, nodes_of

TOL = dict(rtol=1e-4, atol=1e-5)
HIDDEN = 16
RNG = np.random.default_rng(7)


def weights(*names, shape=(HIDDEN,)):
    return {name: RNG.normal(size=shape).astype(np.float32) for name in names}


def feeds(*names, batch=2, seq=5):
    return {name: RNG.normal(size=(batch, seq, HIDDEN)).astype(np.float32) for name in names}


def projection_residual_norm(norm_op="LayerNormalization", extra=(), bias_consumer=False):
    """y = Norm((x @ W + bias) + residual) [then extra nodes]; optionally bias_add is also an output."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["proj"]),
        helper.make_node("Add", ["proj", "bias"], ["biased"]),
        helper.make_node("Add", ["biased", "residual"], ["sum"]),
    ]
    if norm_op == "LayerNormalization":
        nodes.append(helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["norm"], axis=-1, epsilon=1e-5))
    else:
        nodes.append(helper.make_node("RMSNormalization", ["sum", "gamma"], ["norm"], axis=-1, epsilon=1e-6))
    nodes += list(extra)
    last = nodes[-1].output[0]
    nodes.append(helper.make_node("Add", [last, "sum"], ["y"]))  # the residual also feeds the next block
    io = ("batch", "seq", HIDDEN)
    outputs = [("y", np.float32, io)] + ([("biased", np.float32, io)] if bias_consumer else [])
    inits = {**weights("bias", "gamma", "beta", "g", "c"), **weights("w", shape=(HIDDEN, HIDDEN))}
    used = {i for n in nodes for i in n.input}
    return make_model(
        nodes,
        [("x", np.float32, io), ("residual", np.float32, io)],
        outputs,
        {k: v for k, v in inits.items() if k in used},
        opset=23,
        extra_opsets={"com.microsoft": 1},
    )


def test_the_projection_bias_becomes_the_kernels_bias_input():
    model = projection_residual_norm()
    after, _ = assert_rewritten(
        model,
        [skip_layer_norm],
        target="onnxruntime",
        enable=["skip-layer-norm"],
        counts={"skip-layer-norm": 1},
        expected_ops=["MatMul", "SkipLayerNormalization", "Add"],
        feeds=feeds("x", "residual"),
        **TOL,
    )
    (fused,) = nodes_of(after, "SkipLayerNormalization")
    assert list(fused.input) == ["proj", "residual", "gamma", "beta", "bias"]
    assert fused.output[3] == "sum"  # the residual sum keeps its name for the next block


def test_a_bias_add_used_elsewhere_stays_and_the_plain_sum_is_fused():
    model = projection_residual_norm(bias_consumer=True)
    after, _ = assert_rewritten(
        model,
        [skip_layer_norm],
        target="onnxruntime",
        enable=["skip-layer-norm"],
        counts={"skip-layer-norm": 1},
        expected_ops=["MatMul", "Add", "SkipLayerNormalization", "Add"],
        feeds=feeds("x", "residual"),
        **TOL,
    )
    (fused,) = nodes_of(after, "SkipLayerNormalization")
    assert list(fused.input)[:2] == ["biased", "residual"] and len(fused.input) == 4


def test_rms_norm_takes_the_bias_too():
    model = projection_residual_norm("RMSNormalization")
    after, _ = assert_rewritten(
        model,
        [skip_rms_norm],
        target="onnxruntime",
        enable=["skip-rms-norm"],
        counts={"skip-rms-norm": 1},
        expected_ops=["MatMul", "SkipSimplifiedLayerNormalization", "Add"],
        feeds=feeds("x", "residual"),
        **TOL,
    )
    (fused,) = nodes_of(after, "SkipSimplifiedLayerNormalization")
    assert list(fused.input) == ["proj", "residual", "gamma", "bias"]
    assert attrs_of(fused)["epsilon"] == np.float32(1e-6)


def test_weight_and_bias_after_a_skip_norm_fold_into_it():
    extra = [helper.make_node("Mul", ["norm", "g"], ["scaled"]), helper.make_node("Add", ["scaled", "c"], ["shifted"])]
    model = projection_residual_norm(extra=extra)
    after, _ = assert_rewritten(
        model,
        [skip_layer_norm, norm_scale_fold, norm_bias_fold],
        target="onnxruntime",
        enable=["skip-layer-norm"],
        counts={"skip-layer-norm": 1, "norm-scale-fold": 1, "norm-bias-fold": 1},
        expected_ops=["MatMul", "SkipLayerNormalization", "Add"],
        feeds=feeds("x", "residual"),
        **TOL,
    )
    (fused,) = nodes_of(after, "SkipLayerNormalization")
    assert fused.output[3] == "sum"


def test_weight_after_a_skip_rms_norm_folds_into_it():
    model = projection_residual_norm("RMSNormalization", extra=[helper.make_node("Mul", ["g", "norm"], ["scaled"])])
    assert_rewritten(
        model,
        [skip_rms_norm, norm_scale_fold],
        target="onnxruntime",
        enable=["skip-rms-norm"],
        counts={"skip-rms-norm": 1, "norm-scale-fold": 1},
        expected_ops=["MatMul", "SkipSimplifiedLayerNormalization", "Add"],
        feeds=feeds("x", "residual"),
        **TOL,
    )
