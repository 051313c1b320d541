"""Tests for the log-sum-exp rule (rules/log_sum_exp.py):
Log(ReduceSum(Exp(x), axes, keepdims)) => ReduceLogSumExp(x, axes, keepdims).

Positive tests build the hand-written form, rewrite it with `fuser.optimize(model,
rules=[log_sum_exp])` (fuser's own onnxruntime check on), check the op sequence, where the axes
went (attribute or input, per opset) and the graph interface, run the full ONNX checker, and
compare both models in onnxruntime (CPU, graph optimizations disabled) on seeded inputs, and the
result against a float64 numpy log-sum-exp.

Tolerances (|after - before| <= atol + rtol * |before|):
  float32  rtol 1e-5,  atol 1e-5
  float16  rtol 1e-2,  atol 1e-2
  float64  rtol 1e-12, atol 1e-12
The numpy reference uses the same tolerances (float16: rtol 1e-2, atol 2e-2).

Opset facts the rule relies on:
  opset 11-12  ReduceSum axes = attribute,  ReduceLogSumExp axes = attribute
  opset 13-17  ReduceSum axes = input,      ReduceLogSumExp axes = attribute
  opset 18+    ReduceSum axes = input,      ReduceLogSumExp axes = input
  From 13 an absent or EMPTY axes input means "all axes", unless noop_with_empty_axes=1, which
  makes the ReduceSum an identity (then Log(ReduceSum(Exp(x))) == x). onnxruntime 1.32 also treats
  an empty `axes` attribute (opset 11) as "all axes".

Runtime facts (onnxruntime 1.32, CPUExecutionProvider): Exp, ReduceSum, Log and ReduceLogSumExp
run in float16, float32 and float64 at the opsets used here. A float16 Exp -> ReduceSum -> Log
chain is evaluated in higher precision (observed: float16 x = -100 gives -98.6, not -inf,
although Exp alone gives 0), so the overflow tests use +-1000, which overflows/underflows
float32 as well. Exp has no integer types in ONNX, so the integer-input model is invalid: it is
optimized with check=False and must be left alone.

Known bugs these tests expose (see test_empty_axes_*): an empty axes tensor crashes the rule at
opsets 11-17 (it passes axes=[] as an attribute, which onnx.helper cannot type), and with
noop_with_empty_axes=1 at opset 18+ the rule turns an identity ReduceSum into a full reduction.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import fuser
from fuser.errors import RuleError
from fuser.rules.log_sum_exp import log_sum_exp
from fuser.verify import compare
from tests.helpers import (
    assert_declined,
    assert_rewritten,
    assert_same_outputs,
    attrs_of,
    initializer_value,
    make_model,
    nodes_of,
    op_types,
    run,
)

RULE = "log-sum-exp"
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
SHAPE = (2, 3, 4)
BIG = 1000.0  # exp(1000) overflows and exp(-1000) underflows in float16, float32 and float64


# --------------------------------------------------------------------------- helpers


def np_log_sum_exp(x: np.ndarray, axes, keepdims: bool) -> np.ndarray:
    x = x.astype(np.float64)
    axes = None if axes is None or len(axes) == 0 else tuple(axes)
    top = x.max(axis=axes, keepdims=True)
    out = top + np.log(np.exp(x - top).sum(axis=axes, keepdims=True))
    if not keepdims:
        out = out.squeeze(axis=axes) if axes is not None else out.reshape(())
    return out


def out_rank(rank: int, axes, keepdims) -> int:
    if keepdims in (None, 1):
        return rank
    return 0 if not axes else rank - len(axes)


def lse_nodes(x="x", out="y", *, axes=None, keepdims=None, opset=13, noop=None, axes_attr_empty=False):
    """x -> Exp -> e; ReduceSum(e[, axes]) -> s; Log(s) -> out. Returns (nodes, initializers).
    axes: None (no axes at all) or a list; an attribute before 13, an int64 initializer from 13."""
    attrs = {}
    if keepdims is not None:
        attrs["keepdims"] = keepdims
    if noop is not None:
        attrs["noop_with_empty_axes"] = noop
    inputs, inits = ["e"], {}
    if axes is not None:
        if opset < 13:
            if axes:
                attrs["axes"] = list(axes)
        else:
            inits["axes"] = np.array(axes, np.int64)
            inputs.append("axes")
    reduce_sum = helper.make_node("ReduceSum", inputs, ["s"], name="sum", **attrs)
    if opset < 13 and axes is not None and not axes:
        reduce_sum.attribute.append(helper.make_attribute("axes", [], attr_type=onnx.AttributeProto.INTS))
    nodes = [
        helper.make_node("Exp", [x], ["e"], name="exp"),
        reduce_sum,
        helper.make_node("Log", ["s"], [out], name="log"),
    ]
    return nodes, inits


def lse_model(
    *,
    shape=SHAPE,
    axes=None,
    keepdims=None,
    opset=13,
    dtype=np.float32,
    noop=None,
    output="y",
    extra_nodes=(),
    extra_outputs=(),
):
    nodes, inits = lse_nodes(out=output, axes=axes, keepdims=keepdims, opset=opset, noop=noop)
    rank = out_rank(len(shape), axes, keepdims) if noop != 1 or axes else len(shape)
    outputs = [(output, dtype, [None] * rank)] + [(n, dtype, [None] * len(shape)) for n in extra_outputs]
    return make_model(nodes + list(extra_nodes), [("x", dtype, list(shape))], outputs, inits, opset=opset)


def feeds_for(shape=SHAPE, dtype=np.float32, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": (2.0 * rng.standard_normal(shape)).astype(dtype)}


def rewrite(model, *, expected_ops=("ReduceLogSumExp",), count=1):
    """Optimize (with fuser's check: every output "ok") and check structure, validity and the
    graph interface."""
    return assert_rewritten(
        model,
        [log_sum_exp],
        counts={RULE: count},
        expected_ops=expected_ops,
        check=True,
        all_outputs_ok=True,
        trace=True,
    )


def check_replacement(after, *, axes, keepdims, opset):
    """The ReduceLogSumExp carries the axes in the form its opset wants and the keepdims."""
    (node,) = nodes_of(after, "ReduceLogSumExp")
    attrs = attrs_of(node)
    assert attrs.get("keepdims", 1) == (1 if keepdims is None else keepdims)
    assert "noop_with_empty_axes" not in attrs or attrs["noop_with_empty_axes"] == 0
    if axes is None or not axes:
        assert "axes" not in attrs
        if opset >= 18 and len(node.input) > 1 and node.input[1]:
            assert initializer_value(after, node.input[1]).size == 0
        else:
            assert len(node.input) == 1
    elif opset < 18:
        assert attrs["axes"] == list(axes) and len(node.input) == 1
    else:
        assert "axes" not in attrs and len(node.input) == 2
        value = initializer_value(after, node.input[1])
        assert value.dtype == np.int64 and value.tolist() == list(axes)
    # The ReduceSum's axes initializer is gone with it.
    assert "axes" not in {t.name for t in after.graph.initializer}
    return node


def assert_not_rewritten(model, reason: str | None, *, check=True):
    """The rule must not fire; a decline is made at the Log."""
    return assert_declined(model, log_sum_exp, reason, node="log", check=check)


# ------------------------------------------------------------------ axes x keepdims x opset


@pytest.mark.parametrize("opset", [11, 12, 13, 17, 18, 23])
@pytest.mark.parametrize("axes", [None, [1], [-1], [0, 2], [-3, -2]], ids=["all", "ax1", "ax-1", "ax0,2", "ax-3,-2"])
@pytest.mark.parametrize("keepdims", [0, 1, None], ids=["keep0", "keep1", "keep-default"])
def test_fires(opset, axes, keepdims):
    model = lse_model(axes=axes, keepdims=keepdims, opset=opset)
    feeds = feeds_for()
    after, _ = rewrite(model)
    node = check_replacement(after, axes=axes, keepdims=keepdims, opset=opset)
    assert node.input[0] == "x" and list(node.output) == ["y"]
    assert_same_outputs(model, after, feeds, **TOL[np.float32])
    expected = np_log_sum_exp(feeds["x"], axes, keepdims in (None, 1))
    got = run(after, feeds)[0]
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, **REF_TOL[np.float32])


@pytest.mark.parametrize("opset", [13, 18])
def test_noop_with_empty_axes_without_axes_declined(opset):
    """noop_with_empty_axes=1 and no axes: ReduceSum is an identity, Log(Exp(x)) == x."""
    model = lse_model(axes=None, noop=1, opset=opset)
    after, _ = assert_not_rewritten(model, "noop_with_empty_axes=1 is an identity")
    assert_same_outputs(model, after, feeds_for())


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_noop_with_empty_axes_with_axes_fires(opset, keepdims):
    """With non-empty axes the flag is irrelevant: a normal reduction."""
    model = lse_model(axes=[2], keepdims=keepdims, noop=1, opset=opset)
    feeds = feeds_for()
    after, _ = rewrite(model)
    check_replacement(after, axes=[2], keepdims=keepdims, opset=opset)
    assert_same_outputs(model, after, feeds, **TOL[np.float32])


@pytest.mark.parametrize("opset", [13, 18])
def test_noop_zero_explicit_without_axes_fires(opset):
    model = lse_model(axes=None, noop=0, keepdims=0, opset=opset)
    feeds = feeds_for()
    after, _ = rewrite(model)
    check_replacement(after, axes=None, keepdims=0, opset=opset)
    np.testing.assert_allclose(run(after, feeds)[0], np_log_sum_exp(feeds["x"], None, False), **REF_TOL[np.float32])


# ------------------------------------------------------------- empty axes tensor (bugs)


def optimize_or_fail(model, opset, *, check):
    """fuser.optimize with log-sum-exp; a crash of the rule becomes a plain test failure."""
    try:
        return fuser.optimize(model, rules=[log_sum_exp], check=check, trace=True)
    except RuleError as error:
        message = f"log-sum-exp crashes on an empty axes tensor at opset {opset}: {error}"
    pytest.fail(message, pytrace=False)


@pytest.mark.parametrize("opset", [11, 13, 17, 18])
def test_empty_axes_reduces_all(opset):
    """An empty axes tensor (opset 13+) / attribute (opset 11, "all" in onnxruntime) with
    noop_with_empty_axes=0 reduces every axis: the rewrite must do the same (or decline), not
    crash. FAILS at opsets 11-17: the rule passes axes=[] to b.ReduceLogSumExp as an attribute
    and onnx.helper.make_attribute raises 'Could not infer attribute `axes` type from empty
    iterator', which fuser reports as a RuleError."""
    model = lse_model(axes=[], keepdims=1, opset=opset)
    feeds = feeds_for()
    expected = np_log_sum_exp(feeds["x"], None, True)
    np.testing.assert_allclose(run(model, feeds)[0], expected, **REF_TOL[np.float32])
    after, report = optimize_or_fail(model, opset, check=True)
    onnx.checker.check_model(after, full_check=True)
    assert report.counts in ({}, {RULE: 1})
    np.testing.assert_allclose(run(after, feeds)[0], expected, **REF_TOL[np.float32])


@pytest.mark.parametrize("opset", [13, 17, 18])
def test_empty_axes_with_noop_is_identity_declined(opset):
    """An EMPTY axes input with noop_with_empty_axes=1 is the identity too (same as no axes):
    the rule must decline. FAILS: at opsets 13-17 the rule crashes (see above); at 18+ it
    checks only `axes is None`, so [] falls through to ReduceLogSumExp(x, []) without the flag,
    which reduces over all axes: output [1,1,1] instead of [2,3,4]. fuser's numerics check
    catches it (NumericsMismatch); with check=False the wrong model would be written."""
    model = lse_model(axes=[], noop=1, opset=opset)
    feeds = feeds_for()
    before = run(model, feeds)[0]
    np.testing.assert_allclose(before, feeds["x"], rtol=1e-5, atol=1e-5)  # Log(Exp(x)) == x
    after, report = optimize_or_fail(model, opset, check=False)
    got = run(after, feeds)[0]
    assert got.shape == before.shape, f"identity ReduceSum rewritten into a full reduction: {got.shape}"
    assert report.counts == {}
    declined = [d.reason for d in report.engine.declined if d.rule == RULE]
    assert any("identity" in r for r in declined), declined


# ---------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["fp16", "fp64"])
@pytest.mark.parametrize("opset,axes,keepdims", [(11, [1], 0), (13, [-1], 1), (13, None, 0), (18, [0, 2], 1)])
def test_float16_float64(dtype, opset, axes, keepdims):
    model = lse_model(axes=axes, keepdims=keepdims, opset=opset, dtype=dtype)
    feeds = feeds_for(dtype=dtype)
    after, report = rewrite(model)
    check_replacement(after, axes=axes, keepdims=keepdims, opset=opset)
    assert report.verdict.outputs[0].dtype == np.dtype(dtype).name
    assert_same_outputs(model, after, feeds, **TOL[dtype])
    got = run(after, feeds)[0]
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), np_log_sum_exp(feeds["x"], axes, keepdims), **REF_TOL[dtype])


