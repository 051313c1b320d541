"""Tests for the conv-mul-scale rule (rules/conv_mul_scale.py), alone and with conv-add-bias.

Every positive test builds a small Conv -> Mul(constant) model, folds it with
`fuser.optimize(model, rules=[conv_mul_scale])`, checks the op sequence and the folded weight
and bias values, runs the full ONNX checker and compares outputs in onnxruntime (graph
optimizations disabled) with the tolerances stated below. Weights, biases and scales are random
and seeded (scales include negative values), so scaling along the wrong weight axis or forgetting
to scale the bias shows up as a numerics failure.

Runtime facts this file relies on (onnxruntime 1.32, CPUExecutionProvider):
* float16 Conv and Mul have CPU kernels, so float16 models are checked in onnxruntime.
* float64 Conv has NO CPU kernel; float64 models are folded with check=False and compared with
  the ONNX reference evaluator (onnx.reference).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import fuser
from fuser.rules.conv_add_bias import conv_add_bias
from fuser.rules.conv_mul_scale import conv_mul_scale
from tests.helpers import (
    assert_declined,
    assert_rewritten,
    assert_same_outputs,
    attrs_of,
    initializer_value,
    make_model,
    nodes_of,
    op_types,
    reference_run,
    run,
)

RULE = "conv-mul-scale"
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
FP16_TOL = dict(rtol=1e-2, atol=1e-2)
FP64_TOL = dict(rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- builders


def conv_mul_model(
    *,
    dims: int = 2,
    c_in: int = 4,
    c_out: int = 6,
    group: int = 1,
    kernel: int = 3,
    size: int = 5,
    batch: int = 2,
    bias: bool = True,
    scale_shape: tuple | None = None,
    scale_first: bool = False,
    dtype=np.float32,
    scale_dtype=None,
    opset: int = 17,
    source: str = "initializer",
    op: str = "Conv",
    conv_attrs: dict | None = None,
    output: str = "y",
    seed: int = 0,
    checked: bool = True,
):
    """x -> Conv(w[, b]) -> Mul(s) -> `output`; returns (model, feeds, constants).

    scale_shape defaults to [C_out, 1, ...]. source: "initializer", "constant" (op Constant
    node), "input" (graph input, not a constant). checked=False skips the ONNX checker.
    """
    rng = np.random.default_rng(seed)
    ks = (kernel,) * dims
    w_shape = (c_out, c_in // group, *ks) if op == "Conv" else (c_in, c_out // group, *ks)
    if scale_shape is None:
        scale_shape = (c_out,) + (1,) * dims
    scale_dtype = dtype if scale_dtype is None else scale_dtype
    constants = {"w": (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(dtype)}
    if bias:
        constants["b"] = rng.normal(0.0, 1.0, c_out).astype(dtype)
    signs = rng.choice([-1, 1], scale_shape)
    constants["s"] = np.asarray(rng.uniform(0.5, 1.5, scale_shape) * signs).astype(scale_dtype)

    nodes = []
    inits = {k: v for k, v in constants.items() if k != "s"}
    inputs = [("x", dtype, [batch, c_in] + [size] * dims)]
    if source == "initializer":
        inits["s"] = constants["s"]
    elif source == "constant":
        value = numpy_helper.from_array(constants["s"], "s")
        nodes.append(helper.make_node("Constant", [], ["s"], name="s_const", value=value))
    elif source == "input":
        inputs.append(("s", scale_dtype, list(scale_shape)))
    else:
        raise ValueError(source)
    conv_inputs = ["x", "w"] + (["b"] if bias else [])
    nodes.append(helper.make_node(op, conv_inputs, ["conv_out"], name="conv", group=group, **(conv_attrs or {})))
    nodes.append(helper.make_node("Mul", ["s", "conv_out"] if scale_first else ["conv_out", "s"], [output], name="mul"))
    outputs = [(output, dtype, [None] * max(dims + 2, len(scale_shape)))]
    model = make_model(nodes, inputs, outputs, inits, opset=opset, check=checked)
    feeds = {"x": rng.standard_normal(inputs[0][2]).astype(dtype)}
    if source == "input":
        feeds["s"] = constants["s"]
    return model, feeds, constants


def scaled(constants: dict, channels: int):
    """(W * s, b * s or None) in float64, s one value per output channel."""
    s = np.broadcast_to(constants["s"].astype(np.float64).reshape(-1), (channels,))
    w = constants["w"].astype(np.float64)
    new_w = w * s.reshape((-1,) + (1,) * (w.ndim - 1))
    new_b = constants["b"].astype(np.float64) * s if "b" in constants else None
    return new_w, new_b


def fold(model, *, rules=(conv_mul_scale,), expected_ops=("Conv",), counts=None, check=True, **compare):
    """Optimize with `rules` (conv-mul-scale alone by default); check structure, interface and
    validity, and given feeds=/rtol=/atol= the outputs in onnxruntime."""
    return assert_rewritten(model, rules, counts=counts or {RULE: 1}, expected_ops=expected_ops, check=check, **compare)


def fold_and_compare(model, feeds, *, rtol, atol, **kwargs):
    return fold(model, feeds=feeds, rtol=rtol, atol=atol, **kwargs)


def assert_not_folded(model, reason: str | None, *, check=True):
    """The rule must not fire; a decline is made at the Mul, in the main graph."""
    return assert_declined(model, conv_mul_scale, reason, node="mul", scope="main", check=check)


# --------------------------------------------------------------------------- positives


@pytest.mark.parametrize("scale_first", [False, True], ids=["conv*s", "s*conv"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(
    "scale_shape", [(6, 1, 1), (1, 6, 1, 1), (), (1,), (1, 1, 1, 1)], ids=["C11", "1C11", "scalar", "1", "1111"]
)
def test_conv2d_folds(scale_shape, bias, scale_first):
    model, feeds, consts = conv_mul_model(scale_shape=scale_shape, bias=bias, scale_first=scale_first)
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    (conv,) = nodes_of(after, "Conv")
    assert conv.input[0] == "x" and list(conv.output) == ["y"]
    assert len(conv.input) == (3 if bias else 2)
    new_w, new_b = scaled(consts, 6)
    np.testing.assert_allclose(initializer_value(after, conv.input[1]), new_w, rtol=1e-6, atol=1e-7)
    if bias:
        np.testing.assert_allclose(initializer_value(after, conv.input[2]), new_b, rtol=1e-6, atol=1e-7)
    # The scale, the old weight and the old bias are gone.
    assert {t.name for t in after.graph.initializer} & {"w", "b", "s"} == set()


@pytest.mark.parametrize(
    "c_in,c_out,group,attrs",
    [
        (4, 6, 2, {}),
        (6, 6, 6, {"pads": [1, 1, 1, 1]}),
        (4, 6, 1, {"strides": [2, 1], "pads": [1, 0, 2, 1], "dilations": [1, 2], "kernel_shape": [3, 3]}),
        (4, 6, 1, {"auto_pad": "SAME_LOWER", "strides": [2, 2]}),
    ],
    ids=["g2", "depthwise", "strided", "auto-pad"],
)
def test_grouped_and_attributes(c_in, c_out, group, attrs):
    """Conv weights are [C_out, C_in/group, k...]: output channels on axis 0 for every group count."""
    model, feeds, consts = conv_mul_model(c_in=c_in, c_out=c_out, group=group, conv_attrs=attrs, size=7)
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    (conv,) = nodes_of(after, "Conv")
    assert attrs_of(conv) == attrs_of(nodes_of(model, "Conv")[0])
    np.testing.assert_allclose(initializer_value(after, conv.input[1]), scaled(consts, c_out)[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scale_shape", [(6, 1), (1, 6, 1), ()], ids=["C1", "1C1", "scalar"])
def test_conv1d_folds(scale_shape):
    model, feeds, _ = conv_mul_model(dims=1, size=9, scale_shape=scale_shape)
    fold_and_compare(model, feeds, **FP32_TOL)


def test_conv3d_folds():
    model, feeds, _ = conv_mul_model(dims=3, size=4, scale_shape=(1, 6, 1, 1, 1))
    fold_and_compare(model, feeds, **FP32_TOL)


def test_zero_scale_folds():
    """A zero channel scale zeroes that filter and its bias."""
    model, feeds, consts = conv_mul_model()
    s = consts["s"].copy()
    s[2] = 0.0
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "s"))
    model.graph.initializer.append(numpy_helper.from_array(s, "s"))
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    (conv,) = nodes_of(after, "Conv")
    assert not initializer_value(after, conv.input[1])[2].any()
    assert initializer_value(after, conv.input[2])[2] == 0.0


@pytest.mark.parametrize("opset", [7, 11, 13, 14, 17])
def test_opsets(opset):
    model, feeds, _ = conv_mul_model(opset=opset)
    fold_and_compare(model, feeds, **FP32_TOL)


def test_float16():
    model, feeds, consts = conv_mul_model(dtype=np.float16, scale_shape=(1, 6, 1, 1))
    after, _ = fold_and_compare(model, feeds, **FP16_TOL)
    (conv,) = nodes_of(after, "Conv")
    new_w, new_b = scaled(consts, 6)
    w, b = initializer_value(after, conv.input[1]), initializer_value(after, conv.input[2])
    assert w.dtype == b.dtype == np.float16
    # Products computed in float64 and rounded once.
    np.testing.assert_array_equal(w, new_w.astype(np.float16))
    np.testing.assert_array_equal(b, new_b.astype(np.float16))


def test_float64():
    """No float64 Conv in onnxruntime: check=False, numerics with onnx.reference."""
    model, feeds, consts = conv_mul_model(dtype=np.float64, group=2)
    after, _ = fold(model, check=False)
    (conv,) = nodes_of(after, "Conv")
    new_w, new_b = scaled(consts, 6)
    np.testing.assert_array_equal(initializer_value(after, conv.input[1]), new_w)
    np.testing.assert_array_equal(initializer_value(after, conv.input[2]), new_b)
    expected, actual = reference_run(model, feeds)[0], reference_run(after, feeds)[0]
    assert actual.dtype == np.float64
    np.testing.assert_allclose(actual, expected, **FP64_TOL)


def test_scale_from_constant_node():
    model, feeds, _ = conv_mul_model(source="constant")
    fold_and_compare(model, feeds, **FP32_TOL)


def test_shared_weight_other_conv_unchanged():
    """Two Convs share the weight; only one is scaled. The other keeps reading the original."""
    rng = np.random.default_rng(11)
    inits = {
        "w": (rng.standard_normal((6, 4, 3, 3)) / 6).astype(np.float32),
        "b": rng.standard_normal(6).astype(np.float32),
        "s": rng.uniform(0.5, 2.0, (6, 1, 1)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c1"], name="conv"),
        helper.make_node("Mul", ["c1", "s"], ["y1"], name="mul"),
        helper.make_node("Conv", ["x", "w", "b"], ["y2"], name="plain_conv", pads=[1, 1, 1, 1]),
    ]
    model = make_model(
        nodes,
        [("x", np.float32, [2, 4, 5, 5])],
        [("y1", np.float32, [None] * 4), ("y2", np.float32, [None] * 4)],
        inits,
    )
    feeds = {"x": rng.standard_normal((2, 4, 5, 5)).astype(np.float32)}
    after, _ = fold_and_compare(model, feeds, expected_ops=("Conv", "Conv"), **FP32_TOL)
    (plain,) = [n for n in after.graph.node if n.name == "plain_conv"]
    assert list(plain.input) == ["x", "w", "b"]
    np.testing.assert_array_equal(initializer_value(after, "w"), inits["w"])
    np.testing.assert_array_equal(initializer_value(after, "b"), inits["b"])
    np.testing.assert_array_equal(run(after, feeds)[1], run(model, feeds)[1])


def test_two_muls_fold_into_one_conv():
    model, feeds, consts = conv_mul_model(output="mid")
    s2 = np.random.default_rng(2).uniform(0.5, 1.5, (1, 6, 1, 1)).astype(np.float32)
    nodes = list(model.graph.node) + [helper.make_node("Mul", ["s2", "mid"], ["y"], name="mul2")]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer} | {"s2": s2}
    chained = make_model(nodes, [("x", np.float32, [2, 4, 5, 5])], [("y", np.float32, [None] * 4)], inits)
    fold_and_compare(chained, feeds, counts={RULE: 2}, **FP32_TOL)


def test_graph_output_name_survives():
    model, feeds, _ = conv_mul_model(output="block1/scale:0")
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    assert [o.name for o in after.graph.output] == ["block1/scale:0"]
    assert list(nodes_of(after, "Conv")[0].output) == ["block1/scale:0"]


# --------------------------------------------------------- Conv -> Mul -> Add (affine BN)


def affine_model(
    *, bias: bool, unsqueeze: bool = False, mul_first: bool = False, add_first: bool = False, seed: int = 0
):
    """x -> Conv -> Mul(s) -> Add(t) -> y: how exporters write an inference BatchNormalization.

    unsqueeze: s and t are [C] initializers turned into [C, 1, 1] by Unsqueeze nodes (the
    light_inception_v2 form)."""
    rng = np.random.default_rng(seed)
    inits = {"w": (rng.standard_normal((6, 4, 3, 3)) / 6).astype(np.float32)}
    if bias:
        inits["b"] = rng.standard_normal(6).astype(np.float32)
    s = rng.uniform(0.5, 1.5, 6).astype(np.float32)
    t = rng.standard_normal(6).astype(np.float32)
    nodes = []
    if unsqueeze:
        inits |= {"s1": s, "t1": t, "axes": np.array([1, 2], np.int64)}
        nodes += [
            helper.make_node("Unsqueeze", ["s1", "axes"], ["s"], name="unsq_s"),
            helper.make_node("Unsqueeze", ["t1", "axes"], ["t"], name="unsq_t"),
        ]
    else:
        inits |= {"s": s.reshape(6, 1, 1), "t": t.reshape(1, 6, 1, 1)}
    nodes += [
        helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["conv_out"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["s", "conv_out"] if mul_first else ["conv_out", "s"], ["scaled"], name="mul"),
        helper.make_node("Add", ["t", "scaled"] if add_first else ["scaled", "t"], ["y"], name="add"),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 4, 5, 5])], [("y", np.float32, [None] * 4)], inits)
    feeds = {"x": rng.standard_normal((2, 4, 5, 5)).astype(np.float32)}
    return model, feeds, dict(w=inits["w"], b=inits.get("b"), s=s, t=t)


@pytest.mark.parametrize("order", ["mul-add", "add-mul"], ids=["rules=[mul,add]", "rules=[add,mul]"])
@pytest.mark.parametrize("operands", [(False, False), (True, True)], ids=["conv-first", "const-first"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_affine_folds_completely_with_conv_add_bias(bias, operands, order):
    model, feeds, c = affine_model(bias=bias, mul_first=operands[0], add_first=operands[1])
    rules = [conv_mul_scale, conv_add_bias] if order == "mul-add" else [conv_add_bias, conv_mul_scale]
    after, _ = fold_and_compare(model, feeds, rules=rules, counts={RULE: 1, "conv-add-bias": 1}, **FP32_TOL)
    (conv,) = nodes_of(after, "Conv")
    assert list(conv.input[:1]) == ["x"] and list(conv.output) == ["y"]
    w = initializer_value(after, conv.input[1]).astype(np.float64)
    b = initializer_value(after, conv.input[2]).astype(np.float64)
    s, t = c["s"].astype(np.float64), c["t"].astype(np.float64)
    np.testing.assert_allclose(w, c["w"] * s.reshape(-1, 1, 1, 1), rtol=1e-6, atol=1e-7)
    b0 = c["b"].astype(np.float64) if bias else 0.0
    np.testing.assert_allclose(b, b0 * s + t, rtol=1e-6, atol=1e-6)
    assert {i.name for i in after.graph.initializer} == {conv.input[1], conv.input[2]}


def test_affine_with_unsqueezed_constants_folds_completely():
    model, feeds, _ = affine_model(bias=False, unsqueeze=True)
    assert op_types(model) == ["Unsqueeze", "Unsqueeze", "Conv", "Mul", "Add"]
    after, _ = fold_and_compare(
        model, feeds, rules=[conv_mul_scale, conv_add_bias], counts={RULE: 1, "conv-add-bias": 1}, **FP32_TOL
    )
    assert {t.name for t in after.graph.initializer} & {"s1", "t1", "axes"} == set()


def test_affine_all_builtin_rules():
    """With the default rule set (target onnx) the affine pair also folds into the Conv."""
    model, feeds, _ = affine_model(bias=True)
    after, report = fuser.optimize(model)
    assert op_types(after) == ["Conv"]
    assert report.counts == {RULE: 1, "conv-add-bias": 1}
    assert_same_outputs(model, after, feeds, **FP32_TOL)


# ------------------------------------------------------------------------ negatives


@pytest.mark.parametrize(
    "scale_shape",
    [(1, 6, 5, 5), (6, 5, 1), (1, 1, 5, 5), (5,), (2, 6, 1, 1)],
    ids=["1CHW", "CH1", "11HW", "W", "batch"],
)
def test_scale_not_per_channel_not_folded(scale_shape):
    model, _, _ = conv_mul_model(scale_shape=scale_shape, size=7)
    assert_not_folded(model, "is not one value per channel")


def test_scale_with_larger_rank_not_folded():
    model, _, _ = conv_mul_model(scale_shape=(1, 1, 6, 1, 1))
    assert_not_folded(model, "is not one value per channel")


def test_non_constant_scale_not_folded():
    model, _, _ = conv_mul_model(source="input")
    assert_not_folded(model, None)


def test_scale_dtype_mismatch_not_folded():
    """Invalid model (float32 conv times float64 constant): declined, never run (check=False)."""
    model, _, _ = conv_mul_model(scale_dtype=np.float64, checked=False)
    assert_not_folded(model, "the scale is float64, the weights float32", check=False)


def test_conv_transpose_not_matched():
    """The rule is written for Conv only (ConvTranspose keeps output channels on axis 1)."""
    model, _, _ = conv_mul_model(op="ConvTranspose")
    assert_not_folded(model, None)


def test_conv_output_with_second_consumer_not_folded():
    model, _, _ = conv_mul_model()
    model.graph.node.append(helper.make_node("Relu", ["conv_out"], ["r"], name="relu"))
    model.graph.output.append(helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, [None] * 4))
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, "used outside the match")


def test_conv_output_is_graph_output_not_folded():
    model, _, _ = conv_mul_model()
    model.graph.output.append(helper.make_tensor_value_info("conv_out", onnx.TensorProto.FLOAT, [None] * 4))
    assert_not_folded(model, "a graph output")


def test_conv_weight_graph_input_not_folded():
    model, _, _ = conv_mul_model()
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "w"))
    model.graph.input.append(helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [6, 4, 3, 3]))
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, None)
