"""x * HardSigmoid(x, 1/6, 0.5)  or  x * Clip(x + 3, 0, 6) / 6  =>  HardSwish(x) (opset 14).

MobileNetV3-style activations arrive decomposed from most exporters; HardSwish is one
kernel instead of two to four, with no temporaries. hardsigmoid-decomposed turns the
x * (Clip(x + 3, 0, 6) / 6) form into x * HardSigmoid(x) first; the other grouping,
(x * Clip(x + 3, 0, 6)) / 6, is matched here. Before opset 14, which has no HardSwish,
that grouping becomes x * HardSigmoid(x) (PaddlePaddle's exports at opsets 11 to 13): two
nodes instead of four, which the onnxruntime target's NCHWc rules keep in the blocked layout.
"""

from __future__ import annotations

from fuser.rules._hard_activations import (
    RELU6_OF_X_PLUS_3,
    close_to,
    require_divided_by_6,
    require_relu6_of_x_plus_3,
    require_runnable_dtype,
    x,
)
from fuser.rules._simplify import SIMPLIFY_PHASE

from fuser import Builder, Match, const, op, rule


@rule(
    "hardswish-decomposed",
    pattern=op.Mul(x, op.HardSigmoid(x, name="hsig"), name="mul"),
    phase=SIMPLIFY_PHASE,
    opsets=(14, None),
)
def hardswish_decomposed(m: Match, b: Builder):
    """x * HardSigmoid(x, alpha=1/6, beta=0.5)  =>  HardSwish(x)."""
    require_runnable_dtype(m)
    alpha, beta = float(m.attr("hsig", "alpha", 0.2)), float(m.attr("hsig", "beta", 0.5))
    m.require(close_to(alpha, 1 / 6), f"HardSigmoid's alpha is {alpha:g}, not 1/6")
    m.require(beta == 0.5, f"HardSigmoid's beta is {beta:g}, not 0.5")
    return b.HardSwish(m["x"])


@rule(
    "hardswish-clip",
    pattern=(op.Div | op.Mul)(op.Mul(x, RELU6_OF_X_PLUS_3, name="mul"), const("six"), name="scale", commutative=False),
    phase=SIMPLIFY_PHASE,
    opsets=(14, None),
)
def hardswish_clip(m: Match, b: Builder):
    """(x * Clip(x + 3, 0, 6)) / 6  =>  HardSwish(x)."""
    _require_divided_by_6(m)
    return b.HardSwish(m["x"])


@rule(
    "hardswish-clip-regroup",
    pattern=(op.Div | op.Mul)(op.Mul(x, RELU6_OF_X_PLUS_3, name="mul"), const("six"), name="scale", commutative=False),
    phase=SIMPLIFY_PHASE,
    opsets=(6, 13),
)
def hardswish_clip_regroup(m: Match, b: Builder):
    """(x * Clip(x + 3, 0, 6)) / 6  =>  x * HardSigmoid(x, alpha=1/6, beta=0.5), before opset 14."""
    _require_divided_by_6(m)
    return b.Mul(m["x"], b.HardSigmoid(m["x"], alpha=1 / 6, beta=0.5))


def _require_divided_by_6(m: Match) -> None:
    require_runnable_dtype(m)
    require_relu6_of_x_plus_3(m)
    require_divided_by_6(m, "the product")
