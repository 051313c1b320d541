"""An ONNX graph held in a networkx multigraph, convertible back to ONNX without loss.

Every ONNX node is a networkx node of kind "op". Graph inputs and tensors captured from an
enclosing scope are source nodes; every graph output is a sink node. An edge runs from the
node that produces a tensor to each consumer (but for weights: below); its key is the
consumer's input slot (a graph output's position, or for a tensor a subgraph reads from this
scope, the tensor's name: slot -1) and its value the tensor's name. A multigraph, because
Mul(x, x) consumes one tensor twice. The value is the bare name, not networkx's usual dict of
edge data: a million-node graph has millions of edges, and a dict each cost 0.36 GB
(bench/networkx_floor.py).

A scope's initializers (those no graph input overrides, sparse ones too) are not vertices
each: one vertex of kind "initializer", without edges, produces them all, and the reads of each
are kept by its name, keyed as an edge's are. Most weights have one reader and nothing else: as
vertices of their own, the 666k weights of the million-node MLP stack cost 0.35 GB more.

This module is the only one that knows networkx. Nodes nobody rewrote keep their
original NodeProto objects, so converting back is lossless for them; output order is
a topological order keyed by the original positions, so an untouched graph comes back
in its original order and the same input always gives the same bytes.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import heapq
import itertools
import sys
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import networkx as nx
import numpy as np
import onnx
from google.protobuf.message import Message
from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto

from fuser.constants import ConstantValues, is_foldable
from fuser.errors import FuserError, UsageError
from fuser.progress import Progress, Ticker
from fuser.tensors import TensorStore, nbytes, uses_external_data
from fuser.wire import GRAPH_INPUT_FIELD, VALUE_INFO_NAME_FIELD, VALUE_INFO_TYPE_FIELD, encode_varint, field_key

OP = "op"
GRAPH_INPUT = "input"
INITIALIZER = "initializer"
OUTER = "outer"
GRAPH_OUTPUT = "output"

SUBGRAPH_SLOT = -1

_DEFAULT_DOMAINS = ("", "ai.onnx")


@contextlib.contextmanager
def paused_gc():
    """Pause the cyclic garbage collector during bulk work on many small objects.

    Building or rewriting a graph of 100k+ nodes allocates millions of objects and none of
    them are garbage yet; the collector's repeated full scans would make the work
    quadratic. Reference counting still frees everything as usual.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Names:
    """Every node and tensor name used anywhere in a model, so new names never collide."""

    def __init__(self) -> None:
        self._used: set[str] = set()
        self._counters: dict[str, itertools.count] = {}

    def add(self, name: str) -> None:
        if name:
            self._used.add(name)

    def __contains__(self, name: str) -> bool:
        return name in self._used

    def fresh(self, base: str) -> str:
        base = base or "fuser"
        if base not in self._used:
            self._used.add(base)
            return base
        counter = self._counters.setdefault(base, itertools.count(1))
        while True:
            candidate = f"{base}__{next(counter)}"
            if candidate not in self._used:
                self._used.add(candidate)
                return candidate


# The bodies of a node that holds none: one empty dict for them all, as most nodes hold none
# (64 bytes each of a million nodes). Never written to.
_NO_BODIES: dict = {}
_NO_READS: dict = {}  # of a weight nothing reads; never written to


# Attributes a node fingerprint takes the size of rather than the bytes: a large Constant's value, a body.
_BULKY_ATTRIBUTES = frozenset(
    {
        AttributeProto.TENSOR,
        AttributeProto.SPARSE_TENSOR,
        AttributeProto.GRAPH,
        AttributeProto.TENSORS,
        AttributeProto.SPARSE_TENSORS,
        AttributeProto.GRAPHS,
    }
)


def node_fingerprint(proto: NodeProto) -> tuple:
    """What an edit of `proto` in place changes: its fields and its attributes, those holding a
    tensor or a graph by their size (not copied: a Constant may hold megabytes)."""
    return (
        proto.op_type,
        proto.domain,
        proto.name,
        tuple(proto.input),
        tuple(proto.output),
        tuple(
            (a.name, a.type, a.ByteSize()) if a.type in _BULKY_ATTRIBUTES else a.SerializeToString()
            for a in proto.attribute
        ),
    )


class NodeInfo:
    """What a rule or the engine may read about one op node.

    The op type, domain and tensor names are read from the NodeProto once, when the node joins
    the graph: protobuf makes a new Python string at every read of a field (about a microsecond
    each, and a hash to compute again), and the matcher and the engine read them millions of
    times on a large graph. Only Graph changes a node's inputs, and it keeps them current."""

    # No dict per instance: a graph holds one per node.
    __slots__ = ("id", "proto", "subgraphs", "op_type", "domain", "input_names", "output_names")

    def __init__(self, id: int, proto: NodeProto, subgraphs: dict[str, list[Graph]] | None = None) -> None:
        self.id = id
        self.proto = proto
        self.subgraphs = {} if subgraphs is None else subgraphs
        intern = sys.intern
        self.op_type = intern(proto.op_type)
        self.domain = intern(proto.domain)
        # Sliced: protobuf hands a slice over as a list at once, twice as fast as iterating the field.
        self.input_names = tuple(map(intern, proto.input[:]))  # "" for an absent optional input
        self.output_names = tuple(map(intern, proto.output[:]))

    def __repr__(self) -> str:
        return f"NodeInfo(id={self.id}, op_type={self.op_type!r}, name={self.proto.name!r})"

    @property
    def name(self) -> str:
        return self.proto.name

    @property
    def label(self) -> str:
        """The node's name, or for an unnamed node its op and first output (unique in a graph)."""
        name = self.proto.name
        if name:
            return name
        first = next((o for o in self.output_names if o), "")
        return f"{self.op_type}->{first}"

    @property
    def inputs(self) -> list[str]:
        return list(self.input_names)

    @property
    def outputs(self) -> list[str]:
        return list(self.output_names)

    def attr(self, name: str, default=None):
        for attribute in self.proto.attribute[:]:
            if attribute.name == name:
                return onnx.helper.get_attribute_value(attribute)
        return default

    def attrs(self) -> dict:
        return {
            a.name: onnx.helper.get_attribute_value(a)
            for a in self.proto.attribute
            if a.type not in (AttributeProto.GRAPH, AttributeProto.GRAPHS)
        }


