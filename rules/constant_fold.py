"""A node whose inputs are all constants  =>  an initializer holding its result.

Exporters compute shapes, pads and index tensors in the graph; once their inputs are fixed
these are constants, and a Pad or Reshape reading a constant is what the other rules (and
onnxruntime's kernels) want to see. `Constant` nodes become initializers the same way.
Values come from onnx's reference evaluator (fuser/constants.py). A result larger than both
the constants it frees and FOLD_BYTES stays a computation, so a ConstantOfShape that builds
a large weight does not grow the file, nor does a Transpose of an embedding table that a Gather
reads too (the LM head of a tied-embedding decoder's dynamo export): a constant another node
or a subgraph still reads is not freed. What a fold frees is what nothing else reads once its
result replaces it: a weight the Slices of one Concat all read goes with the Concat's fold.
Inside an If/Loop/Scan body a fold may copy a weight of an enclosing scope (BODY_COPY_BYTES).
Initializers a graph input can override (listed as inputs since IR 4) are not constants and
are never folded.
"""

from __future__ import annotations

import functools
import operator

import numpy as np
from fuser.rules._common import is_float
from onnx import AttributeProto, numpy_helper
from fuser.rules._simplify import FOLD_BYTES, SIMPLIFY_PHASE, foldable_op_types, may_be_constant, used

from fuser import Builder, Match, const, op, rule
from fuser.float32_twin import is_sixteen_bit_float
from fuser.graph import SUBGRAPH_SLOT
from fuser.tensors import nbytes

MAX_INPUTS = 32  # Concat/Sum/Max of more constant parts than this stay as they are
COPY_BYTES = 1 << 12  # shape arithmetic and other small results always fold
CONE_LIMIT = 256  # constant nodes looked through for the weights a fold frees
# Inside an If/Loop/Scan body, a fold may copy a weight of an enclosing scope into a result of up
# to this many bytes. The body does its constant work at every run of it, and onnxruntime folds
# it at session start: Silero VAD's branches each cut and reorder the gates of the LSTM weights
# their If reads (Slice, Concat, Unsqueeze; 256 KB each), and left in place they cost its
# `--target onnxruntime` output 1.44 times the time of the folded one with onnxruntime's
# optimizations off (0.264 ms against 0.183, medians, 2 threads; with them on onnxruntime folds
# them itself: 0.177 against 0.175). The file holds a copy per branch (2.3 MB became 3.3 MB); a
# large weight (an embedding table transposed in both branches of a merged decoder) stays one.
BODY_COPY_BYTES = 1 << 20

# Identity is left to identity-elimination, which rewires to the constant instead of copying it.
# A DequantizeLinear of a constant is how a quantized model stores a weight: runtimes read it
# as the integer operand of the operator it feeds (fuser/qdq.py), so it stays.
FOLDABLE = functools.reduce(
    operator.or_,
    (getattr(op, name) for name in foldable_op_types() if name not in ("Identity", "DequantizeLinear")),
)


def frees(graph, tensor: str, reader: int) -> bool:
    """Whether folding `reader` away frees `tensor` and everything it is computed from: nothing
    else reads them (no other node, subgraph or graph output), and they are not captured from an
    outer scope."""
    pending = [(tensor, reader)]
    while pending:
        name, node_id = pending.pop()
        if any(consumer != node_id or slot == SUBGRAPH_SLOT for consumer, slot in graph.consumers(name)):
            return False
        kind = graph.source_kind(name)
        if kind == "op":
            producer = graph.node(graph.producer(name))
            if any(o and o != name and graph.consumers(o) for o in producer.outputs):
                return False
            pending.extend((i, producer.id) for i in producer.inputs if i)
        elif kind != "initializer":
            return False
    return True


def constant_cone(graph, reader: int) -> tuple[set[int], set[str], set[str]] | None:
    """What `reader`'s constant inputs are computed from: the op nodes, the initializers of this
    scope, and the constants captured from an enclosing one; None past CONE_LIMIT nodes."""
    cone: set[int] = set()
    stored: set[str] = set()
    captured: set[str] = set()
    pending = [i for i in graph.node(reader).inputs if i]
    while pending:
        name = pending.pop()
        kind = graph.source_kind(name)
        if kind == "initializer":
            if graph.initializer(name) is not None:  # a sparse one is never constant
                stored.add(name)
        elif kind == "outer":
            captured.add(name)
        elif kind == "op":
            producer = graph.producer(name)
            if producer not in cone:
                cone.add(producer)
                if len(cone) > CONE_LIMIT:
                    return None
                pending.extend(i for i in graph.node(producer).inputs if i)
    return cone, stored, captured


