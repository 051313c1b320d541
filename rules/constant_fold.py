"""A node whose inputs are all constants  =>  an initializer holding its result.

Exporters compute shapes, pads and index tensors in the graph; once their inputs are fixed
these are constants, and a Pad or Reshape reading a constant is what the other rules (and
onnxruntime's kernels) want to see. `Constant` nodes become initializers the same way.
Values come from onnx's reference evaluator (fuser/constants.py). A result larger than both
the constants it replaces and FOLD_BYTES stays a computation, so a ConstantOfShape that builds
a large weight does not grow the file. Initializers a graph input can override (listed as
inputs since IR 4) are not constants and are never folded.

The pattern matches every node; a pass over a whole graph tries it only where no input is known
to vary (constant_candidates).
"""

from __future__ import annotations

import functools
import operator

from fuser.rules._simplify import FOLD_BYTES, SIMPLIFY_PHASE, foldable_op_types, used

from fuser import Builder, Match, const, op, rule
from fuser.constants import is_foldable

MAX_INPUTS = 32  # Concat/Sum/Max of more constant parts than this stay as they are

# Identity is left to identity-elimination, which rewires to the constant instead of copying it.
FOLDABLE_TYPES = frozenset(foldable_op_types()) - {"Identity"}
FOLDABLE = functools.reduce(operator.or_, (getattr(op, name) for name in sorted(FOLDABLE_TYPES)))
# Their outputs depend on the input's shape alone, which shape-fold may find fixed: what is
# computed from them stays a candidate.
SHAPE_READERS = {"Shape", "Size"}


def constant_candidates(graph) -> list[int]:
    """The foldable nodes none of whose inputs is known to vary: a graph input the caller feeds,
    or computed from one (or from a node that is never folded). One look at each node, in
    position order: a tensor whose producer comes later is not yet known to vary, so its reader
    is tried rather than skipped."""
    varying = {value.name for value in graph.feedable_inputs()}
    found = []
    for info in sorted(graph.nodes(), key=lambda info: graph.sort_key(info.id)):
        proto = info.proto
        if varying.isdisjoint(proto.input):
            if is_foldable(info):  # an Identity too: not folded here, but its output may be constant
                if proto.op_type in FOLDABLE_TYPES:
                    found.append(info.id)
                continue
        elif proto.op_type in SHAPE_READERS and proto.domain in ("", "ai.onnx"):
            continue
        varying.update(proto.output)
    return found


@rule(
    "constant-fold",
    pattern=FOLDABLE(*[const(f"input{i}", optional=True) for i in range(MAX_INPUTS)], name="node"),
    phase=SIMPLIFY_PHASE,
    candidates=constant_candidates,
)
def constant_fold(m: Match, b: Builder):
    """A node of constant inputs  =>  its value, as an initializer."""
    node = m.node("node")
    inputs = [m.value(f"input{i}") for i in range(len(node.inputs)) if node.inputs[i]]
    given = sum(value.nbytes for value in inputs)
    limit = None if node.op_type == "Constant" else max(FOLD_BYTES, given)
    results = []
    for output in node.outputs:
        if not output:
            continue
        if not used(m, output):
            results.append(None)
            continue
        value = m.graph.constant_value(output) if limit is None else m.graph.constant_value(output, max_bytes=limit)
        if value is None and limit is not None:
            large = m.graph.constant_value(output)
            m.require(
                large is None,
                f"the result would take {0 if large is None else large.nbytes} bytes, more than its "
                f"constant inputs ({given}) and {FOLD_BYTES}: it stays a computation",
            )
        m.require(value is not None, f"onnx's reference evaluator cannot compute {node.op_type} here")
        results.append(b.constant(value, "folded"))
    m.require(any(r is not None for r in results), "no output is used")
    return results