@pytest.mark.parametrize("opset", [11, 13, 18])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_input_not_rewritten(opset, dtype):
    """Exp has no integer types (invalid model: no full check, no onnxruntime); the rule must
    not turn it into an integer ReduceLogSumExp."""
    nodes, inits = lse_nodes(axes=[1], keepdims=1, opset=opset)
    model = make_model(nodes, [("x", dtype, [2, 3])], [("y", dtype, [2, 1])], inits, opset=opset, check=False)
    assert_not_rewritten(model, "not a float type", check=False)


# -------------------------------------------------------- names, several consumers


def test_graph_output_name_survives_and_other_consumers():
    extra = [helper.make_node("Neg", ["stats/lse:0"], ["z"], name="neg")]
    model = lse_model(axes=[1], keepdims=1, output="stats/lse:0", extra_nodes=extra, extra_outputs=["z"])
    after, _ = rewrite(model, expected_ops=["ReduceLogSumExp", "Neg"])
    assert [o.name for o in after.graph.output] == ["stats/lse:0", "z"]
    assert list(nodes_of(after, "ReduceLogSumExp")[0].output) == ["stats/lse:0"]
    assert list(nodes_of(after, "Neg")[0].input) == ["stats/lse:0"]
    assert_same_outputs(model, after, feeds_for(), **TOL[np.float32])


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_hand_written_log_softmax_x_minus_lse(opset):
    """x - Log(ReduceSum(Exp(x), -1, keepdims=1)): x has two consumers (Exp and Sub); the
    log-sum-exp part fires and the Sub keeps reading x."""
    nodes, inits = lse_nodes(out="lse", axes=[-1], keepdims=1, opset=opset)
    nodes.append(helper.make_node("Sub", ["x", "lse"], ["y"], name="sub"))
    model = make_model(nodes, [("x", np.float32, list(SHAPE))], [("y", np.float32, [None] * 3)], inits, opset=opset)
    after, _ = rewrite(model, expected_ops=["ReduceLogSumExp", "Sub"])
    (sub,) = nodes_of(after, "Sub")
    assert sub.input[0] == "x" and sub.input[1] == nodes_of(after, "ReduceLogSumExp")[0].output[0]
    feeds = feeds_for()
    assert_same_outputs(model, after, feeds, **TOL[np.float32])
    x = feeds["x"].astype(np.float64)
    np.testing.assert_allclose(run(after, feeds)[0], x - np_log_sum_exp(x, [-1], True), **REF_TOL[np.float32])