class Graph:
    """One ONNX graph scope (the main graph, or an If/Loop/Scan body)."""

    def __init__(
        self,
        proto: GraphProto,
        *,
        names: Names,
        tensors: TensorStore,
        opsets: dict[str, int],
        outer: Graph | None = None,
        constant_initializer_inputs: bool = False,
        progress: Progress | None = None,
    ) -> None:
        # Fewer than 30 attributes: past that, CPython gives an instance a key table of its own
        # and every attribute read slows (tests/test_graph.py, ..._share_their_keys_...).
        # Before IR 4 every initializer had to be listed as a graph input too, and such
        # inputs hold the model's weights: they are constants, not values to feed.
        self.constant_initializer_inputs = constant_initializer_inputs
        self._shell = _graph_shell(proto)
        self.names = names
        self.tensors = tensors
        self.opsets = opsets
        # Held weakly: the enclosing graph holds this one through its node, and without the
        # cycle a dropped model is freed at once rather than left to the cyclic collector.
        self._outer = None if outer is None else weakref.ref(outer)
        self.owner: int | None = None  # the node holding this graph, in `outer`
        self.nx = nx.MultiDiGraph()
        # networkx's own node and successor dicts, read directly: its view objects cost more
        # than the lookups they wrap, and the engine makes millions of them on a large graph.
        self._attrs = self.nx._node
        self._succ = self.nx._succ
        self._pred = self.nx._pred
        # Counts this scope's changes: an answer computed from the graph holds while it stays.
        self.revision = 0
        self._ids = itertools.count()
        self._producer: dict[str, tuple[int, int]] = {}
        # The vertex producing the initializers (see the module's docstring), and each one's reads:
        # {consumer: {key: name}}.
        self._weights = next(self._ids)
        self._weight_entry = (self._weights, 0)  # every weight's entry in _producer: one tuple for all, told by `is`
        self._add_vertex(self._weights, kind=INITIALIZER)
        self._weight_reads: dict[str, dict[int, dict]] = {}
        self._by_op: dict[tuple[str, str], dict[int, None]] = {}
        # The nodes holding If/Loop/Scan bodies, so that finding the bodies need not look at every node.
        self._holders: dict[int, None] = {}
        # The vertices of tensors read from enclosing scopes, so that listing them need not look at every node.
        self._captures: dict[int, None] = {}
        # Counts the times an op type appeared in this scope or left it (has_op's answers changed).
        self.op_types_version = 0
        self._initializers: dict[str, TensorProto] = {}
        self._value_info = list(proto.value_info)
        self._inputs = {value.name: value for value in proto.input}
        self._outputs = list(proto.output)
        self._constants = ConstantValues(self)
        self.shared: dict[str, str] = {}  # Builder.once: key -> the tensor rewrites share
        # Tensors a removed node read, since the engine last took them (take_lost_readers).
        self._lost_readers: set[str] = set()
        # The nodes rewrites add, and loaded ones they change, as copies held in one message:
        # a NodeProto of its own costs about 1.6 KB, one among many in a message 0.3 KB (a
        # million-node stack's 333k new Gemms took 0.54 GB of their own). Never removed from,
        # so a node taken from it stays valid.
        self._node_store = GraphProto()
        with paused_gc():
            self._build(proto, Ticker(progress, "load", total=len(proto.node)))

    # ----------------------------------------------------------------- building

    def _build(self, proto: GraphProto, ticker: Ticker) -> None:
        for value in itertools.chain(proto.input, proto.output, proto.value_info):
            self.names.add(value.name)
        constant_inputs = {t.name for t in proto.initializer} if self.constant_initializer_inputs else set()
        for position, value in enumerate(proto.input):
            if value.name not in constant_inputs:
                self._add_source(GRAPH_INPUT, value.name, (-2, position))
        producer, weight_entry = self._producer, self._weight_entry
        for tensor in proto.initializer:
            name = sys.intern(tensor.name)  # read once: protobuf makes a new string at each read
            self.names.add(name)
            self._initializers[name] = tensor
            # Since IR 4 an initializer that is also a graph input is only a default
            # the caller may override, so the input is what produces the tensor.
            if name not in producer:
                producer[name] = weight_entry
        for tensor in proto.sparse_initializer:
            self.names.add(tensor.values.name)
            if tensor.values.name not in self._producer:
                self._add_weight(tensor.values.name)

        # A node is connected as soon as everything it reads has a producer: in one pass for the
        # topologically sorted graphs exporters write, and after the others for any that are not.
        deferred = []
        for position, node in enumerate(proto.node):
            node_id = self._register_node(node, (position,))
            if self._reads_known(node_id):
                self._connect_inputs(node_id)
            else:
                deferred.append(node_id)
            ticker.tick()
        for node_id in deferred:
            self._connect_inputs(node_id)
        ticker.finish()
        for position, value in enumerate(proto.output):
            sink = next(self._ids)
            self._add_vertex(sink, kind=GRAPH_OUTPUT, tensor=value.name, key=(float("inf"), position))
            self._connect(value.name, sink, position)

    def _add_weight(self, tensor: str) -> None:
        self._producer[sys.intern(tensor)] = self._weight_entry

    def _add_source(self, kind: str, tensor: str, key: tuple) -> None:
        tensor = sys.intern(tensor)
        node_id = next(self._ids)
        self._add_vertex(node_id, kind=kind, tensor=tensor, key=key)
        self._producer[tensor] = (node_id, 0)
        if kind == OUTER:
            self._captures[node_id] = None

    def _register_node(self, proto: NodeProto, key: tuple, provenance: str | None = None) -> int:
        node_id = next(self._ids)
        info = NodeInfo(node_id, proto, _NO_BODIES)
        if op_may_hold_graphs(info.op_type, info.domain):
            subgraphs: dict[str, list[Graph]] = {}
            for attribute in proto.attribute[:]:
                if attribute.type == AttributeProto.GRAPH:
                    subgraphs[attribute.name] = [self._subgraph(attribute.g, node_id)]
                elif attribute.type == AttributeProto.GRAPHS:
                    subgraphs[attribute.name] = [self._subgraph(g, node_id) for g in attribute.graphs]
            if subgraphs:
                info.subgraphs = subgraphs
                self._holders[node_id] = None
        self._add_vertex(node_id, kind=OP, info=info, key=key, provenance=provenance)
        self.names.add(proto.name)
        for index, output in enumerate(info.output_names):
            if output:
                self.names.add(output)
                if self._producer.get(output) is self._weight_entry:
                    # A node computing a weight's name (an invalid model loaded as it is): the
                    # reads listed before it are lost with the weight, as they must not return
                    # should the name become a weight again.
                    self._weight_reads.pop(output, None)
                self._producer[output] = (node_id, index)
        of_type = self._by_op.setdefault((info.domain, info.op_type), {})
        if not of_type:
            self.op_types_version += 1
        of_type[node_id] = None
        return node_id

    def _subgraph(self, proto: GraphProto, owner: int) -> Graph:
        sub = Graph(
            proto,
            names=self.names,
            tensors=self.tensors,
            opsets=self.opsets,
            outer=self,
            constant_initializer_inputs=self.constant_initializer_inputs,
        )
        sub.owner = owner
        return sub

    def _reads_known(self, node_id: int) -> bool:
        info: NodeInfo = self._attrs[node_id]["info"]
        producer = self._producer
        for tensor in info.input_names:  # a loop, not all(): asked for every node of a large graph
            if tensor and tensor not in producer:
                return False
        if not info.subgraphs:
            return True
        return all(name in producer for graphs in info.subgraphs.values() for g in graphs for name in g.captured())

    def _connect_inputs(self, node_id: int) -> None:
        info: NodeInfo = self._attrs[node_id]["info"]
        for slot, tensor in enumerate(info.input_names):
            if tensor:
                self._connect(tensor, node_id, slot)
        if not info.subgraphs:
            return
        captured = {name for graphs in info.subgraphs.values() for g in graphs for name in g.captured()}
        for tensor in sorted(captured):
            self._connect(tensor, node_id, SUBGRAPH_SLOT)

    def _connect(self, tensor: str, consumer: int, slot: int) -> None:
        # One string object per tensor name, however many edges carry it: protobuf hands out a
        # new one on every read, and a large graph has millions of edges.
        tensor = sys.intern(tensor)
        if tensor not in self._producer:
            # Not defined in this scope: read from an enclosing graph.
            self._add_source(OUTER, tensor, (-3, 0))
        producer, _ = self._producer[tensor]
        key = tensor if slot == SUBGRAPH_SLOT else slot
        if producer == self._weights:
            reads = self._weight_reads.get(tensor)
            if reads is None:
                reads = self._weight_reads[tensor] = {}
            keys = reads.get(consumer)
            if keys is None:
                keys = reads[consumer] = {}
            keys[key] = tensor
            return
        # networkx's MultiDiGraph.add_edge, written into its dicts: the same structure (one key
        # dict shared by both directions) without its per-call checks, which cost more than the
        # insert on a graph of a million edges. The key is the slot (see the module's docstring).
        keys = self._succ[producer].get(consumer)
        if keys is None:
            keys = self._succ[producer][consumer] = self._pred[consumer][producer] = {}
        keys[key] = tensor

    def _disconnect(self, tensor: str, consumer: int, key: int | str) -> None:
        """networkx's remove_edge, written into its dicts as _connect writes its edges; for a
        weight, the read kept by its name."""
        producer = self._producer[tensor][0]
        if producer == self._weights:
            reads = self._weight_reads[tensor]
            del reads[consumer][key]
            if not reads[consumer]:
                del reads[consumer]
            return
        keys = self._succ[producer][consumer]  # the same dict as self._pred[consumer][producer]
        del keys[key]
        if not keys:
            del self._succ[producer][consumer]
            del self._pred[consumer][producer]

    def _reads(self, tensor: str, producer: int) -> dict[int, dict]:
        """{consumer: {key: tensor read}} of `producer`'s outputs; of `tensor` alone for a weight."""
        return self._weight_reads.get(tensor, _NO_READS) if producer == self._weights else self._succ[producer]

    def _add_vertex(self, node_id: int, **attrs) -> None:
        """networkx's add_node for an id not yet in the graph, written into its dicts."""
        self._succ[node_id] = {}
        self._pred[node_id] = {}
        self._attrs[node_id] = attrs

    def _remove_vertex(self, node_id: int) -> None:
        """networkx's remove_node, written into its dicts as _connect writes its edges."""
        succ, pred = self._succ, self._pred
        for consumer in succ.pop(node_id):
            del pred[consumer][node_id]
        for producer in pred.pop(node_id):
            del succ[producer][node_id]
        del self._attrs[node_id]
        self._captures.pop(node_id, None)

    @property
    def outer(self) -> Graph | None:
        """The graph enclosing this one (an If/Loop/Scan body's), or None for the main graph."""
        if self._outer is None:
            return None
        outer = self._outer()
        if outer is None:  # what the body reads from it cannot be answered any more
            raise UsageError("the graph enclosing this body is gone: keep its model while the body is used")
        return outer

    def __getstate__(self) -> dict:
        # Copied or pickled, a body keeps its enclosing graph: the copy holds it weakly again.
        state = self.__dict__.copy()
        state["_outer"] = self.outer
        return state

    def __setstate__(self, state: dict) -> None:
        outer = state.pop("_outer")
        self.__dict__.update(state)
        self._outer = None if outer is None else weakref.ref(outer)

    # ------------------------------------------------------------------ queries

    def captured(self) -> list[str]:
        """Names this graph (or a graph nested in it) reads from enclosing scopes."""
        return [self._attrs[node_id]["tensor"] for node_id in self._captures if self._succ[node_id]]

    def node(self, node_id: int) -> NodeInfo:
        return self._attrs[node_id]["info"]

    def has_node(self, node_id: int) -> bool:
        data = self._attrs.get(node_id)
        return data is not None and data["kind"] == OP

    def op_type_of(self, node_id: int) -> str | None:
        """The op type of op node `node_id`; None if there is none (removed, or a source or sink)."""
        data = self._attrs.get(node_id)
        return data["info"].op_type if data is not None and data["kind"] == OP else None

    def nodes(self) -> Iterator[NodeInfo]:
        for data in self._attrs.values():
            if data["kind"] == OP:
                yield data["info"]

    def node_count(self) -> int:
        return sum(len(ids) for ids in self._by_op.values())

    def nodes_with_subgraphs(self) -> list[NodeInfo]:
        """The op nodes holding If/Loop/Scan bodies, in the order they were added."""
        return [self._attrs[node_id]["info"] for node_id in self._holders]

    def nodes_of_type(self, op_type: str, domain: str = "") -> list[int]:
        domains = _DEFAULT_DOMAINS if domain in _DEFAULT_DOMAINS else (domain,)
        found: list[int] = []
        for d in domains:
            found.extend(self._by_op.get((d, op_type), ()))
        return found

    def has_op(self, op_types: Iterable[str], domain: str = "") -> bool:
        """True when some node of this scope is of one of `op_types` in `domain`."""
        domains = _DEFAULT_DOMAINS if domain in _DEFAULT_DOMAINS else (domain,)
        return any(self._by_op.get((d, t)) for d in domains for t in op_types)

    def op_type_counts(self) -> dict[tuple[str, str], int]:
        """How many nodes of each (domain, op type) this scope has, not counting its bodies'."""
        return {key: len(ids) for key, ids in self._by_op.items() if ids}

    def domains(self) -> set[str]:
        """The domains of this scope's nodes (not of its bodies')."""
        return {domain for (domain, _), ids in self._by_op.items() if ids}

    def sort_key(self, node_id: int) -> tuple:
        return self._attrs[node_id]["key"]

    def provenance(self, node_id: int) -> str | None:
        return self._attrs[node_id].get("provenance")

    def producer(self, tensor: str) -> int | None:
        """The op node producing `tensor` in this scope, or None for inputs, constants, captures."""
        entry = self._producer.get(tensor)
        if entry is None or self._attrs[entry[0]]["kind"] != OP:
            return None
        return entry[0]

    def defines(self, tensor: str) -> bool:
        return tensor in self._producer and self._attrs[self._producer[tensor][0]]["kind"] != OUTER

    def consumers(self, tensor: str) -> list[tuple[int, int]]:
        """(node id, input slot) for each use of `tensor`; graph outputs are sink nodes, slot = position."""
        entry = self._producer.get(tensor)
        if entry is None:
            return []
        return [
            (consumer, key if key.__class__ is int else SUBGRAPH_SLOT)
            for consumer, edges in self._reads(tensor, entry[0]).items()
            for key, read in edges.items()
            if read == tensor
        ]

    def readers_at_most(self, tensor: str) -> int:
        """How many readers (op nodes, and graph outputs) any output of `tensor`'s producer has (a
        weight's own, for a weight): a bound on the readers of `tensor`, found without listing them."""
        entry = self._producer.get(tensor)
        return 0 if entry is None else len(self._reads(tensor, entry[0]))

    def op_consumers(self, tensor: str) -> list[int]:
        """The op nodes reading `tensor`, once per input slot (and body) that reads it."""
        entry = self._producer.get(tensor)
        if entry is None:
            return []
        attrs = self._attrs
        return [
            consumer
            for consumer, edges in self._reads(tensor, entry[0]).items()
            if attrs[consumer]["kind"] == OP
            for read in edges.values()
            if read == tensor
        ]

    def op_successors(self, node_id: int) -> set[int]:
        """The op nodes reading any output of `node_id`, through a subgraph too."""
        return {c for c in self._succ[node_id] if self._attrs[c]["kind"] == OP}

    def unread_nodes(self) -> list[int]:
        """The op nodes nothing reads any output of: no node, no body (by the edges this scope
        has for what its bodies read) and no graph output."""
        attrs = self._attrs
        return [node_id for node_id, readers in self._succ.items() if not readers and attrs[node_id]["kind"] == OP]

    def op_predecessors(self, node_id: int) -> set[int]:
        """The op nodes whose outputs `node_id` reads, through its subgraphs too."""
        return {p for p in self._pred[node_id] if self._attrs[p]["kind"] == OP}

    def feedable_inputs(self) -> list[onnx.ValueInfoProto]:
        """The graph inputs a caller feeds: those without an initializer of the same name (before
        IR 4 those are the weights; since, a default the caller need not feed)."""
        return [value for name, value in self._inputs.items() if name not in self._initializers]

    def output_values(self) -> list[onnx.ValueInfoProto]:
        """This graph's outputs, in order."""
        return list(self._outputs)

    def output_names(self) -> set[str]:
        """The names of this graph's outputs."""
        return {value.name for value in self._outputs}

    def is_graph_output(self, tensor: str) -> bool:
        return any(self._attrs[c]["kind"] == GRAPH_OUTPUT for c, _ in self.consumers(tensor))

    def is_graph_input(self, tensor: str) -> bool:
        entry = self._producer.get(tensor)
        return entry is not None and self._attrs[entry[0]]["kind"] == GRAPH_INPUT

    def initializer(self, tensor: str) -> TensorProto | None:
        entry = self._producer.get(tensor)
        if entry is self._weight_entry:  # asked of every input of many nodes: weights told at once
            return self._initializers.get(tensor)
        if entry is not None and self._attrs[entry[0]]["kind"] == OUTER and self.outer:
            return self.outer.initializer(tensor)
        return None

    def initializers(self) -> list[TensorProto]:
        """This scope's dense initializers, in file order."""
        return list(self._initializers.values())

    def unread_initializers(self) -> list[str]:
        """This scope's dense initializers that nothing reads, not even a graph output, in file
        order; one that a graph input overrides is that input, and not listed."""
        # One comprehension each, not a shared generator: both are asked of every weight of a
        # large model after every phase that rewrote.
        producer, weight, reads = self._producer, self._weight_entry, self._weight_reads
        return [name for name in self._initializers if producer.get(name) is weight and not reads.get(name)]

    def read_initializers(self) -> list[TensorProto]:
        """This scope's dense initializers that something reads, in file order; one that a graph
        input overrides is that input, and not listed."""
        producer, weight, reads = self._producer, self._weight_entry, self._weight_reads
        return [
            tensor for name, tensor in self._initializers.items() if producer.get(name) is weight and reads.get(name)
        ]

    def is_weight(self, tensor: str) -> bool:
        """Whether `tensor` is an initializer of this scope that no graph input overrides."""
        return self._producer.get(tensor) is self._weight_entry

    def is_constant(self, tensor: str) -> bool:
        """True when the tensor's value is fixed by the model (initializer or Constant node)."""
        entry = self._producer.get(tensor)
        if entry is not None and self._attrs[entry[0]]["kind"] == INITIALIZER:
            # Known without decoding it: a large model's weights are read only when a rule asks.
            return tensor in self._initializers
        return self.constant_value(tensor) is not None

    def constant_value(self, tensor: str, max_bytes: int = 256 << 20) -> np.ndarray | None:
        """The tensor's numpy value if it is constant, evaluating constant subgraphs on demand
        (see fuser/constants.py). Values above `max_bytes` are not materialized; None means
        "not a known constant"."""
        if self._producer.get(tensor) is self._weight_entry:  # most queries: nothing to evaluate
            return self._constants.stored_value(self._initializers.get(tensor), max_bytes)
        return self._constants.value(tensor, max_bytes)

    def source_kind(self, tensor: str) -> str | None:
        """What produces `tensor` in this scope: "op", "input", "initializer", "outer" (a capture), or None."""
        entry = self._producer.get(tensor)
        return None if entry is None else self._attrs[entry[0]]["kind"]

    def opset(self, domain: str = "") -> int | None:
        return self.opsets.get("" if domain in _DEFAULT_DOMAINS else domain)

    # ---------------------------------------------------------------- rewriting

    def add_node(self, proto: NodeProto, key: tuple, provenance: str | None = None) -> int:
        """Add a node whose output names are fresh; connect its inputs."""
        for output in proto.output[:]:
            if output and output in self._producer:
                raise FuserError(f"tensor '{output}' would be produced twice")
        node_id = self._register_node(self._stored(proto), key, provenance)
        self._attrs[node_id]["owned"] = True
        self._connect_inputs(node_id)
        self._changed()
        return node_id

    def _stored(self, proto: NodeProto) -> NodeProto:
        """A copy of `proto` held in the graph's node store."""
        kept = self._node_store.node.add()
        kept.CopyFrom(proto)
        return kept

    def remove_node(self, node_id: int) -> None:
        info = self.node(node_id)
        read = [i for i in info.input_names if i]
        if info.subgraphs:
            read.extend(name for graphs in info.subgraphs.values() for g in graphs for name in g.captured())
        self._lost_readers.update(read)
        weights = self._weight_reads
        for name in read:
            # A body may read a weight its scope never read; what a node removed with it made is gone.
            if name in weights and self._producer.get(name) is self._weight_entry:
                weights[name].pop(node_id, None)
        for output in info.output_names:
            if output and self._producer.get(output, (None,))[0] == node_id:
                del self._producer[output]
                self._constants.forget(output)
        of_type = self._by_op[(info.domain, info.op_type)]
        del of_type[node_id]
        if not of_type:
            self.op_types_version += 1
        self._holders.pop(node_id, None)
        self._remove_vertex(node_id)
        self._changed()

    def _changed(self) -> None:
        self.revision += 1

    def take_lost_readers(self) -> set[str]:
        """The tensors that lost a reader to a removed node since the last call: a rule wanting
        a tensor's sole reader may match now that fewer read it."""
        lost, self._lost_readers = self._lost_readers, set()
        return lost

    def redirect(self, old: str, new: str) -> None:
        """Make every consumer of tensor `old` (not graph outputs) read `new` instead."""
        for consumer, slot in self.consumers(old):
            if self._attrs[consumer]["kind"] != OP:
                continue
            info = self.node(consumer)
            if slot == SUBGRAPH_SLOT:
                raise FuserError(f"tensor '{old}' is read inside a subgraph and cannot be renamed")
            if not self._attrs[consumer].get("owned"):
                # The loaded NodeProto belongs to the caller's model, which must stay as it was.
                info.proto = self._stored(info.proto)
                self._attrs[consumer]["owned"] = True
            info.proto.input[slot] = new
            info.input_names = tuple(map(sys.intern, info.proto.input))
            self._disconnect(old, consumer, slot)
            self._connect(new, consumer, slot)
            self._constants.reconsider(info.output_names)
        self._changed()

    def replace_nodes(
        self,
        removed: list[int],
        nodes: list[NodeProto],
        initializers: list[TensorProto],
        key: tuple,
        provenance: str,
    ) -> list[int]:
        """Swap `removed` for `nodes`; consumers of removed outputs that the new nodes
        produce again (same names) are reconnected to them."""
        removed_set = set(removed)
        dangling = []
        inputs = []
        for node_id in removed:
            info = self.node(node_id)
            inputs.extend(i for i in info.input_names if i)
            if info.subgraphs:
                inputs.extend(name for graphs in info.subgraphs.values() for g in graphs for name in g.captured())
            for output in info.output_names:
                if output:
                    dangling.extend((output, c, s) for c, s in self.consumers(output) if c not in removed_set)
        for node_id in removed:
            self.remove_node(node_id)
        for tensor in initializers:
            self.add_initializer(tensor)
        created = [self.add_node(proto, key + (j,), provenance) for j, proto in enumerate(nodes)]
        for tensor, consumer, slot in dangling:
            if tensor not in self._producer:
                raise FuserError(f"tensor '{tensor}' is still used but no longer produced")
            self._connect(tensor, consumer, slot)
        for tensor in dict.fromkeys(tensor for tensor, _, _ in dangling):
            self._constants.renewed(tensor)
        for tensor in inputs:
            self.remove_if_unused(tensor)
        return created

    def add_initializer(self, tensor: TensorProto) -> None:
        if tensor.name in self._producer:
            raise FuserError(f"initializer '{tensor.name}' already exists")
        self.names.add(tensor.name)
        self._initializers[tensor.name] = tensor
        self._add_weight(tensor.name)
        if self.constant_initializer_inputs:
            # IR < 4 requires every initializer to be listed as a graph input as well.
            self._inputs[tensor.name] = onnx.helper.make_tensor_value_info(
                tensor.name, tensor.data_type, list(tensor.dims)
            )
        self._changed()

    def remove_if_unused(self, tensor: str) -> None:
        """Drop an initializer or a Constant-like producer that a rewrite left without consumers."""
        entry = self._producer.get(tensor)
        if entry is None:
            return
        node_id = entry[0]
        kind = self._attrs[node_id]["kind"]
        # A source's reads, and a weight's own, are known at once (a weight shared by thousands
        # of nodes is asked once per removed reader).
        if self._reads(tensor, node_id) if kind != OP else self.consumers(tensor):
            return
        if kind == OUTER:
            del self._producer[tensor]
            self._remove_vertex(node_id)
            self._changed()
            if self.outer is not None and self.owner is not None:
                self.outer.release_capture(self.owner, tensor)
        elif kind == INITIALIZER:
            self._initializers.pop(tensor, None)
            self._inputs.pop(tensor, None)
            del self._producer[tensor]
            self._weight_reads.pop(tensor, None)
            self._constants.forget(tensor)
            self._changed()
        elif kind == OP:
            info = self.node(node_id)
            if any(self.consumers(o) for o in info.output_names if o):
                return
            if not is_foldable(info):
                return
            inputs = [i for i in info.input_names if i]
            self.remove_node(node_id)
            for name in inputs:
                self.remove_if_unused(name)

    def release_capture(self, node_id: int, tensor: str) -> None:
        """A subgraph of `node_id` stopped reading `tensor`: drop the edge if no subgraph reads it."""
        info = self.node(node_id)
        if any(tensor in g.captured() for graphs in info.subgraphs.values() for g in graphs):
            return
        entry = self._producer.get(tensor)
        if entry is None:
            return
        if tensor in self._reads(tensor, entry[0]).get(node_id, ()):
            self._disconnect(tensor, node_id, tensor)
        self._changed()
        self.remove_if_unused(tensor)

    # --------------------------------------------------------------- conversion

    def topological_order(self) -> list[int]:
        """Op nodes in a deterministic topological order: ties broken by original position.

        That is the nodes sorted by position wherever that order is topological, as it is after
        most rewrites (a replacement takes the position of the node it replaces): checked in one
        pass, a third quicker than ordering with a heap (0.15 s for 100k nodes)."""
        attrs, pred = self._attrs, self._pred
        ordered = sorted((data["key"], node_id) for node_id, data in attrs.items() if data["kind"] == OP)
        placed: set[int] = set()
        for _, node_id in ordered:
            for producer in pred[node_id]:
                if producer not in placed and attrs[producer]["kind"] == OP:
                    return self._ordered_by_heap()
            placed.add(node_id)
        return [node_id for _, node_id in ordered]

    def _ordered_by_heap(self) -> list[int]:
        """topological_order where the nodes' positions are not a topological order: each step
        takes the node of the smallest position among those whose producers are placed."""
        attrs, succ, pred = self._attrs, self._succ, self._pred
        indegree: dict[int, int] = {}
        heap: list[tuple[tuple, int]] = []
        for node_id, data in attrs.items():
            if data["kind"] != OP:
                continue
            degree = sum(len(edges) for p, edges in pred[node_id].items() if attrs[p]["kind"] == OP)
            indegree[node_id] = degree
            if degree == 0:
                heap.append((data["key"], node_id))
        heapq.heapify(heap)
        order: list[int] = []
        while heap:
            _, node_id = heapq.heappop(heap)
            order.append(node_id)
            for consumer, edges in succ[node_id].items():
                if consumer in indegree:
                    indegree[consumer] -= len(edges)
                    if indegree[consumer] == 0:
                        heapq.heappush(heap, (attrs[consumer]["key"], consumer))
        if len(order) != len(indegree):
            raise FuserError("the graph has a cycle")
        return order

    def is_modified(self) -> bool:
        return self.revision > 0 or any(
            g.is_modified() for info in self.nodes_with_subgraphs() for gs in info.subgraphs.values() for g in gs
        )

    def to_proto(self, weights: bool = True) -> GraphProto:
        """The graph as ONNX. weights=False gives its skeleton for shape inference and checks:
        initializers whose values inference never reads (see shape_relevant) become typed graph
        inputs instead of copies of their data."""
        graph = GraphProto()
        self.fill_proto(graph, weights)
        return graph

    def fill_proto(self, graph: GraphProto, weights: bool = True, apart: bool = False) -> list[NodeProto] | None:
        """Write the graph into the empty `graph` (building in place saves a copy of the weights).
        apart: leave this graph's initializers and nodes out, for a ModelParts to hold; the nodes
        (the graph's own NodeProtos, not copies) are returned, in order."""
        with paused_gc():
            graph.MergeFrom(self._shell)
            graph.input.extend(self._inputs.values())
            nodes = [self._node_proto(self.node(i), weights) for i in self.topological_order()]
            if not apart:
                graph.node.extend(nodes)
            # A skeleton's main graph lists its weights as typed inputs; an If/Loop/Scan body's
            # inputs are fixed by its node, so a body keeps its weights, as it must.
            if not weights and self.outer is None:
                add_weightless(graph, self._initializers.values(), self._inputs)
            elif not apart:
                graph.initializer.extend(self._initializers.values())
            graph.value_info.extend(self.live_value_info())
        return nodes if apart else None

    def live_value_info(self) -> list[onnx.ValueInfoProto]:
        """The scope's annotations of tensors it holds: one of a tensor a rewrite removed, or of
        another scope's (a body's tensor annotated in the main graph), is left out."""
        live = self._producer
        return [value for value in self._value_info if value.name in live]

    def _node_proto(self, info: NodeInfo, weights: bool = True) -> NodeProto:
        if not any(g.is_modified() for gs in info.subgraphs.values() for g in gs):
            return info.proto
        node = NodeProto()
        node.CopyFrom(info.proto)
        for attribute in node.attribute[:]:
            if attribute.name not in info.subgraphs:
                continue
            graphs = info.subgraphs[attribute.name]
            if attribute.type == AttributeProto.GRAPH:
                attribute.g.CopyFrom(graphs[0].to_proto(weights))
            else:
                del attribute.graphs[:]
                attribute.graphs.extend(g.to_proto(weights) for g in graphs)
        return node

    def all_graphs(self) -> Iterable[Graph]:
        """This graph and every graph nested in it, outermost first."""
        yield self
        for info in self.nodes_with_subgraphs():
            for graphs in info.subgraphs.values():
                for g in graphs:
                    yield from g.all_graphs()


