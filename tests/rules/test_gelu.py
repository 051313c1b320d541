"""Tests for gelu and gelu-ort (rules/gelu.py):
0.5 * x * (1 + erf(x / sqrt(2)))  =>  Gelu(x);  0.5 * x * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
or Bloom's factored 0.5 * x * (1 + tanh((sqrt(2/pi) x) (1 + 0.044715 x^2)))  =>
Gelu(x, approximate="tanh") at opset 20 and later; on the onnxruntime target, at any opset,
com.microsoft Gelu (erf) / FastGelu (tanh).

Every spelling of the pattern tuple is built: the three associations of the products
((x * inner) * 0.5, (x * 0.5) * inner, x * (inner * 0.5)) times the erf argument x / sqrt(2),
x * (1 / sqrt(2)), and the tanh forms (x^3 as Pow or as products; Bloom's factored argument
with its square term as (x * c) * x or (x * x) * c). Both models run in onnxruntime (CPU,
graph optimizations off) on seeded inputs; the result is also compared with a float64 numpy GELU.

Tolerances (|after - before| <= atol + rtol * |before|; see transformer_models.TOL):
  float32  rtol 1e-4, atol 1e-5
  float16  rtol 1e-2, atol 1e-2
  float64  rtol 1e-9, atol 1e-12
Against numpy: float32 1e-4/1e-5, float16 1e-2/1e-2, float64 1e-9/1e-12.

Runtime facts (onnxruntime 1.32 CPU, checked): Erf has no float64 kernel, nor does
com.microsoft Gelu or the erf Gelu-20 (it expands to Erf); FastGelu and the tanh Gelu-20 run
in float64. So gelu-ort declines a float64 erf GELU, and the float64 erf rewrite of gelu is
compared in the ONNX reference evaluator instead. No bfloat16 Erf/Tanh/Mul kernels: the
bfloat16 rewrite is checked structurally.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import onnx
import pytest
from fuser.rules.gelu import gelu, gelu_ort
from onnx import helper

import fuser
from tests.helpers import (
    assert_declined,
    assert_rewritten,
    attrs_of,
    make_model,
    nodes_of,
    opsets_of,
    run,
)
from tests.rules.transformer_models import GELU_FORMS, GELU_KINDS, TOL, feeds_for, gelu_nodes, np_gelu

CUBIC = 0.044715

SHAPE = ["batch", "sequence", 16]
FEED_SHAPE = (2, 3, 16)
REF_TOL = {
    np.float32: dict(rtol=1e-4, atol=1e-5),
    np.float16: dict(rtol=1e-2, atol=1e-2),
    np.float64: dict(rtol=1e-9, atol=1e-12),
}
CASES = [(k, f) for k in GELU_KINDS for f in GELU_FORMS]
CASE_IDS = [f"{k}-form{f}" for k, f in CASES]


def gelu_model(
    kind="erf-div",
    form=0,
    dtype=np.float32,
    opset=20,
    shape=SHAPE,
    extra_nodes=(),
    extra_outputs=(),
    y="y",
    check=True,
    **constants,
):
    nodes, inits = gelu_nodes(kind=kind, form=form, dtype=dtype, y=y, **constants)
    outputs = [(o, dtype, [None] * len(shape)) for o in (y, *extra_outputs)]
    return make_model(nodes + list(extra_nodes), [("x", dtype, shape)], outputs, inits, opset=opset, check=check)


def approximate(kind):
    return "tanh" if kind.startswith("tanh") else "none"


# -------------------------------------------------------------------------- positives


@pytest.mark.parametrize("kind,form", CASES, ids=CASE_IDS)
def test_every_spelling_becomes_gelu(kind, form):
    model = gelu_model(kind, form)
    feeds = feeds_for(FEED_SHAPE, scale=3.0)
    after, _ = assert_rewritten(
        model, [gelu], counts={"gelu": 1}, expected_ops=["Gelu"], feeds=feeds, **TOL[np.float32]
    )
    (node,) = nodes_of(after, "Gelu")
    assert node.domain == "" and list(node.input) == ["x"] and list(node.output) == ["y"]
    assert attrs_of(node) == ({"approximate": "tanh"} if kind.startswith("tanh") else {})
    np.testing.assert_allclose(run(after, feeds)[0], np_gelu(feeds["x"], approximate(kind)), **REF_TOL[np.float32])


@pytest.mark.parametrize("kind,form", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("opset", [13, 17, 20])
def test_ort_variant(kind, form, opset):
    model = gelu_model(kind, form, opset=opset)
    feeds = feeds_for(FEED_SHAPE, scale=3.0)
    expected = "FastGelu" if kind.startswith("tanh") else "Gelu"
    after, _ = assert_rewritten(
        model,
        [gelu_ort],
        counts={"gelu-ort": 1},
        expected_ops=[expected],
        feeds=feeds,
        target="onnxruntime",
        **TOL[np.float32],
    )
    (node,) = nodes_of(after, expected)
    assert node.domain == "com.microsoft" and list(node.input) == ["x"]
    assert opsets_of(after)["com.microsoft"] == 1
    np.testing.assert_allclose(run(after, feeds)[0], np_gelu(feeds["x"], approximate(kind)), **REF_TOL[np.float32])


def test_opset_boundary():
    _, report = fuser.optimize(gelu_model(opset=19), rules=[gelu])
    assert report.counts == {} and "opset 19" in report.engine.skipped_rules["gelu"]
    # the onnxruntime target with both rules: the standard op from 20, com.microsoft below
    after, report = fuser.optimize(gelu_model(opset=20), rules=[gelu, gelu_ort], target="onnxruntime")
    assert report.counts == {"gelu": 1} and "com.microsoft" not in opsets_of(after)
    _, report = fuser.optimize(gelu_model(opset=19), rules=[gelu, gelu_ort], target="onnxruntime")
    assert report.counts == {"gelu-ort": 1}


@pytest.mark.parametrize("kind", GELU_KINDS)
def test_float16(kind):
    """float16 holds sqrt(2) as 1.4140625 and 0.044715 as 0.04471: still GELU's constants."""
    model = gelu_model(kind, dtype=np.float16)
    feeds = feeds_for(FEED_SHAPE, np.float16, scale=3.0)
    after, _ = assert_rewritten(
        model, [gelu], counts={"gelu": 1}, expected_ops=["Gelu"], feeds=feeds, **TOL[np.float16]
    )
    got = run(after, feeds)[0]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), np_gelu(feeds["x"], approximate(kind)), **REF_TOL[np.float16])
    expected = "FastGelu" if kind.startswith("tanh") else "Gelu"
    assert_rewritten(
        model,
        [gelu_ort],
        counts={"gelu-ort": 1},
        expected_ops=[expected],
        feeds=feeds,
        target="onnxruntime",
        **TOL[np.float16],
    )


