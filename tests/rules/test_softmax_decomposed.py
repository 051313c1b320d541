"""Tests for the softmax-decomposed rule (rules/softmax_decomposed.py):
Div(Exp(x), ReduceSum(Exp(x), axes, keepdims=1)) => Softmax(x, axis).

Positive tests build the hand-written softmax, rewrite it with
`fuser.optimize(model, rules=[softmax_decomposed])` (fuser's own onnxruntime check on), check the op
sequence and the graph interface, run the full ONNX checker, and compare both models in
onnxruntime (CPU, graph optimizations disabled) on seeded inputs, and the result against a
float64 numpy softmax along the reduced axis.

Tolerances (|after - before| <= atol + rtol * |before|):
  float32  rtol 1e-5,  atol 1e-6
  float16  rtol 1e-2,  atol 1e-3
  float64  rtol 1e-12, atol 1e-14
For the numpy reference: float32 rtol 1e-5/atol 1e-6, float16 rtol 1e-2/atol 2e-3,
float64 rtol 1e-12/atol 1e-14.

Opset facts the rule relies on: ReduceSum takes `axes` as an attribute before opset 13 and as an
optional int64 input from 13. Softmax works along one axis from opset 13; before 13 it coerces
to 2-D at `axis`, which equals a one-axis softmax only for the last axis.

The pattern names its Exp "exp" twice: both Div and ReduceSum must read the output of the SAME
Exp node. Two distinct Exp(x) nodes do not match (tested below; nothing is declined either).

Runtime facts (onnxruntime 1.32, CPUExecutionProvider): Exp, ReduceSum, Div, Softmax, Log and
LogSoftmax run in float16, float32 and float64 at the opsets used here. A float16
Exp -> ReduceSum chain is evaluated in higher precision (observed: Log(ReduceSum(Exp(x))) of
float16 x = -100 gives -98.6, not -inf, although Exp alone gives 0), so the overflow tests use
+-1000, which overflows/underflows float32 as well. Exp has no integer
type in ONNX, so the integer-input model is invalid for the checker and for onnxruntime: it is
optimized with check=False and must be left alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

import fuser
from fuser.rules.log_softmax import log_softmax
from fuser.rules.softmax_decomposed import softmax_decomposed
from fuser.verify import compare
from tests.helpers import (
    assert_declined,
    assert_rewritten,
    assert_same_outputs,
    attrs_of,
    make_model,
    nodes_of,
    np_log_softmax,
    op_types,
    run,
)

RULE = "softmax-decomposed"
TOL = {
    np.float32: dict(rtol=1e-5, atol=1e-6),
    np.float16: dict(rtol=1e-2, atol=1e-3),
    np.float64: dict(rtol=1e-12, atol=1e-14),
}
REF_TOL = {
    np.float32: dict(rtol=1e-5, atol=1e-6),
    np.float16: dict(rtol=1e-2, atol=2e-3),
    np.float64: dict(rtol=1e-12, atol=1e-14),
}
BIG = 1000.0  # exp(1000) overflows in float16, float32 and float64
CLASSIFIER_HEAD = Path(__file__).resolve().parents[2] / "models" / "classifier_head.onnx"


# --------------------------------------------------------------------------- helpers


def np_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def reduce_sum(inp: str, out: str, axes, opset: int, *, keepdims=1, name="sum", axes_name="axes"):
    """A ReduceSum node and its initializers: axes as an attribute before 13, an input from 13.
    axes None: no axes at all; keepdims None: attribute left out (default 1)."""
    attrs = {} if keepdims is None else {"keepdims": keepdims}
    inits = {}
    inputs = [inp]
    if axes is not None:
        if opset < 13:
            attrs["axes"] = list(axes)
        else:
            inits[axes_name] = np.array(axes, np.int64)
            inputs.append(axes_name)
    return helper.make_node("ReduceSum", inputs, [out], name=name, **attrs), inits


def decomposed_nodes(x="x", out="y", axes=(-1,), opset=13, keepdims=1, prefix=""):
    """x -> Exp -> e; ReduceSum(e, axes) -> s; Div(e, s) -> out. Returns (nodes, initializers)."""
    e, s = f"{prefix}e", f"{prefix}s"
    rs, inits = reduce_sum(e, s, axes, opset, keepdims=keepdims, name=f"{prefix}sum", axes_name=f"{prefix}axes")
    nodes = [
        helper.make_node("Exp", [x], [e], name=f"{prefix}exp"),
        rs,
        helper.make_node("Div", [e, s], [out], name=f"{prefix}div"),
    ]
    return nodes, inits


def decomposed_model(
    *,
    shape=(2, 3, 4),
    axes=(-1,),
    opset=13,
    dtype=np.float32,
    keepdims=1,
    output="y",
    extra_nodes=(),
    extra_outputs=(),
):
    nodes, inits = decomposed_nodes(out=output, axes=axes, opset=opset, keepdims=keepdims)
    rank = len(shape)
    outputs = [(output, dtype, [None] * rank)] + [(n, dtype, [None] * rank) for n in extra_outputs]
    return make_model(nodes + list(extra_nodes), [("x", dtype, list(shape))], outputs, inits, opset=opset)


def feeds_for(shape, dtype=np.float32, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": (2.0 * rng.standard_normal(shape)).astype(dtype)}


def rewrite(model, *, expected_ops, counts=None, rules=(softmax_decomposed,)):
    """Optimize (with fuser's check: every output "ok") and check structure, validity and the
    graph interface."""
    after, report = assert_rewritten(
        model,
        rules,
        counts=counts or {RULE: 1},
        expected_ops=expected_ops,
        check=True,
        all_outputs_ok=True,
        trace=True,
    )
    # The axes initializer of the decomposed form is gone with it.
    assert "axes" not in {t.name for t in after.graph.initializer}
    return after, report


def assert_not_rewritten(model, reason: str | None, *, check=True, rules=(softmax_decomposed,)):
    """The rule must not fire. reason: expected substring of the decline (made at the Div), or
    None when the pattern must not even match (nothing declined either)."""
    return assert_declined(model, softmax_decomposed, reason, node="div", rules=rules, check=check)


# ------------------------------------------------------------------ opset >= 13


@pytest.mark.parametrize("opset", [13, 18, 23])
@pytest.mark.parametrize(
    "shape,axis",
    [
        ((5, 7), 1),
        ((5, 7), -1),
        ((5, 7), 0),
        ((5, 7), -2),
        ((2, 3, 4), 2),
        ((2, 3, 4), 1),
        ((2, 3, 4), -2),
        ((2, 3, 4), 0),
        ((2, 3, 4, 5), 1),
        ((2, 3, 4, 5), -3),
        ((2, 3, 4, 5), 3),
        ((2, 3, 4, 5), -1),
    ],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else f"axis{v}",
)
def test_fires_opset13_plus(opset, shape, axis):
    model = decomposed_model(shape=shape, axes=[axis], opset=opset)
    feeds = feeds_for(shape)
    after, _ = rewrite(model, expected_ops=["Softmax"])
    (node,) = nodes_of(after, "Softmax")
    assert attrs_of(node) == {"axis": axis}
    assert list(node.input) == ["x"] and list(node.output) == ["y"]
    assert after.graph.initializer == []
    assert_same_outputs(model, after, feeds, **TOL[np.float32])
    np.testing.assert_allclose(run(after, feeds)[0], np_softmax(feeds["x"], axis), **REF_TOL[np.float32])


# ------------------------------------------------------------------ opset 11/12


@pytest.mark.parametrize("opset", [11, 12])
@pytest.mark.parametrize(
    "shape,axis",
    [((5, 7), 1), ((5, 7), -1), ((2, 3, 4), 2), ((2, 3, 4), -1), ((2, 3, 4, 5), 3), ((2, 3, 4, 5), -1)],
    ids=["2d-axis1", "2d-axis-1", "3d-axis2", "3d-axis-1", "4d-axis3", "4d-axis-1"],
)
def test_fires_opset11_last_axis(opset, shape, axis):
    """The last axis, as -1 or as a positive index, is the one case where Softmax-11's 2-D
    coercion equals a one-axis softmax."""
    model = decomposed_model(shape=shape, axes=[axis], opset=opset)
    feeds = feeds_for(shape)
    after, _ = rewrite(model, expected_ops=["Softmax"])
    (node,) = nodes_of(after, "Softmax")
    assert attrs_of(node) == {"axis": axis}
    assert_same_outputs(model, after, feeds, **TOL[np.float32])
    np.testing.assert_allclose(run(after, feeds)[0], np_softmax(feeds["x"], -1), **REF_TOL[np.float32])


@pytest.mark.parametrize("opset", [11, 12])
@pytest.mark.parametrize(
    "shape,axis",
    [((5, 7), 0), ((5, 7), -2), ((2, 3, 4), 1), ((2, 3, 4), -2), ((2, 3, 4), 0), ((2, 3, 4, 5), 1)],
    ids=["2d-axis0", "2d-axis-2", "3d-axis1", "3d-axis-2", "3d-axis0", "4d-axis1"],
)
def test_opset11_other_axis_declined(opset, shape, axis):
    """Softmax-11 with axis=1 on [2,3,4] normalises over 3*4 elements, not over the 3 of axis 1."""
    model = decomposed_model(shape=shape, axes=[axis], opset=opset)
    assert_not_rewritten(model, "before opset 13 Softmax flattens from its axis on: only the last axis matches")


def test_opset11_unknown_rank_declined():
    """Before 13 the rank is needed to know whether the axis is the last one. x comes from a
    Reshape to a runtime shape of unknown length, so shape inference cannot know its rank."""
    nodes, _ = decomposed_nodes(axes=[1], opset=11)
    nodes.insert(0, helper.make_node("Reshape", ["data", "shape"], ["x"], name="reshape"))
    model = make_model(
        nodes,
        [("data", np.float32, [2, 3]), ("shape", np.int64, ["n"])],
        [("y", np.float32, [None, None])],
        opset=11,
    )
    assert_not_rewritten(model, "rank is unknown", check=False)


# ---------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["fp16", "fp64"])
@pytest.mark.parametrize("opset,axis", [(11, -1), (11, 2), (13, 1), (18, -1)])
def test_float16_float64(dtype, opset, axis):
    shape = (2, 3, 4)
    model = decomposed_model(shape=shape, axes=[axis], opset=opset, dtype=dtype)
    feeds = feeds_for(shape, dtype)
    after, report = rewrite(model, expected_ops=["Softmax"])
    assert report.verdict.outputs[0].dtype == np.dtype(dtype).name
    assert_same_outputs(model, after, feeds, **TOL[dtype])
    got = run(after, feeds)[0]
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), np_softmax(feeds["x"], axis), **REF_TOL[dtype])


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_input_not_rewritten(opset, dtype):
    """Exp has no integer types, so this model is invalid (no full check, no onnxruntime);
    the rule must still leave it alone rather than emit an integer Softmax."""
    nodes, inits = decomposed_nodes(axes=[-1], opset=opset)
    model = make_model(nodes, [("x", dtype, [2, 3])], [("y", dtype, [2, 3])], inits, opset=opset, check=False)
    assert_not_rewritten(model, "not a float type", check=False)


def test_bfloat16_fires():
    nodes, inits = decomposed_nodes(axes=[-1], opset=13)
    bf16 = onnx.TensorProto.BFLOAT16
    graph = helper.make_graph(
        nodes,
        "test",
        [helper.make_tensor_value_info("x", bf16, [2, 3])],
        [helper.make_tensor_value_info("y", bf16, [2, 3])],
        [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    after, report = fuser.optimize(model, rules=[softmax_decomposed], check=False, trace=True)
    assert report.counts == {RULE: 1}, [d.reason for d in report.engine.declined]
    assert op_types(after) == ["Softmax"]


# -------------------------------------------------------- names, several consumers


def test_graph_output_name_survives():
    model = decomposed_model(output="head/probs:0")
    after, _ = rewrite(model, expected_ops=["Softmax"])
    assert [o.name for o in after.graph.output] == ["head/probs:0"]
    assert list(nodes_of(after, "Softmax")[0].output) == ["head/probs:0"]
    assert_same_outputs(model, after, feeds_for((2, 3, 4)), **TOL[np.float32])


def test_div_output_is_graph_output_and_has_other_consumers():
    extra = [helper.make_node("Neg", ["y"], ["z"], name="neg"), helper.make_node("Sqrt", ["y"], ["w"], name="sqrt")]
    model = decomposed_model(extra_nodes=extra, extra_outputs=["z", "w"])
    after, _ = rewrite(model, expected_ops=["Softmax", "Neg", "Sqrt"])
    assert list(nodes_of(after, "Softmax")[0].output) == ["y"]
    assert list(nodes_of(after, "Neg")[0].input) == ["y"] and list(nodes_of(after, "Sqrt")[0].input) == ["y"]
    assert_same_outputs(model, after, feeds_for((2, 3, 4)), **TOL[np.float32])


def test_x_with_several_consumers():
    """x also feeds a Relu (a graph output): only the Exp/ReduceSum/Div go."""
    extra = [helper.make_node("Relu", ["x"], ["r"], name="relu")]
    model = decomposed_model(extra_nodes=extra, extra_outputs=["r"])
    after, _ = rewrite(model, expected_ops=["Softmax", "Relu"])
    assert list(nodes_of(after, "Relu")[0].input) == ["x"]
    assert_same_outputs(model, after, feeds_for((2, 3, 4)), **TOL[np.float32])


def test_two_decomposed_softmaxes_share_axes_initializer():
    """Two hand-written softmaxes on one x reading ONE axes initializer: both fire, and the
    shared initializer goes only when no reader is left."""
    n1, inits = decomposed_nodes(out="y1", axes=[-1], prefix="a_")
    n2, _ = decomposed_nodes(out="y2", axes=[-1], prefix="b_")
    n2[1].input[1] = "a_axes"
    model = make_model(
        n1 + n2, [("x", np.float32, [3, 5])], [("y1", np.float32, [3, 5]), ("y2", np.float32, [3, 5])], inits
    )
    after, _ = rewrite(model, expected_ops=["Softmax", "Softmax"], counts={RULE: 2})
    assert after.graph.initializer == []
    assert_same_outputs(model, after, feeds_for((3, 5)), **TOL[np.float32])


# --------------------------------------------------------------------- composition


@pytest.mark.parametrize("order", ["decomposed-first", "log-softmax-first"])
@pytest.mark.parametrize("opset,axis", [(11, -1), (11, 2), (13, 1), (13, -1), (18, 0)])
def test_log_of_decomposed_becomes_log_softmax(opset, axis, order):
    shape = (2, 3, 4)
    nodes, inits = decomposed_nodes(out="p", axes=[axis], opset=opset)
    nodes.append(helper.make_node("Log", ["p"], ["y"], name="log"))
    model = make_model(nodes, [("x", np.float32, list(shape))], [("y", np.float32, [None] * 3)], inits, opset=opset)
    rules = [softmax_decomposed, log_softmax] if order == "decomposed-first" else [log_softmax, softmax_decomposed]
    after, _ = rewrite(model, expected_ops=["LogSoftmax"], counts={RULE: 1, "log-softmax": 1}, rules=rules)
    (node,) = nodes_of(after, "LogSoftmax")
    assert attrs_of(node) == {"axis": axis} and list(node.output) == ["y"]
    feeds = feeds_for(shape)
    assert_same_outputs(model, after, feeds, **TOL[np.float32])
    np.testing.assert_allclose(run(after, feeds)[0], np_log_softmax(feeds["x"], axis), **REF_TOL[np.float32])


def test_log_of_decomposed_with_log_softmax_alone_is_no_match():
    nodes, inits = decomposed_nodes(out="p", axes=[-1])
    nodes.append(helper.make_node("Log", ["p"], ["y"], name="log"))
    model = make_model(nodes, [("x", np.float32, [3, 5])], [("y", np.float32, [3, 5])], inits)
    after, report = fuser.optimize(model, rules=[log_softmax], trace=True)
    assert report.counts == {} and report.engine.declined == []
    assert op_types(after) == ["Exp", "ReduceSum", "Div", "Log"]


def test_classifier_head_all_builtin_rules():
    """The sample model with every built-in rule: only Softmax/LogSoftmax remain of the softmax
    patterns (the linear layer becomes a Gemm), output names unchanged, verdict passes."""
    original = onnx.load(str(CLASSIFIER_HEAD))
    after, report = fuser.optimize(str(CLASSIFIER_HEAD))
    onnx.checker.check_model(after, full_check=True)
    ops = op_types(after)
    assert not {"Exp", "ReduceSum", "Div", "Log"} & set(ops), ops
    assert sorted(o for o in ops if "Softmax" in o) == ["LogSoftmax", "LogSoftmax", "Softmax"]
    assert set(ops) - {"Softmax", "LogSoftmax"} <= {"Gemm", "MatMul", "Add"}
    assert (
        [o.name for o in after.graph.output]
        == [o.name for o in original.graph.output]
        == ["logits", "log_probs", "probs", "log_probs_decomposed"]
    )
    assert report.counts[RULE] == 2 and report.counts["log-softmax"] == 2
    assert report.verdict is not None and report.verdict.passed
    assert {o.name: o.status for o in report.verdict.outputs} == dict.fromkeys(
        ["logits", "log_probs", "probs", "log_probs_decomposed"], "ok"
    )
    produced = {o: n.op_type for n in after.graph.node for o in n.output}
    assert produced["probs"] == "Softmax"
    assert produced["log_probs"] == produced["log_probs_decomposed"] == "LogSoftmax"
    rng = np.random.default_rng(5)
    feeds = {"features": rng.standard_normal((4, 128)).astype(np.float32)}
    assert_same_outputs(original, after, feeds, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ negatives


@pytest.mark.parametrize("opset", [11, 13])
def test_keepdims0_declined(opset):
    """keepdims=0 drops the axis; Div then broadcasts differently. Valid only when broadcasting
    works: [2,3,4] / [2,3] does not, so use [3,3,3] reducing axis 2 ([3,3] broadcasts over it)."""
    model = decomposed_model(shape=(3, 3, 3), axes=[2], opset=opset, keepdims=0)
    assert_not_rewritten(model, "keepdims=0")


@pytest.mark.parametrize("opset", [11, 13])
def test_two_axes_declined(opset):
    model = decomposed_model(shape=(2, 3, 4), axes=[1, 2], opset=opset)
    assert_not_rewritten(model, "not exactly one axis")


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_no_axes_declined(opset):
    """ReduceSum without axes sums everything: not a softmax along one axis."""
    model = decomposed_model(shape=(2, 3, 4), axes=None, opset=opset)
    assert_not_rewritten(model, "ReduceSum reduces axes None")


def test_empty_axes_input_declined():
    model = decomposed_model(shape=(2, 3, 4), axes=[], opset=13)
    assert_not_rewritten(model, "ReduceSum reduces axes []")


def test_axes_graph_input_is_no_match():
    nodes, _ = decomposed_nodes(axes=[-1])
    model = make_model(nodes, [("x", np.float32, [2, 3]), ("axes", np.int64, [1])], [("y", np.float32, [2, 3])])
    assert_not_rewritten(model, None, check=False)


def test_two_distinct_exp_nodes_do_not_match():
    """Exp(x)/ReduceSum(Exp'(x)) with two separate Exp nodes on the same x: the pattern's two
    `exp` names must be one node, so this does not match at all (numerically it would be a
    softmax, but the rule is deliberately structural)."""
    nodes = [
        helper.make_node("Exp", ["x"], ["e1"], name="exp1"),
        helper.make_node("Exp", ["x"], ["e2"], name="exp2"),
        helper.make_node("ReduceSum", ["e2", "axes"], ["s"], name="sum", keepdims=1),
        helper.make_node("Div", ["e1", "s"], ["y"], name="div"),
    ]
    model = make_model(
        nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], {"axes": np.array([-1], np.int64)}
    )
    assert_not_rewritten(model, None)


def test_exp_of_different_tensors_do_not_match():
    nodes = [
        helper.make_node("Exp", ["x"], ["e1"], name="exp1"),
        helper.make_node("Exp", ["z"], ["e2"], name="exp2"),
        helper.make_node("ReduceSum", ["e2", "axes"], ["s"], name="sum", keepdims=1),
        helper.make_node("Div", ["e1", "s"], ["y"], name="div"),
    ]
    model = make_model(
        nodes,
        [("x", np.float32, [2, 3]), ("z", np.float32, [2, 3])],
        [("y", np.float32, [2, 3])],
        {"axes": np.array([-1], np.int64)},
    )
    assert_not_rewritten(model, None)


def test_div_operands_swapped_is_no_match():
    """ReduceSum(Exp(x)) / Exp(x) is not a softmax (Div is not commutative)."""
    nodes, inits = decomposed_nodes(axes=[-1])
    nodes[2].input[:] = ["s", "e"]
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], inits)
    assert_not_rewritten(model, None)


@pytest.mark.parametrize("opset", [11, 13])
def test_exp_output_consumed_elsewhere_declined(opset):
    extra = [helper.make_node("Neg", ["e"], ["z"], name="neg")]
    model = decomposed_model(opset=opset, extra_nodes=extra, extra_outputs=["z"])
    assert_not_rewritten(model, "used outside the match")


def test_exp_output_is_graph_output_declined():
    model = decomposed_model()
    model.graph.output.append(helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, [None] * 3))
    onnx.checker.check_model(model, full_check=True)
    assert_not_rewritten(model, "a graph output")


def test_reduce_sum_output_consumed_elsewhere_declined():
    extra = [helper.make_node("Log", ["s"], ["z"], name="log")]
    model = decomposed_model(extra_nodes=extra, extra_outputs=["z"])
    assert_not_rewritten(model, "used outside the match")


# -------------------------------------------------------------------- overflow


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=["fp32", "fp16", "fp64"])
@pytest.mark.parametrize("opset", [11, 13])
def test_overflow_is_stabilized(dtype, opset):
    """logits = x + bias with one bias row of 1000: Exp overflows to inf and inf/inf = NaN in
    that row of the original; Softmax subtracts the maximum and stays finite."""
    bias = np.zeros((2, 4), dtype)
    bias[0] = BIG
    nodes, inits = decomposed_nodes(x="logits", axes=[-1], opset=opset)
    nodes.insert(0, helper.make_node("Add", ["x", "bias"], ["logits"], name="add"))
    model = make_model(nodes, [("x", dtype, [2, 4])], [("y", dtype, [2, 4])], {**inits, "bias": bias}, opset=opset)
    after, report = fuser.optimize(model, rules=[softmax_decomposed], check=True, trace=True)
    assert report.counts == {RULE: 1}
    assert op_types(after) == ["Add", "Softmax"]
    onnx.checker.check_model(after, full_check=True)
    assert report.verdict.passed
    (out,) = report.verdict.outputs
    assert out.status == "stabilized" and out.stabilized_elements == 4
    assert report.verdict.stabilized == ["y"]

    # Half-integers: x + 1000 is exact even in float16, so the reference sees the same logits.
    feeds = {"x": (np.random.default_rng(3).integers(-6, 7, (2, 4)) * 0.5).astype(dtype)}
    (before,) = run(model, feeds)
    (got,) = run(after, feeds)
    assert np.isnan(before[0]).all() and np.isfinite(before[1]).all()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got.astype(np.float64), np_softmax(feeds["x"] + bias, -1), **REF_TOL[dtype])
    np.testing.assert_allclose(got[1], before[1], **TOL[dtype])
    check = compare("y", before, got, exact=False)
    assert check.status == "stabilized" and check.stabilized_elements == 4
