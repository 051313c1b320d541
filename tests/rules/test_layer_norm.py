"""Tests for layer-norm and layer-norm-ort (rules/layer_norm.py):
(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps)  =>  LayerNormalization(x, ones, axis, eps).

Every spelling of the pattern tuple is built (square Pow(d, 2) or d * d; division Div or Mul
by Reciprocal), rewritten with exactly the rule under test (fuser's own onnxruntime check on),
and both models are run in onnxruntime (CPU, graph optimizations off) on seeded inputs, and
the result is compared with a float64 numpy layer norm.

Tolerances (|after - before| <= atol + rtol * |before|; see transformer_models.TOL):
  float32  rtol 1e-4, atol 1e-5
  float16  rtol 1e-2, atol 1e-2 (the written-out form rounds each step to float16)
  float64  rtol 1e-9, atol 1e-12
Against numpy: float32 rtol 1e-4/atol 1e-4, float16 2e-2/2e-2, float64 1e-9/1e-12,
bfloat16 (after model only) 3e-2/3e-2.

Opsets: LayerNormalization is standard from opset 17 (layer-norm, target onnx); below 17
layer-norm-ort writes it for onnxruntime, which registers it at every opset, and leaves a note
(onnx.checker rejects such a model, so those tests skip the checker). ReduceMean takes its
axes as an attribute before opset 18 and as an input from 18.

Runtime facts (onnxruntime 1.32 CPU, checked): Sub/Pow/Mul/Div/Sqrt/Reciprocal/ReduceMean
run in float16/32/64 but not bfloat16; LayerNormalization runs in bfloat16. So a bfloat16
model is rewritten without fuser's check and only the rewritten model is run.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from fuser.rules.layer_norm import layer_norm, layer_norm_ort
from onnx import helper

import fuser
from tests.helpers import (
    assert_declined,
    assert_rewritten,
    assert_same_outputs,
    attrs_of,
    make_model,
    nodes_of,
    op_types,
    run,
)
from tests.rules.transformer_models import TOL, feeds_for, layer_norm_nodes, np_layer_norm

REF_TOL = {
    np.float32: dict(rtol=1e-4, atol=1e-4),
    np.float16: dict(rtol=2e-2, atol=2e-2),
    np.float64: dict(rtol=1e-9, atol=1e-12),
}
SPELLINGS = [(s, d) for s in ("pow", "mul") for d in ("div", "reciprocal")]
SPELLING_IDS = [f"{s}-{d}" for s, d in SPELLINGS]
SHAPE = ["batch", "sequence", 8]
FEED_SHAPE = (2, 3, 8)


def ln_model(shape=SHAPE, dtype=np.float32, opset=17, out_shape=None, extra_nodes=(), extra_outputs=(), **kwargs):
    nodes, inits = layer_norm_nodes(opset=opset, dtype=dtype, **kwargs)
    outputs = [(kwargs.get("y", "y"), dtype, out_shape or [None] * len(shape))] + [
        (o, dtype, [None] * len(shape)) for o in extra_outputs
    ]
    check = np.dtype(dtype).kind == "f" or np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16)
    return make_model(nodes + list(extra_nodes), [("x", dtype, shape)], outputs, inits, opset=opset, check=check)


def rewrite_onnx(model, **kwargs):
    kwargs.setdefault("counts", {"layer-norm": 1})
    kwargs.setdefault("expected_ops", ["LayerNormalization"])
    return assert_rewritten(model, [layer_norm], **kwargs)


def rewrite_ort(model, expected_ops=("LayerNormalization",), counts=None):
    """layer-norm-ort writes LayerNormalization below opset 17, which onnx.checker rejects:
    check counts, ops, the interface and fuser's verdict without the checker."""
    after, report = fuser.optimize(model, rules=[layer_norm_ort], target="onnxruntime", trace=True)
    assert report.counts == (counts or {"layer-norm-ort": 1}), [d.reason for d in report.engine.declined]
    assert op_types(after) == list(expected_ops)
    assert [o.name for o in after.graph.output] == [o.name for o in model.graph.output]
    assert report.verdict.passed
    assert any("onnx.checker rejects" in n for n in report.notes)
    return after, report


# -------------------------------------------------------------------------- positives


