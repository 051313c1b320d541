"""Reshape(x, Concat(..., Gather(Shape(x), i), ...))  =>  Reshape(x, constant), with 0 and -1.

Exports compute Reshape targets at run time from the input's own dims (split heads:
[batch, seq, heads, head_dim] from Shape(x)), which leaves a Shape/Gather/Unsqueeze/Concat
chain per Reshape when batch and sequence are symbolic. Reshape's target 0 copies the
input's dim at the same position (allowzero=0) and one -1 takes whatever size is left, so a
target whose every entry is a constant, a dim of x read at its own position, or one other
unknown is a constant target. The chain that computed it is removed once unused.
A -1 cannot be inferred when another dim is 0, so a model with an empty dimension would fail
where the computed target did not; transformer exports never reshape empty tensors.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._common import same_dim
from fuser.rules._simplify import SIMPLIFY_PHASE

from fuser import Builder, Match, op, rule, var

PARTS = 8


def _axes(m: Match, node) -> list[int] | None:
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
    if rank is None or int(shape_node.attr("start", 0) or 0) != 0 or shape_node.attr("end") is not None:
        return None
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


def _entries(m: Match, tensor: str) -> list | None:
    """What one Concat part holds, entry by entry: ints, ('dim', tensor, axis), or None (unknown)."""
    value = m.graph.constant_value(tensor)
    if value is not None:
        return [int(v) for v in np.asarray(value).reshape(-1)]
    producer = m.graph.producer(tensor)
    node = m.graph.node(producer) if producer is not None else None
    if node is not None and node.op_type == "Unsqueeze" and _axes(m, node) in ([0], [-1]):
        found = _shape_dim(m, node.inputs[0])
        if found is not None:
            return found
    length = m.shape_of(tensor)
    if length is None or len(length) != 1 or not isinstance(length[0], int):
        return None
    return [None] * length[0]


def _inferred(m: Match, entry):
    """The size shape inference gives ('dim', tensor, axis): an int, a symbol, or None."""
    shape = m.shape_of(entry[1])
    return None if shape is None else shape[entry[2]]


def _same_dim(m: Match, entry, data: str, position: int) -> bool:
    """Whether ('dim', tensor, axis) is data's dim at `position`, provably."""
    _, tensor, axis = entry
    if tensor == data and axis == position:
        return True
    theirs, ours = m.shape_of(tensor), m.shape_of(data)
    if theirs is None or ours is None or position >= len(ours):
        return False
    return same_dim(theirs[axis], ours[position])


@rule(
    "reshape-dims-fold",
    pattern=op.Reshape(
        var("data"),
        op.Concat(var("p0"), *(var(f"p{i}", optional=True) for i in range(1, PARTS)), name="concat"),
        name="reshape",
    ),
    phase=SIMPLIFY_PHASE,
    exact=True,
)
def reshape_dims_fold(m: Match, b: Builder):
    """Reshape to a target computed from the input's own dims  =>  Reshape to a constant (0 / -1)."""
    m.require(int(m.attr("reshape", "allowzero", 0) or 0) == 0, "allowzero=1: a 0 in the target is a real 0")
    m.require(int(m.attr("concat", "axis", 0)) in (0, -1), "the target is not concatenated along its only axis")
    entries: list = []
    for i in range(PARTS):
        if not m.has(f"p{i}"):
            break
        part = _entries(m, m[f"p{i}"])
        m.require(part is not None, f"the length of target part {i} is unknown")
        entries.extend(part)
    data_shape = m.shape("data")
    target = []
    for position, entry in enumerate(entries):
        if isinstance(entry, int):
            target.append(entry)
        elif entry is not None and isinstance(_inferred(m, entry), int):
            target.append(_inferred(m, entry))  # a dim shape inference fixed
        elif entry is not None and _same_dim(m, entry, m["data"], position):
            target.append(0)
        else:
            target.append(None)
    unknown = target.count(None)
    m.require(unknown == 0 or (unknown == 1 and -1 not in target), f"{unknown} target dims are not known from x's own dims")
    m.require(data_shape is not None or all(t != 0 for t in target), "the input's rank is unknown")
    constant = np.array([-1 if t is None else t for t in target], np.int64)
    return b.Reshape(m["data"], constant, **m.attrs("reshape"))
