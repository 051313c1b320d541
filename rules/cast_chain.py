"""Cast(Cast(x, T1), T2)  =>  Cast(x, T2) when T1 holds every value of x exactly; Cast(x, T) of
an x already of type T  =>  x.

Exporters cast back and forth around operators that want another type (int32 <-> int64 for
shapes, fp16 -> fp32 -> fp64). When the intermediate type can hold every value of x's type,
the round trip loses nothing and the direct cast gives the same values.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._simplify import SIMPLIFY_PHASE
from onnx import helper

from fuser import Builder, Match, op, rule, var


# Types whose every value the key type holds exactly: a cast through the key type is lossless.
_HOLDS = {
    np.dtype(np.float64): {np.float16, np.float32, np.float64, np.int8, np.uint8, np.int16, np.uint16, np.int32},
    np.dtype(np.float32): {np.float16, np.float32, np.int8, np.uint8, np.int16, np.uint16},
    np.dtype(np.int64): {np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.bool_},
    np.dtype(np.int32): {np.int8, np.uint8, np.int16, np.uint16, np.int32, np.bool_},
}


def _target(m: Match, node: str) -> np.dtype | None:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(int(m.attr(node, "to"))))
    except (KeyError, TypeError, ValueError):
        return None


@rule(
    "cast-chain",
    pattern=op.Cast(op.Cast(var("x"), name="first"), name="second"),
    phase=SIMPLIFY_PHASE,
    exact=True,
)
def cast_chain(m: Match, b: Builder):
    """Cast(Cast(x, T1), T2), T1 exact for x  =>  Cast(x, T2)."""
    source, middle = m.dtype("x"), _target(m, "first")
    m.require(source is not None and middle is not None, "the types are unknown")
    holds = {np.dtype(t) for t in _HOLDS.get(middle, ())}
    m.require(source in holds, f"{middle} does not hold every {source} value exactly")
    # saturate (opset 19) says what the last cast does with values out of a float8's range.
    attrs = {k: v for k, v in m.attrs("second").items() if k in ("to", "saturate")}
    return b.Cast(m["x"], **attrs)


@rule("cast-noop", pattern=op.Cast(var("x"), name="cast"), phase=SIMPLIFY_PHASE, exact=True)
def cast_noop(m: Match, b: Builder):
    """Cast(x, T) with x of type T  =>  x."""
    source, target = m.dtype("x"), _target(m, "cast")
    m.require(source is not None, "the input's element type is unknown")
    m.require(source == target, f"the Cast changes {source} to {target}")
    return m["x"]
