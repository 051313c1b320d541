"""Tests for the conv-add-bias rule (rules/conv_add_bias.py).

Every positive test builds a small Conv/ConvTranspose -> Add(constant) model, folds it with
`fuser.optimize(model, rules=[conv_add_bias])`, checks the op sequence, the folded bias value,
runs the full ONNX checker and compares outputs in onnxruntime (graph optimizations disabled)
with the tolerances stated below. Weights, biases and addends are random and seeded, so a wrong
channel axis or a dropped bias shows up as a numerics failure.

Runtime facts this file relies on (onnxruntime 1.32, CPUExecutionProvider):
* float16 Conv/ConvTranspose/Add have CPU kernels, so float16 models are checked in onnxruntime.
* float64 Conv has NO CPU kernel; float64 models are folded with check=False and compared with
  the ONNX reference evaluator (onnx.reference), which computes Conv in float64.
* An Add whose operands have different dtypes is an invalid model (the checker rejects it); the
  dtype-mismatch test builds it without the checker and optimizes it with check=False.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fuser.rules.conv_add_bias import conv_add_bias, per_channel
from tests.helpers import (
    assert_declined,
    assert_rewritten,
    attrs_of,
    initializer_value,
    make_model,
    nodes_of,
    op_types,
    reference_run,
    run,
)

RULE = "conv-add-bias"
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
FP16_TOL = dict(rtol=1e-2, atol=1e-2)
FP64_TOL = dict(rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- builders


def conv_add_model(
    *,
    op: str = "Conv",
    dims: int = 2,
    c_in: int = 4,
    c_out: int = 6,
    group: int = 1,
    kernel: int = 3,
    size: int = 5,
    batch: int = 2,
    bias: bool = True,
    addend_shape: tuple | None = None,
    addend_first: bool = False,
    dtype=np.float32,
    addend_dtype=None,
    opset: int = 17,
    source: str = "initializer",
    conv_attrs: dict | None = None,
    output: str = "y",
    seed: int = 0,
    checked: bool = True,
):
    """x -> Conv/ConvTranspose(w[, b]) -> Add(c) -> `output`; returns (model, feeds, constants).

    addend_shape defaults to [C_out, 1, ...] (one value per channel, spatial axes 1).
    source: where the addend comes from: "initializer", "constant" (an op Constant node),
    "input" (a graph input: not a constant), "overridable" (an initializer also listed as a
    graph input, which the caller may override: not a constant either).
    checked=False builds the model without the ONNX checker (for deliberately invalid models).
    """
    rng = np.random.default_rng(seed)
    ks = (kernel,) * dims
    w_shape = (c_out, c_in // group, *ks) if op == "Conv" else (c_in, c_out // group, *ks)
    if addend_shape is None:
        addend_shape = (c_out,) + (1,) * dims
    addend_dtype = dtype if addend_dtype is None else addend_dtype
    constants = {"w": (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(dtype)}
    if bias:
        constants["b"] = rng.normal(0.0, 1.0, c_out).astype(dtype)
    constants["c"] = np.asarray(rng.normal(0.0, 1.0, addend_shape)).astype(addend_dtype)

    nodes = []
    inits = {k: v for k, v in constants.items() if k != "c"}
    inputs = [("x", dtype, [batch, c_in] + [size] * dims)]
    if source == "initializer":
        inits["c"] = constants["c"]
    elif source == "constant":
        value = numpy_helper.from_array(constants["c"], "c")
        nodes.append(helper.make_node("Constant", [], ["c"], name="c_const", value=value))
    elif source == "input":
        inputs.append(("c", addend_dtype, list(addend_shape)))
    elif source == "overridable":
        inits["c"] = constants["c"]
        inputs.append(("c", addend_dtype, list(addend_shape)))
    else:
        raise ValueError(source)
    conv_inputs = ["x", "w"] + (["b"] if bias else [])
    nodes.append(helper.make_node(op, conv_inputs, ["conv_out"], name="conv", group=group, **(conv_attrs or {})))
    add_inputs = ["c", "conv_out"] if addend_first else ["conv_out", "c"]
    nodes.append(helper.make_node("Add", add_inputs, [output], name="add"))
    outputs = [(output, dtype, [None] * max(dims + 2, len(addend_shape)))]
    model = make_model(nodes, inputs, outputs, inits, opset=opset, check=checked)
    feeds = {"x": rng.standard_normal(inputs[0][2]).astype(dtype)}
    if source == "input":
        feeds["c"] = constants["c"]
    return model, feeds, constants


def expected_bias(constants: dict, channels: int) -> np.ndarray:
    """b + c as one value per channel, computed in float64."""
    c = np.broadcast_to(constants["c"].astype(np.float64).reshape(-1), (channels,))
    b = constants["b"].astype(np.float64) if "b" in constants else 0.0
    return c + b


def fold(model, *, expected_ops=("Conv",), count=1, check=True):
    """Optimize with conv-add-bias only; check structure, interface and validity (not numerics)."""
    return assert_rewritten(model, [conv_add_bias], counts={RULE: count}, expected_ops=expected_ops, check=check)


def fold_and_compare(model, feeds, *, expected_ops=("Conv",), count=1, rtol, atol):
    """fold, and the outputs agree with the original's in onnxruntime within rtol/atol."""
    return assert_rewritten(
        model, [conv_add_bias], counts={RULE: count}, expected_ops=expected_ops, feeds=feeds, rtol=rtol, atol=atol
    )


