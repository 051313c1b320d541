"""Tests for the conv-bn-fold rule (rules/conv_bn_fold.py).

Every positive test builds a small Conv/ConvTranspose -> BatchNormalization model, folds it
with `fuser.optimize(model, rules=[conv_bn_fold])`, checks the resulting op sequence, runs the
full ONNX checker, and compares outputs in onnxruntime (graph optimizations disabled) with the
tolerances stated in the test. BatchNormalization parameters are random and seeded
(gamma U(0.5, 1.5), beta N(0, 1), mean N(0, 1), var U(0.5, 2)) so a wrong channel axis, a
dropped bias or a missing epsilon shows up as a numerics failure.

Runtime facts this file relies on (onnxruntime 1.32, CPUExecutionProvider):
* float16 Conv, ConvTranspose and BatchNormalization all have CPU kernels, so float16 models
  are checked in onnxruntime.
* float64 BatchNormalization has a CPU kernel but float64 Conv and ConvTranspose do NOT
  ("NOT_IMPLEMENTED: Could not find an implementation for Conv(11)"). float64 models are
  therefore folded with check=False and their numerics are checked with the ONNX reference
  evaluator (onnx.reference), which computes Conv in float64; onnxruntime is used in addition
  if a later version can load the model.
* onnxruntime crashes (segfault) when asked to run a BatchNormalization in training mode with
  empty optional outputs, so training-mode models are never run: they are optimized with
  check=False (nothing may be rewritten, so nothing would need verifying anyway).
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import sliding_window_view
from onnx import helper, numpy_helper

import fuser
from fuser.rules.conv_bn_fold import conv_bn_fold, fold_conv_bn
from tests.helpers import (
    assert_declined,
    assert_rewritten,
    assert_same_outputs,
    attrs_of,
    initializer,
    light_model,
    make_model,
    nodes_of,
    op_types,
    ort_session,
    randomize_constants,
    reference_run,
    run,
)

RULE = "conv-bn-fold"
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
FP16_TOL = dict(rtol=1e-2, atol=1e-2)
FP64_TOL = dict(rtol=1e-10, atol=1e-10)
BN_PARAMS = ("scale", "beta", "mean", "var")


# --------------------------------------------------------------------------- builders


def bn_params(rng: np.random.Generator, channels: int, dtype=np.float32) -> dict[str, np.ndarray]:
    return {
        "scale": rng.uniform(0.5, 1.5, channels).astype(dtype),
        "beta": rng.normal(0.0, 1.0, channels).astype(dtype),
        "mean": rng.normal(0.0, 1.0, channels).astype(dtype),
        "var": rng.uniform(0.5, 2.0, channels).astype(dtype),
    }


def conv_weight_shape(op: str, c_in: int, c_out: int, group: int, kernel) -> tuple:
    if op == "Conv":
        return (c_out, c_in // group, *kernel)
    return (c_in, c_out // group, *kernel)  # ConvTranspose: [C_in, C_out/group, k...]


def constant_node(name: str, value: np.ndarray) -> onnx.NodeProto:
    """An op Constant node with a `value` tensor attribute."""
    return helper.make_node("Constant", [], [name], name=f"{name}_const", value=numpy_helper.from_array(value, name))


def conv_bn_model(
    *,
    op: str = "Conv",
    dims: int = 2,
    c_in: int = 4,
    c_out: int = 6,
    group: int = 1,
    kernel: int = 3,
    size: int = 7,
    batch: int = 2,
    bias: bool = True,
    dtype=np.float32,
    opset: int = 17,
    conv_attrs: dict | None = None,
    bn_attrs: dict | None = None,
    source: str = "initializer",
    output: str = "y",
    seed: int = 0,
):
    """x -> Conv/ConvTranspose -> BatchNormalization -> `output`; returns (model, feeds, constants).

    source: where the weight, bias and BN parameters come from:
      "initializer"        graph initializers
      "constant"           op Constant nodes with a `value` tensor attribute
      "reshape"            weight = Reshape(flat initializer, shape initializer); the rest initializers
      "cast"               weight = Cast(float64 initializer -> dtype); the rest initializers
      "constant_of_shape"  weight = ConstantOfShape(shape) filled with 0.25, bias = ConstantOfShape(...)
                           filled with 0.5 (uniform, but the BN parameters still differ per channel)
    """
    rng = np.random.default_rng(seed)
    ks = (kernel,) * dims
    w_shape = conv_weight_shape(op, c_in, c_out, group, ks)
    fan_in = int(np.prod(w_shape[1:]))
    constants = {"w": (rng.standard_normal(w_shape) / np.sqrt(fan_in)).astype(dtype)}
    if bias:
        constants["b"] = rng.normal(0.0, 1.0, c_out).astype(dtype)
    constants.update(bn_params(rng, c_out, dtype))

    nodes: list[onnx.NodeProto] = []
    inits: dict[str, np.ndarray] = {}
    if source == "initializer":
        inits.update(constants)
    elif source == "constant":
        nodes.extend(constant_node(name, value) for name, value in constants.items())
    elif source == "reshape":
        inits.update({k: v for k, v in constants.items() if k != "w"})
        inits["w_flat"] = constants["w"].reshape(-1)
        inits["w_shape"] = np.array(w_shape, np.int64)
        nodes.append(helper.make_node("Reshape", ["w_flat", "w_shape"], ["w"], name="w_reshape"))
    elif source == "cast":
        inits.update({k: v for k, v in constants.items() if k != "w"})
        inits["w64"] = constants["w"].astype(np.float64)
        to = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        nodes.append(helper.make_node("Cast", ["w64"], ["w"], name="w_cast", to=to))
    elif source == "constant_of_shape":
        assert bias
        constants["w"] = np.full(w_shape, 0.25, dtype)
        constants["b"] = np.full(c_out, 0.5, dtype)
        inits.update({k: v for k, v in constants.items() if k not in ("w", "b")})
        inits["w_shape"] = np.array(w_shape, np.int64)
        inits["b_shape"] = np.array([c_out], np.int64)
        for name, fill in (("w", 0.25), ("b", 0.5)):
            nodes.append(
                helper.make_node(
                    "ConstantOfShape",
                    [f"{name}_shape"],
                    [name],
                    name=f"{name}_fill",
                    value=numpy_helper.from_array(np.array([fill], dtype)),
                )
            )
    else:
        raise ValueError(source)

    conv_inputs = ["x", "w"] + (["b"] if bias else [])
    nodes.append(helper.make_node(op, conv_inputs, ["conv_out"], name="conv", group=group, **(conv_attrs or {})))
    nodes.append(
        helper.make_node("BatchNormalization", ["conv_out", *BN_PARAMS], [output], name="bn", **(bn_attrs or {}))
    )
    x_shape = [batch, c_in] + [size] * dims
    model = make_model(nodes, [("x", dtype, x_shape)], [(output, dtype, [None] * (dims + 2))], inits, opset=opset)
    feeds = {"x": rng.standard_normal(x_shape).astype(dtype)}
    return model, feeds, constants


def fold(model, *, expected_ops, count=1, check=True):
    """Optimize with conv-bn-fold only and check structure, validity and the graph interface
    (same inputs and outputs, in order, with the same names), not numerics."""
    return assert_rewritten(model, [conv_bn_fold], counts={RULE: count}, expected_ops=expected_ops, check=check)


def fold_and_compare(model, feeds, *, expected_ops=("Conv",), count=1, rtol, atol):
    """fold, and the outputs agree with the original's in onnxruntime within rtol/atol."""
    return assert_rewritten(
        model, [conv_bn_fold], counts={RULE: count}, expected_ops=expected_ops, feeds=feeds, rtol=rtol, atol=atol
    )


