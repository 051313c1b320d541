"""Log(ReduceSum(Exp(x), axes, keepdims))  =>  ReduceLogSumExp(x, axes, keepdims).

ReduceLogSumExp subtracts the maximum before exponentiating, so it stays finite where
Exp overflows. Axes are an attribute of ReduceSum before opset 13 and of ReduceLogSumExp
before opset 18, and an input after; the rewrite moves them between the two forms.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._common import is_float, reduced_axes

from fuser import Builder, Match, const, op, rule, var


@rule(
    "log-sum-exp",
    pattern=op.Log(op.ReduceSum(op.Exp(var("x"), name="exp"), const("axes", optional=True), name="sum"), name="log"),
    stabilizes=True,
)
def log_sum_exp(m: Match, b: Builder):
    """Log(ReduceSum(Exp(x)))  =>  ReduceLogSumExp(x)."""
    dtype = m.dtype("x")
    m.require(is_float(dtype), "x is %s, not a float type", dtype)
    keepdims = int(m.attr("sum", "keepdims", 1))
    axes = reduced_axes(m, "sum", "axes")
    noop_when_empty = int(m.attr("sum", "noop_with_empty_axes", 0))
    if not axes:  # absent or empty: every axis, unless noop_with_empty_axes makes it an identity
        m.require(not noop_when_empty, "ReduceSum without axes and noop_with_empty_axes=1 is an identity")
        return b.ReduceLogSumExp(m["x"], keepdims=keepdims)
    if m.opset >= 18:
        return b.ReduceLogSumExp(m["x"], np.array(axes, dtype=np.int64), keepdims=keepdims)
    return b.ReduceLogSumExp(m["x"], axes=axes, keepdims=keepdims)
