"""The decomposed HardSigmoid/HardSwish exporters write: Clip(x + 3, 0, 6) / 6 and friends.

    HardSigmoid(x; 1/6, 1/2) = max(0, min(1, x/6 + 1/2)) = Clip(x + 3, 0, 6) / 6
    HardSwish(x)             = x * HardSigmoid(x; 1/6, 1/2)

The constants must be single values that do not broadcast x to a larger shape.
"""

from __future__ import annotations

import numpy as np

from fuser.rules._common import require_float, require_no_broadcast

from fuser import Match, const, op, var

x = var("x")

# Clip(x + 3, 0, 6); a Relu6 of x + 3 as torch exports it
RELU6_OF_X_PLUS_3 = op.Clip(
    op.Add(x, const("three"), name="add"),
    const("low", optional=True),
    const("high", optional=True),
    name="clip",
)

# Clip(x + 3, 0, 6) / 6, or the same times 1/6
HARD_SIGMOID_FORM = (op.Div | op.Mul)(RELU6_OF_X_PLUS_3, const("six"), name="scale", commutative=False)


def scalar(m: Match, name: str) -> float:
    """The single value of constant `name`; declines a value that could broadcast x."""
    value = m.value(name)
    m.require(value.size == 1, f"'{name}' has {value.size} values, not one")
    require_no_broadcast(m, name, "x", f"'{name}'")
    m.require(np.issubdtype(value.dtype, np.floating), "'%s' is %s, not a float type", name, value.dtype)
    return float(value.reshape(-1)[0])


# onnxruntime's CPU runs HardSigmoid and HardSwish in these only (not float64: its model would not load).
RUNNABLE_DTYPES = ("float16", "float32")
# How far from 1/6 or 6 a float32 constant may be: written to 6 digits (0.166667) it moves the
# result by at most 2e-6 of it, far inside the check's float32 tolerance; 0.1667 moves it 2e-4.
CLOSE = 1e-5


def close_to(value: float, expected: float, dtype=np.float32) -> bool:
    """Whether `value` is `expected` as nearly as CLOSE, or as nearly as `dtype` can hold it
    (float16 stores 1/6 as 0.16663)."""
    rtol = max(CLOSE, 2 * float(np.finfo(dtype).eps))
    return abs(value - expected) <= rtol * abs(expected)


def require_runnable_dtype(m: Match) -> None:
    require_float(m, "x", RUNNABLE_DTYPES)


def require_relu6_of_x_plus_3(m: Match) -> None:
    m.require(scalar(m, "three") == 3.0, "the Add does not add 3")
    if m.opset < 11:
        low, high = m.attr("clip", "min", None), m.attr("clip", "max", None)
    else:
        low = scalar(m, "low") if m.has("low") else None
        high = scalar(m, "high") if m.has("high") else None
    m.require(low == 0.0 and high == 6.0, f"the Clip is to [{low}, {high}], not [0, 6]")


def require_divided_by_6(m: Match, what: str) -> None:
    """The constant "six" divides by 6 or multiplies by 1/6."""
    six, dtype = scalar(m, "six"), m.value("six").dtype
    divides = m.node("scale").op_type == "Div"
    m.require(close_to(six, 6.0, dtype) if divides else close_to(six, 1 / 6, dtype), f"{what} is not divided by 6")


def require_hard_sigmoid_form(m: Match) -> None:
    require_runnable_dtype(m)
    require_relu6_of_x_plus_3(m)
    require_divided_by_6(m, "the Clip")