@dataclass
class ModelParts:
    """A model as ONNX with its main graph's initializers held apart: the loaded model's own
    tensors, where a ModelProto holding them would hold a copy of every weight. Writing it
    (fuser.model.write_model) streams them and checking it feeds them (fuser.verify). Its main
    graph's nodes are held apart too, as the graph's own NodeProtos, until `proto` is asked
    for: writing streams them, where putting them in the ModelProto copies each (2.7 s and the
    nodes' memory again for a million nodes)."""

    shell: ModelProto  # the model without its main graph's initializers, and without the nodes `nodes` holds
    initializers: list[TensorProto]
    # Where the initializers' data is read from (Model.tensors): weights read in place from the
    # model's file are external data to onnxruntime, inline weights to write_model.
    tensors: TensorStore | None = None
    nodes: list[NodeProto] | None = None  # the main graph's nodes, in order, while not in `shell`

    @property
    def proto(self) -> ModelProto:
        """The model without its main graph's initializers (the nodes held apart put in it)."""
        if self.nodes is not None:
            self.shell.graph.node.extend(self.nodes)
            self.nodes = None
        return self.shell

    def graph_protos(self) -> Iterator[GraphProto]:
        """The main graph (without the nodes held apart) and every body nested in its nodes."""
        yield self.shell.graph
        yield from nested_graph_protos(self.shell.graph.node if self.nodes is None else self.nodes)

    def joined(self) -> ModelProto:
        """The whole model as one ModelProto (a copy of the weights; those read in place from the
        model's file stay references to it)."""
        model = ModelProto()
        model.CopyFrom(self.shell)
        if self.nodes is not None:
            model.graph.node.extend(self.nodes)
        model.graph.initializer.extend(self.initializers)
        return model


