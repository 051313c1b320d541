"""Tests for hardsigmoid-decomposed and hardswish-decomposed / hardswish-clip: the forms torch
and other exporters write become HardSigmoid / HardSwish. Numerics in onnxruntime, optimizations off."""

from __future__ import annotations

import numpy as np
import pytest
from fuser.rules.hardsigmoid_decomposed import hardsigmoid_decomposed
from fuser.rules.hardswish_decomposed import hardswish_clip, hardswish_clip_regroup, hardswish_decomposed
from onnx import helper

from tests.helpers import assert_declined, assert_rewritten, make_model

RULES = [hardsigmoid_decomposed, hardswish_decomposed, hardswish_clip, hardswish_clip_regroup]
X = {"x": (np.random.default_rng(0).standard_normal((2, 8)) * 4).astype(np.float32)}
TOL = {"rtol": 1e-5, "atol": 1e-6}


def clip_nodes(low=0.0, high=6.0, three=3.0):
    inits = {"three": np.array(three, np.float32), "low": np.array(low, np.float32), "high": np.array(high, np.float32)}
    nodes = [helper.make_node("Add", ["x", "three"], ["a"]), helper.make_node("Clip", ["a", "low", "high"], ["c"])]
    return nodes, inits


def torch_hardswish(opset=17, scale_op="Div", six=6.0, **clip):
    """x * (Clip(x + 3, 0, 6) / 6): torch's hardswish decomposition."""
    nodes, inits = clip_nodes(**clip)
    inits["six"] = np.array(six, np.float32)
    nodes += [helper.make_node(scale_op, ["c", "six"], ["h"]), helper.make_node("Mul", ["x", "h"], ["y"])]
    return make_model(nodes, [("x", np.float32, ["n", 8])], [("y", np.float32, ["n", 8])], inits, opset=opset)


def grouped_hardswish(six=6.0, opset=17, scale_op="Div"):
    """(x * Clip(x + 3, 0, 6)) / 6, as PaddlePaddle exports hardswish."""
    nodes, inits = clip_nodes()
    inits["six"] = np.array(six, np.float32)
    nodes += [helper.make_node("Mul", ["x", "c"], ["p"]), helper.make_node(scale_op, ["p", "six"], ["y"])]
    return make_model(nodes, [("x", np.float32, [2, 8])], [("y", np.float32, [2, 8])], inits, opset=opset)


@pytest.mark.parametrize("scale_op, six", [("Div", 6.0), ("Mul", 1 / 6)])
def test_torch_form_becomes_hardswish(scale_op, six):
    assert_rewritten(
        torch_hardswish(scale_op=scale_op, six=six),
        RULES,
        counts={"hardsigmoid-decomposed": 1, "hardswish-decomposed": 1},
        expected_ops=["HardSwish"],
        feeds=X,
        **TOL,
    )


def test_grouped_form_becomes_hardswish():
    assert_rewritten(
        grouped_hardswish(), RULES, counts={"hardswish-clip": 1}, expected_ops=["HardSwish"], feeds=X, **TOL
    )


@pytest.mark.parametrize("opset, scale_op, six", [(13, "Div", 6.0), (11, "Mul", 1 / 6), (13, "Mul", 1 / 6)])
def test_grouped_form_before_opset_14_becomes_x_times_hardsigmoid(opset, scale_op, six):
    after, _ = assert_rewritten(
        grouped_hardswish(six=six, opset=opset, scale_op=scale_op),
        RULES,
        counts={"hardswish-clip-regroup": 1},
        expected_ops=["HardSigmoid", "Mul"],
        feeds=X,
        **TOL,
    )
    hard_sigmoid, product = after.graph.node
    assert list(hard_sigmoid.input) == ["x"] and sorted(product.input) == sorted(["x", hard_sigmoid.output[0]])


def test_grouped_form_divided_by_5_before_opset_14_declines():
    model = grouped_hardswish(six=5.0, opset=13)
    assert_declined(model, hardswish_clip_regroup, "not divided by 6", rules=RULES, check=False)


def test_before_opset_14_only_hardsigmoid():
    assert_rewritten(
        torch_hardswish(opset=13),
        RULES,
        counts={"hardsigmoid-decomposed": 1},
        expected_ops=["HardSigmoid", "Mul"],
        feeds=X,
        **TOL,
    )


def test_hardsigmoid_that_is_a_graph_output_stays_and_names_survive():
    model = torch_hardswish()
    model.graph.output.append(helper.make_tensor_value_info("h", 1, ["n", 8]))
    _, report = assert_rewritten(
        model,
        RULES,
        counts={"hardsigmoid-decomposed": 1},
        expected_ops=["HardSigmoid", "Mul"],
        feeds=X,
        trace=True,
        **TOL,
    )
    assert any("is a graph output" in d.reason for d in report.engine.declined if d.rule == "hardswish-decomposed")