def assert_not_folded(model, reason: str | None, *, check=True):
    """The rule must not fire and the BatchNormalization stays. `reason`: expected substring of
    the decline (made at the BN, in the main graph), or None when the pattern itself must not
    match (then nothing is declined either)."""
    after, report = assert_declined(model, conv_bn_fold, reason, node="bn", scope="main", check=check)
    assert "BatchNormalization" in op_types(after)
    return after, report


def ort_load_error(model: onnx.ModelProto) -> str | None:
    """None if onnxruntime (CPU, no graph optimizations) can load the model, else the reason."""
    try:
        ort_session(model)
    except Exception as error:  # noqa: BLE001 - onnxruntime raises several types
        return str(error).splitlines()[0]
    return None


# --------------------------------------------------------------------- Conv variants


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_conv2d_folds(bias):
    model, feeds, _ = conv_bn_model(bias=bias)
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    (conv,) = nodes_of(after, "Conv")
    # The folded Conv reads the original input, always has a bias, and writes the BN's output name.
    assert conv.input[0] == "x" and len(conv.input) == 3 and all(conv.input)
    assert list(conv.output) == ["y"]
    # The old weight/BN initializers are gone; only the folded ones remain.
    names = {t.name for t in after.graph.initializer}
    assert not names & {"w", "b", *BN_PARAMS}
    assert names == {conv.input[1], conv.input[2]}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("c_in,c_out,group", [(4, 6, 2), (6, 9, 3), (4, 4, 4)], ids=["g2", "g3", "g4-4to4"])
def test_grouped_conv_folds(c_in, c_out, group, bias):
    model, feeds, _ = conv_bn_model(c_in=c_in, c_out=c_out, group=group, bias=bias)
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    assert attrs_of(nodes_of(after, "Conv")[0])["group"] == group


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_depthwise_conv_folds(bias):
    model, feeds, _ = conv_bn_model(c_in=8, c_out=8, group=8, bias=bias, conv_attrs={"pads": [1, 1, 1, 1]})
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    (conv,) = nodes_of(after, "Conv")
    assert attrs_of(conv)["group"] == 8
    assert initializer(after, conv.input[1]).dims == [8, 1, 3, 3]


