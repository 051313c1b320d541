"""Clip(x + 3, 0, 6) / 6  =>  HardSigmoid(x, alpha=1/6, beta=0.5).

torch exports hardsigmoid (and the inner part of hardswish, x * hardsigmoid(x)) this way:
three nodes and two temporaries for what one HardSigmoid computes. Once it is a HardSigmoid,
hardswish-decomposed can see x * HardSigmoid(x), and the onnxruntime target can fuse it
into a preceding Conv.
"""

from __future__ import annotations

from fuser.rules._hard_activations import HARD_SIGMOID_FORM, require_hard_sigmoid_form
from fuser.rules._simplify import SIMPLIFY_PHASE

from fuser import Builder, Match, rule


@rule("hardsigmoid-decomposed", pattern=HARD_SIGMOID_FORM, phase=SIMPLIFY_PHASE, opsets=(6, None))
def hardsigmoid_decomposed(m: Match, b: Builder):
    """Clip(x + 3, 0, 6) / 6  =>  HardSigmoid(x, alpha=1/6, beta=0.5)."""
    require_hard_sigmoid_form(m)
    return b.HardSigmoid(m["x"], alpha=1 / 6, beta=0.5)