def assert_not_folded(model, reason: str | None, *, check=True):
    """The rule must not fire. `reason`: expected substring of the decline (made at the Add,
    in the main graph); None when the pattern itself must not match (nothing declined either)."""
    return assert_declined(model, conv_add_bias, reason, node="add", scope="main", check=check)


# ---------------------------------------------------------------- per_channel helper


@pytest.mark.parametrize(
    "shape,rank,ok",
    [
        ((6, 1, 1), 4, True),
        ((1, 6, 1, 1), 4, True),
        ((), 4, True),
        ((1,), 4, True),
        ((1, 1, 1, 1), 4, True),
        ((6, 1), 3, True),
        ((1, 1), 4, True),
        ((1, 6, 5, 5), 4, False),
        ((6, 5, 1), 4, False),
        ((6,), 4, False),
        ((2, 6, 1, 1), 4, False),
        ((1, 1, 6, 1, 1), 4, False),
        ((1, 3, 1, 1), 4, False),
    ],
)
def test_per_channel(shape, rank, ok):
    addend = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    values = per_channel(addend, rank, 6)
    if not ok:
        assert values is None
    else:
        assert values.shape == (6,)
        np.testing.assert_array_equal(values, np.broadcast_to(addend.reshape(-1), (6,)))


# --------------------------------------------------------------------- Conv variants