@pytest.mark.parametrize("square,division", SPELLINGS, ids=SPELLING_IDS)
@pytest.mark.parametrize("opset", [17, 18, 21])
def test_every_spelling_becomes_layer_normalization(square, division, opset):
    model = ln_model(square=square, division=division, opset=opset, eps=1e-5)
    feeds = feeds_for(FEED_SHAPE)
    after, _ = rewrite_onnx(model, feeds=feeds, **TOL[np.float32])
    (node,) = nodes_of(after, "LayerNormalization")
    assert attrs_of(node)["axis"] == -1
    assert attrs_of(node)["epsilon"] == pytest.approx(1e-5)
    assert list(node.output) == ["y"] and node.input[0] == "x"
    scale = onnx.numpy_helper.to_array(next(t for t in after.graph.initializer if t.name == node.input[1]))
    np.testing.assert_array_equal(scale, np.ones(8, np.float32))
    np.testing.assert_allclose(run(after, feeds)[0], np_layer_norm(feeds["x"], eps=1e-5), **REF_TOL[np.float32])


@pytest.mark.parametrize("square,division", SPELLINGS, ids=SPELLING_IDS)
@pytest.mark.parametrize("opset", [13, 16])
def test_ort_variant_below_opset_17(square, division, opset):
    model = ln_model(square=square, division=division, opset=opset)
    after, _ = rewrite_ort(model)
    feeds = feeds_for(FEED_SHAPE, seed=1)
    assert_same_outputs(model, after, feeds, **TOL[np.float32])
    np.testing.assert_allclose(run(after, feeds)[0], np_layer_norm(feeds["x"]), **REF_TOL[np.float32])


def test_opset_boundaries():
    """layer-norm is skipped at 16 (target onnx: nothing happens), layer-norm-ort at 17."""
    _, report = fuser.optimize(ln_model(opset=16), rules=[layer_norm])
    assert report.counts == {} and "opset 16" in report.engine.skipped_rules["layer-norm"]
    _, report = fuser.optimize(ln_model(opset=17), rules=[layer_norm_ort], target="onnxruntime")
    assert report.counts == {} and "opset 17" in report.engine.skipped_rules["layer-norm-ort"]
    # the onnxruntime target takes the standard rule at 17 and the -ort one below
    after, report = fuser.optimize(ln_model(opset=17), rules=[layer_norm, layer_norm_ort], target="onnxruntime")
    assert report.counts == {"layer-norm": 1} and report.notes == []
    onnx.checker.check_model(after, full_check=True)
    _, report = fuser.optimize(ln_model(opset=16), rules=[layer_norm, layer_norm_ort], target="onnxruntime")
    assert report.counts == {"layer-norm-ort": 1}


def test_layer_norm_ort_is_not_an_onnx_target_rule():
    _, report = fuser.optimize(ln_model(opset=16), rules=[layer_norm_ort], target="onnx")
    assert report.counts == {} and report.rules == []


@pytest.mark.parametrize(
    "axes,shape,axis,scale_shape",
    [
        ([-2, -1], [2, 3, 8], -2, (3, 8)),
        ([1, 2], [2, 3, 8], -2, (3, 8)),
        ([2], [2, 3, 8], -1, (8,)),
        ([0, 1], [4, 8], -2, (4, 8)),
    ],
    ids=["last-two-negative", "last-two-positive", "last-positive", "whole-2d"],
)
def test_trailing_axes(axes, shape, axis, scale_shape):
    model = ln_model(shape=shape, axes=axes, opset=18)
    feeds = feeds_for(tuple(shape))
    after, _ = rewrite_onnx(model, feeds=feeds, **TOL[np.float32])
    (node,) = nodes_of(after, "LayerNormalization")
    assert attrs_of(node)["axis"] == axis
    scale = onnx.numpy_helper.to_array(next(t for t in after.graph.initializer if t.name == node.input[1]))
    assert scale.shape == scale_shape
    np.testing.assert_allclose(run(after, feeds)[0], np_layer_norm(feeds["x"], axis), **REF_TOL[np.float32])


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["fp16", "fp64"])
@pytest.mark.parametrize("opset", [17, 18])
def test_float16_float64(dtype, opset):
    model = ln_model(dtype=dtype, opset=opset, square="mul", division="reciprocal")
    feeds = feeds_for(FEED_SHAPE, dtype)
    after, report = rewrite_onnx(model, feeds=feeds, **TOL[dtype])
    assert report.verdict.outputs[0].dtype == np.dtype(dtype).name
    (node,) = nodes_of(after, "LayerNormalization")
    scale = onnx.numpy_helper.to_array(next(t for t in after.graph.initializer if t.name == node.input[1]))
    assert scale.dtype == dtype
    got = run(after, feeds)[0]
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), np_layer_norm(feeds["x"]), **REF_TOL[dtype])


def test_float16_ort_variant():
    model = ln_model(dtype=np.float16, opset=16)
    after, _ = rewrite_ort(model)
    assert_same_outputs(model, after, feeds_for(FEED_SHAPE, np.float16), **TOL[np.float16])


