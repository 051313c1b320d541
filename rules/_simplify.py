"""What the simplification rules share: their phase, and which ops folding may evaluate.

Exported models carry shape arithmetic (Shape, Gather, Concat, ConstantOfShape feeding a Pad
or a Reshape), `Constant` nodes and no-op nodes that hide the patterns the fusion rules look
for. The simplification rules run in their own phase, before every fusion rule: a fusion
then sees the graph as it really is (a Pad with constant pads, a Reshape to a fixed shape),
whichever node the worklist reaches first. The same rules in phase 0 would race the fusions
node by node, and a Conv visited before the Pad arithmetic above it folded would keep its Pad.
"""

from __future__ import annotations

import weakref

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


# Operators whose result is their input's shape: a constant once shape inference fixes it.
SHAPE_READERS = frozenset({"Shape", "Size"})


def may_be_constant(graph) -> tuple[set[int], set[str]]:
    """_may_be_constant's answer for `graph` as it is now: the rules naming their candidates ask
    it in turn of the same graph, and it takes a look at every node. The sets are shared: a
    caller must not change them."""
    scopes, revisions = graph, []
    while scopes is not None:  # a body's answer depends on its enclosing scopes too
        revisions.append(scopes.revision)
        scopes = scopes.outer
    kept = _answers.get(graph)
    if kept is None or kept[0] != revisions:
        kept = _answers[graph] = (revisions, _may_be_constant(graph))
    return kept[1]


# may_be_constant's answers, with the revisions of the scopes they were found at.
_answers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _may_be_constant(graph) -> tuple[set[int], set[str]]:
    """The nodes whose every input may be constant during a simplification pass, and the tensors
    besides this scope's weights that may be: what enclosing scopes hold or compute (not their
    inputs), what a Shape or Size reports (shape-fold makes it a constant where shape inference
    fixes it, and what is computed from it must fold in the same pass, ahead of rules that would
    take it in), and what nodes of such inputs compute. More than the evaluator would call
    constant (a random or body-holding node's outputs count here) is only more to try. One look
    at each node: nearly every node of a large model reads an activation first, which turns it
    away at once."""
    known = {name for name in graph.captured() if _captured_may_be_constant(graph, name)}
    is_weight = graph.is_weight
    found: set[int] = set()
    for info in graph.nodes():  # in the order the nodes came, which is mostly the graph's order
        names = info.input_names
        first = names[0] if names else ""
        if first and first not in known and info.op_type not in SHAPE_READERS and not is_weight(first):
            continue  # the usual first input, an activation
        if info.op_type in SHAPE_READERS or all(not name or name in known or is_weight(name) for name in names):
            found.add(info.id)
            known.update(info.output_names)
    # A reader that came before the node it reads (a rewrite's nodes come last) is found from it.
    pending = [o for node_id in found for o in graph.node(node_id).output_names if o]
    while pending:
        for consumer in graph.op_consumers(pending.pop()):
            info = graph.node(consumer)
            if consumer not in found and all(not name or name in known or is_weight(name) for name in info.input_names):
                found.add(consumer)
                fresh = [o for o in info.output_names if o and o not in known]
                known.update(fresh)
                pending.extend(fresh)
    known.discard("")
    return found, known


def _captured_may_be_constant(graph, name: str) -> bool:
    """Whether a tensor a body reads from an enclosing scope may be constant, told by what makes
    it in the scope that does, without evaluating it: a weight (which may be large, in a file)
    or a node's output may be; a graph input is not."""
    scope = graph.outer
    while scope is not None and scope.source_kind(name) == "outer":
        scope = scope.outer
    return scope is not None and scope.source_kind(name) in ("initializer", "op")


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


def unsqueeze_axes(m: Match, node) -> list[int] | None:
    """Unsqueeze's axes: an attribute before opset 13, a constant input from 13."""
    if len(node.inputs) > 1:
        value = m.graph.constant_value(node.inputs[1])
        return None if value is None else [int(a) for a in value.reshape(-1)]
    axes = node.attr("axes")
    return None if axes is None else list(axes)