@pytest.mark.parametrize("addend_first", [False, True], ids=["conv+c", "c+conv"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(
    "addend_shape",
    [(6, 1, 1), (1, 6, 1, 1), (), (1,), (1, 1, 1, 1), (1, 1)],
    ids=["C11", "1C11", "scalar", "1", "1111", "11"],
)
def test_conv2d_folds(addend_shape, bias, addend_first):
    model, feeds, consts = conv_add_model(addend_shape=addend_shape, bias=bias, addend_first=addend_first)
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    (conv,) = nodes_of(after, "Conv")
    # The folded Conv reads the original input and weight, always has a bias, writes the Add's output.
    assert list(conv.input[:2]) == ["x", "w"] and len(conv.input) == 3
    assert list(conv.output) == ["y"]
    folded = initializer_value(after, conv.input[2])
    assert folded.shape == (6,) and folded.dtype == np.float32
    np.testing.assert_allclose(folded, expected_bias(consts, 6), rtol=1e-6, atol=1e-6)
    # The addend (and the old bias) are gone; the weight is reused untouched.
    names = {t.name for t in after.graph.initializer}
    assert names == {"w", conv.input[2]}
    np.testing.assert_array_equal(initializer_value(after, "w"), consts["w"])


@pytest.mark.parametrize(
    "conv_attrs,group",
    [
        ({"strides": [2, 1], "pads": [1, 0, 2, 1], "dilations": [1, 2], "kernel_shape": [3, 3]}, 1),
        ({"auto_pad": "SAME_UPPER"}, 2),
        ({"pads": [1, 1, 1, 1]}, 2),
    ],
    ids=["strided", "auto-pad-g2", "padded-g2"],
)
def test_conv_attributes_preserved(conv_attrs, group):
    model, feeds, _ = conv_add_model(conv_attrs=conv_attrs, group=group, size=7)
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    assert attrs_of(nodes_of(after, "Conv")[0]) == attrs_of(nodes_of(model, "Conv")[0])


def test_depthwise_conv_folds():
    model, feeds, consts = conv_add_model(c_in=6, c_out=6, group=6, addend_shape=(1, 6, 1, 1))
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    (conv,) = nodes_of(after, "Conv")
    np.testing.assert_allclose(initializer_value(after, conv.input[2]), expected_bias(consts, 6), rtol=1e-6)


@pytest.mark.parametrize("addend_shape", [(6, 1), (1, 6, 1), (), (1,)], ids=["C1", "1C1", "scalar", "1"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_conv1d_folds(addend_shape, bias):
    model, feeds, consts = conv_add_model(dims=1, size=9, addend_shape=addend_shape, bias=bias)
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    (conv,) = nodes_of(after, "Conv")
    np.testing.assert_allclose(initializer_value(after, conv.input[2]), expected_bias(consts, 6), rtol=1e-6, atol=1e-6)


def test_conv3d_folds():
    model, feeds, _ = conv_add_model(dims=3, size=4, addend_shape=(6, 1, 1, 1))
    fold_and_compare(model, feeds, **FP32_TOL)


# ------------------------------------------------------------------ ConvTranspose


@pytest.mark.parametrize("addend_first", [False, True], ids=["conv+c", "c+conv"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("c_in,c_out,group", [(4, 6, 1), (4, 6, 2), (6, 9, 3)], ids=["g1", "g2", "g3"])
def test_conv_transpose_folds(c_in, c_out, group, bias, addend_first):
    """ConvTranspose weights are [C_in, C_out/group, k...]: the channel count is W.shape[1] * group."""
    conv_attrs = {"strides": [2, 1], "pads": [1, 0, 0, 1], "output_padding": [1, 0]}
    model, feeds, consts = conv_add_model(
        op="ConvTranspose",
        c_in=c_in,
        c_out=c_out,
        group=group,
        bias=bias,
        addend_shape=(c_out, 1, 1),
        addend_first=addend_first,
        conv_attrs=conv_attrs,
        size=4,
    )
    after, _ = fold_and_compare(model, feeds, expected_ops=("ConvTranspose",), **FP32_TOL)
    (conv,) = nodes_of(after, "ConvTranspose")
    assert attrs_of(conv) == attrs_of(nodes_of(model, "ConvTranspose")[0])
    folded = initializer_value(after, conv.input[2])
    assert folded.shape == (c_out,)
    np.testing.assert_allclose(folded, expected_bias(consts, c_out), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("addend_shape", [(6, 1), ()], ids=["C1", "scalar"])
def test_conv_transpose_1d_folds(addend_shape):
    model, feeds, _ = conv_add_model(op="ConvTranspose", dims=1, size=6, group=2, addend_shape=addend_shape)
    fold_and_compare(model, feeds, expected_ops=("ConvTranspose",), **FP32_TOL)


# ------------------------------------------------------------------ opsets / dtypes


@pytest.mark.parametrize("opset", [7, 11, 13, 14, 17, 21])
def test_opsets(opset):
    """Add changed versions at 7 (multidirectional broadcast), 13 and 14 (types); Conv at 11."""
    model, feeds, _ = conv_add_model(opset=opset)
    fold_and_compare(model, feeds, **FP32_TOL)


@pytest.mark.parametrize("op", ["Conv", "ConvTranspose"])
def test_float16(op):
    model, feeds, consts = conv_add_model(op=op, dtype=np.float16, addend_shape=(1, 6, 1, 1))
    after, _ = fold_and_compare(model, feeds, expected_ops=(op,), **FP16_TOL)
    (conv,) = nodes_of(after, op)
    folded = initializer_value(after, conv.input[2])
    assert folded.dtype == np.float16
    # Summed in float64 and rounded once to float16.
    np.testing.assert_array_equal(folded, expected_bias(consts, 6).astype(np.float16))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_float64(bias):
    """onnxruntime has no float64 Conv kernel: fold with check=False, compare with onnx.reference."""
    model, feeds, consts = conv_add_model(dtype=np.float64, bias=bias)
    after, _ = fold(model, check=False)
    (conv,) = nodes_of(after, "Conv")
    folded = initializer_value(after, conv.input[2])
    assert folded.dtype == np.float64
    np.testing.assert_array_equal(folded, expected_bias(consts, 6))
    expected, actual = reference_run(model, feeds)[0], reference_run(after, feeds)[0]
    assert actual.dtype == expected.dtype == np.float64
    np.testing.assert_allclose(actual, expected, **FP64_TOL)


# ---------------------------------------------------------- where constants live, sharing


def test_addend_from_constant_node():
    model, feeds, _ = conv_add_model(source="constant")
    assert op_types(model) == ["Constant", "Conv", "Add"]
    # The Constant node fed only the Add: it goes away with it.
    fold_and_compare(model, feeds, **FP32_TOL)


def test_addend_from_constant_subgraph():
    """The exporter form: Unsqueeze(c[C], axes=[1, 2]) -> [C, 1, 1] computed in the graph."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((6, 4, 3, 3)) / 6).astype(np.float32)
    c = rng.standard_normal(6).astype(np.float32)
    nodes = [
        helper.make_node("Unsqueeze", ["c", "axes"], ["c3"], name="unsq"),
        helper.make_node("Conv", ["x", "w"], ["conv_out"], name="conv"),
        helper.make_node("Add", ["conv_out", "c3"], ["y"], name="add"),
    ]
    model = make_model(
        nodes,
        [("x", np.float32, [2, 4, 5, 5])],
        [("y", np.float32, [None] * 4)],
        {"w": w, "c": c, "axes": np.array([1, 2], np.int64)},
    )
    feeds = {"x": rng.standard_normal((2, 4, 5, 5)).astype(np.float32)}
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    assert {t.name for t in after.graph.initializer} & {"c", "axes"} == set()


def test_shared_bias_other_conv_unchanged():
    """Two Convs share the bias; only one is followed by Add. The other keeps the original bias."""
    rng = np.random.default_rng(4)
    inits = {
        "w": (rng.standard_normal((6, 4, 3, 3)) / 6).astype(np.float32),
        "b": rng.standard_normal(6).astype(np.float32),
        "c": rng.standard_normal((6, 1, 1)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c1"], name="conv"),
        helper.make_node("Add", ["c1", "c"], ["y1"], name="add"),
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
    np.testing.assert_array_equal(initializer_value(after, "b"), inits["b"])
    np.testing.assert_array_equal(run(after, feeds)[1], run(model, feeds)[1])


def test_shared_addend_both_pairs_fold():
    rng = np.random.default_rng(5)
    inits = {
        "w1": (rng.standard_normal((6, 4, 3, 3)) / 6).astype(np.float32),
        "w2": (rng.standard_normal((6, 4, 1, 1)) / 2).astype(np.float32),
        "c": rng.standard_normal((6, 1, 1)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c1", "c"], ["y1"], name="add1"),
        helper.make_node("Conv", ["x", "w2"], ["c2"], name="conv2"),
        helper.make_node("Add", ["c", "c2"], ["y2"], name="add2"),
    ]
    model = make_model(
        nodes,
        [("x", np.float32, [2, 4, 5, 5])],
        [("y1", np.float32, [None] * 4), ("y2", np.float32, [None] * 4)],
        inits,
    )
    feeds = {"x": rng.standard_normal((2, 4, 5, 5)).astype(np.float32)}
    after, _ = fold_and_compare(model, feeds, expected_ops=("Conv", "Conv"), count=2, **FP32_TOL)
    assert "c" not in {t.name for t in after.graph.initializer}


def test_two_adds_fold_into_one_conv():
    """Conv -> Add(c1) -> Add(c2): after the first fold the second Add follows a Conv again."""
    model, feeds, consts = conv_add_model(output="mid")
    c2 = np.random.default_rng(9).standard_normal((1, 6, 1, 1)).astype(np.float32)
    nodes = list(model.graph.node) + [helper.make_node("Add", ["c2", "mid"], ["y"], name="add2")]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer} | {"c2": c2}
    chained = make_model(nodes, [("x", np.float32, [2, 4, 5, 5])], [("y", np.float32, [None] * 4)], inits)
    after, _ = fold_and_compare(chained, feeds, count=2, **FP32_TOL)
    (conv,) = nodes_of(after, "Conv")
    total = expected_bias(consts, 6) + c2.reshape(-1)
    np.testing.assert_allclose(initializer_value(after, conv.input[2]), total, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------- output names


def test_graph_output_name_survives():
    model, feeds, _ = conv_add_model(output="features/add_out:0")
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    assert [o.name for o in after.graph.output] == ["features/add_out:0"]
    assert list(nodes_of(after, "Conv")[0].output) == ["features/add_out:0"]


def test_add_output_is_graph_output_and_feeds_another_node():
    """The root's output may have any number of consumers: they all read the new Conv."""
    model, feeds, _ = conv_add_model()
    nodes = list(model.graph.node) + [helper.make_node("Relu", ["y"], ["r"], name="relu")]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    model = make_model(
        nodes, [("x", np.float32, [2, 4, 5, 5])], [("y", np.float32, [None] * 4), ("r", np.float32, [None] * 4)], inits
    )
    after, _ = fold_and_compare(model, feeds, expected_ops=("Conv", "Relu"), **FP32_TOL)
    (conv,) = nodes_of(after, "Conv")
    assert list(conv.output) == ["y"] and list(nodes_of(after, "Relu")[0].input) == ["y"]


def test_value_info_of_removed_tensor_is_dropped():
    model, feeds, _ = conv_add_model()
    model = onnx.shape_inference.infer_shapes(model)
    assert "conv_out" in [v.name for v in model.graph.value_info]
    after, _ = fold_and_compare(model, feeds, **FP32_TOL)
    assert "conv_out" not in [v.name for v in after.graph.value_info]


# ------------------------------------------------------------------------ negatives


@pytest.mark.parametrize(
    "addend_shape",
    [(1, 6, 5, 5), (6, 5, 1), (6, 1, 5), (1, 1, 1, 5), (5,), (2, 6, 1, 1)],
    ids=["1CHW", "CH1", "C1W", "111W", "W", "batch-NC11"],
)
def test_addend_not_per_channel_not_folded(addend_shape):
    """Output is [2, 6, 5, 5] (3x3 kernel on 7x7): an addend varying along H, W or N is not a bias."""
    model, _, _ = conv_add_model(addend_shape=addend_shape, size=7)
    assert_not_folded(model, "is not one value per channel")


def test_addend_with_larger_rank_not_folded():
    """A rank-5 addend turns the 4-D conv output into a 5-D tensor: not a bias."""
    model, _, _ = conv_add_model(addend_shape=(1, 1, 6, 1, 1))
    assert_not_folded(model, "is not one value per channel")


def test_addend_that_enlarges_the_channels_not_folded():
    """One output channel plus an addend with 4 channels broadcasts the output to 4 channels."""
    model, _, _ = conv_add_model(c_out=1, addend_shape=(1, 4, 1, 1))
    assert_not_folded(model, "is not one value per channel")


def test_conv1d_spatial_addend_not_folded():
    model, _, _ = conv_add_model(dims=1, size=9, addend_shape=(6, 7))
    assert_not_folded(model, "is not one value per channel")


def test_addend_dtype_mismatch_not_folded():
    """float32 conv + float64 constant: an invalid model (Add needs one type). The rule must not
    build a float32 bias out of it; it declines. Never run in onnxruntime (check=False)."""
    model, _, _ = conv_add_model(addend_dtype=np.float64, checked=False)
    with pytest.raises((onnx.checker.ValidationError, onnx.shape_inference.InferenceError)):
        onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, "the added constant is float64, the weights float32", check=False)


@pytest.mark.parametrize("source", ["input", "overridable"])
def test_non_constant_addend_not_folded(source):
    """A graph input (or an initializer that a graph input may override) is not a constant."""
    model, _, _ = conv_add_model(source=source)
    assert_not_folded(model, None)


def test_conv_weight_graph_input_not_folded():
    model, _, _ = conv_add_model()
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "w"))
    model.graph.input.append(helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [6, 4, 3, 3]))
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, None)


def test_conv_bias_graph_input_not_folded():
    model, _, _ = conv_add_model()
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "b"))
    model.graph.input.append(helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [6]))
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, None)