@pytest.mark.parametrize(
    "dims,conv_attrs",
    [
        (1, {}),
        (1, {"strides": [2], "pads": [1, 2], "dilations": [2]}),
        (2, {}),
        (2, {"strides": [2, 1], "pads": [1, 0, 2, 1], "dilations": [1, 2], "kernel_shape": [3, 3]}),
        (2, {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
        (3, {}),
        (3, {"strides": [1, 2, 2], "pads": [1, 1, 0, 0, 1, 1], "dilations": [2, 1, 1]}),
    ],
    ids=["1d", "1d-strided", "2d", "2d-strided", "2d-auto-pad", "3d", "3d-strided"],
)
def test_conv_ranks_and_attributes_preserved(dims, conv_attrs):
    model, feeds, _ = conv_bn_model(dims=dims, conv_attrs=conv_attrs, size=7 if dims < 3 else 6)
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    before_attrs = attrs_of(nodes_of(model, "Conv")[0])
    after_attrs = attrs_of(nodes_of(after, "Conv")[0])
    assert after_attrs == before_attrs


def test_conv_bn_bn_chain_folds_both():
    """After the first fold the second BN follows a Conv and is folded in the same run."""
    model, feeds, _ = conv_bn_model(output="mid")
    rng = np.random.default_rng(7)
    second = {f"{k}2": v for k, v in bn_params(rng, 6).items()}
    nodes = list(model.graph.node) + [
        helper.make_node("BatchNormalization", ["mid", *second], ["y"], name="bn2", epsilon=1e-3)
    ]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer} | second
    chained = make_model(nodes, [("x", np.float32, [2, 4, 7, 7])], [("y", np.float32, [None] * 4)], inits)
    fold_and_compare(chained, feeds, count=2, **FP32_TOL)


def test_shared_bn_parameters_both_pairs_fold():
    """Two Conv->BN pairs that share the weight and all BN parameters: both fold independently."""
    rng = np.random.default_rng(3)
    inits = {"w": rng.standard_normal((6, 4, 3, 3)).astype(np.float32) / 6, **bn_params(rng, 6)}
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c1"], name="conv1"),
        helper.make_node("BatchNormalization", ["c1", *BN_PARAMS], ["y1"], name="bn1"),
        helper.make_node("Conv", ["x", "w"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c2", *BN_PARAMS], ["y2"], name="bn2"),
    ]
    model = make_model(
        nodes,
        [("x", np.float32, [2, 4, 7, 7])],
        [("y1", np.float32, [None] * 4), ("y2", np.float32, [None] * 4)],
        inits,
    )
    feeds = {"x": rng.standard_normal((2, 4, 7, 7)).astype(np.float32)}
    fold_and_compare(model, feeds, expected_ops=("Conv", "Conv"), count=2, **FP32_TOL)


# ------------------------------------------------------------------ ConvTranspose


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(
    "c_in,c_out,group", [(4, 6, 1), (4, 6, 2), (6, 4, 2), (6, 9, 3)], ids=["g1", "g2", "g2-shrink", "g3"]
)
def test_conv_transpose_folds(c_in, c_out, group, bias):
    conv_attrs = {"strides": [2, 1], "pads": [1, 0, 0, 1], "output_padding": [1, 0], "dilations": [1, 2]}
    model, feeds, _ = conv_bn_model(
        op="ConvTranspose", c_in=c_in, c_out=c_out, group=group, bias=bias, conv_attrs=conv_attrs, size=5
    )
    after, _ = fold_and_compare(model, feeds, expected_ops=("ConvTranspose",), **FP32_TOL)
    (conv,) = nodes_of(after, "ConvTranspose")
    assert attrs_of(conv) == attrs_of(nodes_of(model, "ConvTranspose")[0])
    # Weight layout is unchanged: [C_in, C_out/group, k...].
    assert list(initializer(after, conv.input[1]).dims) == [c_in, c_out // group, 3, 3]
    assert list(initializer(after, conv.input[2]).dims) == [c_out]


@pytest.mark.parametrize("dims", [1, 3])
def test_conv_transpose_other_ranks(dims):
    model, feeds, _ = conv_bn_model(op="ConvTranspose", dims=dims, c_in=4, c_out=6, group=2, size=4)
    fold_and_compare(model, feeds, expected_ops=("ConvTranspose",), **FP32_TOL)


# -------------------------------------------------------------- where constants live


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("op", ["Conv", "ConvTranspose"])
def test_constant_nodes(op, bias):
    """Weight, bias and every BN parameter come from op Constant nodes (`value` attribute)."""
    model, feeds, _ = conv_bn_model(op=op, group=2, bias=bias, source="constant")
    assert op_types(model).count("Constant") == (6 if bias else 5)
    # The Constant nodes feed only the folded pair, so they go away with it.
    fold_and_compare(model, feeds, expected_ops=(op,), **FP32_TOL)


@pytest.mark.parametrize("source", ["reshape", "cast", "constant_of_shape"])
@pytest.mark.parametrize("op", ["Conv", "ConvTranspose"])
def test_weight_from_constant_subgraph(op, source):
    model, feeds, _ = conv_bn_model(op=op, group=2, source=source)
    after, _ = fold_and_compare(model, feeds, expected_ops=(op,), **FP32_TOL)
    # The constant subgraph and its inputs are no longer needed.
    leftover = {t.name for t in after.graph.initializer} & {"w_flat", "w_shape", "w64", "b_shape"}
    assert leftover == set()


def test_constant_subgraph_shared_with_other_consumer_is_kept():
    """The Reshape producing the weight also feeds an unrelated Conv: it must survive the fold."""
    model, feeds, _ = conv_bn_model(source="reshape")
    nodes = list(model.graph.node) + [helper.make_node("Conv", ["x", "w"], ["z"], name="other_conv")]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    model = make_model(
        nodes,
        [("x", np.float32, [2, 4, 7, 7])],
        [("y", np.float32, [None] * 4), ("z", np.float32, [None] * 4)],
        inits,
    )
    after, _ = fold(model, expected_ops=["Reshape", "Conv", "Conv"])
    assert_same_outputs(model, after, feeds, **FP32_TOL)
    other = [n for n in after.graph.node if n.name == "other_conv"]
    assert len(other) == 1 and list(other[0].input) == ["x", "w"]


# ---------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("op", ["Conv", "ConvTranspose"])
def test_float16(op):
    """float16 throughout. onnxruntime 1.32 has CPU float16 kernels for Conv, ConvTranspose
    and BatchNormalization, so this is checked in onnxruntime (looser fp16 tolerances)."""
    model, feeds, _ = conv_bn_model(op=op, group=2, dtype=np.float16, size=5)
    assert ort_load_error(model) is None
    after, _ = fold_and_compare(model, feeds, expected_ops=(op,), **FP16_TOL)
    (conv,) = nodes_of(after, op)
    for name in conv.input[1:]:
        assert initializer(after, name).data_type == onnx.TensorProto.FLOAT16


@pytest.mark.parametrize("op,group", [("Conv", 1), ("Conv", 2), ("ConvTranspose", 1)])
def test_float64(op, group):
    """float64 throughout. onnxruntime 1.32's CPU provider has no float64 Conv/ConvTranspose
    kernel (NOT_IMPLEMENTED), so fuser's own onnxruntime check cannot run (check=False) and the
    numerics are compared with the ONNX reference evaluator, which computes in float64. If
    onnxruntime can load the model, it is compared there too.

    ConvTranspose is only tested with group=1 here: onnx 1.23's reference ConvTranspose does not
    support group > 1 (it reshapes W to (group, C_in/group, C_out*k) and raises). Grouped
    transposed folding in float64 is covered by test_fold_conv_bn_property."""
    model, feeds, _ = conv_bn_model(op=op, group=group, dtype=np.float64, bn_attrs={"epsilon": 1e-3})
    after, _ = fold(model, expected_ops=[op], check=False)
    (conv,) = nodes_of(after, op)
    for name in conv.input[1:]:
        assert initializer(after, name).data_type == onnx.TensorProto.DOUBLE
    expected = reference_run(model, feeds)
    actual = reference_run(after, feeds)
    assert len(expected) == len(actual) == 1
    assert actual[0].dtype == expected[0].dtype == np.float64
    np.testing.assert_allclose(actual[0], expected[0], **FP64_TOL)
    if ort_load_error(model) is None:  # not the case in onnxruntime 1.32 (no double Conv kernel)
        assert_same_outputs(model, after, feeds, **FP64_TOL)


def test_mixed_precision_bn_opset15():
    """Opset 15 lets BN parameters have another float type than X: float16 data, float32
    scale/bias/mean/var. The folded weight and bias must be float16 (the Conv's type)."""
    rng = np.random.default_rng(4)
    inits = {"w": (rng.standard_normal((6, 4, 3, 3)) / 6).astype(np.float16), **bn_params(rng, 6, np.float32)}
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["conv_out"], name="conv"),
        helper.make_node("BatchNormalization", ["conv_out", *BN_PARAMS], ["y"], name="bn", epsilon=1e-3),
    ]
    model = make_model(nodes, [("x", np.float16, [2, 4, 7, 7])], [("y", np.float16, [None] * 4)], inits, opset=15)
    feeds = {"x": rng.standard_normal((2, 4, 7, 7)).astype(np.float16)}
    after, _ = fold_and_compare(model, feeds, **FP16_TOL)
    (conv,) = nodes_of(after, "Conv")
    for name in conv.input[1:]:
        assert initializer(after, name).data_type == onnx.TensorProto.FLOAT16


# ------------------------------------------------------------------ BN opset variants


@pytest.mark.parametrize(
    "opset,bn_attrs",
    [
        (7, {"spatial": 1}),
        (9, {}),
        (14, {}),
        (14, {"training_mode": 0}),
        (15, {}),
        (15, {"training_mode": 0}),
        (17, {"training_mode": 0, "momentum": 0.5}),
    ],
    ids=["opset7-spatial1", "opset9", "opset14", "opset14-training0", "opset15", "opset15-training0", "opset17"],
)
@pytest.mark.parametrize("epsilon", [None, 1e-3, 0.25], ids=["eps-default", "eps-1e-3", "eps-0.25"])
def test_bn_opsets_and_epsilon(opset, bn_attrs, epsilon):
    attrs = dict(bn_attrs)
    if epsilon is not None:
        attrs["epsilon"] = epsilon
    model, feeds, _ = conv_bn_model(opset=opset, bn_attrs=attrs, group=2)
    fold_and_compare(model, feeds, **FP32_TOL)


def test_epsilon_is_honoured_in_folded_weights():
    """With a small variance epsilon dominates: the folded weights must use the node's epsilon."""
    eps = 1e-3
    model, feeds, consts = conv_bn_model(bn_attrs={"epsilon": eps}, seed=5)
    # Replace var by tiny values so an epsilon of 1e-5 would give visibly different weights.
    small_var = np.full(6, 1e-3, np.float32)
    model.graph.initializer.remove(initializer(model, "var"))
    model.graph.initializer.append(numpy_helper.from_array(small_var, "var"))
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    (conv,) = nodes_of(after, "Conv")
    folded = numpy_helper.to_array(initializer(after, conv.input[1]))
    eps32 = float(np.float32(eps))  # the attribute is stored as float32
    right, _ = fold_conv_bn(consts["w"], consts["b"], consts["scale"], consts["beta"], consts["mean"], small_var, eps32)
    wrong, _ = fold_conv_bn(consts["w"], consts["b"], consts["scale"], consts["beta"], consts["mean"], small_var, 1e-5)
    np.testing.assert_allclose(folded, right, rtol=1e-6, atol=0)
    assert not np.allclose(folded, wrong, rtol=1e-2)


# ------------------------------------------------------------------- shared weights


@pytest.mark.parametrize("source", ["initializer", "constant"])
def test_shared_weight_other_conv_unchanged(source):
    """Two Convs read the same weight; only one is followed by BN. The other Conv must keep
    reading the original, unmodified weight."""
    rng = np.random.default_rng(11)
    w = (rng.standard_normal((6, 4, 3, 3)) / 6).astype(np.float32)
    params = bn_params(rng, 6)
    nodes = []
    inits = dict(params)
    if source == "initializer":
        inits["w"] = w
    else:
        nodes.append(constant_node("w", w))
    nodes += [
        helper.make_node("Conv", ["x", "w"], ["c1"], name="conv"),
        helper.make_node("BatchNormalization", ["c1", *BN_PARAMS], ["y1"], name="bn"),
        helper.make_node("Conv", ["x", "w"], ["y2"], name="plain_conv", pads=[1, 1, 1, 1]),
    ]
    model = make_model(
        nodes,
        [("x", np.float32, [2, 4, 7, 7])],
        [("y1", np.float32, [None] * 4), ("y2", np.float32, [None] * 4)],
        inits,
    )
    feeds = {"x": rng.standard_normal((2, 4, 7, 7)).astype(np.float32)}
    expected_ops = ["Conv", "Conv"] if source == "initializer" else ["Constant", "Conv", "Conv"]
    after, _ = fold(model, expected_ops=expected_ops)
    assert_same_outputs(model, after, feeds, **FP32_TOL)

    (plain,) = [n for n in after.graph.node if n.name == "plain_conv"]
    assert list(plain.input) == ["x", "w"]
    if source == "initializer":
        assert initializer(after, "w").SerializeToString() == initializer(model, "w").SerializeToString()
    else:
        (const,) = nodes_of(after, "Constant")
        assert const.SerializeToString() == nodes_of(model, "Constant")[0].SerializeToString()
    # The folded Conv got its own weight, different from the shared one.
    (folded,) = [n for n in after.graph.node if n.op_type == "Conv" and n.name != "plain_conv"]
    assert folded.input[1] != "w"
    # Plain conv output is bit-identical (same weight, same input).
    np.testing.assert_array_equal(run(after, feeds)[1], run(model, feeds)[1])


# --------------------------------------------------------------------- output names


def test_bn_output_graph_output_name_survives():
    model, feeds, _ = conv_bn_model(output="features/bn_out:0")
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    assert [o.name for o in after.graph.output] == ["features/bn_out:0"]
    assert list(nodes_of(after, "Conv")[0].output) == ["features/bn_out:0"]


def test_bn_output_is_graph_output_and_feeds_another_node():
    model, feeds, _ = conv_bn_model()
    nodes = list(model.graph.node) + [helper.make_node("Relu", ["y"], ["r"], name="relu")]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    model = make_model(
        nodes,
        [("x", np.float32, [2, 4, 7, 7])],
        [("y", np.float32, [None] * 4), ("r", np.float32, [None] * 4)],
        inits,
    )
    after, _ = fold_and_compare(model, feeds, expected_ops=("Conv", "Relu"), **FP32_TOL)
    (conv,) = nodes_of(after, "Conv")
    (relu,) = nodes_of(after, "Relu")
    assert list(conv.output) == ["y"] and list(relu.input) == ["y"]


def test_value_info_of_removed_tensor_is_dropped():
    """Models usually carry value_info from shape inference; the Conv's intermediate output
    disappears with the fold, and so must its value_info."""
    model, feeds, _ = conv_bn_model()
    model = onnx.shape_inference.infer_shapes(model)
    assert [v.name for v in model.graph.value_info] == ["conv_out"]
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    assert [v.name for v in after.graph.value_info] == []


# ------------------------------------------------------------------------ subgraphs


def if_model_with_conv_bn_in_branch():
    """If(cond): then-branch = Conv -> BN reading the weights from the main graph's initializers."""
    inner, feeds, _ = conv_bn_model()
    out = lambda name: helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [None] * 4)  # noqa: E731
    then_branch = helper.make_graph(list(inner.graph.node), "then", [], [out("y")])
    else_branch = helper.make_graph([helper.make_node("Identity", ["x"], ["y_else"])], "else", [], [out("y_else")])
    inits = {t.name: numpy_helper.to_array(t) for t in inner.graph.initializer}
    model = make_model(
        [helper.make_node("If", ["cond"], ["out"], name="if", then_branch=then_branch, else_branch=else_branch)],
        [("x", np.float32, [2, 4, 7, 7]), ("cond", np.bool_, [])],
        [("out", np.float32, [None] * 4)],
        inits,
    )
    return model, {"x": feeds["x"], "cond": np.array(True)}


