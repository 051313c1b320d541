"""Tests for the log-softmax rule (rules/log_softmax.py): Log(Softmax(x)) => LogSoftmax(x).

Every positive test builds a small model, rewrites it with
`fuser.optimize(model, rules=[log_softmax])` (fuser's own onnxruntime check on), checks the op
sequence and the graph interface, runs the full ONNX checker, and compares the two models in
onnxruntime (CPU, graph optimizations disabled) on seeded inputs, and both against a float64
numpy reference of the semantics the opset prescribes.

Tolerances (|after - before| <= atol + rtol * |before|):
  float32  rtol 1e-5,  atol 1e-5
  float16  rtol 1e-2,  atol 1e-2
  float64  rtol 1e-12, atol 1e-12
The numpy reference is compared with the same tolerances (float16 outputs: rtol 1e-2, atol 2e-2,
since the input itself is rounded to float16 before the model sees it).

Axis semantics the rule relies on: before opset 13 Softmax and LogSoftmax both coerce the input to
2-D at `axis` (default 1) and normalise over everything from `axis` on; from opset 13 both work
along the single axis `axis` (default -1). The rewrite copies the Softmax's attributes as they
are, so an absent axis must stay absent (the defaults agree per opset).

Runtime facts (onnxruntime 1.32, CPUExecutionProvider): Softmax, LogSoftmax and Log have float16,
float32 and float64 kernels at every opset used here, so every dtype is checked in onnxruntime.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import fuser
from fuser.rules.log_softmax import log_softmax
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

RULE = "log-softmax"
TOL = {
    np.float32: dict(rtol=1e-5, atol=1e-5),
    np.float16: dict(rtol=1e-2, atol=1e-2),
    np.float64: dict(rtol=1e-12, atol=1e-12),
}
REF_TOL = {
    np.float32: dict(rtol=1e-5, atol=1e-5),
    np.float16: dict(rtol=1e-2, atol=2e-2),
    np.float64: dict(rtol=1e-12, atol=1e-12),
}


# --------------------------------------------------------------------------- helpers


def np_log_softmax_coerced(x: np.ndarray, axis: int) -> np.ndarray:
    """Opset < 13 semantics: flatten to [prod(dims[:axis]), prod(dims[axis:])], normalise rows."""
    axis = axis % x.ndim
    rows = int(np.prod(x.shape[:axis]))
    return np_log_softmax(x.reshape(rows, -1), 1).reshape(x.shape)


def reference(x: np.ndarray, axis: int | None, opset: int) -> np.ndarray:
    if opset < 13:
        return np_log_softmax_coerced(x, 1 if axis is None else axis)
    return np_log_softmax(x, -1 if axis is None else axis)


def softmax_attrs(axis: int | None) -> dict:
    return {} if axis is None else {"axis": axis}


def log_softmax_model(
    *, shape=(2, 3, 4), axis=None, opset=13, dtype=np.float32, output="y", extra_nodes=(), extra_outputs=()
):
    """x -> Softmax(axis) -> sm -> Log -> `output`; extra nodes/outputs appended."""
    nodes = [
        helper.make_node("Softmax", ["x"], ["sm"], name="softmax", **softmax_attrs(axis)),
        helper.make_node("Log", ["sm"], [output], name="log"),
        *extra_nodes,
    ]
    rank = len(shape)
    outputs = [(output, dtype, [None] * rank)] + [(name, dtype, [None] * rank) for name in extra_outputs]
    return make_model(nodes, [("x", dtype, list(shape))], outputs, opset=opset)


def feeds_for(shape, dtype=np.float32, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": (2.0 * rng.standard_normal(shape)).astype(dtype)}


def rewrite(model, *, expected_ops, count=1, rules=(log_softmax,)):
    """Optimize (with fuser's check: every output "ok") and check structure, validity and the
    graph interface."""
    return assert_rewritten(
        model, rules, counts={RULE: count}, expected_ops=expected_ops, check=True, all_outputs_ok=True, trace=True
    )


def assert_not_rewritten(model, reason: str | None):
    """The rule must not fire. reason: expected substring of the decline, or None when the
    pattern must not even match (nothing declined either)."""
    return assert_declined(model, log_softmax, reason, check=True)


# ------------------------------------------------------------------ opset >= 13


@pytest.mark.parametrize("opset", [13, 18, 23])
@pytest.mark.parametrize(
    "shape,axis",
    [
        ((2, 3, 4), None),
        ((2, 3, 4), -1),
        ((2, 3, 4), 1),
        ((2, 3, 4), 0),
        ((2, 3, 4), -3),
        ((2, 3, 4, 5), 1),
        ((5, 7), None),
    ],
    ids=["3d-default", "3d-axis-1", "3d-axis1", "3d-axis0", "3d-axis-3", "4d-axis1", "2d-default"],
)
def test_fires_opset13_plus(opset, shape, axis):
    model = log_softmax_model(shape=shape, axis=axis, opset=opset)
    feeds = feeds_for(shape)
    after, _ = rewrite(model, expected_ops=["LogSoftmax"])
    (node,) = nodes_of(after, "LogSoftmax")
    assert attrs_of(node) == softmax_attrs(axis)  # absent stays absent: default -1 on both
    assert list(node.input) == ["x"] and list(node.output) == ["y"]
    assert_same_outputs(model, after, feeds, **TOL[np.float32])
    np.testing.assert_allclose(run(after, feeds)[0], reference(feeds["x"], axis, opset), **REF_TOL[np.float32])


# ------------------------------------------------------------------ opset < 13 (2-D coercion)


COERCION_CASES = [
    ((2, 3, 4, 5), None, "4d-default"),
    ((2, 3, 4, 5), 1, "4d-axis1"),
    ((2, 3, 4, 5), 2, "4d-axis2"),
    ((2, 3, 4, 5), 0, "4d-axis0"),
    ((2, 3, 4, 5), -1, "4d-axis-1"),
    ((2, 3, 4), 1, "3d-axis1"),
    ((2, 3, 4), None, "3d-default"),
]


@pytest.mark.parametrize(
    "opset,shape,axis",
    [
        pytest.param(opset, shape, axis, id=f"opset{opset}-{name}")
        for opset in (9, 11, 12)
        for shape, axis, name in COERCION_CASES
        if opset >= 11 or axis is None or axis >= 0  # negative axes exist from opset 11
    ],
)
def test_fires_opset11_keeps_coercion(opset, shape, axis):
    """axis=1 (explicit or default) on a 3-D/4-D input normalises over C*H*W, not over C alone.
    The rewrite copies the axis (or its absence) and LogSoftmax-11 coerces the same way."""
    model = log_softmax_model(shape=shape, axis=axis, opset=opset)
    feeds = feeds_for(shape)
    after, _ = rewrite(model, expected_ops=["LogSoftmax"])
    (node,) = nodes_of(after, "LogSoftmax")
    assert attrs_of(node) == softmax_attrs(axis)  # absent stays absent: default 1 on both
    assert_same_outputs(model, after, feeds, **TOL[np.float32])
    got = run(after, feeds)[0]
    np.testing.assert_allclose(got, reference(feeds["x"], axis, opset), **REF_TOL[np.float32])
    effective = (1 if axis is None else axis) % len(shape)
    if effective < len(shape) - 1:
        # Make sure the test can tell the two semantics apart: the single-axis result differs.
        assert not np.allclose(got, np_log_softmax(feeds["x"], effective), atol=1e-3)


# ---------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["fp16", "fp64"])
@pytest.mark.parametrize("opset,axis", [(11, None), (11, 1), (13, None), (13, 1), (18, -1)])
def test_float16_float64(dtype, opset, axis):
    shape = (2, 3, 4)
    model = log_softmax_model(shape=shape, axis=axis, opset=opset, dtype=dtype)
    feeds = feeds_for(shape, dtype)
    after, report = rewrite(model, expected_ops=["LogSoftmax"])
    assert after.graph.output[0].type.tensor_type.elem_type == helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    (out,) = report.verdict.outputs
    assert out.dtype == np.dtype(dtype).name
    assert_same_outputs(model, after, feeds, **TOL[dtype])
    got = run(after, feeds)[0]
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), reference(feeds["x"], axis, opset), **REF_TOL[dtype])


# -------------------------------------------------------- names, several consumers


def test_graph_output_name_survives():
    model = log_softmax_model(output="head/log_probs:0")
    after, _ = rewrite(model, expected_ops=["LogSoftmax"])
    assert [o.name for o in after.graph.output] == ["head/log_probs:0"]
    assert list(nodes_of(after, "LogSoftmax")[0].output) == ["head/log_probs:0"]
    assert_same_outputs(model, after, feeds_for((2, 3, 4)), **TOL[np.float32])


def test_log_output_is_graph_output_and_has_other_consumers():
    extra = [
        helper.make_node("Neg", ["y"], ["z"], name="neg"),
        helper.make_node("Exp", ["y"], ["w"], name="exp"),
    ]
    model = log_softmax_model(extra_nodes=extra, extra_outputs=["z", "w"])
    after, _ = rewrite(model, expected_ops=["LogSoftmax", "Neg", "Exp"])
    (lsm,) = nodes_of(after, "LogSoftmax")
    assert list(lsm.output) == ["y"]
    assert list(nodes_of(after, "Neg")[0].input) == ["y"]
    assert list(nodes_of(after, "Exp")[0].input) == ["y"]
    assert_same_outputs(model, after, feeds_for((2, 3, 4)), **TOL[np.float32])


def test_log_output_internal_with_two_consumers():
    """The Log output is not a graph output but feeds two nodes: both read the LogSoftmax."""
    extra = [
        helper.make_node("Neg", ["t"], ["z"], name="neg"),
        helper.make_node("Relu", ["t"], ["r"], name="relu"),
    ]
    model = log_softmax_model(output="t", extra_nodes=extra, extra_outputs=["z", "r"])
    del model.graph.output[0]  # "t" is internal: the graph outputs are z and r only
    onnx.checker.check_model(model, full_check=True)
    after, _ = rewrite(model, expected_ops=["LogSoftmax", "Neg", "Relu"])
    (lsm,) = nodes_of(after, "LogSoftmax")
    assert list(nodes_of(after, "Neg")[0].input) == list(lsm.output)
    assert list(nodes_of(after, "Relu")[0].input) == list(lsm.output)
    assert_same_outputs(model, after, feeds_for((2, 3, 4)), **TOL[np.float32])


def test_input_with_several_consumers_and_logits_output():
    """Logits = Add(x, b) is a graph output and also feeds Relu: it must survive unchanged."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Add", ["x", "b"], ["logits"], name="add"),
        helper.make_node("Softmax", ["logits"], ["sm"], name="softmax", axis=-1),
        helper.make_node("Log", ["sm"], ["y"], name="log"),
        helper.make_node("Relu", ["logits"], ["r"], name="relu"),
    ]
    model = make_model(
        nodes,
        [("x", np.float32, [3, 6])],
        [("logits", np.float32, [3, 6]), ("y", np.float32, [3, 6]), ("r", np.float32, [3, 6])],
        {"b": rng.standard_normal(6).astype(np.float32)},
    )
    after, _ = rewrite(model, expected_ops=["Add", "LogSoftmax", "Relu"])
    assert list(nodes_of(after, "LogSoftmax")[0].input) == ["logits"]
    assert_same_outputs(model, after, feeds_for((3, 6)), **TOL[np.float32])