@pytest.mark.parametrize("kind", GELU_KINDS)
def test_float64_declined(kind):
    """Gelu-20's function body holds its constants as float32: onnxruntime's float64 Gelu is
    ~6e-9 off a float64 GELU, FastGelu ~2e-7 (measured), and com.microsoft Gelu has no float64
    kernel, so both rules leave float64 written out rather than fail fuser's float64 check."""
    model = gelu_model(kind, dtype=np.float64)
    assert_declined(model, gelu, "the input is float64; the fused op takes float16, float32, bfloat16", check=False)
    assert_declined(
        model, gelu_ort, "the input is float64; the fused op takes float16, float32", check=False, target="onnxruntime"
    )


def test_float64_tanh_gelu_is_less_precise_than_float64():
    """The measurement behind the decline: the standard Gelu(tanh) in onnxruntime against the
    written-out float64 form it would replace."""
    model = gelu_model("tanh", dtype=np.float64)
    gelu_op = make_model(
        [helper.make_node("Gelu", ["x"], ["y"], approximate="tanh")],
        [("x", np.float64, SHAPE)],
        [("y", np.float64, [None] * 3)],
        opset=20,
    )
    feeds = feeds_for(FEED_SHAPE, np.float64, scale=3.0)
    written_out, fused = run(model, feeds)[0], run(gelu_op, feeds)[0]
    np.testing.assert_allclose(written_out, np_gelu(feeds["x"], "tanh"), **REF_TOL[np.float64])
    assert not np.allclose(fused, written_out, **TOL[np.float64])