def test_fold_inside_if_branch():
    model, feeds = if_model_with_conv_bn_in_branch()
    after, report = fold(model, expected_ops=["If"])
    assert [r.scope for r in report.rewrites] == ["main/if.then_branch"]
    branches = {a.name: a.g for a in after.graph.node[0].attribute}
    assert [n.op_type for n in branches["then_branch"].node] == ["Conv"]
    assert [n.op_type for n in branches["else_branch"].node] == ["Identity"]
    assert_same_outputs(model, after, feeds, **FP32_TOL)


def test_fold_inside_if_branch_leaves_no_dead_outer_initializers():
    """At top level the fold removes the initializers it made unused (see test_conv2d_folds);
    the same is expected when the folded pair sits in a subgraph and reads outer initializers."""
    model, _ = if_model_with_conv_bn_in_branch()
    after, _ = fold(model, expected_ops=["If"])
    used = {i for n in after.graph.node for i in n.input}
    for attribute in after.graph.node[0].attribute:
        used |= {i for n in attribute.g.node for i in n.input}
    dead = sorted(t.name for t in after.graph.initializer if t.name not in used)
    assert dead == [], f"unused initializers left in the main graph: {dead}"


def test_conv_output_read_inside_subgraph_not_folded():
    """The Conv output is also captured by an If branch: it has another consumer."""
    model, _, _ = conv_bn_model()
    out = lambda name: helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [None] * 4)  # noqa: E731
    branch = lambda tag: helper.make_graph(  # noqa: E731
        [helper.make_node("Identity", ["conv_out"], [f"o_{tag}"])], tag, [], [out(f"o_{tag}")]
    )
    model.graph.input.append(helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, []))
    model.graph.node.append(
        helper.make_node("If", ["cond"], ["side"], name="if", then_branch=branch("then"), else_branch=branch("else"))
    )
    model.graph.output.append(out("side"))
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, "used outside the match")