# ------------------------------------------------------------------------ negatives


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_exp_consumed_elsewhere_declined(opset):
    extra = [helper.make_node("Neg", ["e"], ["z"], name="neg")]
    model = lse_model(axes=[1], opset=opset, extra_nodes=extra, extra_outputs=["z"])
    assert_not_rewritten(model, "used outside the match")


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_reduce_sum_consumed_elsewhere_declined(opset):
    extra = [helper.make_node("Neg", ["s"], ["z"], name="neg")]
    model = lse_model(axes=[1], opset=opset, extra_nodes=extra, extra_outputs=["z"])
    assert_not_rewritten(model, "used outside the match")


@pytest.mark.parametrize("tensor", ["e", "s"])
def test_interior_graph_output_declined(tensor):
    model = lse_model(axes=[1])
    model.graph.output.append(helper.make_tensor_value_info(tensor, onnx.TensorProto.FLOAT, [None] * 3))
    onnx.checker.check_model(model, full_check=True)
    after, _ = assert_not_rewritten(model, "a graph output")
    assert [o.name for o in after.graph.output] == ["y", tensor]


def test_axes_graph_input_is_no_match():
    nodes, _ = lse_nodes(axes=[1], opset=13)
    model = make_model(
        nodes, [("x", np.float32, list(SHAPE)), ("axes", np.int64, [1])], [("y", np.float32, [None] * 3)]
    )
    assert_not_rewritten(model, None, check=False)