def test_bfloat16_structure():
    model = gelu_model("erf-div", dtype=ml_dtypes.bfloat16)
    after, report = fuser.optimize(model, rules=[gelu], check=False, trace=True)
    assert report.counts == {"gelu": 1}, [d.reason for d in report.engine.declined]
    onnx.checker.check_model(after, full_check=True)


# ----------------------------------------------------------------- names and consumers


def test_graph_output_name_survives_with_other_consumers():
    extra = [helper.make_node("Neg", ["mlp/act:0"], ["z"], name="neg")]
    model = gelu_model(y="mlp/act:0", extra_nodes=extra, extra_outputs=["z"])
    after, _ = assert_rewritten(
        model, [gelu], counts={"gelu": 1}, expected_ops=["Gelu", "Neg"], feeds=feeds_for(FEED_SHAPE), **TOL[np.float32]
    )
    assert list(nodes_of(after, "Gelu")[0].output) == ["mlp/act:0"]


def test_x_with_other_consumers():
    extra = [helper.make_node("Relu", ["x"], ["r"], name="relu")]
    model = gelu_model(extra_nodes=extra, extra_outputs=["r"])
    assert_rewritten(
        model,
        [gelu],
        counts={"gelu": 1},
        expected_ops=["Gelu", "Relu"],
        feeds=feeds_for(FEED_SHAPE),
        **TOL[np.float32],
    )


def test_two_gelus_sharing_constants():
    n1, inits = gelu_nodes(y="y1", prefix="a_")
    n2, _ = gelu_nodes(x="r", y="y2", prefix="b_", form=2)
    for node in n2:
        node.input[:] = [
            i.replace("b_", "a_") if i.startswith("b_") and i[2:] in ("half", "one", "root_two") else i
            for i in node.input
        ]
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu")] + n1 + n2
    model = make_model(
        nodes,
        [("x", np.float32, SHAPE)],
        [("y1", np.float32, [None] * 3), ("y2", np.float32, [None] * 3)],
        inits,
        opset=20,
    )
    after, _ = assert_rewritten(
        model,
        [gelu],
        counts={"gelu": 2},
        expected_ops=["Relu", "Gelu", "Gelu"],
        feeds=feeds_for(FEED_SHAPE),
        **TOL[np.float32],
    )
    assert after.graph.initializer == []


# --------------------------------------------------------------------------- declines


@pytest.mark.parametrize("form", GELU_FORMS)
def test_outer_factor_declined(form):
    assert_declined(gelu_model(form=form, half=0.6), gelu, "the outer factor is 0.6, not 0.5")


def test_added_constant_declined():
    assert_declined(gelu_model(one=2.0), gelu, "the added constant is 2, not 1")


@pytest.mark.parametrize("kind,value", [("erf-div", 1 / math.sqrt(2)), ("erf-mul", math.sqrt(2)), ("erf-div", 1.5)])
def test_erf_scale_declined(kind, value):
    """Dividing by 1/sqrt(2) (or multiplying by sqrt(2)) is not GELU's erf argument."""
    assert_declined(gelu_model(kind, root_two=value), gelu, "the erf argument's scale is")


@pytest.mark.parametrize(
    "constant,value,reason",
    [
        ("three", 2.0, "the exponent is 2, not 3"),
        ("cubic", 0.05, "the cubic coefficient is 0.05"),
        ("tanh_scale", 0.7, "the tanh argument's scale is 0.7"),
    ],
)
def test_tanh_constants_declined(constant, value, reason):
    assert_declined(gelu_model("tanh", **{constant: value}), gelu, reason)


@pytest.mark.parametrize("kind", ["tanh-factored", "tanh-factored-square"])
@pytest.mark.parametrize(
    "constant,value,reason",
    [
        ("one_inner", 2.0, "the constant term of the factored polynomial is 2, not 1"),
        ("cubic", 0.05, "the cubic coefficient is 0.05"),
        ("tanh_scale", 0.7, "the tanh argument's scale is 0.7"),
    ],
)
def test_factored_tanh_constants_declined(kind, constant, value, reason):
    assert_declined(gelu_model(kind, **{constant: value}), gelu, reason)