# ------------------------------------------------------------------------ negatives


def test_training_mode_not_folded():
    """training_mode=1 (opset 15) with the optional outputs left empty, so only the
    training-mode check can decline. (The checker needs 3 output slots in training mode.)"""
    model, _, _ = conv_bn_model(opset=15)
    bn = nodes_of(model, "BatchNormalization")[0]
    bn.output.extend(["", ""])
    bn.attribute.append(helper.make_attribute("training_mode", 1))
    onnx.checker.check_model(model, full_check=True)
    # check=False: onnxruntime must never run this model (it segfaults on it).
    assert_not_folded(model, "training mode", check=False)


def test_training_mode_with_running_stat_outputs_not_folded():
    model, _, _ = conv_bn_model(opset=15)
    bn = nodes_of(model, "BatchNormalization")[0]
    bn.output.extend(["running_mean", "running_var"])
    bn.attribute.append(helper.make_attribute("training_mode", 1))
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, "running-statistics outputs", check=False)


def test_bn_with_several_outputs_not_folded():
    """Opset 9: a BN with mean/var/saved_mean/saved_var outputs is a training BN."""
    model, _, _ = conv_bn_model(opset=9)
    nodes_of(model, "BatchNormalization")[0].output.extend(["mean_out", "var_out", "saved_mean", "saved_var"])
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, "running-statistics outputs", check=False)


