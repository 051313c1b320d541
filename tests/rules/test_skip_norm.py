"""Tests for skip-layer-norm and skip-rms-norm (rules/skip_norm.py):
LayerNormalization(a + b)  =>  com.microsoft SkipLayerNormalization(input, skip, s, beta);
RMSNormalization / SimplifiedLayerNormalization(a + b)  =>  SkipSimplifiedLayerNormalization.

The fused kernels' fourth output is the sum; where the residual Add also feeds the next block
(pre-norm GPT-2/Llama) or is a graph output, it stands in for the Add, so the Add disappears.
Both models run in onnxruntime (CPU, graph optimizations off) on seeded inputs.

Tolerances (|after - before| <= atol + rtol * |before|; see transformer_models.TOL):
  float32  rtol 1e-4, atol 1e-5;  float16 rtol 1e-2, atol 1e-2.

Kernel limits (onnxruntime 1.32 CPU, checked): float32/float16 only (float64 declines), 2-D or
3-D input (rank 4 fails at run time, so it declines), a [B, S, H] skip, or [1, S, H] / [S, H]
against a [B, S, H] input, in either Add operand order: the broadcast addend becomes the
second input. Addends whose symbolic dims differ in name cannot be shown equal and decline.
Both rules run in phase 1, after norm-scale-fold / norm-bias-fold: a written-out norm with its
weight and bias behind a residual Add becomes one Skip* node.
SimplifiedLayerNormalization and the com.microsoft ops are unknown to onnx.checker's full
check for the -ort cases, so those tests check fuser's verdict and the interface.
"""

from __future__ import annotations

import numpy as np
import pytest
from fuser.rules.layer_norm import layer_norm_ort
from fuser.rules.norm_affine_fold import norm_bias_fold, norm_scale_fold
from fuser.rules.rms_norm import rms_norm_ort
from fuser.rules.skip_norm import skip_layer_norm, skip_rms_norm
from onnx import helper

import fuser
from tests.helpers import assert_declined, assert_same_outputs, make_model, nodes_of, op_types, opsets_of
from tests.rules.transformer_models import TOL, layer_norm_nodes, rms_norm_nodes

RULES = [skip_layer_norm, skip_rms_norm]
H = 8
RNG = np.random.default_rng(11)
S = RNG.uniform(0.5, 1.5, H)
BETA = RNG.normal(0, 0.5, H)


def skip_model(
    *,
    op="LayerNormalization",
    a_shape=("batch", "sequence", H),
    b_shape=("batch", "sequence", H),
    dtype=np.float32,
    opset=17,
    beta=True,
    swapped=False,
    sum_uses=(),
    y="y",
    check=True,
    scale=None,
    scale_dtype=None,
):
    """a + b -> Norm -> y; sum_uses: "next" (a second Add reads the sum, as the next block's
    residual), "output" (the sum is a graph output). scale_dtype: the scale's and y's, when not
    the addends' (a mixed-precision SimplifiedLayerNormalization)."""
    inputs = ["b", "a"] if swapped else ["a", "b"]
    inits = {"s": np.asarray(S if scale is None else scale, scale_dtype or dtype)}
    norm_inputs = ["sum", "s"]
    if beta and op == "LayerNormalization":
        inits["beta"] = BETA.astype(dtype)
        norm_inputs.append("beta")
    nodes = [
        helper.make_node("Add", inputs, ["sum"], name="residual"),
        helper.make_node(op, norm_inputs, [y], name="norm", axis=-1, epsilon=1e-5),
    ]
    outputs = [(y, scale_dtype or dtype, [None] * len(a_shape))]
    if "next" in sum_uses:
        nodes.append(helper.make_node("Add", ["sum", y], ["next"], name="next_residual"))
        outputs.append(("next", dtype, [None] * len(a_shape)))
    if "output" in sum_uses:
        outputs.append(("sum", dtype, [None] * len(a_shape)))
    graph_inputs = [("a", dtype, list(a_shape)), ("b", dtype, list(b_shape))]
    return make_model(nodes, graph_inputs, outputs, inits, opset=opset, check=check)


SKIP_RULES = ["skip-layer-norm", "skip-rms-norm"]  # off by default (slower kernels on CPU)


def feeds(a_shape=(2, 3, H), b_shape=(2, 3, H), dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal(a_shape).astype(dtype), "b": rng.standard_normal(b_shape).astype(dtype)}


def fuse(model, rules=RULES, counts=None, expected_ops=None):
    enable = [r.name for r in rules if r.name in SKIP_RULES]
    after, report = fuser.optimize(model, rules=list(rules), target="onnxruntime", trace=True, enable=enable)
    if counts is not None:
        assert report.counts == counts, [d.reason for d in report.engine.declined]
    if expected_ops is not None:
        assert op_types(after) == list(expected_ops)
    assert [i.name for i in after.graph.input] == [i.name for i in model.graph.input]
    assert [o.name for o in after.graph.output] == [o.name for o in model.graph.output]
    assert report.verdict.passed
    return after, report


