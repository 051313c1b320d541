"""Identity(x)  =>  x.

Exporters leave Identity nodes behind (a weight shared under two names, a renamed output);
they copy a tensor and hide the producer from the rules that match across them. A graph
output keeps its name: there the engine keeps one Identity, and the rule declines.
"""

from __future__ import annotations

from fuser.rules._simplify import SIMPLIFY_PHASE

from fuser import Builder, Match, op, rule, var


@rule("identity-elimination", pattern=op.Identity(var("x")), phase=SIMPLIFY_PHASE, exact=True)
def identity_elimination(m: Match, b: Builder):
    """Identity(x)  =>  x."""
    return m["x"]