def as_proto(model: ModelProto | ModelParts) -> ModelProto:
    return model.joined() if isinstance(model, ModelParts) else model


def split_parts(model: ModelProto | ModelParts) -> tuple[ModelProto, list[TensorProto] | Iterable[TensorProto]]:
    """The model without its main graph's initializers (for a ModelProto, the model itself, whose
    own initializers the caller skips), and those initializers."""
    if isinstance(model, ModelParts):
        return model.proto, model.initializers
    return model, model.graph.initializer


@functools.cache
def graphless_op_types() -> frozenset[str]:
    """The default domain's op types that no version gives a graph attribute: a node of one of
    these holds no If/Loop/Scan-like body (onnx.checker refuses a model that gives it one, and
    so does loading), and the walks over every node skip listing its attributes, which costs
    more than this test; an op of another domain, or one onnx does not know, may hold one."""
    holding = (AttributeProto.GRAPH, AttributeProto.GRAPHS)
    schemas = [s for s in onnx.defs.get_all_schemas_with_history() if s.domain in _DEFAULT_DOMAINS]
    holders = {s.name for s in schemas if any(a.type in holding for a in s.attributes.values())}
    return frozenset(s.name for s in schemas) - holders


def may_hold_graphs(node: NodeProto) -> bool:
    """Whether `node` may have If/Loop/Scan-like bodies: it is not of graphless_op_types()."""
    return op_may_hold_graphs(node.op_type, node.domain)


