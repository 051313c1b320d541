"""fuser.testing, the public helpers for rule tests: each helper passes a right claim and fails a wrong one."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from fuser import Builder, Match, const, op, rule, var
from fuser.testing import (
    assert_declined,
    assert_rewritten,
    initializer_value,
    make_model,
    model_from_text,
    op_types,
    rules_named,
    run,
)

RELU_TWICE = """
g (float[N, 4] x) => (float[N, 4] y) {
    r = Relu (x)
    y = Relu (r)
}
"""


@rule("test-double-relu", pattern=op.Relu(op.Relu(var("x"), name="inner")), exact=True)
def double_relu(m: Match, b: Builder):
    """Relu(Relu(x)) => Relu(x)."""
    return b.Relu(m["x"])


@rule("test-add-zero", pattern=op.Add(var("x"), const("zero")), exact=True)
def add_zero(m: Match, b: Builder):
    """x + 0 => x."""
    m.require(not np.any(m.value("zero")), "the constant is not all zeros")
    m.require(m.shape("zero") is not None and m.value("zero").ndim <= (m.rank("x") or 0), "it broadcasts x")
    return b.Identity(m["x"])


def test_model_from_text_adds_the_header_and_checks_the_model():
    model = model_from_text(RELU_TWICE, opset=14)
    assert op_types(model) == ["Relu", "Relu"]
    assert {o.domain: o.version for o in model.opset_import} == {"": 14}
    x = np.array([[-1, 2, -3, 4]], np.float32)
    np.testing.assert_array_equal(run(model, {"x": x})[0], np.maximum(x, 0))


def test_model_from_text_takes_initializers_and_rejects_bad_text():
    model = model_from_text(
        "g (float[2] x) => (float[2] y) <float[2] zero> { y = Add (x, zero) }",
        initializers={"zero": np.zeros(2, np.float32)},
    )
    np.testing.assert_array_equal(initializer_value(model, "zero"), np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="not valid ONNX text"):
        model_from_text("g (float[2] x) => (float[2] y) { y = Add (x, }")
    with pytest.raises(onnx.checker.ValidationError):
        model_from_text("g (float[2] x) => (float[2] y) { y = NoSuchOp (x) }")


def test_make_model_from_tuples():
    model = make_model(
        [onnx.helper.make_node("Relu", ["x"], ["y"])], [("x", np.float16, ["N", 3])], [("y", np.float16, ["N", 3])]
    )
    assert op_types(model) == ["Relu"]


def test_assert_rewritten_passes_a_rewrite_and_fails_wrong_claims():
    model = model_from_text(RELU_TWICE)
    after, report = assert_rewritten(model, double_relu, counts={"test-double-relu": 1}, expected_ops=["Relu"])
    assert report.verdict.passed and op_types(after) == ["Relu"]
    assert_rewritten(model, [double_relu])  # without counts: at least one rewrite
    with pytest.raises(AssertionError, match="counts"):
        assert_rewritten(model, double_relu, counts={"test-double-relu": 2})
    with pytest.raises(AssertionError, match="optimized ops"):
        assert_rewritten(model, double_relu, expected_ops=["Relu", "Relu"])
    with pytest.raises(AssertionError, match="nothing was rewritten"):
        assert_rewritten(model_from_text("g (float[2] x) => (float[2] y) { y = Relu (x) }"), double_relu)


def test_assert_rewritten_compares_given_feeds():
    model = model_from_text(RELU_TWICE)
    x = np.linspace(-2, 2, 8, dtype=np.float32).reshape(2, 4)
    assert_rewritten(model, double_relu, feeds={"x": x})


def test_assert_declined_checks_the_reason():
    nonzero = model_from_text("g (float[2] x) => (float[2] y) <float[2] k = {1.0, 0.0}> { y = Add (x, k) }")
    assert_declined(nonzero, add_zero, "not all zeros")
    with pytest.raises(AssertionError):
        assert_declined(nonzero, add_zero, "some other reason")
    zero = model_from_text("g (float[2] x) => (float[2] y) <float[2] k = {0.0, 0.0}> { y = Add (x, k) }")
    with pytest.raises(AssertionError, match="rewritten"):
        assert_declined(zero, add_zero, "not all zeros")
    # reason=None: the pattern must not match at all.
    assert_declined(model_from_text(RELU_TWICE), add_zero, None)


def test_rules_are_found_by_name():
    (found,) = rules_named("conv-bn-fold")
    assert found.name == "conv-bn-fold"
    with pytest.raises(ValueError, match="no registered rule"):
        rules_named("no-such-rule")
    model = model_from_text(
        """
        g (float[1, 2, 4, 4] x) => (float[1, 2, 4, 4] y)
          <float[2, 2, 1, 1] w = {1.0, 0.5, -1.0, 2.0}, float[2] s = {1.0, 2.0}, float[2] b = {0.0, 1.0},
           float[2] mean = {0.5, -0.5}, float[2] var = {1.0, 4.0}> {
            c = Conv (x, w)
            y = BatchNormalization (c, s, b, mean, var)
        }
        """
    )
    assert_rewritten(model, "conv-bn-fold", counts={"conv-bn-fold": 1}, expected_ops=["Conv"])
