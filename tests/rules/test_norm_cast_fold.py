"""Tests for norm-cast-fold-ort and norm-cast-fold (rules/norm_cast_fold.py), and
norm-scale-through-cast (rules/norm_scale_through_cast.py): the Casts around a float32
normalization of float16 data, and the float16 weight after the Cast back.

The models are x (float16) -> Cast(float32) -> LayerNormalization / RMSNormalization /
SimplifiedLayerNormalization -> Cast(float16), optionally followed by the float16 weight Mul of
a Llama RMSNorm, and the written-out float16 Llama RMSNorm itself (normalized in float32, cast
back, times the weight), fused by the norm rules first. Both models run in onnxruntime (CPU,
graph optimizations off).

norm-cast-fold-ort and norm-scale-through-cast give the bits onnxruntime gives for the model
(asserted): Cast up is exact and read in float32 alike, and onnxruntime multiplies a float16
Mul in float32 without the Cast down before it. norm-cast-fold (off by default) computes the
ONNX function of the model's norm (bit-identical with a scale of ones), but rounds where
onnxruntime's run of the model does not, so with a weight after it the two differ by float16
rounding (transformer_models.TOL: rtol 1e-2, atol 1e-2).

Declines: a scale or bias that float16 cannot hold exactly, inputs of other types than float16,
a result cast to another type, a weight that varies outside the normalized axes, float32
tensors used elsewhere. SimplifiedLayerNormalization is unknown to onnx.checker, so its tests
check fuser's verdict.
"""

from __future__ import annotations

import numpy as np
import pytest
from fuser.rules.norm_affine_fold import norm_scale_fold
from fuser.rules.norm_cast_fold import norm_cast_fold, norm_cast_fold_ort
from fuser.rules.norm_scale_through_cast import norm_scale_through_cast
from fuser.rules.rms_norm import rms_norm, rms_norm_ort
from onnx import TensorProto, helper

import fuser
from tests.helpers import assert_declined, assert_rewritten, assert_same_outputs, initializer_value, make_model
from tests.helpers import nodes_of, op_types
from tests.rules.transformer_models import TOL, feeds_for

RULE = "norm-cast-fold"
ORT_RULE = "norm-cast-fold-ort"
THROUGH = "norm-scale-through-cast"
H = 16
SHAPE = ["batch", "sequence", H]
FEEDS = feeds_for((2, 5, H), np.float16, scale=3.0)
RNG = np.random.default_rng(3)
WEIGHT = RNG.uniform(0.5, 1.5, H).astype(np.float16)
BIAS = RNG.normal(0, 0.5, H).astype(np.float16)
OPSETS = {"LayerNormalization": 17, "RMSNormalization": 23, "SimplifiedLayerNormalization": 17}


def cast_norm_model(
    op="LayerNormalization",
    *,
    scale=None,
    bias=None,
    dtype=np.float16,
    back_to=TensorProto.FLOAT16,
    weight=False,
    weight_shape=(H,),
    float_output=None,
):
    """x -> Cast(float32) -> op(., scale[, bias]) -> Cast(back_to) [-> Mul(float16 weight)] -> y.
    scale/bias: float32 arrays (scale defaults to ones); float_output: "xf" or "n", a float32
    tensor also given as a graph output."""
    inits = {"s": np.ones(H, np.float32) if scale is None else np.asarray(scale, np.float32)}
    norm_inputs = ["xf", "s"]
    if bias is not None:
        inits["b"] = np.asarray(bias, np.float32)
        norm_inputs.append("b")
    nodes = [
        helper.make_node("Cast", ["x"], ["xf"], name="up", to=TensorProto.FLOAT),
        helper.make_node(op, norm_inputs, ["n"], name="norm", axis=-1, epsilon=1e-6),
        helper.make_node("Cast", ["n"], ["back" if weight else "y"], name="down", to=back_to),
    ]
    if weight:
        inits["w"] = np.broadcast_to(WEIGHT, weight_shape).copy()
        nodes.append(helper.make_node("Mul", ["w", "back"], ["y"], name="weight"))
    out_dtype = helper.tensor_dtype_to_np_dtype(back_to)
    outputs = [("y", out_dtype, [None] * 3)] + ([(float_output, np.float32, [None] * 3)] if float_output else [])
    check = op != "SimplifiedLayerNormalization"
    return make_model(nodes, [("x", dtype, SHAPE)], outputs, inits, opset=OPSETS[op], check=check)