def test_conv_output_with_second_consumer_not_folded():
    model, _, _ = conv_add_model()
    model.graph.node.append(helper.make_node("Relu", ["conv_out"], ["r"], name="relu"))
    model.graph.output.append(helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, [None] * 4))
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, "used outside the match")


def test_conv_output_is_graph_output_not_folded():
    model, _, _ = conv_add_model()
    model.graph.output.append(helper.make_tensor_value_info("conv_out", onnx.TensorProto.FLOAT, [None] * 4))
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, "a graph output")


def test_add_of_two_convs_not_folded():
    """Neither operand is a constant: no match, nothing declined."""
    rng = np.random.default_rng(6)
    inits = {k: (rng.standard_normal((6, 4, 1, 1))).astype(np.float32) for k in ("w1", "w2")}
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1"),
        helper.make_node("Conv", ["x", "w2"], ["b"], name="conv2"),
        helper.make_node("Add", ["a", "b"], ["y"], name="add"),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 4, 5, 5])], [("y", np.float32, [None] * 4)], inits)
    assert_not_folded(model, None)


def test_add_after_relu_not_folded():
    model, _, _ = conv_add_model()
    conv = nodes_of(model, "Conv")[0]
    conv.output[0] = "conv_raw"
    model.graph.node.insert(1, helper.make_node("Relu", ["conv_raw"], ["conv_out"], name="relu"))
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, None)