def test_non_spatial_bn_not_folded():
    """Opset 7 spatial=0: per-activation statistics cannot fold into per-channel weights."""
    rng = np.random.default_rng(0)
    inits = {"w": rng.standard_normal((6, 4, 1, 1)).astype(np.float32)}
    # spatial=0 parameters are per activation: shape (C, H, W).
    inits |= {k: np.tile(v[:, None, None], (1, 5, 5)) for k, v in bn_params(rng, 6).items()}
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["conv_out"], name="conv"),
        helper.make_node("BatchNormalization", ["conv_out", *BN_PARAMS], ["y"], name="bn", spatial=0),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 4, 5, 5])], [("y", np.float32, [None] * 4)], inits, opset=7)
    assert_not_folded(model, "spatial")


def test_bfloat16_weights_not_folded():
    """Conv takes bfloat16 since opset 22; the fold casts its float64 result back to the
    weights' dtype and keeps to float16, float32 and float64."""
    import ml_dtypes

    model, _, consts = conv_bn_model()
    model.opset_import[0].version = 22
    for tensor in list(model.graph.initializer):
        model.graph.initializer.remove(tensor)
        model.graph.initializer.append(numpy_helper.from_array(consts[tensor.name].astype(ml_dtypes.bfloat16), tensor.name))
    for value in [*model.graph.input, *model.graph.output]:
        value.type.tensor_type.elem_type = onnx.TensorProto.BFLOAT16
    assert_not_folded(model, "weights are bfloat16, not a float type", check=False)


@pytest.mark.parametrize("var_value,epsilon", [(-1.0, 1e-5), (-1e-3, 1e-3)], ids=["negative", "var+eps==0"])
def test_non_positive_variance_not_folded(var_value, epsilon):
    """var + epsilon <= 0 would put inf/NaN into the folded weights: the rule declines."""
    model, _, consts = conv_bn_model(bn_attrs={"epsilon": epsilon})
    var = consts["var"].copy()
    var[2] = np.float32(var_value)
    model.graph.initializer.remove(initializer(model, "var"))
    model.graph.initializer.append(numpy_helper.from_array(var, "var"))
    assert_not_folded(model, "variance + epsilon is not positive", check=False)


@pytest.mark.parametrize("param", list(BN_PARAMS))
def test_bn_parameter_graph_input_not_folded(param):
    model, _, _ = conv_bn_model()
    model.graph.initializer.remove(initializer(model, param))
    model.graph.input.append(helper.make_tensor_value_info(param, onnx.TensorProto.FLOAT, [6]))
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, None)


@pytest.mark.parametrize("param", ["w", "b", "scale", "var"])
def test_initializer_overridable_by_graph_input_not_folded(param):
    """Since IR 4 an initializer that is also listed as a graph input is only a default the
    caller may override: it is not a constant and must not be folded."""
    model, _, consts = conv_bn_model()
    shape = list(consts[param].shape)
    model.graph.input.append(helper.make_tensor_value_info(param, onnx.TensorProto.FLOAT, shape))
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, None)


def test_conv_weight_graph_input_not_folded():
    model, _, _ = conv_bn_model()
    model.graph.initializer.remove(initializer(model, "w"))
    model.graph.input.append(helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [6, 4, 3, 3]))
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, None)


def test_conv_output_with_second_consumer_not_folded():
    model, _, _ = conv_bn_model()
    model.graph.node.append(helper.make_node("Relu", ["conv_out"], ["r"], name="relu"))
    model.graph.output.append(helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, [None] * 4))
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, "used outside the match")


def test_conv_output_is_graph_output_not_folded():
    model, _, _ = conv_bn_model()
    model.graph.output.append(helper.make_tensor_value_info("conv_out", onnx.TensorProto.FLOAT, [None] * 4))
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, "a graph output")