def op_may_hold_graphs(op_type: str, domain: str) -> bool:
    """may_hold_graphs for a node whose op type and domain are read already."""
    return op_type not in graphless_op_types() or domain not in _DEFAULT_DOMAINS


def opset_versions(model: ModelProto) -> dict[str, int]:
    """The model's opset imports as {domain: version}, the default domain as "" (not "ai.onnx")."""
    return {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}


def topological_positions(graph: GraphProto) -> list[int] | None:
    """The positions of `graph`'s nodes in an order where each comes after the nodes making its
    inputs (ties kept in their order); None when no such order exists. Tensors no node of this
    graph makes (inputs, initializers, an enclosing graph's) are there from the start."""
    made_by = {output: index for index, node in enumerate(graph.node) for output in node.output if output}
    waiting = [0] * len(graph.node)
    readers: dict[int, list[int]] = {}
    for index, node in enumerate(graph.node):
        producers = {made_by[name] for name in _read_names(node) if name in made_by}
        producers.discard(index)
        waiting[index] = len(producers)
        for producer in producers:
            readers.setdefault(producer, []).append(index)
    ready = [index for index, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for reader in readers.get(index, []):
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, reader)
    return order if len(order) == len(graph.node) else None


def _read_names(node: NodeProto) -> list[str]:
    """The tensors `node` reads: its inputs and what its bodies read from outside them."""
    names = [name for name in node.input if name]
    for body in node_bodies(node):
        inner = {v.name for v in body.input} | {t.name for t in body.initializer}
        inner |= {o for n in body.node for o in n.output}
        names += [name for n in body.node for name in _read_names(n) if name not in inner]
    return names


