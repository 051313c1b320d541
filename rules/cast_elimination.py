"""Cast(x, to=T) where x is already T  =>  x.

Exports write casts that convert nothing (Llama's `hidden_states.to(torch.float32)` on a
float32 model). They change no value, but they stand between the residual Add and its
normalization, and between a norm and its weight, hiding both fusions. A simplification: it
runs with them, before every fusion.
"""

from __future__ import annotations

import onnx

from fuser.rules._simplify import SIMPLIFY_PHASE

from fuser import Builder, Match, op, rule, var

PRIORITY = 2


@rule("cast-elimination", pattern=op.Cast(var("x"), name="cast"), phase=SIMPLIFY_PHASE, exact=True)
def cast_elimination(m: Match, b: Builder):
    """Cast to the type x already has  =>  x."""
    dtype = m.dtype("x")
    m.require(dtype is not None, "the input's element type is unknown")
    target = onnx.helper.tensor_dtype_to_np_dtype(int(m.attr("cast", "to")))
    m.require(dtype == target, f"the Cast converts {dtype} to {target}")
    m.require(m.attr("cast", "saturate", 1) == 1 or not dtype.name.startswith("float8"), "a saturating float8 cast")
    return m["x"]