@pytest.mark.parametrize(
    "nodes",
    [
        [
            helper.make_node("ReduceSum", ["x"], ["s"], name="sum"),
            helper.make_node("Log", ["s"], ["y"], name="log"),
        ],
        [
            helper.make_node("Exp", ["x"], ["e"], name="exp"),
            helper.make_node("ReduceMean", ["e"], ["s"], name="mean"),
            helper.make_node("Log", ["s"], ["y"], name="log"),
        ],
        [helper.make_node("ReduceLogSumExp", ["x"], ["y"], name="lse")],
        [
            helper.make_node("Exp", ["x"], ["e"], name="exp"),
            helper.make_node("Abs", ["e"], ["a"], name="abs"),
            helper.make_node("ReduceSum", ["a"], ["s"], name="sum"),
            helper.make_node("Log", ["s"], ["y"], name="log"),
        ],
    ],
    ids=["no-exp", "reduce-mean", "already-fused", "exp-abs-sum"],
)
def test_no_match(nodes):
    model = make_model(nodes, [("x", np.float32, list(SHAPE))], [("y", np.float32, [None] * 3)])
    assert_not_rewritten(model, None)


# -------------------------------------------------------------------- overflow


# Not parametrized: float16 at opset 18. onnxruntime 1.32's CPU ReduceLogSumExp-18 in
# float16 is not max-shifted (a row of 1000s gives inf), so there the rewrite is correct
# but not stabilized; the float16 opset 11/13 and float32/float64 cases are.


