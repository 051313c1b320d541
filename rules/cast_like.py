"""CastLike(x, like)  =>  Cast(x, to=like's element type), when that type is known.

torch's dynamo exporter without its optimizer (optimize=False) writes CastLike(constant,
activation) wherever a Python number meets a tensor: every Conv's zero bias arrives as
Expand(CastLike(0, x), shape), so constant-fold cannot evaluate it (x is not constant) and
conv-bn-fold or pad-conv-fold never see a constant bias. Only the element type of `like`
matters; written as a Cast, a constant `x` folds.
"""

from __future__ import annotations

from onnx import helper

from fuser import Builder, Match, op, rule, var
from fuser.rules._simplify import SIMPLIFY_PHASE


@rule(
    "cast-like",
    pattern=op.CastLike(var("x"), var("like"), name="cast"),
    phase=SIMPLIFY_PHASE,
    exact=True,
)
def cast_like(m: Match, b: Builder):
    """CastLike(x, like) with like's element type known  =>  Cast(x, to=that type)."""
    target = m.dtype("like")
    m.require(target is not None, "the element type of the second input is unknown")
    # CastLike's saturate (float8 targets) means what Cast's does.
    attrs = {k: v for k, v in m.attrs("cast").items() if k == "saturate"}
    return b.Cast(m["x"], to=helper.np_dtype_to_tensor_dtype(target), **attrs)