def _dims_of_shape(m: Match, shape_node, indices) -> list | None:
    """('dim', tensor, axis) for each index into Shape(tensor)."""
    tensor = shape_node.inputs[0]
    rank = m.rank_of(tensor)
    if not rank or int(shape_node.attr("start", 0) or 0) != 0 or shape_node.attr("end") is not None:
        return None
    if not all(-rank <= int(i) < rank for i in indices):
        return None  # out of range: the model fails there, nothing to read
    return [("dim", tensor, int(i) % rank) for i in indices]


def _shape_dim(m: Match, tensor: str) -> list | None:
    """[('dim', x, axis)] when `tensor` is one dim of Shape(x), read as a scalar: Gather(Shape(x), i)
    or Squeeze(Slice(Shape(x), i, i + 1)); else None."""
    producer = m.graph.producer(tensor)
    node = m.graph.node(producer) if producer is not None else None
    if node is None:
        return None
    if node.op_type == "Gather" and int(node.attr("axis", 0) or 0) == 0:
        index = m.graph.constant_value(node.inputs[1])
        source = m.graph.producer(node.inputs[0])
        if index is None or index.size != 1 or source is None or m.graph.node(source).op_type != "Shape":
            return None
        return _dims_of_shape(m, m.graph.node(source), [int(index.reshape(()))])
    if node.op_type == "Squeeze":
        inner = m.graph.producer(node.inputs[0])
        sliced = m.graph.node(inner) if inner is not None else None
        if sliced is None or sliced.op_type != "Slice" or len(sliced.inputs) < 3:
            return None
        source = m.graph.producer(sliced.inputs[0])
        bounds = [m.graph.constant_value(t) for t in sliced.inputs[1:]]
        if source is None or m.graph.node(source).op_type != "Shape" or any(v is None for v in bounds):
            return None
        rank = m.rank_of(m.graph.node(source).inputs[0])
        axes = [int(a) for a in bounds[2].reshape(-1)] if len(bounds) > 2 else [0]
        steps = [int(a) for a in bounds[3].reshape(-1)] if len(bounds) > 3 else [1]
        if rank is None or axes != [0] or steps != [1]:
            return None
        start, end = (int(v.reshape(-1)[0]) for v in bounds[:2])
        start, end = start + rank if start < 0 else start, min(end + rank if end < 0 else end, rank)
        if end - start != 1:
            return None
        return _dims_of_shape(m, m.graph.node(source), [start])
    return None


def shape_entries(m: Match, tensor: str) -> list | None:
    """What a 1-D shape tensor (a Concat part, say) holds, entry by entry: ints, ('dim', tensor,
    axis) for a dim read at run time, or None (unknown); None when not even its length is known."""
    value = m.graph.constant_value(tensor)
    if value is not None:
        return [int(v) for v in np.asarray(value).reshape(-1)]
    producer = m.graph.producer(tensor)
    node = m.graph.node(producer) if producer is not None else None
    if node is not None and node.op_type == "Unsqueeze" and unsqueeze_axes(m, node) in ([0], [-1]):
        found = _shape_dim(m, node.inputs[0])
        if found is not None:
            return found
    length = m.shape_of(tensor)
    if length is None or len(length) != 1 or not isinstance(length[0], int):
        return None
    return [None] * length[0]


def concat_entries(m: Match, tensor: str) -> list | None:
    """shape_entries of a 1-D shape tensor, or of each part of the Concat that makes it."""
    producer = m.graph.producer(tensor)
    node = m.graph.node(producer) if producer is not None else None
    if node is None or node.op_type != "Concat" or int(node.attr("axis", 0)) not in (0, -1):
        return shape_entries(m, tensor)
    entries: list = []
    for part in node.inputs:
        found = shape_entries(m, part)
        if found is None:
            return None
        entries.extend(found)
    return entries