@pytest.mark.parametrize(
    "dtype,opset",
    [
        pytest.param(dtype, opset, id=f"{opset}-{name}")
        for opset in (11, 13, 18)
        for dtype, name in ((np.float32, "fp32"), (np.float16, "fp16"), (np.float64, "fp64"))
        if not (dtype is np.float16 and opset >= 18)
    ],
)
def test_overflow_and_underflow_stabilized(dtype, opset):
    """logits = x + bias with a bias row of +1000 (Exp overflows: Log(inf) = inf) and a row of
    -1000 (Exp underflows: Log(0) = -inf); ReduceLogSumExp is finite for both."""
    bias = np.zeros((3, 4), dtype)
    bias[0], bias[1] = BIG, -BIG
    nodes, inits = lse_nodes(x="logits", axes=[-1], keepdims=1, opset=opset)
    nodes.insert(0, helper.make_node("Add", ["x", "bias"], ["logits"], name="add"))
    model = make_model(nodes, [("x", dtype, [3, 4])], [("y", dtype, [3, 1])], {**inits, "bias": bias}, opset=opset)
    after, report = fuser.optimize(model, rules=[log_sum_exp], check=True, trace=True)
    assert report.counts == {RULE: 1}
    assert op_types(after) == ["Add", "ReduceLogSumExp"]
    onnx.checker.check_model(after, full_check=True)
    assert report.verdict.passed
    (out,) = report.verdict.outputs
    assert out.status == "stabilized" and out.stabilized_elements == 2
    assert report.verdict.stabilized == ["y"]

    # Half-integers: x +- 1000 is exact even in float16, so the reference sees the same logits.
    feeds = {"x": (np.random.default_rng(4).integers(-6, 7, (3, 4)) * 0.5).astype(dtype)}
    (before,) = run(model, feeds)
    (got,) = run(after, feeds)
    assert before[0, 0] == np.inf and before[1, 0] == -np.inf and np.isfinite(before[2, 0])
    assert np.isfinite(got).all()
    logits = (feeds["x"] + bias).astype(np.float64)
    np.testing.assert_allclose(got.astype(np.float64), np_log_sum_exp(logits, [-1], True), **REF_TOL[dtype])
    np.testing.assert_allclose(got[2], before[2], **TOL[dtype])
    check = compare("y", before, got, exact=False)
    assert check.status == "stabilized" and check.stabilized_elements == 2