def all_graph_protos(graph: GraphProto) -> Iterator[GraphProto]:
    """A GraphProto and every If/Loop/Scan body nested in it, outermost first."""
    yield graph
    yield from nested_graph_protos(graph.node)


def nested_graph_protos(nodes: Iterable[NodeProto]) -> Iterator[GraphProto]:
    """Every If/Loop/Scan body nested in `nodes`, outermost first."""
    for node in nodes:
        if may_hold_graphs(node):
            for body in node_bodies(node):
                yield from all_graph_protos(body)


def node_bodies(node: NodeProto) -> Iterator[GraphProto]:
    """The bodies `node` holds directly (its GRAPH and GRAPHS attributes), in attribute order."""
    for attribute in node.attribute[:]:
        if attribute.type == AttributeProto.GRAPH:
            yield attribute.g
        elif attribute.type == AttributeProto.GRAPHS:
            yield from attribute.graphs


# What a skeleton keeps of the initializers: shape inference reads the values of integer tensors
# (Reshape targets, Slice bounds) and of a few tiny float ones (Resize scales, Range bounds); of
# every other tensor it needs only the type and dims, so those become typed graph inputs. A
# graph of many small weights would otherwise be copied whole for every inference and check.
SKELETON_BYTES = 64 << 10
SKELETON_ELEMENTS = 64
_INTEGER_TYPES = frozenset(
    {
        TensorProto.INT64,
        TensorProto.INT32,
        TensorProto.INT16,
        TensorProto.INT8,
        TensorProto.UINT64,
        TensorProto.UINT32,
        TensorProto.UINT16,
        TensorProto.UINT8,
        TensorProto.BOOL,
    }
)