# -------------------------------------------------------------------------- positives


@pytest.mark.parametrize("beta", [True, False], ids=["beta", "no-beta"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_skip_layer_norm(beta, dtype):
    model = skip_model(beta=beta, dtype=dtype)
    after, _ = fuse(model, counts={"skip-layer-norm": 1}, expected_ops=["SkipLayerNormalization"])
    (node,) = nodes_of(after, "SkipLayerNormalization")
    assert node.domain == "com.microsoft" and list(node.input[:2]) == ["a", "b"] and node.output[0] == "y"
    assert len(node.input) == (4 if beta else 3)
    assert opsets_of(after)["com.microsoft"] == 1
    assert_same_outputs(model, after, feeds(dtype=dtype), **TOL[dtype])


@pytest.mark.parametrize("op,opset", [("RMSNormalization", 23), ("SimplifiedLayerNormalization", 17)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_skip_rms_norm(op, opset, dtype):
    model = skip_model(op=op, opset=opset, dtype=dtype, check=op == "RMSNormalization")
    after, _ = fuse(model, counts={"skip-rms-norm": 1}, expected_ops=["SkipSimplifiedLayerNormalization"])
    assert list(after.graph.node[0].input) == ["a", "b", "s"]
    assert_same_outputs(model, after, feeds(dtype=dtype), **TOL[dtype])


@pytest.mark.parametrize("op,opset", [("LayerNormalization", 17), ("SimplifiedLayerNormalization", 17)])
def test_pre_norm_residual_uses_the_fourth_output(op, opset):
    """The sum feeds the norm AND the next block's Add: the fused node's 4th output stands in
    for it, so 2 nodes remain of 3 (Add, Norm, Add)."""
    model = skip_model(op=op, opset=opset, sum_uses=("next",), check=op == "LayerNormalization")
    after, _ = fuse(model)
    assert len(after.graph.node) == 2
    fused, following = after.graph.node
    assert fused.op_type.startswith("Skip") and following.op_type == "Add"
    assert following.input[0] == fused.output[3] and fused.output[3] != ""
    assert_same_outputs(model, after, feeds(), **TOL[np.float32])


def test_sum_as_graph_output_keeps_its_name():
    model = skip_model(sum_uses=("output",))
    after, _ = fuse(model, counts={"skip-layer-norm": 1})
    assert [o.name for o in after.graph.output] == ["y", "sum"]
    produced = {o: n.op_type for n in after.graph.node for o in n.output}
    assert produced["y"] == "SkipLayerNormalization" and "sum" in produced
    assert "Add" not in op_types(after)
    assert_same_outputs(model, after, feeds(), **TOL[np.float32])


@pytest.mark.parametrize("skip_shape", [(1, 3, H), (3, H)], ids=["1xSxH", "SxH"])
@pytest.mark.parametrize("swapped", [False, True], ids=["input-first", "skip-first"])
def test_broadcast_skip_becomes_second_input(skip_shape, swapped):
    model = skip_model(a_shape=(2, 3, H), b_shape=skip_shape, swapped=swapped)
    after, _ = fuse(model, counts={"skip-layer-norm": 1}, expected_ops=["SkipLayerNormalization"])
    assert list(after.graph.node[0].input[:2]) == ["a", "b"]
    assert_same_outputs(model, after, feeds(b_shape=skip_shape), **TOL[np.float32])


def test_two_dimensional_input():
    model = skip_model(a_shape=("tokens", H), b_shape=("tokens", H))
    after, _ = fuse(model, counts={"skip-layer-norm": 1})
    assert_same_outputs(model, after, feeds((6, H), (6, H)), **TOL[np.float32])


def test_shared_scale_across_two_blocks():
    """Two residual norms read ONE scale and bias initializer (tied weights)."""
    nodes = [
        helper.make_node("Add", ["a", "b"], ["sum1"], name="res1"),
        helper.make_node("LayerNormalization", ["sum1", "s", "beta"], ["y1"], name="norm1"),
        helper.make_node("Add", ["sum1", "y1"], ["sum2"], name="res2"),
        helper.make_node("LayerNormalization", ["sum2", "s", "beta"], ["y2"], name="norm2"),
    ]
    inits = {"s": S.astype(np.float32), "beta": BETA.astype(np.float32)}
    shape = ["batch", "sequence", H]
    model = make_model(
        nodes, [("a", np.float32, shape), ("b", np.float32, shape)], [("y2", np.float32, [None] * 3)], inits
    )
    after, _ = fuse(model, counts={"skip-layer-norm": 2})
    assert op_types(after) == ["SkipLayerNormalization", "SkipLayerNormalization"]
    assert_same_outputs(model, after, feeds(), **TOL[np.float32])


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_written_out_norm_with_weight_becomes_one_skip_node(kind):
    """Regression: the norm's weight Mul and bias Add fold before the Skip* fusion (phase 1),
    so none stays behind the fused node. Opset 16, as legacy exports of BERT/Llama."""
    if kind == "layer":
        nodes, inits = layer_norm_nodes(x="sum", y="n", opset=16)
        rules = [layer_norm_ort, norm_scale_fold, norm_bias_fold, skip_layer_norm]
        expected = "SkipLayerNormalization"
    else:
        nodes, inits = rms_norm_nodes(x="sum", y="n", opset=16)
        rules = [rms_norm_ort, norm_scale_fold, skip_rms_norm]
        expected = "SkipSimplifiedLayerNormalization"
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"], name="residual"), *nodes]
    nodes.append(helper.make_node("Mul", ["n", "g"], ["w" if kind == "layer" else "y"], name="weight"))
    inits["g"] = S.astype(np.float32)
    if kind == "layer":
        nodes.append(helper.make_node("Add", ["w", "c"], ["y"], name="bias"))
        inits["c"] = BETA.astype(np.float32)
    nodes.append(helper.make_node("Add", ["sum", "y"], ["next"], name="next_residual"))
    shape = ["batch", "sequence", H]
    model = make_model(
        nodes,
        [("a", np.float32, shape), ("b", np.float32, shape)],
        [("next", np.float32, [None] * 3)],
        inits,
        opset=16,
    )
    after, _ = fuse(model, rules=rules, expected_ops=[expected, "Add"])
    assert_same_outputs(model, after, feeds(), **TOL[np.float32])


# --------------------------------------------------------------------------- declines


def test_float64_declined():
    model = skip_model(dtype=np.float64)
    assert_declined(model, skip_layer_norm, "the input is float64", target="onnxruntime", enable=["skip-layer-norm"])


def test_mixed_precision_norm_declined():
    """A float16 sum normalized with a float32 scale and result (norm-cast-fold-ort makes these
    from a float16 Llama's RMSNorm): the Skip kernels take one type for input, scale and result."""
    model = skip_model(op="SimplifiedLayerNormalization", dtype=np.float16, scale_dtype=np.float32, check=False)
    assert_declined(
        model,
        skip_rms_norm,
        "the norm's scale is float32, its input float16",
        target="onnxruntime",
        enable=["skip-rms-norm"],
    )


def test_rank_4_declined():
    shape = ("batch", 2, 3, H)
    assert_declined(
        skip_model(a_shape=shape, b_shape=shape),
        skip_layer_norm,
        "the kernel takes 2-D or 3-D inputs",
        target="onnxruntime",
        enable=["skip-layer-norm"],
    )


def test_differently_named_symbolic_dims_declined():
    """[batch, seq, H] + [n, seq, H]: n may be 1 where batch is not; Add broadcasts, the kernel
    would not."""
    model = skip_model(b_shape=("n", "sequence", H))
    assert_declined(
        model, skip_layer_norm, "are not provably the same", target="onnxruntime", enable=["skip-layer-norm"]
    )


def test_batch_one_input_with_batch_skip_is_swapped():
    """A [2, S, H] skip against a [1, S, H] input is fine for Add (broadcast), and would be
    fine for the kernel with the operands swapped: it is accepted that way round."""
    model = skip_model(a_shape=(1, 3, H), b_shape=(2, 3, H))
    after, _ = fuse(model, counts={"skip-layer-norm": 1})
    assert list(after.graph.node[0].input[:2]) == ["b", "a"]
    assert_same_outputs(model, after, feeds((1, 3, H), (2, 3, H)), **TOL[np.float32])


def test_unbroadcastable_shapes_declined():
    """[2, 1, H] + [1, 3, H] broadcasts both ways: neither operand is the kernel's input."""
    model = skip_model(a_shape=(2, 1, H), b_shape=(1, 3, H))
    assert_declined(
        model, skip_layer_norm, "are not provably the same", target="onnxruntime", enable=["skip-layer-norm"]
    )


def test_not_last_axis_declined():
    nodes = [
        helper.make_node("Add", ["a", "b"], ["sum"], name="residual"),
        helper.make_node("LayerNormalization", ["sum", "s"], ["y"], name="norm", axis=-2),
    ]
    shape = ["batch", 3, H]
    model = make_model(
        nodes,
        [("a", np.float32, shape), ("b", np.float32, shape)],
        [("y", np.float32, [None] * 3)],
        {"s": np.ones((3, H), np.float32)},
    )
    assert_declined(
        model, skip_layer_norm, "not over the last axis only", target="onnxruntime", enable=["skip-layer-norm"]
    )


def test_sum_is_graph_output_and_feeds_the_next_block():
    """The sum is a graph output and feeds the next Add: both read the fused node's 4th output,
    under the name "sum" (kept by an Identity or by renaming)."""
    model = skip_model(sum_uses=("next", "output"))
    after, _ = fuse(model, counts={"skip-layer-norm": 1})
    assert "Add" in op_types(after) and op_types(after).count("Add") == 1
    assert_same_outputs(model, after, feeds(), **TOL[np.float32])
