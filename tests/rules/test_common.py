"""Tests for the shared rule helpers (rules/_common.py), through a probe rule that calls them
on real matches and records what they return or why they decline.

require_scalar accepts a constant within rtol (1e-4) of the expected value, widened to what
the constant's own dtype can hold (2 eps of float16 for float16, 2^-7 for bfloat16, so
float16's 1.4140625 is sqrt(2)); trailing_axes turns reduction axes into LayerNormalization's
negative `axis`; broadcast_over reshapes a Mul/Add constant to the normalized dims or declines;
is_float counts bfloat16 as a float.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from fuser.rules._common import (
    broadcast_over,
    is_float,
    require_scalar,
    static_dims,
    trailing_axes,
)
from onnx import helper

import fuser
from fuser import Builder, Match, const, op, rule, var
from tests.helpers import make_model

SEEN: dict = {}


def probe(check):
    """A rule on Mul(x, k) that runs `check(m)`, records its result and declines with
    "probed" (so the model is never rewritten)."""

    @rule("probe", pattern=op.Mul(var("x"), const("k"), name="mul"), description="probe")
    def probe_rule(m: Match, b: Builder):
        SEEN["result"] = check(m)
        m.require(False, "probed")

    return probe_rule


def run_probe(check, k, x_shape=("batch", 3, 8), dtype=np.float32):
    """(result, decline reason) of `check` on x * k."""
    SEEN.clear()
    model = make_model(
        [helper.make_node("Mul", ["x", "k"], ["y"], name="mul")],
        [("x", dtype, list(x_shape))],
        [("y", dtype, [None] * len(x_shape))],
        {"k": np.asarray(k, dtype)},
        check=False,
    )
    _, report = fuser.optimize(model, rules=[probe(check)], trace=True, check=False)
    (declined,) = report.engine.declined
    return SEEN.get("result"), declined.reason


@pytest.mark.parametrize(
    "dtype,value,expected,accepted",
    [
        (np.float32, math.sqrt(2), math.sqrt(2), True),
        (np.float32, 1.4142, math.sqrt(2), True),  # within 1e-4
        (np.float32, 1.414, math.sqrt(2), False),
        (np.float16, math.sqrt(2), math.sqrt(2), True),  # held as 1.4140625
        (ml_dtypes.bfloat16, math.sqrt(2), math.sqrt(2), True),  # held as 1.4140625
        (ml_dtypes.bfloat16, 1.39, math.sqrt(2), False),
        (np.float16, 0.6, 0.5, False),
    ],
)
def test_require_scalar(dtype, value, expected, accepted):
    result, reason = run_probe(lambda m: require_scalar(m, "k", expected, "the constant"), value, dtype=dtype)
    assert reason == "probed" if accepted else reason.startswith("the constant is ")


def test_require_scalar_vector():
    _, reason = run_probe(lambda m: require_scalar(m, "k", 2.0, "the constant"), np.full(8, 2.0))
    assert reason == "the constant is not a single constant"


@pytest.mark.parametrize(
    "axes,first",
    [([-1], -1), ([2], -1), ([1, 2], -2), ([-2, -1], -2), ([2, 1], -2), ([0, 1, 2], -3)],
)
def test_trailing_axes(axes, first):
    result, reason = run_probe(lambda m: trailing_axes(m, axes, "x"), 1.0)
    assert reason == "probed" and result == first


@pytest.mark.parametrize(
    "axes,reason",
    [
        ([1], "axes [1] are not the trailing axes"),
        ([0, 2], "are not the trailing"),
        ([], "the reduction has no explicit axes"),
        (None, "no explicit axes"),
    ],
)
def test_trailing_axes_declines(axes, reason):
    _, got = run_probe(lambda m: trailing_axes(m, axes, "x"), 1.0)
    assert reason in got


def test_static_dims():
    result, _ = run_probe(lambda m: static_dims(m, "x", -2), 1.0)
    assert result == (3, 8)
    _, reason = run_probe(lambda m: static_dims(m, "x", -3), 1.0)
    assert "('batch', 3, 8) are not fixed sizes" in reason


@pytest.mark.parametrize(
    "shape,ok",
    [
        ((8,), True),
        ((1, 1, 8), True),
        ((), True),
        ((1, 8), True),
        ((3, 1), False),
        ((2, 1, 8), False),
        ((1, 1, 1, 8), False),
    ],
)
def test_broadcast_over(shape, ok):
    value = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    result, reason = run_probe(lambda m: broadcast_over(m, value, (8,), 3, "the constant"), 1.0)
    if ok:
        assert reason == "probed" and result.shape == (8,)
        np.testing.assert_array_equal(result, np.broadcast_to(value.reshape(-1), (8,)))
    else:
        assert reason.startswith("the constant")


def test_is_float():
    assert all(is_float(np.dtype(t)) for t in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16))
    assert not any(is_float(np.dtype(t)) for t in (np.int32, np.int64, np.bool_))
    assert not is_float(None)