def shape_relevant(tensor: TensorProto, dims: tuple[int, ...] | None = None) -> bool:
    """Whether a skeleton keeps `tensor`'s values (see SKELETON_BYTES); `dims`: its dims, if read already."""
    if uses_external_data(tensor):
        return False
    count = 1
    for dim in tensor.dims[:] if dims is None else dims:
        count *= dim
    if count <= SKELETON_ELEMENTS:
        return True
    return tensor.data_type in _INTEGER_TYPES and nbytes(tensor) <= SKELETON_BYTES


def add_weightless(graph: GraphProto, initializers: Iterable[TensorProto], inputs, listed_only: bool = False) -> None:
    """Add `initializers` to a main graph: those shape inference reads as they are, the others as
    typed inputs (their data stays out). listed_only (IR < 4, where every initializer must be a
    graph input too): an initializer that is not an input stays, so the checker still sees that."""
    # The typed inputs are written as protobuf's bytes and parsed in one call: a message added
    # and filled field by field costs about 5 microseconds, and a large model has hundreds of
    # thousands of weights (the validation of the 100k-node MLP stack spent 0.33 s here).
    types: dict[tuple, bytes] = {}  # weights of a model share a few types: each serialized once
    kept = []
    declared = []
    for tensor in initializers:
        dims = tuple(tensor.dims[:])
        if shape_relevant(tensor, dims) or (listed_only and tensor.name not in inputs):
            kept.append(tensor)
            continue
        name = tensor.name
        if name in inputs:
            continue
        key = (tensor.data_type, dims)
        type_bytes = types.get(key)
        if type_bytes is None:
            type_bytes = types[key] = onnx.helper.make_tensor_type_proto(key[0], dims).SerializeToString()
        declared.append(_value_info_entry(name.encode(), type_bytes))
    if declared:
        graph.MergeFromString(b"".join(declared))
    graph.initializer.extend(kept)


