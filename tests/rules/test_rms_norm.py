"""Tests for rms-norm and rms-norm-ort (rules/rms_norm.py):
x / sqrt(mean(x^2) + eps)  =>  RMSNormalization(x, ones, axis, eps) at opset 23 and later, or
onnxruntime's SimplifiedLayerNormalization (target onnxruntime) below 23.

Every spelling of the pattern tuple is built (square Pow(x, 2) or x * x; division Div, Mul by
Reciprocal, or Mul by 1 / sqrt), rewritten with exactly the rule under test (fuser's check on),
and both models are run in onnxruntime (CPU, graph optimizations off) on seeded inputs; the
result is also compared with a float64 numpy RMS norm.

Tolerances (|after - before| <= atol + rtol * |before|; see transformer_models.TOL):
  float32  rtol 1e-4, atol 1e-5
  float16  rtol 1e-2, atol 1e-2
  float64  rtol 1e-9, atol 1e-12
Against numpy: float32 1e-4/1e-4, float16 2e-2/2e-2, float64 1e-9/1e-12.

SimplifiedLayerNormalization is onnxruntime's own operator in the default domain, unknown to
onnx.checker: the -ort tests check the interface and fuser's verdict instead, and that the rule
leaves its note. bfloat16: onnxruntime 1.32 runs no bfloat16 Pow/ReduceMean/Div (nor the
Mul RMSNormalization expands to), so the bfloat16 rewrite is checked structurally only;
rms-norm-ort declines bfloat16 by the rule's own dtype list.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from fuser.rules.rms_norm import rms_norm, rms_norm_ort
from onnx import helper

import fuser
from tests.helpers import (
    assert_declined,
    assert_rewritten,
    assert_same_outputs,
    attrs_of,
    initializer_value,
    make_model,
    nodes_of,
    op_types,
    run,
)
from tests.rules.transformer_models import TOL, feeds_for, np_rms_norm, rms_norm_nodes

REF_TOL = {
    np.float32: dict(rtol=1e-4, atol=1e-4),
    np.float16: dict(rtol=2e-2, atol=2e-2),
    np.float64: dict(rtol=1e-9, atol=1e-12),
}
SPELLINGS = [(s, d) for s in ("pow", "mul") for d in ("div", "reciprocal", "one_div")]
SPELLING_IDS = [f"{s}-{d}" for s, d in SPELLINGS]
SHAPE = ["batch", "sequence", 8]
FEED_SHAPE = (2, 3, 8)


def rms_model(
    shape=SHAPE, dtype=np.float32, opset=23, out_rank=None, extra_nodes=(), extra_outputs=(), check=True, **kwargs
):
    nodes, inits = rms_norm_nodes(opset=opset, dtype=dtype, **kwargs)
    outputs = [(kwargs.get("y", "y"), dtype, [None] * (out_rank or len(shape)))]
    outputs += [(o, dtype, [None] * len(shape)) for o in extra_outputs]
    return make_model(nodes + list(extra_nodes), [("x", dtype, shape)], outputs, inits, opset=opset, check=check)


def rewrite_onnx(model, **kwargs):
    kwargs.setdefault("counts", {"rms-norm": 1})
    kwargs.setdefault("expected_ops", ["RMSNormalization"])
    return assert_rewritten(model, [rms_norm], **kwargs)


def rewrite_ort(model, expected_ops=("SimplifiedLayerNormalization",)):
    after, report = fuser.optimize(model, rules=[rms_norm_ort], target="onnxruntime", trace=True)
    assert report.counts == {"rms-norm-ort": 1}, [d.reason for d in report.engine.declined]
    assert op_types(after) == list(expected_ops)
    assert [o.name for o in after.graph.output] == [o.name for o in model.graph.output]
    assert report.verdict.passed
    assert any("SimplifiedLayerNormalization" in n for n in report.notes)
    return after, report


# -------------------------------------------------------------------------- positives


@pytest.mark.parametrize("square,division", SPELLINGS, ids=SPELLING_IDS)
@pytest.mark.parametrize("opset", [23, 24])
def test_every_spelling_becomes_rms_normalization(square, division, opset):
    model = rms_model(square=square, division=division, opset=opset, eps=1e-6)
    feeds = feeds_for(FEED_SHAPE)
    after, _ = rewrite_onnx(model, feeds=feeds, **TOL[np.float32])
    (node,) = nodes_of(after, "RMSNormalization")
    assert attrs_of(node)["axis"] == -1 and attrs_of(node)["epsilon"] == pytest.approx(1e-6)
    assert list(node.input[:1]) == ["x"] and list(node.output) == ["y"]
    np.testing.assert_array_equal(initializer_value(after, node.input[1]), np.ones(8, np.float32))
    np.testing.assert_allclose(run(after, feeds)[0], np_rms_norm(feeds["x"]), **REF_TOL[np.float32])


@pytest.mark.parametrize("square,division", SPELLINGS, ids=SPELLING_IDS)
@pytest.mark.parametrize("opset", [17, 22])
def test_ort_variant_below_opset_23(square, division, opset):
    model = rms_model(square=square, division=division, opset=opset)
    after, _ = rewrite_ort(model)
    (node,) = nodes_of(after, "SimplifiedLayerNormalization")
    assert node.domain == "" and attrs_of(node)["axis"] == -1
    feeds = feeds_for(FEED_SHAPE, seed=2)
    assert_same_outputs(model, after, feeds, **TOL[np.float32])
    np.testing.assert_allclose(run(after, feeds)[0], np_rms_norm(feeds["x"]), **REF_TOL[np.float32])


def test_opset_boundaries():
    _, report = fuser.optimize(rms_model(opset=22), rules=[rms_norm])
    assert report.counts == {} and "opset 22" in report.engine.skipped_rules["rms-norm"]
    _, report = fuser.optimize(rms_model(opset=23), rules=[rms_norm_ort], target="onnxruntime")
    assert report.counts == {} and "opset 23" in report.engine.skipped_rules["rms-norm-ort"]
    _, report = fuser.optimize(rms_model(opset=23), rules=[rms_norm, rms_norm_ort], target="onnxruntime")
    assert report.counts == {"rms-norm": 1}
    _, report = fuser.optimize(rms_model(opset=22), rules=[rms_norm, rms_norm_ort], target="onnxruntime")
    assert report.counts == {"rms-norm-ort": 1}


def test_two_trailing_axes():
    model = rms_model(shape=["batch", 3, 8], axes=[-2, -1])
    feeds = feeds_for(FEED_SHAPE)
    after, _ = rewrite_onnx(model, feeds=feeds, **TOL[np.float32])
    (node,) = nodes_of(after, "RMSNormalization")
    assert attrs_of(node)["axis"] == -2
    assert initializer_value(after, node.input[1]).shape == (3, 8)
    np.testing.assert_allclose(run(after, feeds)[0], np_rms_norm(feeds["x"], -2), **REF_TOL[np.float32])


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["fp16", "fp64"])
def test_float16_float64(dtype):
    model = rms_model(dtype=dtype, division="one_div")
    feeds = feeds_for(FEED_SHAPE, dtype)
    after, report = rewrite_onnx(model, feeds=feeds, **TOL[dtype])
    assert report.verdict.outputs[0].dtype == np.dtype(dtype).name
    got = run(after, feeds)[0]
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), np_rms_norm(feeds["x"]), **REF_TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["fp16", "fp64"])
def test_ort_variant_float16_float64(dtype):
    model = rms_model(dtype=dtype, opset=17)
    after, _ = rewrite_ort(model)
    assert_same_outputs(model, after, feeds_for(FEED_SHAPE, dtype), **TOL[dtype])


def test_bfloat16():
    """rms-norm rewrites bfloat16 (structure only: onnxruntime cannot run either model);
    rms-norm-ort declines it."""
    bf16 = ml_dtypes.bfloat16
    after, report = fuser.optimize(rms_model(dtype=bf16), rules=[rms_norm], check=False, trace=True)
    assert report.counts == {"rms-norm": 1}
    assert op_types(after) == ["RMSNormalization"]
    onnx.checker.check_model(after, full_check=True)
    model = rms_model(dtype=bf16, opset=17)
    assert_declined(model, rms_norm_ort, "the input is bfloat16", check=False, target="onnxruntime")


# ----------------------------------------------------------------- names and consumers


def test_graph_output_name_survives():
    extra = [helper.make_node("Neg", ["block/rms:0"], ["z"], name="neg")]
    model = rms_model(y="block/rms:0", extra_nodes=extra, extra_outputs=["z"])
    after, _ = rewrite_onnx(
        model, expected_ops=["RMSNormalization", "Neg"], feeds=feeds_for(FEED_SHAPE), **TOL[np.float32]
    )
    assert list(nodes_of(after, "RMSNormalization")[0].output) == ["block/rms:0"]


def test_x_with_other_consumers():
    """x is read by the norm and by a residual Add (a graph output): only the norm goes."""
    extra = [helper.make_node("Add", ["x", "y"], ["residual"], name="residual")]
    model = rms_model(extra_nodes=extra, extra_outputs=["residual"])
    after, _ = rewrite_onnx(
        model, expected_ops=["RMSNormalization", "Add"], feeds=feeds_for(FEED_SHAPE), **TOL[np.float32]
    )
    assert list(nodes_of(after, "Add")[0].input) == ["x", "y"]


# --------------------------------------------------------------------------- declines


def test_exponent_three_declined():
    assert_declined(rms_model(two=3.0), rms_norm, "the exponent is 3, not 2")


def test_numerator_two_declined():
    assert_declined(rms_model(division="one_div", one=2.0), rms_norm, "the numerator of the reciprocal is 2, not 1")


def test_epsilon_of_higher_rank_declined():
    """A one-element epsilon of rank 4 makes the written-out norm of a 3-D x 4-D."""
    rank = len(SHAPE) + 1
    model = rms_model(eps=np.full((1,) * rank, 1e-6, np.float32), out_rank=rank)
    assert_declined(model, rms_norm, "epsilon may broadcast x to a higher rank")


def test_epsilon_vector_declined():
    assert_declined(rms_model(eps=np.full(8, 1e-6, np.float32)), rms_norm, "epsilon is not a single value")


def test_keepdims_0_declined():
    model = rms_model(shape=[8, 8, 8], keepdims=0)
    assert_declined(model, rms_norm, "keepdims=0")


def test_non_trailing_axis_declined():
    model = rms_model(shape=[2, 8, 8], axes=[1])
    assert_declined(model, rms_norm, "axes [1] are not the trailing axes")


@pytest.mark.parametrize(
    "shape,axes", [(["batch", "sequence", "hidden"], [-1]), (SHAPE, [-2, -1])], ids=["hidden", "sequence"]
)
def test_symbolic_normalized_dim_declined(shape, axes):
    assert_declined(rms_model(shape=shape, axes=axes), rms_norm, "are not fixed sizes")


def test_mean_square_is_graph_output_declined():
    assert_declined(rms_model(extra_outputs=["ms"]), rms_norm, "'ms' (output of mean) is a graph output")


def test_square_used_elsewhere_declined():
    extra = [helper.make_node("Neg", ["sq"], ["z"], name="other")]
    model = rms_model(extra_nodes=extra, extra_outputs=["z"])
    assert_declined(model, rms_norm, "'sq' (output of square) is used outside the match")


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_input_declined(dtype):
    nodes, inits = rms_norm_nodes()
    inits = {k: (v.astype(dtype) if v.dtype == np.float32 else v) for k, v in inits.items()}
    model = make_model(nodes, [("x", dtype, SHAPE)], [("y", dtype, [None] * 3)], inits, opset=23, check=False)
    assert_declined(model, rms_norm, f"the input is {np.dtype(dtype).name}", check=False)


def test_different_tensors_in_square_and_division_is_no_match():
    nodes, inits = rms_norm_nodes()
    nodes[-1].input[0] = "z"
    model = make_model(
        nodes, [("x", np.float32, SHAPE), ("z", np.float32, SHAPE)], [("y", np.float32, [None] * 3)], inits, opset=23
    )
    assert_declined(model, rms_norm, None)