def test_bfloat16_rewritten_and_runs():
    """onnxruntime has no bfloat16 Sub/Pow/ReduceMean, so the original cannot run there: the
    rewrite is made without the check, and the LayerNormalization it writes (which does run in
    bfloat16) is compared with numpy. onnxruntime's Python API takes no bfloat16 arrays, so the
    model casts a float32 input to bfloat16 and the result back."""
    nodes, inits = layer_norm_nodes(dtype=ml_dtypes.bfloat16)
    to_bf16 = helper.make_node("Cast", ["x32"], ["x"], name="to_bf16", to=onnx.TensorProto.BFLOAT16)
    to_f32 = helper.make_node("Cast", ["y"], ["y32"], name="to_f32", to=onnx.TensorProto.FLOAT)
    model = make_model(
        [to_bf16, *nodes, to_f32], [("x32", np.float32, SHAPE)], [("y32", np.float32, [None] * 3)], inits
    )
    after, report = fuser.optimize(model, rules=[layer_norm], check=False, trace=True)
    assert report.counts == {"layer-norm": 1}, [d.reason for d in report.engine.declined]
    assert op_types(after) == ["Cast", "LayerNormalization", "Cast"]
    onnx.checker.check_model(after, full_check=True)
    x = feeds_for(FEED_SHAPE)["x"]
    got = run(after, {"x32": x})[0]
    expected = np_layer_norm(x.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=3e-2, atol=3e-2)


def test_fixed_batch_and_sequence():
    model = ln_model(shape=[2, 3, 8])
    rewrite_onnx(model, feeds=feeds_for(FEED_SHAPE), **TOL[np.float32])


# ----------------------------------------------------------------- names and consumers


def test_graph_output_name_survives_and_other_consumers_read_it():
    extra = [helper.make_node("Neg", ["encoder/ln:0"], ["z"], name="neg")]
    model = ln_model(y="encoder/ln:0", extra_nodes=extra, extra_outputs=["z"])
    after, _ = rewrite_onnx(
        model, expected_ops=["LayerNormalization", "Neg"], feeds=feeds_for(FEED_SHAPE), **TOL[np.float32]
    )
    assert list(nodes_of(after, "LayerNormalization")[0].output) == ["encoder/ln:0"]
    assert list(nodes_of(after, "Neg")[0].input) == ["encoder/ln:0"]


def test_x_with_other_consumers_stays():
    extra = [helper.make_node("Relu", ["x"], ["r"], name="relu")]
    model = ln_model(extra_nodes=extra, extra_outputs=["r"])
    after, _ = rewrite_onnx(
        model, expected_ops=["LayerNormalization", "Relu"], feeds=feeds_for(FEED_SHAPE), **TOL[np.float32]
    )
    assert list(nodes_of(after, "Relu")[0].input) == ["x"]


def test_two_norms_sharing_constants():
    """Two layer norms (of x and of Relu(x)) read ONE eps and ONE exponent initializer."""
    n1, inits = layer_norm_nodes(y="y1", prefix="a_")
    n2, _ = layer_norm_nodes(x="r", y="y2", prefix="b_")
    for node in n2:
        node.input[:] = [{"b_eps": "a_eps", "b_two": "a_two"}.get(i, i) for i in node.input]
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu")] + n1 + n2
    model = make_model(
        nodes, [("x", np.float32, SHAPE)], [("y1", np.float32, [None] * 3), ("y2", np.float32, [None] * 3)], inits
    )
    after, _ = rewrite_onnx(
        model,
        counts={"layer-norm": 2},
        expected_ops=["Relu", "LayerNormalization", "LayerNormalization"],
        feeds=feeds_for(FEED_SHAPE),
        **TOL[np.float32],
    )
    assert {t.name for t in after.graph.initializer}.isdisjoint({"a_eps", "a_two"})


def test_inside_an_if_branch():
    """A layer norm in the then-branch of an If, reading x from the enclosing graph."""
    nodes, inits = layer_norm_nodes(y="branch_y")
    then_graph = helper.make_graph(
        nodes,
        "then",
        [],
        [helper.make_tensor_value_info("branch_y", onnx.TensorProto.FLOAT, [None, None, 8])],
        [onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    else_graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["else_y"])],
        "else",
        [],
        [helper.make_tensor_value_info("else_y", onnx.TensorProto.FLOAT, [None, None, 8])],
    )
    model = make_model(
        [helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then_graph, else_branch=else_graph)],
        [("cond", np.bool_, []), ("x", np.float32, SHAPE)],
        [("y", np.float32, [None, None, 8])],
    )
    after, report = fuser.optimize(model, rules=[layer_norm], inputs=None, runs=3)
    assert report.counts == {"layer-norm": 1}
    assert report.rewrites[0].scope == "main/if.then_branch"
    onnx.checker.check_model(after, full_check=True)
    branch = next(a.g for a in after.graph.node[0].attribute if a.name == "then_branch")
    assert [n.op_type for n in branch.node] == ["LayerNormalization"]
    x = feeds_for(FEED_SHAPE)["x"]
    for cond in (True, False):
        feeds = {"cond": np.array(cond), "x": x}
        assert_same_outputs(model, after, feeds, **TOL[np.float32])
    np.testing.assert_allclose(run(after, {"cond": np.array(True), "x": x})[0], np_layer_norm(x), **REF_TOL[np.float32])


