"""Tests for pad-conv-fold and pad-pool-fold (rules/pad_conv_fold.py): a zero Pad of the
spatial axes moves into the Conv's / AveragePool's pads. Numerics in onnxruntime, optimizations off."""

from __future__ import annotations

import numpy as np
import onnx
from fuser.rules.pad_conv_fold import pad_conv_fold, pad_pool_fold
from onnx import helper

from tests.helpers import assert_declined, assert_rewritten, attrs_of, make_model

RNG = np.random.default_rng(0)
X = RNG.standard_normal((1, 4, 7, 7)).astype(np.float32)
W = RNG.standard_normal((8, 4, 3, 3)).astype(np.float32)
TOL = {"rtol": 1e-5, "atol": 1e-5}


def padded_model(pad_pads, consumer="Conv", value=None, mode="constant", batch=1, **attrs):
    pad_inputs = ["x", "pads"] + (["value"] if value is not None else [])
    inits = {"pads": np.array(pad_pads, np.int64), "w": W}
    if value is not None:
        inits["value"] = np.array(value, np.float32)
    nodes = [helper.make_node("Pad", pad_inputs, ["p"], mode=mode)]
    if consumer == "Conv":
        nodes.append(helper.make_node("Conv", ["p", "w"], ["y"], **attrs))
    else:
        nodes.append(helper.make_node(consumer, ["p"], ["y"], kernel_shape=[3, 3], **attrs))
    model = make_model(nodes, [("x", np.float32, [batch, 4, 7, 7])], [("y", np.float32, None)], inits, check=False)
    inferred = onnx.shape_inference.infer_shapes(model)
    model.graph.output[0].CopyFrom(inferred.graph.output[0])  # the checker wants the output's shape
    onnx.checker.check_model(model, full_check=True)
    return model


def test_asymmetric_same_pad_folds_into_conv():
    model = padded_model([0, 0, 0, 0, 0, 0, 1, 1], strides=[2, 2])
    after, _ = assert_rewritten(
        model, [pad_conv_fold], counts={"pad-conv-fold": 1}, expected_ops=["Conv"], feeds={"x": X}, **TOL
    )
    assert attrs_of(after.graph.node[0])["pads"] == [0, 0, 1, 1]


def test_pad_adds_to_conv_pads_with_symbolic_batch():
    model = padded_model([0, 0, 1, 2, 0, 0, 1, 0], pads=[1, 1, 1, 1], batch="n")
    after, _ = assert_rewritten(
        model, [pad_conv_fold], counts={"pad-conv-fold": 1}, expected_ops=["Conv"], feeds={"x": X}, **TOL
    )
    assert attrs_of(after.graph.node[0])["pads"] == [2, 3, 2, 1]


def test_valid_auto_pad_is_no_padding_and_takes_the_pad():
    """Hugging Face's EfficientNet: an explicit Pad, then a strided Conv with auto_pad=VALID."""
    model = padded_model([0, 0, 0, 0, 0, 0, 1, 1], strides=[2, 2], auto_pad="VALID")
    after, _ = assert_rewritten(
        model, [pad_conv_fold], counts={"pad-conv-fold": 1}, expected_ops=["Conv"], feeds={"x": X}, **TOL
    )
    attrs = attrs_of(after.graph.node[0])
    assert attrs["pads"] == [0, 0, 1, 1] and "auto_pad" not in attrs


def test_same_auto_pad_declines():
    model = padded_model([0, 0, 1, 1, 0, 0, 1, 1], auto_pad="SAME_UPPER")
    assert_declined(model, pad_conv_fold, "pads automatically (SAME_UPPER)")


def test_average_pool_counts_the_zeros():
    model = padded_model([0, 0, 1, 1, 0, 0, 1, 1], consumer="AveragePool")
    after, _ = assert_rewritten(
        model, [pad_pool_fold], counts={"pad-pool-fold": 1}, expected_ops=["AveragePool"], feeds={"x": X}, **TOL
    )
    assert attrs_of(after.graph.node[0])["count_include_pad"] == 1


# --------------------------------------------------------------------------- negatives


def test_nonzero_value_declines():
    assert_declined(padded_model([0, 0, 1, 1, 0, 0, 1, 1], value=1.0), pad_conv_fold, "not zero", check=False)


def test_reflect_mode_declines():
    assert_declined(padded_model([0, 0, 1, 1, 0, 0, 1, 1], mode="reflect"), pad_conv_fold, "constant mode", check=False)


def test_channel_padding_declines():
    model = padded_model([0, 1, 0, 0, 0, 0, 0, 0], consumer="AveragePool")
    assert_declined(model, pad_pool_fold, "batch or channel", check=False)


def test_pool_with_uncounted_pads_declines():
    model = padded_model([0, 0, 1, 1, 0, 0, 1, 1], consumer="AveragePool", pads=[1, 1, 1, 1])
    assert_declined(model, pad_pool_fold, "does not count", check=False)


def test_max_pool_is_left_alone():
    model = padded_model([0, 0, 1, 1, 0, 0, 1, 1], consumer="MaxPool")
    assert_declined(model, pad_pool_fold, None, check=False)


def test_padded_tensor_used_elsewhere_declines():
    model = padded_model([0, 0, 1, 1, 0, 0, 1, 1])
    model.graph.output.append(helper.make_tensor_value_info("p", 1, None))
    assert_declined(model, pad_conv_fold, "graph output", check=False)


def test_pool_pads_as_large_as_the_kernel_decline():
    """A Pad of 3 before a 3x3 AveragePool: the merged pool would pad by its whole kernel, which
    onnxruntime refuses to load; the Pad and the pool ran."""
    model = padded_model([0, 0, 3, 0, 0, 0, 0, 0], consumer="AveragePool")
    assert_declined(model, pad_pool_fold, "not all be smaller than the kernel", check=False)


def test_pool_pads_one_less_than_the_kernel_fold():
    model = padded_model([0, 0, 2, 2, 0, 0, 2, 2], consumer="AveragePool")
    assert_rewritten(model, [pad_pool_fold], counts={"pad-pool-fold": 1}, feeds={"x": X}, **TOL)