def written_out_llama_rms(opset):
    """HF Llama's RMSNorm in float16 as torch.onnx writes it: x.to(float32), x * 1/sqrt(mean(x²) + eps),
    .to(float16), weight * that."""
    inits = {
        "two": np.array(2, np.float32),
        "eps": np.array(1e-6, np.float32),
        "one": np.array(1, np.float32),
        "w": WEIGHT,
        "axes": np.array([-1], np.int64),
    }
    nodes = [
        helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
        helper.make_node("Pow", ["xf", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["ms_eps"]),
        helper.make_node("Sqrt", ["ms_eps"], ["rms"]),
        helper.make_node("Div", ["one", "rms"], ["inv"]),
        helper.make_node("Mul", ["xf", "inv"], ["n"]),
        helper.make_node("Cast", ["n"], ["n16"], to=TensorProto.FLOAT16),
        helper.make_node("Mul", ["w", "n16"], ["y"]),
    ]
    return make_model(nodes, [("x", np.float16, SHAPE)], [("y", np.float16, SHAPE)], inits, opset=opset)


@pytest.mark.parametrize("op", ["LayerNormalization", "RMSNormalization"])
def test_a_norm_of_ones_between_casts_computes_the_same_on_float16(op):
    model = cast_norm_model(op)
    after, _ = assert_rewritten(model, norm_cast_fold, counts={RULE: 1}, expected_ops=[op], feeds=FEEDS, enable=[RULE])
    (norm,) = nodes_of(after, op)
    assert norm.input[0] == "x" and initializer_value(after, norm.input[1]).dtype == np.float16


def test_simplified_layer_normalization_between_casts():
    model = cast_norm_model("SimplifiedLayerNormalization")
    after, report = fuser.optimize(model, rules=[norm_cast_fold], target="onnxruntime", enable=[RULE])
    assert report.counts == {RULE: 1} and report.verdict.passed
    assert op_types(after) == ["SimplifiedLayerNormalization"]
    assert_same_outputs(model, after, FEEDS, rtol=0, atol=0)


def test_the_weight_after_the_cast_back_is_left_to_norm_scale_fold():
    """Alone, the rule keeps the float16 weight Mul. onnxruntime runs a float16 Mul in float32
    and drops a Cast to float16 right before it, so the model multiplies the unrounded
    normalized values: the two differ by float16 rounding until the weight is folded too."""
    model = cast_norm_model("SimplifiedLayerNormalization", weight=True)
    after, report = fuser.optimize(model, rules=[norm_cast_fold], target="onnxruntime", enable=[RULE])
    assert report.counts == {RULE: 1} and report.verdict.passed
    assert op_types(after) == ["SimplifiedLayerNormalization", "Mul"]
    assert_same_outputs(model, after, FEEDS, **TOL[np.float16])


def test_learned_scale_and_bias_that_float16_holds_fold_within_its_tolerance():
    model = cast_norm_model(scale=WEIGHT.astype(np.float32), bias=BIAS.astype(np.float32))
    after, _ = assert_rewritten(
        model,
        norm_cast_fold,
        counts={RULE: 1},
        expected_ops=["LayerNormalization"],
        feeds=FEEDS,
        **TOL[np.float16],
        enable=[RULE],
    )
    (norm,) = nodes_of(after, "LayerNormalization")
    np.testing.assert_array_equal(initializer_value(after, norm.input[1]), WEIGHT)
    np.testing.assert_array_equal(initializer_value(after, norm.input[2]), BIAS)


def test_written_out_float16_llama_rms_norm_on_the_onnxruntime_target():
    """rms-norm-ort fuses the float32 core, norm-cast-fold-ort takes the Cast up in, and the
    float16 weight after the Cast back folds into the float32 scale: a norm and a Cast, with
    the bits onnxruntime gives for the model."""
    model = written_out_llama_rms(opset=18)
    after, report = fuser.optimize(
        model, rules=[rms_norm_ort, norm_cast_fold_ort, norm_scale_through_cast], target="onnxruntime", inputs=FEEDS
    )
    assert report.counts == {"rms-norm-ort": 1, ORT_RULE: 1, THROUGH: 1} and report.verdict.passed
    assert op_types(after) == ["SimplifiedLayerNormalization", "Cast"]
    norm = after.graph.node[0]
    assert norm.input[0] == "x"
    np.testing.assert_array_equal(initializer_value(after, norm.input[1]), WEIGHT.astype(np.float32))
    assert_same_outputs(model, after, FEEDS, rtol=0, atol=0)


def test_written_out_float16_llama_rms_norm_at_opset_23():
    """The standard RMSNormalization takes one type for input, scale and result: the Cast up
    stays, the weight folds."""
    model = written_out_llama_rms(opset=23)
    assert_rewritten(
        model,
        [rms_norm, norm_cast_fold_ort, norm_scale_through_cast],
        counts={"rms-norm": 1, THROUGH: 1},
        expected_ops=["Cast", "RMSNormalization", "Cast"],
        feeds=FEEDS,
        **TOL[np.float16],
    )


def test_the_full_fold_then_its_weight():
    """norm-cast-fold with norm-scale-fold after it: one float16 norm with the weight."""
    model = written_out_llama_rms(opset=18)
    after, report = fuser.optimize(
        model, rules=[rms_norm_ort, norm_cast_fold, norm_scale_fold], target="onnxruntime", enable=[RULE], inputs=FEEDS
    )
    assert report.counts == {"rms-norm-ort": 1, RULE: 1, "norm-scale-fold": 1} and report.verdict.passed
    assert op_types(after) == ["SimplifiedLayerNormalization"]
    np.testing.assert_array_equal(initializer_value(after, after.graph.node[0].input[1]), WEIGHT)
    assert_same_outputs(model, after, FEEDS, **TOL[np.float16])


def test_norm_cast_fold_is_off_by_default():
    model = written_out_llama_rms(opset=18)
    _, report = fuser.optimize(model, target="onnxruntime", inputs=FEEDS)
    assert RULE not in report.counts and report.counts.get(ORT_RULE) == 1


def test_mixed_precision_simplified_layer_normalization():
    model = cast_norm_model("SimplifiedLayerNormalization", weight=True)
    after, report = fuser.optimize(model, rules=[norm_cast_fold_ort], target="onnxruntime")
    assert report.counts == {ORT_RULE: 1} and report.verdict.passed
    assert op_types(after) == ["SimplifiedLayerNormalization", "Cast", "Mul"]
    assert after.graph.node[0].input[0] == "x"
    assert_same_outputs(model, after, FEEDS, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["LayerNormalization", "RMSNormalization"])
def test_norm_cast_fold_ort_takes_only_simplified_layer_normalization(op):
    """onnxruntime's LayerNormalization and RMSNormalization want one type for x and the scale."""
    assert_declined(cast_norm_model(op), norm_cast_fold_ort, None, target="onnxruntime")


def test_weight_through_the_cast_of_a_layer_norm_with_bias():
    model = cast_norm_model(scale=WEIGHT.astype(np.float32), bias=BIAS.astype(np.float32), weight=True)
    after, _ = assert_rewritten(
        model,
        norm_scale_through_cast,
        counts={THROUGH: 1},
        expected_ops=["Cast", "LayerNormalization", "Cast"],
        feeds=FEEDS,
        **TOL[np.float16],
    )
    norm = after.graph.node[1]
    w = WEIGHT.astype(np.float64)
    np.testing.assert_allclose(initializer_value(after, norm.input[1]), WEIGHT.astype(np.float64) * w, rtol=1e-6)
    np.testing.assert_allclose(initializer_value(after, norm.input[2]), BIAS.astype(np.float64) * w, rtol=1e-6)


def test_weight_varying_outside_the_normalized_axes_is_declined():
    model = cast_norm_model(weight=True, weight_shape=(5, H))
    assert_declined(model, norm_scale_through_cast, "varies outside the normalized axes")


def test_weight_after_a_cast_to_another_type_is_declined():
    model = cast_norm_model(back_to=TensorProto.DOUBLE)
    model.graph.node.append(helper.make_node("Mul", ["y", "y"], ["unused"]))  # not a constant: no match either
    assert_declined(model, norm_scale_through_cast, None)


def test_cast_result_used_elsewhere_is_declined():
    model = cast_norm_model(weight=True)
    model.graph.output.append(helper.make_tensor_value_info("back", TensorProto.FLOAT16, None))
    assert_declined(model, norm_scale_through_cast, "'back' (output of down) is a graph output")


def test_a_scale_float16_cannot_hold_is_declined():
    model = cast_norm_model(scale=np.full(H, 0.1, np.float32))
    assert_declined(model, norm_cast_fold, "the scale does not convert to float16 exactly", enable=[RULE])


def test_a_bias_float16_cannot_hold_is_declined():
    model = cast_norm_model(bias=np.full(H, 1e-6, np.float32))
    assert_declined(model, norm_cast_fold, "the bias does not convert to float16 exactly", enable=[RULE])


def test_a_float64_input_is_declined():
    """Normalizing float64 in float32 loses precision the fused norm on float64 would keep."""
    model = cast_norm_model(dtype=np.float64, back_to=TensorProto.DOUBLE)
    assert_declined(model, norm_cast_fold, "the norm's input is cast from float64, not from float16", enable=[RULE])


def test_a_result_cast_to_another_type_is_declined():
    model = cast_norm_model(back_to=TensorProto.DOUBLE)
    assert_declined(model, norm_cast_fold, "the result is not cast back to float16", enable=[RULE])


@pytest.mark.parametrize("tensor, producer", [("xf", "up"), ("n", "norm")])
def test_float32_tensors_used_elsewhere_are_declined(tensor, producer):
    model = cast_norm_model(float_output=tensor)
    assert_declined(model, norm_cast_fold, f"'{tensor}' (output of {producer}) is a graph output", enable=[RULE])
