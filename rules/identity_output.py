"""y = Identity(Op(...)) with y a graph output  =>  Op(...) writing y itself.

Exporters name a graph output through a final Identity (PaddlePaddle's "save_infer_model"
scale, torch's renamed outputs). The output's name must survive, so identity-elimination
keeps such an Identity; here the producer writes the output under its name instead, when
nothing else reads the producer's own output.
"""

from __future__ import annotations

import functools
import operator

from fuser import Builder, Match, op, rule, var
from fuser.rules._simplify import SIMPLIFY_PHASE, foldable_op_types


MAX_INPUTS = 32

ANY_OP = functools.reduce(operator.or_, (getattr(op, name) for name in foldable_op_types() if name != "Identity"))


@rule(
    "identity-output",
    pattern=op.Identity(
        ANY_OP(*[var(f"input{i}", optional=True) for i in range(MAX_INPUTS)], name="producer"), name="identity"
    ),
    phase=SIMPLIFY_PHASE,
    exact=True,
)
def identity_output(m: Match, b: Builder):
    """Identity(Op(...)) as a graph output  =>  Op(...) writing the output."""
    m.require(m.is_graph_output("identity"), "the Identity's output is not a graph output")
    producer = m.node("producer")
    m.require(len(producer.outputs) == 1, f"{producer.op_type} has several outputs")
    inputs = [m[f"input{i}"] for i in range(len(producer.inputs))]
    return b.like(producer, *inputs)
