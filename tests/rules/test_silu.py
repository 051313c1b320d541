"""Tests for silu and silu-ort (rules/silu.py):
x * Sigmoid(x)  =>  Swish(x, alpha=1) at opset 24 and later; com.microsoft QuickGelu(x, alpha=1)
on the onnxruntime target at any opset; x * Sigmoid(alpha * x) (CLIP's quick GELU, alpha
1.702)  =>  the same with that alpha.

Both operand orders of the Mul are built, and of the scale's Mul; both models run in
onnxruntime (CPU, graph optimizations off) on seeded inputs; the result is also compared with
float64 numpy.

Tolerances (|after - before| <= atol + rtol * |before|; see transformer_models.TOL):
  float32  rtol 1e-4, atol 1e-5
  float16  rtol 1e-2, atol 1e-2
  float64  rtol 1e-9, atol 1e-12
Against numpy: the same.

Runtime facts (onnxruntime 1.32 CPU, checked): Sigmoid, Mul, Swish-24 and QuickGelu run in
float16/32/64; nothing of these runs in bfloat16, so the bfloat16 rewrite of silu is checked
structurally and silu-ort declines bfloat16 by its dtype list.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from fuser.rules.silu import silu, silu_ort
from onnx import helper

import fuser
from tests.helpers import assert_declined, assert_rewritten, attrs_of, make_model, nodes_of, opsets_of, run
from tests.rules.transformer_models import TOL, feeds_for

SHAPE = ["batch", "sequence", 16]
ON = ["silu"]  # off by default: onnxruntime's Swish is slower than Sigmoid + Mul
FEED_SHAPE = (2, 3, 16)


def silu_model(
    dtype=np.float32,
    opset=24,
    swapped=False,
    y="y",
    extra_nodes=(),
    extra_outputs=(),
    check=True,
    alpha=None,
    out_rank=3,
):
    """x * Sigmoid(x), or with `alpha` (a value or an array) x * Sigmoid(x * alpha)."""
    mul_inputs = ["sig", "x"] if swapped else ["x", "sig"]
    nodes, inits = [], {}
    if alpha is None:
        nodes.append(helper.make_node("Sigmoid", ["x"], ["sig"], name="sigmoid"))
    else:
        inits["alpha"] = np.asarray(alpha, dtype)
        scale_inputs = ["alpha", "x"] if swapped else ["x", "alpha"]
        nodes.append(helper.make_node("Mul", scale_inputs, ["scaled"], name="scale"))
        nodes.append(helper.make_node("Sigmoid", ["scaled"], ["sig"], name="sigmoid"))
    nodes += [helper.make_node("Mul", mul_inputs, [y], name="mul"), *extra_nodes]
    outputs = [(y, dtype, [None] * out_rank)] + [(o, dtype, [None] * 3) for o in extra_outputs]
    return make_model(nodes, [("x", dtype, SHAPE)], outputs, inits, opset=opset, check=check)


def np_silu(x, alpha=1.0):
    x = x.astype(np.float64)
    return x / (1 + np.exp(-alpha * x))


@pytest.mark.parametrize("swapped", [False, True], ids=["x-first", "sigmoid-first"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=["fp32", "fp16", "fp64"])
def test_becomes_swish(swapped, dtype):
    model = silu_model(dtype, swapped=swapped)
    feeds = feeds_for(FEED_SHAPE, dtype, scale=3.0)
    after, _ = assert_rewritten(
        model, [silu], counts={"silu": 1}, expected_ops=["Swish"], feeds=feeds, enable=ON, **TOL[dtype]
    )
    (node,) = nodes_of(after, "Swish")
    assert list(node.input) == ["x"] and list(node.output) == ["y"] and attrs_of(node) == {"alpha": 1.0}
    np.testing.assert_allclose(run(after, feeds)[0].astype(np.float64), np_silu(feeds["x"]), **TOL[dtype])


@pytest.mark.parametrize("swapped", [False, True], ids=["x-first", "sigmoid-first"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=["fp32", "fp16", "fp64"])
@pytest.mark.parametrize("opset", [13, 24])
def test_becomes_quick_gelu(swapped, dtype, opset):
    model = silu_model(dtype, opset=opset, swapped=swapped)
    feeds = feeds_for(FEED_SHAPE, dtype, scale=3.0)
    after, _ = assert_rewritten(
        model,
        [silu_ort],
        counts={"silu-ort": 1},
        expected_ops=["QuickGelu"],
        feeds=feeds,
        target="onnxruntime",
        **TOL[dtype],
    )
    (node,) = nodes_of(after, "QuickGelu")
    assert node.domain == "com.microsoft" and attrs_of(node) == {"alpha": 1.0}
    assert opsets_of(after)["com.microsoft"] == 1
    np.testing.assert_allclose(run(after, feeds)[0].astype(np.float64), np_silu(feeds["x"]), **TOL[dtype])


@pytest.mark.parametrize("swapped", [False, True], ids=["x-first", "alpha-first"])
@pytest.mark.parametrize(
    "dtype,alpha", [(np.float32, 1.702), (np.float16, 1.702), (np.float64, 1.5)], ids=["fp32", "fp16", "fp64"]
)
def test_scaled_sigmoid_becomes_quick_gelu_and_swish(swapped, dtype, alpha):
    model = silu_model(dtype, swapped=swapped, alpha=alpha)
    feeds = feeds_for(FEED_SHAPE, dtype, scale=3.0)
    held = float(np.asarray(alpha, dtype))  # float16 holds 1.702 as 1.7021484375
    for rule, fused, target, enable in ((silu_ort, "QuickGelu", "onnxruntime", ()), (silu, "Swish", "onnx", ON)):
        after, _ = assert_rewritten(
            model,
            [rule],
            counts={rule.name: 1},
            expected_ops=[fused],
            feeds=feeds,
            target=target,
            enable=enable,
            **TOL[dtype],
        )
        (node,) = nodes_of(after, fused)
        assert list(node.input) == ["x"] and attrs_of(node) == {"alpha": pytest.approx(held, rel=1e-7)}
        expected = np_silu(feeds["x"], held)
        np.testing.assert_allclose(run(after, feeds)[0].astype(np.float64), expected, **TOL[dtype])


def test_float64_scale_float32_cannot_hold_declined():
    model = silu_model(np.float64, alpha=1.702)
    reason = "the scale 1.702 is not exact as a float32 attribute"
    assert_declined(model, silu_ort, reason, target="onnxruntime")
    assert_declined(model, silu, reason, enable=ON)


def test_scale_of_higher_rank_declined():
    """A [1, 1, 1, 1] scale makes the written-out activation of a 3-D x 4-D; QuickGelu(x) stays 3-D."""
    model = silu_model(alpha=np.full((1, 1, 1, 1), 1.702, np.float32), out_rank=4)
    assert_declined(model, silu_ort, "the sigmoid's scale may broadcast x to a higher rank", target="onnxruntime")


def test_scale_vector_declined():
    model = silu_model(alpha=np.full(16, 1.702, np.float32))
    assert_declined(model, silu_ort, "the sigmoid's scale is not a single constant", target="onnxruntime")


def test_scale_used_elsewhere_declined():
    extra = [helper.make_node("Neg", ["scaled"], ["z"], name="neg")]
    model = silu_model(alpha=1.702, extra_nodes=extra, extra_outputs=["z"])
    assert_declined(model, silu_ort, "'scaled' (output of scale) is used outside the match", target="onnxruntime")


def test_sigmoid_of_another_tensor_scaled_is_no_match():
    """z * Sigmoid(alpha * x) is a gated unit, not a quick GELU."""
    nodes = [
        helper.make_node("Mul", ["x", "alpha"], ["scaled"], name="scale"),
        helper.make_node("Sigmoid", ["scaled"], ["sig"], name="sigmoid"),
        helper.make_node("Mul", ["z", "sig"], ["y"], name="mul"),
    ]
    model = make_model(
        nodes,
        [("x", np.float32, SHAPE), ("z", np.float32, SHAPE)],
        [("y", np.float32, [None] * 3)],
        {"alpha": np.asarray(1.702, np.float32)},
        opset=24,
    )
    assert_declined(model, silu_ort, None, target="onnxruntime")


def test_off_by_default():
    _, report = fuser.optimize(silu_model())
    assert "silu" not in report.counts
    _, report = fuser.optimize(silu_model(), enable=ON)
    assert report.counts.get("silu") == 1


def test_opset_boundary():
    _, report = fuser.optimize(silu_model(opset=23), rules=[silu], enable=ON)
    assert report.counts == {} and "opset 23" in report.engine.skipped_rules["silu"]
    _, report = fuser.optimize(silu_model(opset=24), rules=[silu, silu_ort], target="onnxruntime", enable=ON)
    assert report.counts == {"silu": 1}
    _, report = fuser.optimize(silu_model(opset=23), rules=[silu, silu_ort], target="onnxruntime")
    assert report.counts == {"silu-ort": 1}


def test_bfloat16():
    model = silu_model(ml_dtypes.bfloat16)
    after, report = fuser.optimize(model, rules=[silu], check=False, enable=ON)
    assert report.counts == {"silu": 1}
    onnx.checker.check_model(after, full_check=True)
    assert_declined(model, silu_ort, "the input is bfloat16", check=False, target="onnxruntime")


def test_graph_output_name_survives_and_x_has_other_consumers():
    extra = [helper.make_node("Add", ["x", "mlp/gate:0"], ["z"], name="add")]
    model = silu_model(y="mlp/gate:0", extra_nodes=extra, extra_outputs=["z"])
    after, _ = assert_rewritten(
        model,
        [silu],
        counts={"silu": 1},
        expected_ops=["Swish", "Add"],
        feeds=feeds_for(FEED_SHAPE),
        enable=ON,
        **TOL[np.float32],
    )
    assert list(nodes_of(after, "Swish")[0].output) == ["mlp/gate:0"]
    assert list(nodes_of(after, "Add")[0].input) == ["x", "mlp/gate:0"]


def test_sigmoid_used_elsewhere_declined():
    """Llama's gate: when the Sigmoid itself is read elsewhere, the Mul alone cannot go."""
    extra = [helper.make_node("Neg", ["sig"], ["z"], name="neg")]
    model = silu_model(extra_nodes=extra, extra_outputs=["z"])
    assert_declined(model, silu, "'sig' (output of sigmoid) is used outside the match", enable=ON)


def test_sigmoid_is_graph_output_declined():
    assert_declined(silu_model(extra_outputs=["sig"]), silu, "'sig' (output of sigmoid) is a graph output", enable=ON)


def test_sigmoid_of_another_tensor_is_no_match():
    """z * Sigmoid(x) is a gated unit, not SiLU."""
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["sig"], name="sigmoid"),
        helper.make_node("Mul", ["z", "sig"], ["y"], name="mul"),
    ]
    model = make_model(
        nodes, [("x", np.float32, SHAPE), ("z", np.float32, SHAPE)], [("y", np.float32, [None] * 3)], opset=24
    )
    assert_declined(model, silu, None, enable=ON)
    assert_declined(model, silu_ort, None, target="onnxruntime")


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_input_declined(dtype):
    model = silu_model(dtype, check=False)
    assert_declined(model, silu, f"the input is {np.dtype(dtype).name}", check=False, enable=ON)
    assert_declined(model, silu_ort, f"the input is {np.dtype(dtype).name}", check=False, target="onnxruntime")
