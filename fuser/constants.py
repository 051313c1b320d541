"""Constant evaluation: the value of a tensor fixed by the model, bounded in size.

Exported models often compute weights in the graph (ConstantOfShape, Reshape of an
initializer, Cast, ...). Rules see through such subgraphs because `Graph.constant_value`
asks this module, which evaluates them on demand (one node at a time, with onnx's
reference evaluator) and caches the results per graph scope; results larger than a
bound are never materialized.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import NodeProto, TensorProto, numpy_helper

if TYPE_CHECKING:
    from fuser.graph import Graph

_NONDETERMINISTIC = {
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
}
# Ops whose output can be far larger than their inputs: bounded before evaluation.
_EXPANDING = {"ConstantOfShape", "Expand", "Tile", "Range", "Resize", "Upsample", "Pad"}


def is_foldable(info) -> bool:
    """Whether a node (a NodeInfo) computes a function of its inputs alone: a standard operator,
    not a random one, holding no subgraph."""
    return info.domain in ("", "ai.onnx") and info.op_type not in _NONDETERMINISTIC and not info.subgraphs


def constant_node_value(node: NodeProto) -> np.ndarray | None:
    for attribute in node.attribute[:]:
        if attribute.name == "value":
            return numpy_helper.to_array(attribute.t)
        if attribute.name == "value_float":
            return np.array(attribute.f, dtype=np.float32)
        if attribute.name == "value_floats":
            return np.array(list(attribute.floats), dtype=np.float32)
        if attribute.name == "value_int":
            return np.array(attribute.i, dtype=np.int64)
        if attribute.name == "value_ints":
            return np.array(list(attribute.ints), dtype=np.int64)
    return None


def _estimated_bytes(node: NodeProto, inputs: list[np.ndarray | None]) -> int | None:
    """The memory evaluating an operator that can grow its input takes at its peak, from its
    inputs alone. onnx's reference Range counts in 8-byte values before casting, and its Expand
    multiplies by float64 ones of the result's shape."""
    try:
        if node.op_type == "ConstantOfShape":
            value = next((a.t for a in node.attribute[:] if a.name == "value"), None)
            itemsize = 4 if value is None else onnx.helper.tensor_dtype_to_np_dtype(value.data_type).itemsize
            return math.prod(int(d) for d in inputs[0].reshape(-1)) * itemsize
        if node.op_type == "Expand":
            shape = np.broadcast_shapes(inputs[0].shape, tuple(int(d) for d in inputs[1]))
            return math.prod(shape) * (8 + inputs[0].itemsize)
        if node.op_type == "Tile":
            return inputs[0].nbytes * math.prod(int(r) for r in inputs[1].reshape(-1))
        if node.op_type == "Range":
            start, limit, delta = (float(v) for v in inputs[:3])
            return max(0, math.ceil((limit - start) / delta)) * (8 + inputs[0].itemsize) if delta else None
    except (TypeError, ValueError, IndexError, AttributeError, KeyError, OverflowError):
        return None
    return None  # growth unknown beforehand (Pad, Resize): not evaluated


def evaluate_node(
    node: NodeProto, inputs: list[np.ndarray | None], opsets: dict[str, int], max_bytes: int
) -> list[np.ndarray] | None:
    """The node's outputs, or None if it cannot be evaluated or a result exceeds `max_bytes`."""
    if node.op_type == "Constant":
        value = constant_node_value(node)
        return None if value is None or value.nbytes > max_bytes else [value]
    if node.op_type in _EXPANDING:
        size = _estimated_bytes(node, inputs)
        if size is None or size > max_bytes:
            return None
    if any(isinstance(v, np.ndarray) and v.nbytes > max_bytes for v in inputs):
        return None
    try:
        from onnx.reference import ReferenceEvaluator

        feeds = {name: value for name, value in zip(node.input, inputs) if name}
        opset_imports = [onnx.helper.make_opsetid(d, v) for d, v in opsets.items()]
        graph = onnx.helper.make_graph(
            [node],
            "fold",
            [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in feeds],
            [onnx.helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output[:] if o],
        )
        model = onnx.helper.make_model(graph, opset_imports=opset_imports)
        with np.errstate(
            all="ignore"
        ):  # an overflow is the result's to show (constant-fold declines it), not a warning
            results = ReferenceEvaluator(model).run(None, feeds)
    except Exception:  # noqa: BLE001 - any failure means "not foldable", never a crash
        return None
    arrays = []
    for value in results:
        if not isinstance(value, np.ndarray) and not np.isscalar(value):
            return None
        value = np.asarray(value)
        if value.nbytes > max_bytes:
            return None
        arrays.append(value)
    return arrays


