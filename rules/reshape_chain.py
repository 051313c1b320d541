"""Reshape(Reshape(x, s1), s2)  =>  Reshape(x, s2); Reshape(x, s) to x's own shape  =>  x.

Flatten-then-view sequences and reshapes to the shape a tensor already has are common in
exports. A Reshape only reinterprets the element order, so the first of two is irrelevant
unless the second copies one of its dimensions (a 0 in s2 without allowzero).
"""

from __future__ import annotations

from fuser.rules._simplify import SIMPLIFY_PHASE, same_shape

from fuser import Builder, Match, const, op, rule, var


@rule(
    "reshape-chain",
    pattern=op.Reshape(op.Reshape(var("x"), var("first_shape"), name="first"), const("shape"), name="second"),
    phase=SIMPLIFY_PHASE,
    exact=True,
)
def reshape_chain(m: Match, b: Builder):
    """Reshape(Reshape(x, s1), s2)  =>  Reshape(x, s2)."""
    shape = m.value("shape")
    m.require(
        m.attr("second", "allowzero", 0) == 1 or not bool((shape == 0).any()),
        "the second Reshape copies a dimension of the first's result (a 0 in its shape)",
    )
    return b.Reshape(m["x"], m["shape"], **m.attrs("second"))


@rule("reshape-noop", pattern=op.Reshape(var("x"), var("shape"), name="reshape"), phase=SIMPLIFY_PHASE, exact=True)
def reshape_noop(m: Match, b: Builder):
    """Reshape(x, s) whose result has x's shape  =>  x."""
    m.require(same_shape(m, "x", "reshape"), f"the Reshape changes the shape {m.shape('x')} to {m.shape('reshape')}")
    shape = m.shape("x")
    m.require(all(isinstance(d, int) for d in shape), "x's shape is not fixed")
    return m["x"]