def test_two_stacked_log_softmax_both_fire():
    nodes = [
        helper.make_node("Softmax", ["x"], ["sm1"], name="softmax1", axis=-1),
        helper.make_node("Log", ["sm1"], ["l1"], name="log1"),
        helper.make_node("Softmax", ["l1"], ["sm2"], name="softmax2", axis=0),
        helper.make_node("Log", ["sm2"], ["y"], name="log2"),
    ]
    model = make_model(nodes, [("x", np.float32, [3, 5])], [("y", np.float32, [3, 5])], opset=13)
    after, _ = rewrite(model, expected_ops=["LogSoftmax", "LogSoftmax"], count=2)
    assert [attrs_of(n)["axis"] for n in nodes_of(after, "LogSoftmax")] == [-1, 0]
    assert_same_outputs(model, after, feeds_for((3, 5)), **TOL[np.float32])


def test_fires_inside_if_branch():
    out = lambda name: helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [None, None])  # noqa: E731
    then_branch = helper.make_graph(
        [
            helper.make_node("Softmax", ["x"], ["sm"], name="softmax"),
            helper.make_node("Log", ["sm"], ["y_then"], name="log"),
        ],
        "then",
        [],
        [out("y_then")],
    )
    else_branch = helper.make_graph([helper.make_node("Identity", ["x"], ["y_else"])], "else", [], [out("y_else")])
    model = make_model(
        [helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then_branch, else_branch=else_branch)],
        [("x", np.float32, [3, 5]), ("cond", np.bool_, [])],
        [("y", np.float32, [None, None])],
        opset=13,
    )
    after, report = rewrite(model, expected_ops=["If"])
    assert [r.scope for r in report.rewrites] == ["main/if.then_branch"]
    branch = {a.name: a.g for a in after.graph.node[0].attribute}["then_branch"]
    assert [n.op_type for n in branch.node] == ["LogSoftmax"]
    assert [o.name for o in branch.output] == ["y_then"]
    feeds = {"x": feeds_for((3, 5))["x"], "cond": np.array(True)}
    assert_same_outputs(model, after, feeds, **TOL[np.float32])


