"""Exp(x) / ReduceSum(Exp(x), axis, keepdims=1)  =>  Softmax(x, axis).

The hand-written form overflows to inf/inf = NaN for large x; Softmax subtracts the
maximum first. Only one reduced axis with keepdims=1 is the same computation. From
opset 13 Softmax works along one axis; before 13 it flattens everything from `axis` on,
which equals the one-axis form only when the axis is the last one.
"""

from __future__ import annotations

from fuser.rules._common import is_float, reduced_axes

from fuser import Builder, Match, const, op, rule, var


@rule(
    "softmax-decomposed",
    pattern=op.Div(
        op.Exp(var("x"), name="exp"),
        op.ReduceSum(op.Exp(var("x"), name="exp"), const("axes", optional=True), name="sum"),
        name="div",
    ),
    stabilizes=True,
)
def softmax_decomposed(m: Match, b: Builder):
    """Exp(x) / ReduceSum(Exp(x), axis, keepdims=1)  =>  Softmax(x, axis)."""
    m.require(m.attr("sum", "keepdims", 1) == 1, "ReduceSum drops the reduced axis (keepdims=0)")
    axes = reduced_axes(m, "sum", "axes")
    m.require(axes is not None and len(axes) == 1, f"ReduceSum reduces axes {axes}, not exactly one axis")
    axis = axes[0]
    dtype = m.dtype("x")
    m.require(is_float(dtype), "x is %s, not a float type", dtype)
    if m.opset < 13 and axis != -1:
        rank = m.rank("x")
        m.require(rank is not None, "the input's rank is unknown (needed before opset 13)")
        m.require(axis == rank - 1, "before opset 13 Softmax flattens from its axis on: only the last axis matches")
    return b.Softmax(m["x"], axis=axis)