def test_bn_after_relu_not_folded():
    model, _, _ = conv_bn_model()
    conv = nodes_of(model, "Conv")[0]
    conv.output[0] = "conv_raw"
    relu = helper.make_node("Relu", ["conv_raw"], ["conv_out"], name="relu")
    model.graph.node.insert(list(model.graph.node).index(conv) + 1, relu)
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, None)


def test_bn_on_graph_input_not_folded():
    rng = np.random.default_rng(0)
    model = make_model(
        [helper.make_node("BatchNormalization", ["x", *BN_PARAMS], ["y"], name="bn")],
        [("x", np.float32, [2, 6, 5, 5])],
        [("y", np.float32, [None] * 4)],
        bn_params(rng, 6),
    )
    assert_not_folded(model, None)


# ------------------------------------------------------------- IR < 4 (weights as inputs)


def test_ir3_model_with_initializers_as_inputs():
    """Before IR 4 every initializer must also be a graph input (those inputs are the weights).
    The folded model must still be a valid IR 3 model: new initializers need graph inputs too."""
    rng = np.random.default_rng(2)
    inits = {"w": (rng.standard_normal((6, 4, 3, 3)) / 6).astype(np.float32), **bn_params(rng, 6)}
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["conv_out"], name="conv"),
        helper.make_node("BatchNormalization", ["conv_out", *BN_PARAMS], ["y"], name="bn"),
    ]
    inputs = [("x", np.float32, [2, 4, 7, 7])] + [(k, np.float32, list(v.shape)) for k, v in inits.items()]
    model = make_model(nodes, inputs, [("y", np.float32, [None] * 4)], inits, opset=9, ir_version=3)
    feeds = {"x": rng.standard_normal((2, 4, 7, 7)).astype(np.float32)}
    after, report = fuser.optimize(model, rules=[conv_bn_fold])
    assert report.counts == {RULE: 1}
    assert op_types(after) == ["Conv"]
    assert after.ir_version == 3
    assert_same_outputs(model, after, feeds, **FP32_TOL)
    input_names = {i.name for i in after.graph.input}
    missing = [t.name for t in after.graph.initializer if t.name not in input_names]
    assert missing == [], f"IR 3 initializers missing from graph inputs: {missing}"
    onnx.checker.check_model(after, full_check=True)


# ------------------------------------------------------ fold_conv_bn property test


