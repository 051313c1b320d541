"""Tests for the onnxruntime-target rule fused-gemm (rules/fused_gemm.py), its composition with
matmul-add-gemm, and all built-in rules on the shipped mlp sample model.

Positive tests build Gemm -> activation models, rewrite them with
`fuser.optimize(model, rules=[fused_gemm], target="onnxruntime")`, check that one com.microsoft
FusedGemm remains with Gemm's alpha/beta/transA/transB and the activation's parameters, that the
model declares the com.microsoft opset, pass the full ONNX checker, and compare outputs in
onnxruntime (graph optimizations disabled) with the tolerances stated below.

Runtime facts this file relies on (onnxruntime 1.32, CPUExecutionProvider):
* FusedGemm runs float32 and float16 on the CPU (float16 models are checked in onnxruntime);
  there is no float64 FusedGemm, so the rule declines float64.
* FusedGemm's C input is optional (Gemm without C fuses).
* Gemm-6 (opset 6) has no CPU kernel in onnxruntime; opset 6 models are optimized with check=False.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

import fuser
from fuser.rules.fused_gemm import fused_gemm
from fuser.rules.matmul_add_gemm import matmul_add_gemm
from tests.helpers import (
    assert_declined,
    assert_rewritten,
    assert_same_outputs,
    attrs_of,
    make_model,
    nodes_of,
    op_types,
    opsets_of,
)

RULE = "fused-gemm"
MS = "com.microsoft"
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
FP16_TOL = dict(rtol=1e-2, atol=1e-2)
M, K, N = 3, 4, 5
MODELS = Path(__file__).resolve().parents[2] / "models"


# --------------------------------------------------------------------------- builders


def gemm_act_model(
    act: str = "Relu",
    act_attrs: dict | None = None,
    *,
    gemm_attrs: dict | None = None,
    c_shape: tuple | None = (N,),
    dtype=np.float32,
    opset: int = 17,
    output: str = "y",
    extra_opsets: dict | None = None,
    seed: int = 0,
):
    """a -> Gemm(w[, c]) -> act -> `output`; returns (model, feeds). transA/transB flip the
    stored layouts of a and w so the product is always [M, N]."""
    rng = np.random.default_rng(seed)
    attrs = dict(gemm_attrs or {})
    a_shape = (K, M) if attrs.get("transA") else (M, K)
    w_shape = (N, K) if attrs.get("transB") else (K, N)
    inits = {"w": (rng.standard_normal(w_shape) / 2).astype(dtype)}
    inputs = ["a", "w"]
    if c_shape is not None:
        inits["c"] = np.asarray(rng.standard_normal(c_shape)).astype(dtype)
        inputs.append("c")
    extra = {}
    if opset < 7:
        extra["broadcast"] = 1
    nodes = [
        helper.make_node("Gemm", inputs, ["gemm_out"], name="gemm", **attrs, **extra),
        helper.make_node(act, ["gemm_out"], [output], name="act", **(act_attrs or {})),
    ]
    model = make_model(
        nodes, [("a", dtype, list(a_shape))], [(output, dtype, [M, N])], inits, opset=opset, extra_opsets=extra_opsets
    )
    return model, {"a": rng.standard_normal(a_shape).astype(dtype)}


def fuse(model, feeds, *, rules=(fused_gemm,), counts=None, expected_ops=("FusedGemm",), tol=FP32_TOL):
    """Optimize for onnxruntime with `rules` (fused-gemm alone by default); check structure,
    interface, validity, the numerics check, the outputs in onnxruntime within `tol`, and that
    every FusedGemm is in the com.microsoft domain (imported at version 1)."""
    after, report = assert_rewritten(
        model, rules, counts=counts or {RULE: 1}, expected_ops=expected_ops, target="onnxruntime", feeds=feeds, **tol
    )
    assert opsets_of(after).get(MS) == 1
    assert all(n.domain == MS for n in nodes_of(after, "FusedGemm"))
    return after, report


def assert_not_fused(model, reason: str | None):
    """fused-gemm must not fire (declines are made at the activation); no com.microsoft opset."""
    after, report = assert_declined(model, fused_gemm, reason, node="act", target="onnxruntime")
    assert MS not in opsets_of(after)
    return after, report


# --------------------------------------------------------------------------- positives

ACTIVATIONS = [
    ("Relu", {}, {}),
    ("LeakyRelu", {}, {"activation_alpha": 0.01}),
    ("LeakyRelu", {"alpha": 0.2}, {"activation_alpha": 0.2}),
    ("Sigmoid", {}, {}),
    ("Tanh", {}, {}),
    ("HardSigmoid", {}, {"activation_alpha": 0.2, "activation_beta": 0.5}),
    ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}, {"activation_alpha": 0.3, "activation_beta": 0.4}),
]
ACT_IDS = ["relu", "leaky-default", "leaky-0.2", "sigmoid", "tanh", "hardsigmoid-default", "hardsigmoid-0.3-0.4"]
GEMM_ATTRS = [
    {},
    {"alpha": 0.5, "beta": 2.0},
    {"transA": 1},
    {"transB": 1},
    {"alpha": -1.5, "beta": 0.25, "transA": 1, "transB": 1},
]
GEMM_IDS = ["plain", "alpha-beta", "transA", "transB", "all"]


@pytest.mark.parametrize("gemm_attrs", GEMM_ATTRS, ids=GEMM_IDS)
@pytest.mark.parametrize("act,act_attrs,act_params", ACTIVATIONS, ids=ACT_IDS)
def test_gemm_activation_fused(act, act_attrs, act_params, gemm_attrs):
    model, feeds = gemm_act_model(act, act_attrs, gemm_attrs=gemm_attrs)
    after, _ = fuse(model, feeds)
    (node,) = nodes_of(after, "FusedGemm")
    assert list(node.input) == ["a", "w", "c"] and list(node.output) == ["y"]
    attrs = attrs_of(node)
    assert attrs.pop("activation") == act
    for name, value in act_params.items():
        assert np.float32(attrs.pop(name)) == np.float32(value)
    # Exactly Gemm's own attributes remain, unchanged.
    assert attrs == attrs_of(nodes_of(model, "Gemm")[0])


@pytest.mark.parametrize(
    "c_shape", [None, (N,), (1, N), (M, 1), (M, N), ()], ids=["no-C", "N", "1N", "M1", "MN", "scalar"]
)
def test_bias_shapes(c_shape):
    model, feeds = gemm_act_model("LeakyRelu", {"alpha": 0.1}, c_shape=c_shape, gemm_attrs={"beta": 0.5})
    after, _ = fuse(model, feeds)
    assert len(nodes_of(after, "FusedGemm")[0].input) == (2 if c_shape is None else 3)


@pytest.mark.parametrize("opset", [7, 9, 11, 13, 17])
def test_opsets(opset):
    model, feeds = gemm_act_model("Sigmoid", opset=opset, gemm_attrs={"transB": 1})
    fuse(model, feeds)


@pytest.mark.parametrize("act,act_attrs", [("Relu", {}), ("HardSigmoid", {"alpha": 0.3}), ("Tanh", {})])
def test_float16(act, act_attrs):
    model, feeds = gemm_act_model(act, act_attrs, dtype=np.float16, gemm_attrs={"alpha": 0.5})
    after, _ = fuse(model, feeds, tol=FP16_TOL)
    assert after.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16


def test_existing_microsoft_opset_import_kept():
    model, feeds = gemm_act_model(extra_opsets={MS: 1})
    after, _ = fuse(model, feeds)
    assert [o.domain for o in after.opset_import].count(MS) == 1


def test_activation_output_name_survives():
    model, feeds = gemm_act_model(output="head/relu:0")
    after, _ = fuse(model, feeds)
    assert [o.name for o in after.graph.output] == ["head/relu:0"]


def test_matmul_add_relu_becomes_one_fused_gemm():
    """MatMul + Add + Relu: matmul-add-gemm makes the Gemm, fused-gemm then absorbs the Relu."""
    rng = np.random.default_rng(2)
    inits = {"w": rng.standard_normal((K, N)).astype(np.float32), "c": rng.standard_normal(N).astype(np.float32)}
    nodes = [
        helper.make_node("MatMul", ["a", "w"], ["mm"], name="matmul"),
        helper.make_node("Add", ["c", "mm"], ["h"], name="add"),
        helper.make_node("Relu", ["h"], ["y"], name="act"),
    ]
    model = make_model(nodes, [("a", np.float32, [M, K])], [("y", np.float32, [M, N])], inits)
    feeds = {"a": rng.standard_normal((M, K)).astype(np.float32)}
    after, _ = fuse(model, feeds, rules=[matmul_add_gemm, fused_gemm], counts={"matmul-add-gemm": 1, RULE: 1})
    (node,) = nodes_of(after, "FusedGemm")
    assert list(node.input) == ["a", "w", "c"] and attrs_of(node) == {"activation": "Relu"}
    # Same result with the rules listed the other way round.
    again, report = fuser.optimize(model, rules=[fused_gemm, matmul_add_gemm], target="onnxruntime")
    assert op_types(again) == ["FusedGemm"] and report.verdict.passed


# ------------------------------------------------------------------------ negatives


def test_gemm_output_is_graph_output_declined():
    model, _ = gemm_act_model()
    model.graph.output.append(helper.make_tensor_value_info("gemm_out", onnx.TensorProto.FLOAT, [M, N]))
    assert_not_fused(model, "a graph output")


def test_gemm_output_with_another_consumer_declined():
    model, _ = gemm_act_model()
    model.graph.node.append(helper.make_node("Neg", ["gemm_out"], ["n"], name="neg"))
    model.graph.output.append(helper.make_tensor_value_info("n", onnx.TensorProto.FLOAT, [M, N]))
    assert_not_fused(model, "used outside the match")


def test_float64_declined():
    model, _ = gemm_act_model(dtype=np.float64)
    assert_not_fused(model, "float32/float16, this tensor is float64")


@pytest.mark.parametrize("act", ["Clip", "Elu", "Softplus"])
def test_unsupported_activation_not_matched(act):
    model, _ = gemm_act_model(act)
    assert_not_fused(model, None)


def test_not_selected_for_target_onnx():
    model, _ = gemm_act_model()
    after, report = fuser.optimize(model, rules=[fused_gemm])
    assert report.rules == [] and report.counts == {}
    assert op_types(after) == ["Gemm", "Relu"]


def test_opset6_gemm_broadcast_attribute_not_copied():
    """BUG: Gemm-6 has a `broadcast` attribute that FusedGemm does not know. The rule copies
    every Gemm attribute, so the FusedGemm it builds is rejected by onnxruntime ("Unrecognized
    attribute: broadcast for operator FusedGemm"). (onnxruntime has no Gemm-6 kernel either, so
    this only matters for the validity of the written model; check=False here.)"""
    model, _ = gemm_act_model(opset=6)
    after, report = fuser.optimize(model, rules=[fused_gemm], target="onnxruntime", check=False)
    if report.counts:
        (node,) = nodes_of(after, "FusedGemm")
        assert "broadcast" not in attrs_of(node)


# ------------------------------------------------------------------------ mlp sample


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
def test_mlp_all_rules(target):
    path = MODELS / "mlp.onnx"
    model = onnx.load(path)
    after, report = fuser.optimize(path, target=target)
    assert report.verdict is not None and report.verdict.passed
    onnx.checker.check_model(after, full_check=True)
    assert [o.name for o in after.graph.output] == [o.name for o in model.graph.output]
    assert report.counts["matmul-add-gemm"] == 2
    if target == "onnx":
        assert op_types(after) == ["Gemm", "Relu", "Gemm"]
        assert MS not in opsets_of(after)
    else:
        assert op_types(after) == ["FusedGemm", "Gemm"]
        assert report.counts[RULE] == 1
        assert attrs_of(after.graph.node[0])["activation"] == "Relu"
        assert opsets_of(after)[MS] == 1
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    feeds = {model.graph.input[0].name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    assert_same_outputs(model, after, feeds, rtol=1e-4, atol=1e-5)
