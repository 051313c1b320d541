"""Tests for slice-chain (rules/slice_chain.py); outputs bit-identical."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.rules.slice_chain import slice_chain
from onnx import helper

from tests.helpers import assert_declined, assert_rewritten, make_model

RNG = np.random.default_rng(0)
X = {"x": RNG.standard_normal((2, 7, 6, 5)).astype(np.float32)}
BIG = np.iinfo(np.int64).max


def chained(first, second, dtype=np.int64, batch=2, also_output=False):
    """Slice(Slice(x, *first), *second); each a (starts, ends, axes[, steps]) tuple."""
    inits, nodes = {}, []
    source = "x"
    for name, params in (("a", first), ("b", second)):
        inputs = [source]
        for part, values in zip(("starts", "ends", "axes", "steps"), params):
            inits[f"{name}_{part}"] = np.array(values, dtype)
            inputs.append(f"{name}_{part}")
        output = "y" if name == "b" else "inner"
        nodes.append(helper.make_node("Slice", inputs, [output], name=f"slice_{name}"))
        source = output
    outputs = [("y", np.float32, None)] + ([("inner", np.float32, None)] if also_output else [])
    model = make_model(nodes, [("x", np.float32, [batch, 7, 6, 5])], outputs, inits, check=False)
    inferred = onnx.shape_inference.infer_shapes(model)
    for index, value in enumerate(inferred.graph.output):
        model.graph.output[index].CopyFrom(value)  # the checker wants the outputs' shapes
    return model


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_strided_subsampling_of_two_axes_is_one_slice(dtype):
    """LeViT's queries: x[:, ::2][:, :, ::2]."""
    model = chained(([0], [BIG if dtype == np.int64 else 2**31 - 1], [1], [2]), ([0], [2**31 - 1], [2], [2]), dtype)
    after, _ = assert_rewritten(model, [slice_chain], counts={"slice-chain": 1}, expected_ops=["Slice"], feeds=X)
    assert len(after.graph.node[0].input) == 5


def test_negative_axes_and_missing_steps():
    model = chained(([1], [-1], [-1]), ([2], [7], [1], [1]))
    assert_rewritten(model, [slice_chain], counts={"slice-chain": 1}, expected_ops=["Slice"], feeds=X)


def test_symbolic_batch():
    model = chained(([1], [5], [3], [2]), ([-4], [-1], [-3], [1]), batch="n")
    assert_rewritten(model, [slice_chain], counts={"slice-chain": 1}, expected_ops=["Slice"], feeds=X)


def test_the_same_axis_twice_declines():
    model = chained(([0], [6], [1], [2]), ([1], [3], [-3], [1]))
    assert_declined(model, slice_chain, "share an axis")


def test_an_inner_slice_read_elsewhere_stays():
    model = chained(([0], [6], [1], [2]), ([0], [4], [2], [1]), also_output=True)
    assert_declined(model, slice_chain, "is a graph output")