def np_conv(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, group: int) -> np.ndarray:
    """Direct N-D grouped convolution (stride 1, no padding), float64."""
    dims = x.ndim - 2
    n, c_in = x.shape[:2]
    kernel = w.shape[2:]
    windows = sliding_window_view(x, kernel, axis=tuple(range(2, 2 + dims)))  # [N, C_in, *O, *K]
    out_spatial = windows.shape[2 : 2 + dims]
    windows = windows.reshape(n, group, c_in // group, *out_spatial, *kernel)
    wg = w.reshape(group, w.shape[0] // group, w.shape[1], *kernel)
    o, k = "opq"[:dims], "abc"[:dims]
    y = np.einsum(f"ngc{o}{k},gdc{k}->ngd{o}", windows, wg).reshape(n, w.shape[0], *out_spatial)
    if b is not None:
        y = y + b.reshape((-1,) + (1,) * dims)
    return y


def np_conv_transpose(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, group: int) -> np.ndarray:
    """Direct N-D grouped transposed convolution (stride 1, no padding); w is [C_in, C_out/group, k...]."""
    dims = x.ndim - 2
    n, c_in = x.shape[:2]
    spatial, kernel = x.shape[2:], w.shape[2:]
    per_group = w.shape[1]
    xg = x.reshape(n, group, c_in // group, *spatial)
    wg = w.reshape(group, c_in // group, per_group, *kernel)
    out = np.zeros((n, group, per_group, *(s + k - 1 for s, k in zip(spatial, kernel))))
    for offset in np.ndindex(*kernel):
        tap = wg[(slice(None),) * 3 + offset]
        contribution = np.einsum("ngc...,gcd->ngd...", xg, tap)
        window = tuple(slice(o, o + s) for o, s in zip(offset, spatial))
        out[(slice(None),) * 3 + window] += contribution
    y = out.reshape(n, group * per_group, *out.shape[3:])
    if b is not None:
        y = y + b.reshape((-1,) + (1,) * dims)
    return y


def np_batchnorm(y, scale, beta, mean, var, epsilon):
    shape = (-1,) + (1,) * (y.ndim - 2)
    r = lambda a: np.asarray(a, np.float64).reshape(shape)  # noqa: E731
    return r(scale) * (y - r(mean)) / np.sqrt(r(var) + epsilon) + r(beta)


@pytest.mark.parametrize("transpose", [False, True], ids=["conv", "conv-transpose"])
@pytest.mark.parametrize("dims", [1, 2])
def test_numpy_reference_matches_onnxruntime(transpose, dims):
    """Sanity check of the numpy conv references used by the property test."""
    op = "ConvTranspose" if transpose else "Conv"
    rng = np.random.default_rng(1)
    group, c_in, c_out = 2, 4, 6
    w = rng.standard_normal(conv_weight_shape(op, c_in, c_out, group, (3,) * dims)).astype(np.float32)
    b = rng.standard_normal(c_out).astype(np.float32)
    x = rng.standard_normal((2, c_in) + (5,) * dims).astype(np.float32)
    model = make_model(
        [helper.make_node(op, ["x", "w", "b"], ["y"], group=group)],
        [("x", np.float32, list(x.shape))],
        [("y", np.float32, [None] * (dims + 2))],
        {"w": w, "b": b},
    )
    conv = np_conv_transpose if transpose else np_conv
    reference = conv(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), group)
    np.testing.assert_allclose(run(model, {"x": x})[0], reference, rtol=1e-5, atol=1e-5)


@st.composite
def fold_cases(draw):
    group = draw(st.integers(1, 3))
    dims = draw(st.sampled_from([1, 2]))
    return dict(
        transpose=draw(st.booleans()),
        dims=dims,
        group=group,
        c_in=group * draw(st.integers(1, 3)),
        c_out=group * draw(st.integers(1, 3)),
        kernel=tuple(draw(st.lists(st.integers(1, 3), min_size=dims, max_size=dims))),
        bias=draw(st.booleans()),
        dtype=draw(st.sampled_from([np.float32, np.float64])),
        epsilon=draw(st.sampled_from([1e-5, 1e-3, 0.1])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=30, deadline=None)
@given(fold_cases())
def test_fold_conv_bn_property(case):
    """conv(x, W', b') == BN(conv(x, W, b)) for random grouped (transposed) 1-D/2-D convolutions."""
    rng = np.random.default_rng(case["seed"])
    dims, group, dtype = case["dims"], case["group"], case["dtype"]
    kernel = case["kernel"]
    op = "ConvTranspose" if case["transpose"] else "Conv"
    w = rng.standard_normal(conv_weight_shape(op, case["c_in"], case["c_out"], group, kernel)).astype(dtype)
    b = rng.standard_normal(case["c_out"]).astype(dtype) if case["bias"] else None
    params = bn_params(rng, case["c_out"], dtype)
    x = rng.standard_normal((2, case["c_in"]) + (4,) * dims)
    # Rules receive read-only arrays (shared with the graph): fold_conv_bn must not write to them.
    for array in [w, b, *params.values()]:
        if array is not None:
            array.flags.writeable = False

    new_w, new_b = fold_conv_bn(
        w,
        b,
        params["scale"],
        params["beta"],
        params["mean"],
        params["var"],
        case["epsilon"],
        transpose=case["transpose"],
        group=group,
    )
    assert new_w.shape == w.shape and new_w.dtype == dtype
    assert new_b.shape == (case["c_out"],) and new_b.dtype == dtype

    conv = np_conv_transpose if case["transpose"] else np_conv
    as64 = lambda a: None if a is None else a.astype(np.float64)  # noqa: E731
    expected = np_batchnorm(conv(x, as64(w), as64(b), group), *(params[k] for k in BN_PARAMS), case["epsilon"])
    actual = conv(x, as64(new_w), as64(new_b), group)
    tol = FP64_TOL if dtype == np.float64 else dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(actual, expected, **tol)


# ----------------------------------------------------------------------- real models

LIGHT_MODELS = ["resnet50", "densenet121", "inception_v2", "shufflenet"]


def randomized_light_model(name: str) -> onnx.ModelProto:
    """The light model with random weights (randomize_constants) and, on top, every BN
    parameter re-drawn from this file's distributions (gamma U(0.5,1.5), beta N(0,1),
    mean N(0,1), var U(0.5,2)), so the numerics check does not depend on how
    randomize_constants classifies tensors (a negative variance gives NaN outputs, and NaN
    compares equal to NaN, which would hide folding errors).
    """
    model = randomize_constants(onnx.load(light_model(name)))
    rng = np.random.default_rng(LIGHT_MODELS.index(name))
    by_name = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "BatchNormalization":
            continue
        channels = int(np.prod(by_name[node.input[1]].dims))
        for tensor_name, value in zip(node.input[1:5], bn_params(rng, channels).values()):
            by_name[tensor_name].CopyFrom(numpy_helper.from_array(value, tensor_name))
    return model


def conv_bn_pairs(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    producer = {o: n for n in model.graph.node for o in n.output}
    return [
        n
        for n in model.graph.node
        if n.op_type == "BatchNormalization" and n.input[0] in producer and producer[n.input[0]].op_type == "Conv"
    ]


def data_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    weights = {t.name for t in model.graph.initializer}
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        if value.name not in weights:
            shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
            feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    assert len(feeds) == 1
    return feeds


@functools.lru_cache(maxsize=None)
def folded_light_model(name: str):
    """(original, folded, report) for a randomized light model; computed once per session."""
    model = randomized_light_model(name)
    after, report = fuser.optimize(model, rules=[conv_bn_fold])
    return model, after, report


@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_light_model(name):
    model, after, report = folded_light_model(name)
    pairs = conv_bn_pairs(model)
    bn_before = op_types(model).count("BatchNormalization")
    assert pairs, "the model has Conv->BatchNormalization pairs"

    assert report.counts == {RULE: len(pairs)}
    assert conv_bn_pairs(after) == []
    assert op_types(after).count("BatchNormalization") == bn_before - len(pairs)
    assert op_types(after).count("Conv") == op_types(model).count("Conv")
    assert report.verdict is not None and report.verdict.passed
    assert [o.name for o in after.graph.output] == [o.name for o in model.graph.output]

    feeds = data_feeds(model, seed=1)
    expected = run(model, feeds)
    assert all(np.isfinite(e).all() for e in expected)
    assert_same_outputs(model, after, feeds, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_light_model_output_is_valid_onnx(name):
    """The light models are IR 3 (every initializer also a graph input): the folded model must
    still pass the ONNX checker, so the new folded initializers need graph inputs too."""
    model, after, _ = folded_light_model(name)
    onnx.checker.check_model(model, full_check=True)
    assert after.ir_version == model.ir_version == 3
    onnx.checker.check_model(after, full_check=True)
