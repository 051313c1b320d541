"""Tests for the matmul-add-gemm rule (rules/matmul_add_gemm.py).

Positive tests build MatMul(A, B) -> Add(C) models, rewrite them with
`fuser.optimize(model, rules=[matmul_add_gemm])`, check that one Gemm(A, B, C) with default
attributes remains, run the full ONNX checker and compare outputs in onnxruntime (graph
optimizations disabled) with the tolerances stated below. Weights and biases are random and
seeded, so a bias broadcast along the wrong axis shows up as a numerics failure.

Runtime facts this file relies on (onnxruntime 1.32, CPUExecutionProvider):
* Gemm and MatMul have float32 and float64 kernels, so float64 models are checked in onnxruntime.
* The rule is declared for opsets 11 and later (Gemm's C is optional and broadcasts
  unidirectionally from 11 on); for older models it is skipped and says so in
  report.engine.skipped_rules.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import fuser
from fuser.errors import RuleError
from fuser.rules.matmul_add_gemm import broadcasts_into, matmul_add_gemm
from tests.helpers import assert_declined, assert_rewritten, assert_same_outputs, make_model, nodes_of, op_types, run

RULE = "matmul-add-gemm"
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
FP64_TOL = dict(rtol=1e-12, atol=1e-12)
M, K, N = 3, 4, 5


# --------------------------------------------------------------------------- builders


def mm_add_model(
    *,
    a_shape=(M, K),
    w_shape=(K, N),
    c_shape=(N,),
    c_first: bool = False,
    dtype=np.float32,
    opset: int = 17,
    c_source: str = "initializer",
    w_source: str = "initializer",
    output: str = "y",
    out_shape=None,
    seed: int = 0,
):
    """a -> MatMul(w) -> Add(c) -> `output`; returns (model, feeds).

    c_source/w_source: "initializer" or "input" (a graph input with the given shape)."""
    rng = np.random.default_rng(seed)
    concrete = lambda shape: [d if isinstance(d, int) else 2 for d in shape]  # noqa: E731

    def sample(shape):
        if np.issubdtype(dtype, np.integer):
            return rng.integers(-5, 5, concrete(shape)).astype(dtype)
        return np.asarray(rng.standard_normal(concrete(shape))).astype(dtype)

    values = {"w": sample(w_shape), "c": sample(c_shape)}
    inputs = [("a", dtype, list(a_shape))]
    inits = {}
    feeds = {"a": sample(a_shape)}
    for name, source, shape in (("w", w_source, w_shape), ("c", c_source, c_shape)):
        if source == "initializer":
            inits[name] = values[name]
        else:
            inputs.append((name, dtype, list(shape)))
            feeds[name] = values[name]
    nodes = [
        helper.make_node("MatMul", ["a", "w"], ["mm"], name="matmul"),
        helper.make_node("Add", ["c", "mm"] if c_first else ["mm", "c"], [output], name="add"),
    ]
    rank = max(len(a_shape), len(w_shape), len(c_shape))
    model = make_model(nodes, inputs, [(output, dtype, out_shape or [None] * rank)], inits, opset=opset)
    return model, feeds


def rewrite(model, feeds, *, tol=FP32_TOL, expected_ops=("Gemm",), count=1):
    """Optimize with matmul-add-gemm only; check structure, interface, validity, the numerics
    check and the outputs in onnxruntime within `tol`."""
    return assert_rewritten(
        model, [matmul_add_gemm], counts={RULE: count}, expected_ops=expected_ops, feeds=feeds, **tol
    )


def assert_not_rewritten(model, reason: str | None, *, check=True):
    """The rule must not fire; a decline is made at the Add, in the main graph."""
    return assert_declined(model, matmul_add_gemm, reason, node="add", scope="main", check=check)


# ------------------------------------------------------------------ broadcasts_into


@pytest.mark.parametrize(
    "c_shape,m,n,ok",
    [
        ((5,), 3, 5, True),
        ((1, 5), 3, 5, True),
        ((3, 1), 3, 5, True),
        ((3, 5), 3, 5, True),
        ((), 3, 5, True),
        ((1,), 3, 5, True),
        ((1, 1), 3, 5, True),
        ((5,), "M", 5, True),
        ((3,), 3, 5, False),
        ((2, 5), 3, 5, False),
        ((3, 5), 1, 5, False),
        ((1, 3, 5), 3, 5, False),
        (("M", 5), "M", 5, False),
        ((5,), 3, "N", False),
    ],
)
def test_broadcasts_into(c_shape, m, n, ok):
    """Symbolic dims only broadcast from 1 (the rule does not trust equal names for C)."""
    assert broadcasts_into(c_shape, m, n) is ok


# --------------------------------------------------------------------------- positives


@pytest.mark.parametrize("c_first", [False, True], ids=["mm+c", "c+mm"])
@pytest.mark.parametrize(
    "c_shape", [(N,), (1, N), (M, 1), (M, N), (), (1,), (1, 1)], ids=["N", "1N", "M1", "MN", "scalar", "1", "11"]
)
def test_bias_shapes(c_shape, c_first):
    model, feeds = mm_add_model(c_shape=c_shape, c_first=c_first)
    after, _ = rewrite(model, feeds)
    (gemm,) = nodes_of(after, "Gemm")
    assert list(gemm.input) == ["a", "w", "c"] and list(gemm.output) == ["y"]
    assert list(gemm.attribute) == []  # alpha = beta = 1, no transposes


@pytest.mark.parametrize("c_shape", [(N,), (M, N), (M, 1)], ids=["N", "MN", "M1"])
def test_bias_is_graph_input(c_shape):
    """A runtime bias with a known compatible shape is fine: Gemm takes C as an input."""
    model, feeds = mm_add_model(c_shape=c_shape, c_source="input")
    after, _ = rewrite(model, feeds)
    assert list(nodes_of(after, "Gemm")[0].input) == ["a", "w", "c"]


def test_weight_is_graph_input():
    model, feeds = mm_add_model(w_source="input")
    rewrite(model, feeds)


def test_symbolic_batch_dimension():
    """A is ('batch', K): M is unknown, a bias [N] (or [1, N]) still broadcasts into [M, N]."""
    model, feeds = mm_add_model(a_shape=("batch", K), c_shape=(1, N))
    after, report = fuser.optimize(model, rules=[matmul_add_gemm], dims={"batch": 7})
    assert report.counts == {RULE: 1} and report.verdict.passed
    feeds = {"a": np.random.default_rng(1).standard_normal((7, K)).astype(np.float32)}
    assert_same_outputs(model, after, feeds, **FP32_TOL)


def test_float64():
    model, feeds = mm_add_model(dtype=np.float64, c_shape=(M, 1))
    after, _ = rewrite(model, feeds, tol=FP64_TOL)
    assert after.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.DOUBLE


@pytest.mark.parametrize("opset", [11, 13, 14, 17, 21])
def test_opsets(opset):
    model, feeds = mm_add_model(opset=opset)
    rewrite(model, feeds)


def test_graph_output_name_survives():
    model, feeds = mm_add_model(output="logits:0")
    after, _ = rewrite(model, feeds)
    assert [o.name for o in after.graph.output] == ["logits:0"]


def test_add_output_with_several_consumers():
    model, feeds = mm_add_model()
    model.graph.node.append(helper.make_node("Relu", ["y"], ["r"], name="relu"))
    model.graph.output.append(helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, [None, None]))
    after, _ = rewrite(model, feeds, expected_ops=("Gemm", "Relu"))
    assert list(nodes_of(after, "Relu")[0].input) == ["y"]


def test_shared_weight_two_layers():
    """Two MatMul+Add pairs read the same weight and bias: both become Gemms reading them."""
    rng = np.random.default_rng(3)
    inits = {"w": rng.standard_normal((K, K)).astype(np.float32), "c": rng.standard_normal(K).astype(np.float32)}
    nodes = [
        helper.make_node("MatMul", ["a", "w"], ["m1"], name="matmul1"),
        helper.make_node("Add", ["m1", "c"], ["h"], name="add1"),
        helper.make_node("MatMul", ["h", "w"], ["m2"], name="matmul2"),
        helper.make_node("Add", ["c", "m2"], ["y"], name="add2"),
    ]
    model = make_model(nodes, [("a", np.float32, [M, K])], [("y", np.float32, [M, K])], inits)
    feeds = {"a": rng.standard_normal((M, K)).astype(np.float32)}
    after, _ = rewrite(model, feeds, expected_ops=("Gemm", "Gemm"), count=2)
    assert [list(n.input) for n in after.graph.node] == [["a", "w", "c"], ["h", "w", "c"]]


# ------------------------------------------------------------------------ negatives


@pytest.mark.parametrize(
    "a_shape,w_shape,c_shape,out_rank,reason",
    [
        ((2, M, K), (K, N), (N,), 3, "A has shape (2, 3, 4), Gemm needs 2-D"),
        ((K,), (K, N), (N,), 1, "A has shape (4,), Gemm needs 2-D"),
        ((M, K), (K,), (1,), 1, "B has shape (4,), Gemm needs 2-D"),
        ((M, K), (2, K, N), (N,), 3, "B has shape (2, 4, 5), Gemm needs 2-D"),
    ],
    ids=["3d-A", "1d-A", "1d-B", "3d-B"],
)
def test_non_2d_operands_declined(a_shape, w_shape, c_shape, out_rank, reason):
    """MatMul also takes 1-D and N-D operands (promoted / batched); Gemm does not."""
    model, _ = mm_add_model(a_shape=a_shape, w_shape=w_shape, c_shape=c_shape, out_shape=[None] * out_rank)
    assert_not_rewritten(model, reason)


@pytest.mark.parametrize(
    "a_shape,c_shape",
    [((M, K), (1, M, N)), ((M, K), (2, M, N)), ((1, K), (M, N)), ((1, K), (M, 1)), ((1, K), (1, 1, 1))],
    ids=["rank3-bias", "batched-bias", "enlarges-M", "enlarges-M-col", "rank3-ones"],
)
def test_bias_not_broadcastable_into_output_declined(a_shape, c_shape):
    """Add broadcasts both ways; Gemm only broadcasts C into [M, N]: a C that would enlarge the
    output (or raise its rank) stays an Add."""
    model, _ = mm_add_model(a_shape=a_shape, c_shape=c_shape)
    assert_not_rewritten(model, "does not broadcast into")


@pytest.mark.parametrize("c_shape", [(2, N), (M,)], ids=["wrong-M", "M-as-last-dim"])
def test_bias_incompatible_with_output_declined(c_shape):
    """Add would fail on these shapes at run time (not shape-inferable either); never rewritten."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["a", "w"], ["mm"], name="matmul"),
        helper.make_node("Add", ["mm", "c"], ["y"], name="add"),
    ]
    inits = {"w": rng.standard_normal((K, N)).astype(np.float32), "c": rng.standard_normal(c_shape).astype(np.float32)}
    model = make_model(nodes, [("a", np.float32, [M, K])], [("y", np.float32, [None, None])], inits, check=False)
    assert_not_rewritten(model, "does not broadcast into", check=False)