# ------------------------------------------------------------------------ negatives


@pytest.mark.parametrize("opset", [11, 13])
def test_softmax_output_consumed_elsewhere_declined(opset):
    model = log_softmax_model(
        opset=opset, extra_nodes=[helper.make_node("Relu", ["sm"], ["r"], name="relu")], extra_outputs=["r"]
    )
    _, report = assert_not_rewritten(model, "used outside the match")
    assert {d.node for d in report.engine.declined} == {"log"}


@pytest.mark.parametrize("opset", [11, 13])
def test_softmax_output_is_graph_output_declined(opset):
    model = log_softmax_model(opset=opset)
    model.graph.output.append(helper.make_tensor_value_info("sm", onnx.TensorProto.FLOAT, [None] * 3))
    onnx.checker.check_model(model, full_check=True)
    after, _ = assert_not_rewritten(model, "a graph output")
    assert [o.name for o in after.graph.output] == ["y", "sm"]


def test_softmax_feeding_two_logs_declined():
    """Both Logs read one Softmax: for each match the Softmax has a consumer outside it."""
    model = log_softmax_model(extra_nodes=[helper.make_node("Log", ["sm"], ["y2"], name="log2")], extra_outputs=["y2"])
    _, report = assert_not_rewritten(model, "used outside the match")
    assert {d.node for d in report.engine.declined} == {"log", "log2"}