# --------------------------------------------------------------------------- negatives


def test_clip_to_5_declines():
    assert_declined(torch_hardswish(high=5.0), hardsigmoid_decomposed, "not [0, 6]", rules=RULES, check=False)


def test_add_of_2_declines():
    assert_declined(torch_hardswish(three=2.0), hardsigmoid_decomposed, "does not add 3", rules=RULES, check=False)


def test_divided_by_5_declines():
    assert_declined(grouped_hardswish(six=5.0), hardswish_clip, "not divided by 6", rules=RULES, check=False)


def test_hardsigmoid_with_default_alpha_is_not_hardswish():
    nodes = [helper.make_node("HardSigmoid", ["x"], ["h"]), helper.make_node("Mul", ["x", "h"], ["y"])]
    model = make_model(nodes, [("x", np.float32, [2, 8])], [("y", np.float32, [2, 8])])
    assert_declined(model, hardswish_decomposed, "alpha is 0.2", check=False)


def test_broadcasting_constant_declines():
    nodes, inits = clip_nodes()
    inits["three"] = np.full((1, 1, 1), 3.0, np.float32)
    inits["six"] = np.array(6.0, np.float32)
    nodes += [helper.make_node("Div", ["c", "six"], ["h"]), helper.make_node("Mul", ["x", "h"], ["y"])]
    model = make_model(nodes, [("x", np.float32, [2, 8])], [("y", np.float32, [1, 2, 8])], inits)
    assert_declined(model, hardsigmoid_decomposed, "broadcast x", rules=RULES, check=False)


@pytest.mark.parametrize(
    ("model", "rule"),
    [
        (torch_hardswish(six=6.005), hardsigmoid_decomposed),
        (torch_hardswish(scale_op="Mul", six=0.1667), hardsigmoid_decomposed),
        (grouped_hardswish(six=6.005), hardswish_clip),
        (grouped_hardswish(six=0.1667, scale_op="Mul", opset=13), hardswish_clip_regroup),
    ],
    ids=["div-6.005", "mul-0.1667", "grouped-div-6.005", "regroup-mul-0.1667"],
)
def test_a_constant_near_6_but_not_it_declines(model, rule):
    """6.005 or 0.1667 would move every output by 1e-4 to 1e-3 of it: as much as float32's check allows."""
    assert_declined(model, rule, "not divided by 6", rules=RULES, check=False)


def test_hardsigmoid_whose_alpha_is_near_a_sixth_is_not_hardswish():
    nodes = [helper.make_node("HardSigmoid", ["x"], ["h"], alpha=0.1665), helper.make_node("Mul", ["x", "h"], ["y"])]
    model = make_model(nodes, [("x", np.float32, [2, 8])], [("y", np.float32, [2, 8])], opset=14)
    assert_declined(model, hardswish_decomposed, "alpha is 0.1665", check=False)


def test_a_sixth_written_to_six_digits_is_a_sixth():
    assert_rewritten(
        torch_hardswish(scale_op="Mul", six=0.166667),
        RULES,
        counts={"hardsigmoid-decomposed": 1, "hardswish-decomposed": 1},
        expected_ops=["HardSwish"],
        feeds=X,
        **TOL,
    )


def _as(model, dtype):
    """`model` with its input, output and constants in `dtype`."""
    from onnx import numpy_helper

    element = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.elem_type = element
    for tensor in model.graph.initializer:
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(dtype), tensor.name))
    return model


@pytest.mark.parametrize("grouped", [False, True], ids=["torch", "grouped"])
def test_float64_stays_decomposed(grouped):
    """onnxruntime's CPU has no float64 HardSigmoid or HardSwish: the model would not load."""
    model = _as(grouped_hardswish() if grouped else torch_hardswish(), np.float64)
    rule = hardswish_clip if grouped else hardsigmoid_decomposed
    assert_declined(model, rule, "the input is float64", rules=RULES, check=False)


def test_float16_with_a_sixth_as_float16_holds_it_is_fused():
    model = _as(torch_hardswish(scale_op="Mul", six=1 / 6), np.float16)
    feeds = {"x": X["x"].astype(np.float16)}
    assert_rewritten(
        model,
        RULES,
        counts={"hardsigmoid-decomposed": 1, "hardswish-decomposed": 1},
        expected_ops=["HardSwish"],
        feeds=feeds,
        rtol=1e-2,
        atol=1e-2,
    )