def test_symbolic_bias_dim_declined():
    """C is ('M', 1) with A ('M', K): the same name would do, but the rule only trusts ints."""
    model, _ = mm_add_model(a_shape=("M", K), c_shape=("M", 1), c_source="input")
    assert_not_rewritten(model, "does not broadcast into")


def test_unknown_a_shape_declined():
    model, _ = mm_add_model(w_source="initializer")
    model.graph.input[0].type.tensor_type.ClearField("shape")
    assert_not_rewritten(model, "A has shape None")


def test_unknown_bias_shape_declined():
    model, _ = mm_add_model(c_source="input")
    model.graph.input[1].type.tensor_type.ClearField("shape")
    assert_not_rewritten(model, "the bias's shape is unknown")


@pytest.mark.parametrize("dtype,name", [(np.int32, "int32"), (np.int64, "int64"), (np.float16, "float16")])
def test_unsupported_dtypes_declined(dtype, name):
    model, _ = mm_add_model(dtype=dtype)
    assert_not_rewritten(model, f"takes float32/float64, not {name}")


def test_matmul_output_with_another_consumer_declined():
    model, _ = mm_add_model()
    model.graph.node.append(helper.make_node("Relu", ["mm"], ["r"], name="relu"))
    model.graph.output.append(helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, [None, None]))
    assert_not_rewritten(model, "used outside the match")