@pytest.mark.parametrize(
    "nodes",
    [
        [helper.make_node("Log", ["x"], ["y"], name="log")],
        [helper.make_node("Softmax", ["x"], ["y"], name="softmax")],
        [helper.make_node("LogSoftmax", ["x"], ["y"], name="lsm")],
        [
            helper.make_node("Softmax", ["x"], ["sm"], name="softmax"),
            helper.make_node("Relu", ["sm"], ["rl"], name="relu"),
            helper.make_node("Log", ["rl"], ["y"], name="log"),
        ],
        [
            helper.make_node("Hardmax", ["x"], ["hm"], name="hardmax"),
            helper.make_node("Log", ["hm"], ["y"], name="log"),
        ],
    ],
    ids=["log-only", "softmax-only", "logsoftmax-already", "log-relu-softmax", "log-hardmax"],
)
def test_no_match(nodes):
    model = make_model(nodes, [("x", np.float32, [3, 5])], [("y", np.float32, [3, 5])], opset=13)
    assert_not_rewritten(model, None)


# ------------------------------------------------------------------- stabilization


def huge_logits_model(dtype, opset):
    """logits = x + bias with a bias row [1000, 0, -1000]: fuser's synthetic normal inputs
    then make Softmax underflow to exactly 0 in that row, and Log(0) = -inf."""
    bias = np.array([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]], dtype)
    nodes = [
        helper.make_node("Add", ["x", "bias"], ["logits"], name="add"),
        helper.make_node("Softmax", ["logits"], ["sm"], name="softmax", axis=1),
        helper.make_node("Log", ["sm"], ["y"], name="log"),
    ]
    return make_model(nodes, [("x", dtype, [2, 3])], [("y", dtype, [2, 3])], {"bias": bias}, opset=opset), bias


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=["fp32", "fp16", "fp64"])
@pytest.mark.parametrize("opset", [11, 13])
def test_huge_logits_are_stabilized(dtype, opset):
    model, bias = huge_logits_model(dtype, opset)
    after, report = fuser.optimize(model, rules=[log_softmax], check=True, trace=True)
    assert report.counts == {RULE: 1}
    assert op_types(after) == ["Add", "LogSoftmax"]
    onnx.checker.check_model(after, full_check=True)
    # fuser's verdict: the -inf elements became finite: "stabilized", which passes.
    assert report.verdict.passed
    (out,) = report.verdict.outputs
    assert out.name == "y" and out.status == "stabilized"
    assert out.stabilized_elements == 2
    assert report.verdict.stabilized == ["y"]

    # The same, by hand, on an explicit input.
    feeds = {"x": np.zeros((2, 3), dtype)}
    feeds["x"][1] = np.array([0.5, -1.0, 2.0], dtype)
    (before,) = run(model, feeds)
    (got,) = run(after, feeds)
    assert np.isneginf(before[0, 1:]).all() and np.isfinite(before[1]).all()
    assert np.isfinite(got).all()
    expected = np_log_softmax(feeds["x"] + bias, 1)
    np.testing.assert_allclose(got.astype(np.float64), expected, **REF_TOL[dtype])
    np.testing.assert_allclose(got[0], np.array([0.0, -1000.0, -2000.0]), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(got[1], before[1], **TOL[dtype])
    check = compare("y", before, got, exact=False)
    assert check.status == "stabilized" and check.stabilized_elements == 2
