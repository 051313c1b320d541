"""What the simplification rules share: their phase, and which ops folding may evaluate.

Exported models carry shape arithmetic (Shape, Gather, Concat, ConstantOfShape feeding a Pad
or a Reshape), `Constant` nodes and no-op nodes that hide the patterns the fusion rules look
for. The simplification rules run in their own phase, before every fusion rule: a fusion
then sees the graph as it really is (a Pad with constant pads, a Reshape to a fixed shape),
whichever node the worklist reaches first. The same rules in phase 0 would race the fusions
node by node, and a Conv visited before the Pad arithmetic above it folded would keep its Pad.
"""

from __future__ import annotations

import numpy as np
import onnx

from fuser import Match

SIMPLIFY_PHASE = -1

# A folded value may be as large as the constants it replaces, or this many bytes: shape
# arithmetic always fits, while a ConstantOfShape or Expand that builds a large weight out of
# a few bytes stays a computation instead of growing the file.
FOLD_BYTES = 1 << 16

_NOT_FOLDED = {
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
    "If",
    "Loop",
    "Scan",
    "SequenceMap",
}


def foldable_op_types() -> tuple[str, ...]:
    """Every standard ONNX operator except the random ones and those holding subgraphs."""
    names = {s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain in ("", "ai.onnx")}
    return tuple(sorted(names - _NOT_FOLDED))


def used(m: Match, tensor: str) -> bool:
    return bool(tensor) and (m.consumers_of(tensor) > 0 or m.graph.is_graph_output(tensor))


def same_shape(m: Match, tensor: str, other: str) -> bool:
    """True when both shapes are known and equal dimension by dimension (same symbols count)."""
    shape, other_shape = m.shape(tensor), m.shape(other)
    if shape is None or other_shape is None or len(shape) != len(other_shape):
        return False
    return all(a == b and a != "?" for a, b in zip(shape, other_shape))


def broadcast_keeps_shape(m: Match, tensor: str, constant: np.ndarray) -> bool:
    """`tensor` op `constant` has `tensor`'s shape: the constant adds no axis and no dimension."""
    shape = m.shape(tensor)
    if shape is None or constant.ndim > len(shape):
        return False
    for dim, const_dim in zip(reversed(shape), reversed(constant.shape)):
        if const_dim != 1 and dim != const_dim:
            return False
    return True