# onnx's data propagation follows a vector input of fixed length element by element wherever a
# Slice or Gather reads it, values unknown or not: 1.0 s and 0.76 GB for 10M elements, and a
# packed 760 MB weight (190M floats) exhausted 24 GB. An initializer whose data is elsewhere is
# not followed, unless it is of int32 or int64, which propagation reads (and fails on). Shapes
# are vectors of a few elements.
LONG_VECTOR = 1 << 16
_READ_BY_PROPAGATION = frozenset({TensorProto.INT32, TensorProto.INT64})


def valueless_long_vectors(graph: onnx.GraphProto) -> bytes:
    """For the inference of a skeleton: a ModelProto in protobuf's bytes that, appended to the
    skeleton's (protobuf merges them), gives each input of `graph` that is a vector of
    LONG_VECTOR elements or more (not of int32 or int64) an initializer of its name whose data is
    elsewhere (nowhere: inference reads none of it; the checker never sees these). Empty when
    there is none."""
    stand_ins = ModelProto()
    for value in graph.input:
        tensor_type = value.type.tensor_type
        dims = tensor_type.shape.dim if value.type.HasField("tensor_type") and tensor_type.HasField("shape") else ()
        long = len(dims) == 1 and dims[0].HasField("dim_value") and dims[0].dim_value >= LONG_VECTOR
        if long and tensor_type.elem_type not in _READ_BY_PROPAGATION:
            tensor = stand_ins.graph.initializer.add(name=value.name, data_type=tensor_type.elem_type)
            tensor.dims.append(dims[0].dim_value)
            tensor.data_location = TensorProto.EXTERNAL
            tensor.external_data.add(key="location", value="values-not-read")
    return stand_ins.SerializeToString() if stand_ins.graph.initializer else b""


def _value_info_entry(name: bytes, type_bytes: bytes) -> bytes:
    """GraphProto's `input` field holding ValueInfoProto(name, type), in protobuf's wire format."""
    body = b"".join(
        (_VALUE_INFO_NAME, encode_varint(len(name)), name, _VALUE_INFO_TYPE, encode_varint(len(type_bytes)), type_bytes)
    )
    return b"".join((_GRAPH_INPUT, encode_varint(len(body)), body))


_GRAPH_INPUT = field_key(GRAPH_INPUT_FIELD)
_VALUE_INFO_NAME = field_key(VALUE_INFO_NAME_FIELD)
_VALUE_INFO_TYPE = field_key(VALUE_INFO_TYPE_FIELD)


def weightless_model(model: ModelProto, in_place: bool = False) -> ModelProto:
    """A copy of `model` without the weights shape inference does not read (see shape_relevant),
    for checks and inference. in_place: `model` itself becomes that skeleton, which saves copying
    its nodes (for a process that will not use the model again: the child checking it)."""
    if in_place:
        graph = model.graph
        initializers = list(graph.initializer)  # still readable once out of the graph
        del graph.initializer[:]
        add_weightless(graph, initializers, {value.name for value in graph.input}, listed_only=model.ir_version < 4)
        return model
    skeleton = ModelProto()
    copy_fields_except(model, skeleton, {"graph"})
    copy_fields_except(model.graph, skeleton.graph, {"initializer"})
    inputs = {value.name for value in model.graph.input}
    add_weightless(skeleton.graph, model.graph.initializer, inputs, listed_only=model.ir_version < 4)
    return skeleton


def _graph_shell(proto: GraphProto) -> GraphProto:
    """Everything of a GraphProto except the parts fuser rebuilds."""
    shell = GraphProto()
    copy_fields_except(proto, shell, {"node", "initializer", "value_info", "input"})
    return shell


def copy_fields_except(source: Message, target: Message, skipped: set[str]) -> None:
    """Copy every set field of `source` into `target`, except the named ones (never copied)."""
    for descriptor, value in source.ListFields():
        if descriptor.name in skipped:
            continue
        field_value = getattr(target, descriptor.name)
        if isinstance(value, Message):
            field_value.CopyFrom(value)
        elif hasattr(value, "extend") and not isinstance(value, (str, bytes)):
            field_value.extend(value)
        else:
            setattr(target, descriptor.name, value)