class ConstantValues:
    """The known constant tensors of one graph scope, evaluated on demand and cached.

    The graph tells it about changes: `forget` when a tensor stops being produced, and
    `reconsider` when a node starts reading another tensor (what it computes may have
    become constant). Tensors found not to be constant are remembered too, so repeated
    queries on activations stop at once.
    """

    def __init__(self, graph: Graph) -> None:
        # Held weakly: the graph holds this, and a cycle would leave a dropped model (all its
        # nodes) to the cyclic collector rather than free it at once.
        self._graph_ref = weakref.ref(graph)
        self._cache: dict[str, np.ndarray] = {}
        self._not_constant: set[str] = set()

    @property
    def _graph(self) -> Graph:
        return self._graph_ref()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_graph_ref"] = self._graph  # copied or pickled with the graph, held weakly again
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._graph_ref = weakref.ref(state["_graph_ref"])

    def value(self, tensor: str, max_bytes: int) -> np.ndarray | None:
        if not tensor:  # an absent optional input: never recorded as not constant, or every node
            return None  # with one would look not constant to the search
        cached = self._cache.get(tensor)
        if cached is not None:
            return cached if cached.nbytes <= max_bytes else None
        if tensor in self._not_constant:
            return None
        graph = self._graph
        if graph.source_kind(tensor) == "initializer":  # nothing to evaluate: most queries are weights
            return self.stored_value(graph.initializer(tensor), max_bytes)
        order = self._dependencies(tensor)
        if order is None:
            return None
        graph = self._graph
        for node_id in order:
            proto = graph.node(node_id).proto
            inputs = []
            for name in proto.input[:]:
                value = self._leaf_value(name, max_bytes) if name else None
                if name and value is None:
                    return None
                inputs.append(value)
            outputs = evaluate_node(proto, inputs, graph.opsets, max_bytes)
            if outputs is None:
                return None
            for name, value in zip(proto.output, outputs):
                if name:
                    value.flags.writeable = False
                    self._cache[name] = value
        return self._leaf_value(tensor, max_bytes)

    def forget(self, tensor: str) -> None:
        """`tensor` is no longer produced in this scope (its node or initializer was removed)."""
        self._cache.pop(tensor, None)
        self._not_constant.discard(tensor)

    def reconsider(self, tensors: Iterable[str]) -> None:
        """A node producing `tensors` now reads another input: they, and what is computed
        from them, may have become constant."""
        pending = [t for t in tensors if t in self._not_constant]
        while pending:
            tensor = pending.pop()
            self._not_constant.discard(tensor)
            for consumer in self._graph.op_consumers(tensor):
                pending.extend(t for t in self._graph.node(consumer).output_names if t in self._not_constant)

    def renewed(self, tensor: str) -> None:
        """A rewrite produces `tensor` anew under its name: if it is constant now (a Shape
        folded into a graph output's copy of it), what is computed from it may be too, though it
        was found not to be while `tensor` was not."""
        graph = self._graph
        found = [o for c in graph.op_consumers(tensor) for o in graph.node(c).output_names if o in self._not_constant]
        # Where nothing computed from it was found not constant there is nothing to take back, and
        # no search up its producers (every fusion of a large model renews its root's output).
        if found and self._dependencies(tensor) is not None:
            self.reconsider(found)

    def _leaf_value(self, tensor: str, max_bytes: int) -> np.ndarray | None:
        """An initializer's, a capture's or an already evaluated tensor's value.

        An initializer's is decoded from its TensorProto at each ask, not held: a copy of its
        bytes, microseconds for the small weights a large model has hundreds of thousands of
        (held, the 333k biases of the million-node stack took 126 MB), and no second copy of a
        large weight kept beside the model's own."""
        cached = self._cache.get(tensor)
        if cached is not None:
            return cached if cached.nbytes <= max_bytes else None
        graph = self._graph
        kind = graph.source_kind(tensor)
        if kind == "outer":
            return graph.outer.constant_value(tensor, max_bytes)
        return self.stored_value(graph.initializer(tensor) if kind == "initializer" else None, max_bytes)

    def stored_value(self, proto: TensorProto | None, max_bytes: int) -> np.ndarray | None:
        """An initializer's value, read-only; None for none, or a sparse one, which stays opaque."""
        if proto is None:
            return None
        value = self._graph.tensors.value(proto, max_bytes)
        if value is not None and value.flags.writeable:  # one over the tensor's bytes never is
            value.flags.writeable = False
        return value

    def _reads_not_constant(self, info) -> bool:
        """Whether the node reads a tensor already known not to be constant (a value cached
        since outranks that record)."""
        not_constant, cache = self._not_constant, self._cache
        return any(name in not_constant and name not in cache for name in info.input_names)

    def _dependencies(self, tensor: str) -> list[int] | None:
        """Op nodes to evaluate, inputs first, for `tensor`; None if it is not constant.

        Iterative depth-first search: the entries still marked "expanded" on the stack are
        the ancestors of the current tensor, so when a non-constant input turns up, all of
        them are recorded as non-constant too and later queries stop at once.
        """
        graph = self._graph
        producer = graph.producer(tensor)
        if producer is not None and tensor not in self._cache:
            # Most tensors are computed from an input already known not to be constant: settled
            # without the search, which is most of the time of a first look at a large graph.
            info = graph.node(producer)
            if not is_foldable(info) or self._reads_not_constant(info):
                self._not_constant.add(tensor)
                return None
        stack: list[tuple[str, bool]] = [(tensor, False)]
        order: list[int] = []
        done: set[int] = set()
        while stack:
            name, expanded = stack.pop()
            if expanded:
                node_id = graph.producer(name)
                if node_id not in done:
                    done.add(node_id)
                    order.append(node_id)
                continue
            if name in self._cache:
                continue
            kind = graph.source_kind(name) if name not in self._not_constant else None
            node_id = None
            if kind == "initializer":
                constant = graph.initializer(name) is not None  # sparse initializers stay opaque
            elif kind == "outer":
                constant = graph.outer is not None and graph.outer.constant_value(name) is not None
            elif kind == "op":
                node_id = graph.producer(name)
                info = graph.node(node_id)
                # An input known not to be constant settles it before any is searched: the
                # activation of a residual block's Add is, while its first input leads back
                # through the whole block to the same activation.
                constant = is_foldable(info) and not self._reads_not_constant(info)
            else:
                constant = False
            if not constant:
                self._not_constant.add(name)
                self._not_constant.update(n for n, e in stack if e)
                return None
            if node_id is not None and node_id not in done:
                stack.append((name, True))
                # The first input is looked at first: it is the activation where there is one
                # (Conv's x, MatMul's A), which settles the question before any weight is.
                stack.extend((i, False) for i in reversed(graph.node(node_id).input_names) if i)
        return order