# --------------------------------------------------------------------------- declines


def test_exponent_three_declined():
    assert_declined(ln_model(two=3.0), layer_norm, "the exponent is 3, not 2")


def test_epsilon_vector_declined():
    assert_declined(ln_model(eps=np.full(8, 1e-5, np.float32)), layer_norm, "epsilon is not a single value")


def test_epsilon_of_higher_rank_declined():
    """A one-element epsilon of rank 4 makes the written-out norm of a 3-D x 4-D."""
    rank = len(SHAPE) + 1
    model = ln_model(eps=np.full((1,) * rank, 1e-5, np.float32), out_shape=[None] * rank)
    assert_declined(model, layer_norm, "epsilon may broadcast x to a higher rank")


@pytest.mark.parametrize("eps", [-1e-5, 2.0])
def test_epsilon_out_of_range_declined(eps):
    assert_declined(ln_model(eps=eps), layer_norm, "is not a small non-negative number")


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("which", ["mean", "var"])
def test_keepdims_0_declined(which, opset):
    """[8, 8, 8] so that the [8, 8] reduction still broadcasts (the model stays valid)."""
    kwargs = {"keepdims": 0, "var_keepdims": 0} if which == "mean" else {"var_keepdims": 0}
    model = ln_model(shape=[8, 8, 8], opset=opset, **kwargs)
    assert_declined(model, layer_norm, "keepdims=0")


@pytest.mark.parametrize("opset", [17, 18])
def test_non_trailing_axis_declined(opset):
    model = ln_model(shape=[2, 8, 8], axes=[1], opset=opset)
    assert_declined(model, layer_norm, "axes [1] are not the trailing axes")


def test_mean_and_variance_over_different_axes_declined():
    model = ln_model(shape=[2, 8, 8], axes=[-1], var_axes=[-2, -1])
    assert_declined(model, layer_norm, "the mean and the variance reduce different axes")


def test_symbolic_normalized_dim_declined():
    model = ln_model(shape=["batch", "sequence", "hidden"])
    assert_declined(model, layer_norm, "are not fixed sizes")


def test_centered_tensor_is_graph_output_declined():
    model = ln_model(extra_outputs=["centered"])
    assert_declined(model, layer_norm, "'centered' (output of sub) is a graph output")


def test_variance_used_elsewhere_declined():
    extra = [helper.make_node("Sqrt", ["var"], ["z"], name="other")]
    model = ln_model(extra_nodes=extra, extra_outputs=["z"])
    assert_declined(model, layer_norm, "'var' (output of var) is used outside the match")


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_input_declined(dtype):
    """Sqrt has no integer types: the model is invalid, and the rule must still say why it
    leaves it alone rather than write an integer LayerNormalization."""
    nodes, inits = layer_norm_nodes(dtype=np.float32)
    inits = {k: (v.astype(dtype) if v.dtype == np.float32 else v) for k, v in inits.items()}
    model = make_model(nodes, [("x", dtype, SHAPE)], [("y", dtype, [None] * 3)], inits, check=False)
    assert_declined(model, layer_norm, f"the input is {np.dtype(dtype).name}", check=False)


def test_different_x_in_mean_and_sub_is_no_match():
    """mean(z) subtracted from x is not a normalization of x."""
    nodes, inits = layer_norm_nodes()
    nodes[0].input[0] = "z"
    model = make_model(
        nodes, [("x", np.float32, SHAPE), ("z", np.float32, SHAPE)], [("y", np.float32, [None] * 3)], inits
    )
    assert_declined(model, layer_norm, None)


@pytest.mark.parametrize(("eps", "fused"), [(0.1, False), (1e-3, False), (1e-4, True), (1e-5, True), (0.5, True)])
def test_a_float64_epsilon_is_fused_only_where_float32_holds_it_closely(eps, fused):
    """The fused op's epsilon is a float32 attribute: 0.1 would move a float64 norm by 3e-9."""
    model = ln_model(dtype=np.float64, eps=eps)
    if fused:
        rewrite_onnx(model, feeds=feeds_for(FEED_SHAPE, np.float64), **TOL[np.float64])
    else:
        assert_declined(model, layer_norm, f"epsilon {eps!r} is not exact as a float32 attribute", check=False)