def test_matmul_output_is_graph_output_declined():
    model, _ = mm_add_model()
    model.graph.output.append(helper.make_tensor_value_info("mm", onnx.TensorProto.FLOAT, [None, None]))
    assert_not_rewritten(model, "a graph output")


@pytest.mark.parametrize("opset", [9, 10])
def test_old_opsets_skipped(opset):
    model, _ = mm_add_model(opset=opset)
    after, report = fuser.optimize(model, rules=[matmul_add_gemm], trace=True)
    assert report.counts == {}
    assert op_types(after) == ["MatMul", "Add"]
    assert RULE in report.engine.skipped_rules
    assert f"opset {opset}" in report.engine.skipped_rules[RULE]
    assert "11 and later" in report.engine.skipped_rules[RULE]
    assert report.engine.declined == []


def test_add_of_two_matmuls_rewrites_one():
    """Add(MatMul1, MatMul2): C is the other MatMul's output; one of them becomes a Gemm."""
    rng = np.random.default_rng(4)
    inits = {k: rng.standard_normal((K, N)).astype(np.float32) for k in ("w1", "w2")}
    nodes = [
        helper.make_node("MatMul", ["a", "w1"], ["m1"], name="matmul1"),
        helper.make_node("MatMul", ["a", "w2"], ["m2"], name="matmul2"),
        helper.make_node("Add", ["m1", "m2"], ["y"], name="add"),
    ]
    model = make_model(nodes, [("a", np.float32, [M, K])], [("y", np.float32, [M, N])], inits)
    feeds = {"a": rng.standard_normal((M, K)).astype(np.float32)}
    rewrite(model, feeds, expected_ops=("MatMul", "Gemm"))