def stored_bytes_freed(graph, reader: int) -> int:
    """Bytes of the initializers that folding `reader` leaves unread, with the constant nodes
    between them and it: a weight that several Slices read, cut and put together again (the
    gate order of an LSTM's weights in PyTorch's exports), is freed by folding the Concat of
    them all, which `frees` does not see, one input at a time."""
    found = constant_cone(graph, reader)
    if found is None:
        return 0
    cone, stored, _ = found
    removed = {reader}

    def only_removed_read(tensor: str) -> bool:
        return all(consumer in removed and slot != SUBGRAPH_SLOT for consumer, slot in graph.consumers(tensor))

    # A node goes with the fold once nothing but what goes reads it: settled from the reader up.
    changed = True
    while changed:
        changed = False
        for node_id in cone - removed:
            if all(only_removed_read(o) for o in graph.node(node_id).outputs if o):
                removed.add(node_id)
                changed = True
    return sum(nbytes(graph.initializer(name)) for name in stored if only_removed_read(name))


def copies_captured(graph, reader: int, result_bytes: int) -> bool:
    """Whether folding `reader` in an If/Loop/Scan body copies a constant an enclosing scope
    holds, into a result of at most BODY_COPY_BYTES (see there)."""
    if graph.outer is None or result_bytes > BODY_COPY_BYTES:
        return False
    found = constant_cone(graph, reader)
    return found is not None and bool(found[2])


def stored_bytes(graph, tensors: list[str]) -> int:
    """Bytes of the initializers and outer-scope captures that `tensors` are computed from."""
    pending, seen, total = list(tensors), set(), 0
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        kind = graph.source_kind(name)
        if kind == "op":
            pending.extend(i for i in graph.node(graph.producer(name)).inputs if i)
        elif kind in ("initializer", "outer"):
            value = graph.constant_value(name)
            total += 0 if value is None else value.nbytes
    return total


def maybe_constant(graph) -> set[int]:
    """The nodes whose every input may be constant during a pass (Rule.candidates): the pattern
    is tried at every node of nearly every op type."""
    return may_be_constant(graph)[0]


def _overflows(value: np.ndarray, inputs: list[tuple[str, np.ndarray]], node) -> bool:
    """Whether a 16-bit float result has inf or NaN though every float constant it comes from
    (its inputs, and a value it holds: ConstantOfShape's) is finite: onnxruntime sums and
    averages 16-bit floats in float32, the reference evaluator in the 16-bit type."""
    if not is_sixteen_bit_float(value) or np.isfinite(value.astype(np.float64)).all():
        return False
    held = [numpy_helper.to_array(a.t) for a in node.proto.attribute if a.type == AttributeProto.TENSOR]
    sources = [v for _, v in inputs] + held
    return bool(sources) and all(not is_float(v.dtype) or np.isfinite(v.astype(np.float64)).all() for v in sources)


@rule(
    "constant-fold",
    pattern=FOLDABLE(*[const(f"input{i}", optional=True) for i in range(MAX_INPUTS)], name="node"),
    phase=SIMPLIFY_PHASE,
    candidates=maybe_constant,
)
def constant_fold(m: Match, b: Builder):
    """A node of constant inputs  =>  its value, as an initializer."""
    node = m.node("node")
    inputs = [(name, m.value(f"input{i}")) for i, name in enumerate(node.inputs) if name]
    given = sum(value.nbytes for _, value in inputs)
    limit = None if node.op_type == "Constant" else max(FOLD_BYTES, given)
    results, freeing = [], None
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
        m.require(
            not _overflows(value, inputs, node),
            "the result is inf or NaN where the constants are finite: onnxruntime may compute it in a "
            "wider type (a float16 mean of 60000s is 60000 there)",
        )
        if limit is not None and value.nbytes > COPY_BYTES:
            # A constant another node still reads stays beside the result: only what the fold frees pays for it.
            if freeing is None:
                freeing = {name: frees(m.graph, name, node.id) for name, _ in inputs}
            freed = max(
                sum(constant.nbytes for name, constant in inputs if freeing[name]),
                stored_bytes_freed(m.graph, node.id),
            )
            copying = copies_captured(m.graph, node.id, value.nbytes)
            m.require(
                value.nbytes <= FOLD_BYTES or value.nbytes <= freed or copying,
                f"the result would take {value.nbytes} bytes, more than {FOLD_BYTES} and than the constants the "
                f"fold frees ({freed}): the others are still read, and the model would hold both; it stays a "
                "computation",
            )
            # Below FOLD_BYTES a fold may add data made from small constants (a causal mask from its
            # shape), but not a second copy of a stored one that stays, but for BODY_COPY_BYTES.
            added = value.nbytes - freed
            kept = stored_bytes(m.graph, [name for name, _ in inputs if not freeing[name]])
            m.require(
                added <= 0 or kept < added or copying,
                f"the result would add {added} bytes to the model, and the stored constants it is computed from "
                f"that stay hold {kept} (as many or more): it is likely a copy of them; it stays a computation",
            )
        results.append(b.constant(value, "folded"))
    m.require(any(r is not None for r in results), "no output is used")
    return results