@pytest.mark.parametrize(
    "kind,constant,value", [("erf-div", "half", 0.5), ("erf-mul", "one", 1.0), ("tanh", "cubic", CUBIC)]
)
def test_constant_of_higher_rank_declined(kind, constant, value):
    """A [1, 1, 1, 1] constant makes the written-out GELU of a 3-D x 4-D; Gelu(x) stays 3-D."""
    nodes, inits = gelu_nodes(kind=kind, **{constant: np.full((1, 1, 1, 1), value, np.float32)})
    model = make_model(nodes, [("x", np.float32, SHAPE)], [("y", np.float32, [None] * 4)], inits, opset=20)
    assert_declined(model, gelu, "may broadcast x to a higher rank")
    assert_declined(model, gelu_ort, "may broadcast x to a higher rank", target="onnxruntime")


def test_one_element_constant_of_x_rank_fuses():
    model = gelu_model("tanh", half=np.full((1, 1, 1), 0.5, np.float32))
    assert_rewritten(
        model, [gelu], counts={"gelu": 1}, expected_ops=["Gelu"], feeds=feeds_for(FEED_SHAPE), **TOL[np.float32]
    )


def test_constant_vector_declined():
    assert_declined(gelu_model(half=np.full(16, 0.5, np.float32)), gelu, "the outer factor is not a single constant")


def test_erf_output_used_elsewhere_declined():
    extra = [helper.make_node("Neg", ["erf"], ["z"], name="other")]
    model = gelu_model(extra_nodes=extra, extra_outputs=["z"])
    assert_declined(model, gelu, "'erf' (output of erf) is used outside the match")


def test_tanh_is_graph_output_declined():
    assert_declined(gelu_model("tanh", extra_outputs=["tanh"]), gelu, "'tanh' (output of tanh) is a graph output")


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_input_declined(dtype):
    nodes, inits = gelu_nodes(kind="erf-mul")
    inits = {k: v.astype(dtype) for k, v in inits.items()}
    model = make_model(nodes, [("x", dtype, SHAPE)], [("y", dtype, [None] * 3)], inits, opset=20, check=False)
    assert_declined(model, gelu, f"the input is {np.dtype(dtype).name}", check=False)


def test_two_different_x_is_no_match():
    """0.5 * z * (1 + erf(x / sqrt(2))) is not a GELU of anything."""
    nodes, inits = gelu_nodes()
    nodes[3].input[0] = "z"  # the Mul(x, plus) of form 0
    model = make_model(
        nodes, [("x", np.float32, SHAPE), ("z", np.float32, SHAPE)], [("y", np.float32, [None] * 3)], inits, opset=20
    )
    assert_declined(model, gelu, None)


@pytest.mark.parametrize("kind", ["tanh-factored", "tanh-factored-square"])
def test_factored_square_needs_x_twice(kind):
    """(x * 0.044715) * z in place of 0.044715 * x^2 is not GELU's polynomial."""
    nodes, inits = gelu_nodes(kind=kind)
    square = nodes[1] if kind == "tanh-factored" else nodes[0]
    square.input[list(square.input).index("x")] = "z"
    model = make_model(
        nodes, [("x", np.float32, SHAPE), ("z", np.float32, SHAPE)], [("y", np.float32, [None] * 3)], inits, opset=20
    )
    assert_declined(model, gelu, None)


def test_cube_of_products_needs_x_three_times():
    """x * (x * z) in place of x^3 is not GELU's polynomial."""
    nodes, inits = gelu_nodes(kind="tanh-products")
    assert nodes[0].op_type == "Mul" and list(nodes[0].input) == ["x", "x"]
    nodes[0].input[1] = "z"
    model = make_model(
        nodes, [("x", np.float32, SHAPE), ("z", np.float32, SHAPE)], [("y", np.float32, [None] * 3)], inits, opset=20
    )
    assert_declined(model, gelu, None)