def test_add_of_matmul_with_itself():
    """BUG: Add(mm, mm) with mm = MatMul(a, w). The pattern binds C to the MatMul's own output,
    which the rewrite removes; the rule must decline (C must not be the MatMul's output) instead
    of building Gemm(a, w, mm), which makes the engine raise RuleError
    ("the replacement reads 'mm', which it removes")."""
    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("MatMul", ["a", "w"], ["mm"], name="matmul"),
        helper.make_node("Add", ["mm", "mm"], ["y"], name="add"),
    ]
    model = make_model(
        nodes,
        [("a", np.float32, [M, K])],
        [("y", np.float32, [M, N])],
        {"w": rng.standard_normal((K, N)).astype(np.float32)},
    )
    feeds = {"a": rng.standard_normal((M, K)).astype(np.float32)}
    try:
        after, report = fuser.optimize(model, rules=[matmul_add_gemm], trace=True)
    except RuleError as error:
        pytest.fail(f"matmul-add-gemm crashed on Add(mm, mm): {error}")
    assert report.counts == {}
    np.testing.assert_array_equal(run(after, feeds)[0], run(model, feeds)[0])


def test_sub_not_matched():
    model, _ = mm_add_model()
    model.graph.node[1].op_type = "Sub"
    assert_not_rewritten(model, None)
