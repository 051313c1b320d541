"""Folded constants must be finite in the weights' dtype: every folding rule declines otherwise.

float16 holds at most 65504. Each case below folds to a value past that (a tiny variance, a
large scale or shift) and must decline with the reason, leaving the model as it was, while
the same fold in float32 is applied. The last test runs the whole CLI: the overflowing fold is
left out and the rest of the model is still optimized (exit 0, not a failed check).
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from fuser.rules._folding import cast_finite
from fuser.rules.batchnorm_affine_fold import batchnorm_affine_fold
from fuser.rules.conv_add_bias import conv_add_bias
from fuser.rules.conv_bn_fold import conv_bn_fold
from fuser.rules.conv_mul_scale import conv_mul_scale
from onnx import helper

from tests.helpers import assert_declined, assert_rewritten, in_process_cli, make_model

CHANNELS = 2


def conv_then(op_type: str, dtype, constant: np.ndarray) -> onnx.ModelProto:
    w = np.full((CHANNELS, 1, 1, 1), 2.0, dtype)
    return make_model(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"), helper.make_node(op_type, ["c", "k"], ["y"])],
        [("x", dtype, [1, 1, 2, 2])],
        [("y", dtype, [1, CHANNELS, 2, 2])],
        {"w": w, "b": np.full(CHANNELS, 100.0, dtype), "k": constant.astype(dtype).reshape(1, CHANNELS, 1, 1)},
    )


def conv_bn(dtype, variance: float) -> onnx.ModelProto:
    return make_model(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
            helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["y"], epsilon=0.0),
        ],
        [("x", dtype, [1, 1, 2, 2])],
        [("y", dtype, [1, CHANNELS, 2, 2])],
        {
            "w": np.full((CHANNELS, 1, 1, 1), 100.0, dtype),
            "scale": np.ones(CHANNELS, dtype),
            "shift": np.zeros(CHANNELS, dtype),
            "mean": np.zeros(CHANNELS, dtype),
            "var": np.full(CHANNELS, variance, dtype),
        },
    )


def bn_then(op_type: str, dtype, constant: float) -> onnx.ModelProto:
    return make_model(
        [
            helper.make_node("BatchNormalization", ["x", "scale", "shift", "mean", "var"], ["n"], name="bn"),
            helper.make_node(op_type, ["n", "k"], ["y"]),
        ],
        [("x", dtype, [1, CHANNELS, 2, 2])],
        [("y", dtype, [1, CHANNELS, 2, 2])],
        {
            "scale": np.full(CHANNELS, 1000.0, dtype),
            "shift": np.full(CHANNELS, 60000.0, dtype),
            "mean": np.zeros(CHANNELS, dtype),
            "var": np.ones(CHANNELS, dtype),
            "k": np.full((1, CHANNELS, 1, 1), constant, dtype),
        },
    )


# Each case: (model builder, rule, the float16 decline reason's start).
CASES = {
    "conv-bn-fold": (lambda dtype: conv_bn(dtype, 1e-6), conv_bn_fold, "the folded weights are not finite in float16"),
    "conv-mul-scale": (
        lambda dtype: conv_then("Mul", dtype, np.full(CHANNELS, 40000.0)),
        conv_mul_scale,
        "the folded weights are not finite in float16",
    ),
    "conv-add-bias": (
        lambda dtype: conv_then("Add", dtype, np.full(CHANNELS, 65504.0)),
        conv_add_bias,
        "the folded bias values are not finite in float16",
    ),
    "batchnorm-affine-fold-mul": (
        lambda dtype: bn_then("Mul", dtype, 100.0),
        batchnorm_affine_fold,
        "the folded scale values are not finite in float16",
    ),
    "batchnorm-affine-fold-add": (
        lambda dtype: bn_then("Add", dtype, 60000.0),
        batchnorm_affine_fold,
        "the folded shift values are not finite in float16",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_fold_that_overflows_float16_declines(case):
    build, rule, reason = CASES[case]
    assert_declined(build(np.float16), rule, reason)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_same_fold_in_float32_is_applied(case):
    build, rule, _ = CASES[case]
    model = build(np.float32)
    after, _ = assert_rewritten(
        model, [rule], counts={rule.name: 1}, expected_ops=["BatchNormalization" if "batchnorm" in case else "Conv"]
    )
    assert all(np.isfinite(onnx.numpy_helper.to_array(t)).all() for t in after.graph.initializer)


def test_cast_finite_keeps_finite_values_exactly():
    class Recorder:
        def require(self, condition, reason):
            assert condition, reason

    values = np.array([1.5, -65504.0, 0.0])
    assert cast_finite(Recorder(), "weights", values, np.float16).tolist() == [1.5, -65504.0, 0.0]


def test_the_cli_leaves_the_overflowing_fold_out_and_optimizes_the_rest(monkeypatch, capfd, tmp_path):
    """float16 Conv -> BatchNormalization whose fold overflows, next to one that folds cleanly."""
    dtype = np.float16
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c1"], name="conv1"),
        helper.make_node("BatchNormalization", ["c1", "scale", "shift", "mean", "tiny"], ["y1"], epsilon=0.0),
        helper.make_node("Conv", ["x", "w"], ["c2"], name="conv2"),
        helper.make_node("BatchNormalization", ["c2", "scale", "shift", "mean", "one"], ["y2"], epsilon=0.0),
    ]
    model = make_model(
        nodes,
        [("x", dtype, [1, 1, 2, 2])],
        [("y1", dtype, [1, CHANNELS, 2, 2]), ("y2", dtype, [1, CHANNELS, 2, 2])],
        {
            "w": np.full((CHANNELS, 1, 1, 1), 100.0, dtype),
            "scale": np.ones(CHANNELS, dtype),
            "shift": np.zeros(CHANNELS, dtype),
            "mean": np.zeros(CHANNELS, dtype),
            "tiny": np.full(CHANNELS, 1e-6, dtype),
            "one": np.ones(CHANNELS, dtype),
        },
    )
    onnx.save(model, tmp_path / "m.onnx")
    result = in_process_cli(monkeypatch, capfd)(tmp_path, "optimize", "m.onnx")
    assert result.returncode == 0, result.stderr
    assert re.search(r"conv-bn-fold +1\n", result.stderr) and "numerics check: passed" in result.stderr
    written = onnx.load(tmp_path / "m.fused.onnx")
    assert [n.op_type for n in written.graph.node] == ["Conv", "BatchNormalization", "Conv"]
