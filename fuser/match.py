"""Matching a pattern at one root node, and what a rule sees of a match."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx

from fuser.context import Context
from fuser.graph import Graph, NodeInfo, node_fingerprint, valueless_long_vectors
from fuser.pattern import Const, OpPattern
from fuser.skim import graphs_and_outputs, infer_serialized, skimmed
from fuser.tensors import read_only


class Decline(Exception):
    """A rule refuses a match; the message is the sentence the trace and report show."""


class NotACandidate(Decline):
    """A match the rule never meant to take (Match.only_if): declined without a record."""


@dataclass
class Bindings:
    nodes: dict[str, int] = field(default_factory=dict)
    tensors: dict[str, str | None] = field(default_factory=dict)

    def copy(self) -> Bindings:
        return Bindings(dict(self.nodes), dict(self.tensors))


def find_matches(graph: Graph, pattern: OpPattern, root: int) -> Iterator[Bindings]:
    """Every way `pattern` matches with its root at node `root` (usually zero or one)."""
    if not may_match(graph, pattern, root):
        return iter(())
    return _match_op(graph, pattern, root, Bindings())


def matches_where_it_may(graph: Graph, pattern: OpPattern, root: int) -> Iterator[Bindings]:
    """find_matches at a root where may_match holds (asked already, it is not asked again)."""
    return _match_op(graph, pattern, root, Bindings())


def may_match(graph: Graph, pattern: OpPattern, root: int) -> bool:
    """Whether the root and the op types of its required producers fit `pattern`: what turns
    away most nodes, asked before any matching state is built (an engine tries each node of a
    large graph against every rule rooted at its op type, and few of them match)."""
    info = graph.node(root)
    if info.op_type not in pattern.op_types:
        return False
    plan = _plan(pattern)
    if info.domain not in plan.domains:
        return False
    inputs = info.input_names
    if plan.const_slots:
        for slot in plan.const_slots:
            if slot < len(inputs) and inputs[slot] and not graph.is_constant(inputs[slot]):
                return False
    for required in plan.producers:
        for slot, op_types in required:
            tensor = inputs[slot] if slot < len(inputs) else ""
            producer = graph.producer(tensor) if tensor else None
            if producer is None or graph.node(producer).op_type not in op_types:
                break
        else:
            return True
    return False


@dataclass(frozen=True)
class _Plan:
    """How to match one OpPattern, worked out once: the matcher visits every node of a large
    graph, and re-deriving this per visit dominated its time."""

    domains: tuple[str, ...]
    size: int  # inputs the pattern lists
    required: int  # of which not optional
    # Per input order (two for a commutative op): the var/const leaves as
    # (slot, name, optional, is_const) in slot order, the op inputs as (slot, pattern), and per
    # count of inputs a node has, the leaves it leaves absent as {name: None} (None if one of
    # them is required): Concat-like patterns list 32 optional inputs, and a node has few.
    orders: tuple[tuple[tuple, tuple, tuple], ...]
    # For a pattern of one order whose inputs are all leaves (constant-fold's, tried at every
    # node), the slots of its const leaves: asked first, they turn most nodes away at once.
    const_slots: tuple[int, ...] | None = None
    # Per input order, (slot, op types) of each required op input: a node matches only where
    # some order has a producer of those types at each of those slots (may_match).
    producers: tuple[tuple[tuple[int, tuple[str, ...]], ...], ...] = ((),)


_plans: dict[int, tuple[OpPattern, _Plan]] = {}


def _plan(pattern: OpPattern) -> _Plan:
    cached = _plans.get(id(pattern))
    if cached is not None and cached[0] is pattern:
        return cached[1]
    orders = []
    for order in (pattern.inputs, tuple(reversed(pattern.inputs))) if pattern.commutative else (pattern.inputs,):
        leaves = tuple(
            (slot, p.name, p.optional, isinstance(p, Const))
            for slot, p in enumerate(order)
            if not isinstance(p, OpPattern)
        )
        ops = tuple((slot, p) for slot, p in enumerate(order) if isinstance(p, OpPattern))
        absent = tuple(
            {name: None for slot, name, _, _ in leaves if slot >= count}
            if all(optional for slot, _, optional, _ in leaves if slot >= count)
            else None
            for count in range(len(order) + 1)
        )
        orders.append((leaves, ops, absent))
    leaves, ops, _ = orders[0]
    plan = _Plan(
        domains=(pattern.domain,) if pattern.domain else ("", "ai.onnx"),
        size=len(pattern.inputs),
        required=sum(1 for i in pattern.inputs if not i.optional),
        orders=tuple(orders),
        const_slots=tuple(slot for slot, _, _, is_const in leaves if is_const)
        if len(orders) == 1 and not ops
        else None,
        producers=tuple(tuple((slot, p.op_types) for slot, p in ops if not p.optional) for _, ops, _ in orders),
    )
    _plans[id(pattern)] = (pattern, plan)  # the pattern is kept alive, so its id stays its own
    return plan


def _match_op(graph: Graph, pattern: OpPattern, node_id: int, bindings: Bindings) -> Iterator[Bindings]:
    info = graph.node(node_id)
    if info.op_type not in pattern.op_types:
        return
    plan = _plan(pattern)
    if info.domain not in plan.domains:
        return
    bound = bindings.nodes.get(pattern.name)
    if bound is not None:
        if bound == node_id:
            yield bindings
        return
    if node_id in bindings.nodes.values():
        return
    if pattern.attrs:
        for attr, expected in pattern.attrs:
            actual = info.attr(attr)
            if actual is None:
                actual = _default_attribute(graph, info, attr)
            if callable(expected):
                if not expected(actual):
                    return
            elif not _same_attribute(actual, expected):
                return
    actual_inputs = info.input_names
    present = len(actual_inputs)
    while present and not actual_inputs[present - 1]:
        present -= 1
    if present > plan.size or present < plan.required:
        return
    if plan.const_slots:
        for slot in plan.const_slots:
            if slot < present and actual_inputs[slot] and not graph.is_constant(actual_inputs[slot]):
                return
    for leaves, ops, absent in plan.orders:
        start = bindings.copy()
        start.nodes[pattern.name] = node_id
        yield from _match_inputs(graph, leaves, ops, absent[present], actual_inputs, present, start)


_UNBOUND = object()


def _match_inputs(graph: Graph, leaves: tuple, ops: tuple, absent, actual, present: int, bindings: Bindings):
    """Extend `bindings` (owned by this call) with a node's inputs; yields each complete match.

    A var/const input binds or compares in exactly one way, so all of them are settled in place
    first and only op inputs branch. Whether a const input is constant can mean evaluating a
    constant subgraph: that is asked last, once the structure around it has matched.
    """
    tensors = bindings.tensors
    constants = []
    for slot, name, optional, is_const in leaves:
        if slot >= present and absent is not None and tensors.keys().isdisjoint(absent):
            tensors.update(absent)  # every leaf from here on is an absent optional input
            break
        tensor = (actual[slot] or None) if slot < present else None
        bound = tensors.get(name, _UNBOUND)
        if bound is not _UNBOUND:
            if bound != tensor:
                return
        elif tensor is None and not optional:
            return
        else:
            tensors[name] = tensor
        if is_const and tensor is not None:
            constants.append(tensor)
    if not ops:
        if all(graph.is_constant(t) for t in constants):
            yield bindings
        return
    constant = None
    for complete in _match_op_inputs(graph, ops, 0, actual, present, bindings):
        if constant is None:
            constant = all(graph.is_constant(t) for t in constants)
        if not constant:
            return
        yield complete


def _match_op_inputs(graph: Graph, ops: tuple, index: int, actual, present: int, bindings: Bindings):
    if index == len(ops):
        yield bindings
        return
    slot, pattern = ops[index]
    tensor = actual[slot] if slot < present else None
    if not tensor:
        if pattern.optional:
            yield from _match_op_inputs(graph, ops, index + 1, actual, present, bindings)
        return
    producer = graph.producer(tensor)
    if producer is None:
        return
    outputs = graph.node(producer).output_names
    if pattern.output >= len(outputs) or outputs[pattern.output] != tensor:
        return
    for partial in _match_op(graph, pattern, producer, bindings):
        yield from _match_op_inputs(graph, ops, index + 1, actual, present, partial)


def _same_attribute(actual, expected) -> bool:
    """Float attributes are stored as float32: compare at that precision, not as Python floats."""
    if isinstance(expected, float) and isinstance(actual, (float, int)):
        return np.float32(actual) == np.float32(expected)
    return actual == expected


def _default_attribute(graph: Graph, info: NodeInfo, attr: str):
    """The schema default of an attribute, so `training_mode=0` matches when it is absent."""
    opset = graph.opset(info.domain) or onnx.defs.onnx_opset_version()
    try:
        schema = onnx.defs.get_schema(info.op_type, opset, info.domain or "")
    except Exception:  # noqa: BLE001 - unknown op or domain: no default known
        return None
    attribute = schema.attributes.get(attr)
    if attribute is None or not attribute.default_value.name:
        return None
    return onnx.helper.get_attribute_value(attribute.default_value)


class Match:
    """What a rule's function receives: matched nodes, bound tensors, constants, types.

    ``m["x"]`` is the tensor bound to ``var("x")``/``const("x")`` (None if an optional
    input is absent); ``m.value("w")`` its numpy value (read-only); ``m.node("conv")``
    the matched node; ``m.attr("conv", "group", 1)`` an attribute with a default;
    ``m.context`` the run's machine choices (fuser/context.py: ``m.context.nchwc_block``).
    """

    def __init__(self, graph: Graph, pattern: OpPattern, bindings: Bindings, types: TypeInfo, context: Context):
        self.graph = graph
        self.pattern = pattern
        self._bindings = bindings
        self._types = types
        self.context = context
        self.root: NodeInfo = graph.node(bindings.nodes[pattern.name])
        self.absorbed: list[int] = []
        self._nodes: tuple[NodeInfo, ...] | None = None  # asked several times by the engine's checks
        # While the engine watches a rule from outside fuser build: node id -> node_fingerprint
        # before, of the matched nodes and of those absorbed, as they are absorbed.
        self.watched: dict[int, tuple] | None = None

    def __getitem__(self, name: str) -> str | None:
        if name in self._bindings.tensors:
            return self._bindings.tensors[name]
        if name in self._bindings.nodes:
            return self.node(name).output_names[0]
        raise KeyError(f"the pattern binds no tensor or node named '{name}'")

    def has(self, name: str) -> bool:
        """True when `name` is bound: a present optional input, or a present optional node."""
        return self._bindings.tensors.get(name) is not None or name in self._bindings.nodes

    def node(self, name: str) -> NodeInfo:
        return self.graph.node(self._bindings.nodes[name])

    def absorb(self, node_ids) -> None:
        """Make nodes the rule found by walking the graph (beyond its pattern) part of the match.

        They are removed with it, so, like the pattern's own nodes, every one of their outputs
        must feed only the match (else the match is declined). The tensors the rule read along
        the way are its own to vet: the replacement may not read what the match removes.
        """
        if not self.absorbed:
            self._bindings = self._bindings.copy()  # the matcher may still backtrack through the original
        for node_id in node_ids:
            if node_id not in self._bindings.nodes.values():
                self._bindings.nodes[f"absorbed:{node_id}"] = node_id
                self.absorbed.append(node_id)
                if self.watched is not None:
                    self.watched.setdefault(node_id, node_fingerprint(self.graph.node(node_id).proto))
        self._nodes = None

    @property
    def bindings(self) -> Bindings:
        return self._bindings

    @property
    def node_ids(self) -> list[int]:
        return list(self._bindings.nodes.values())

    @property
    def nodes(self) -> list[NodeInfo]:
        if self._nodes is None:
            node = self.graph.node
            self._nodes = tuple(node(i) for i in self._bindings.nodes.values())
        return list(self._nodes)

    def attr(self, node: str, attr: str, default=None):
        """The attribute's value; when absent, `default`, else the ONNX schema's default."""
        info = self.node(node)
        value = info.attr(attr)
        if value is not None:
            return value
        return default if default is not None else _default_attribute(self.graph, info, attr)

    def attrs(self, node: str) -> dict:
        return self.node(node).attrs()

    def value(self, name: str) -> np.ndarray | None:
        """The constant value bound to `name`; None for an absent optional input."""
        tensor = self[name]
        if tensor is None:
            return None
        value = self.graph.constant_value(tensor)
        if value is None:
            raise Decline(f"'{name}' ({tensor}) is not a constant small enough to read")
        return read_only(value)  # shared with the graph: rules build new tensors

    # A name given to dtype/shape/rank/consumers/is_graph_output is read as the pattern's name
    # first, then as a tensor. A tensor taken from the graph (a node's inputs, say) goes to the
    # *_of forms instead, which never read it as a pattern name: tensors and pattern names can
    # be the same string (the dynamo exporter names tensors after their ops, "cos", "transpose").

    def dtype(self, name_or_tensor: str) -> np.dtype | None:
        return self.dtype_of(self._tensor(name_or_tensor))

    def dtype_of(self, tensor: str | None) -> np.dtype | None:
        stored = self.graph.initializer(tensor) if tensor else None
        if stored is not None:  # read from the TensorProto: a weight is never decoded to answer this
            return _np_dtype(stored.data_type)
        value = self.graph.constant_value(tensor) if tensor else None
        if value is not None:
            return value.dtype
        return self._types.dtype(tensor)

    def shape(self, name_or_tensor: str) -> tuple | None:
        """Known shape: ints for fixed dims, strings for symbolic ones, None if unknown."""
        return self.shape_of(self._tensor(name_or_tensor))

    def shape_of(self, tensor: str | None) -> tuple | None:
        stored = self.graph.initializer(tensor) if tensor else None
        if stored is not None:
            return tuple(stored.dims[:])
        value = self.graph.constant_value(tensor) if tensor else None
        if value is not None:
            return value.shape
        return self._types.shape(tensor)

    def rank(self, name_or_tensor: str) -> int | None:
        return self.rank_of(self._tensor(name_or_tensor))

    def rank_of(self, tensor: str | None) -> int | None:
        shape = self.shape_of(tensor)
        return None if shape is None else len(shape)

    @property
    def opset(self) -> int:
        return self.graph.opset("") or 1

    def consumers(self, name_or_tensor: str) -> int:
        return self.consumers_of(self._tensor(name_or_tensor))

    def consumers_of(self, tensor: str) -> int:
        return len(self.graph.consumers(tensor))

    def is_graph_output(self, name_or_tensor: str) -> bool:
        return self.graph.is_graph_output(self._tensor(name_or_tensor))

    def require(self, condition: bool, reason: str, *args) -> None:
        """Decline the match with `reason` unless `condition` holds. With `args`, the reason is a
        %-format filled in only on a decline: `m.require(ok, "x is %s", dtype)` costs nothing
        when the check passes, where an f-string formats a numpy dtype (10 microseconds) at
        every match of a large model."""
        if not condition:
            raise Decline(reason % args if args else reason)

    def only_if(self, condition: bool) -> None:
        """Leave the match alone, without a decline in the trace or report, unless `condition` holds.

        For a check that fails on nearly every node the pattern matches, where a decline per
        node would be noise (and, on a large model, most of the report): common-subexpression
        matches every node and looks for a twin that almost none has.
        """
        if not condition:
            raise NotACandidate("not a candidate")

    def _tensor(self, name_or_tensor: str) -> str | None:
        if name_or_tensor in self._bindings.tensors or name_or_tensor in self._bindings.nodes:
            return self[name_or_tensor]
        return name_or_tensor


# A tensor's type as TypeInfo keeps it: (ONNX element type, dims or None when the rank is
# unknown), a dim being an int, a symbolic name, or "?". Plain tuples rather than the
# TypeProtos of the inferred model, which would keep that whole model (a copy of the graph)
# alive for every table entry.
Entry = tuple[int, tuple | None]


_UNREAD = object()


def _entry_of(type_proto: onnx.TypeProto) -> Entry:
    tensor = type_proto.tensor_type
    if not tensor.HasField("shape"):
        return tensor.elem_type, None
    dims = []
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value"):
            dims.append(dim.dim_value)
        elif dim.HasField("dim_param"):
            dims.append(dim.dim_param)
        else:
            dims.append("?")
    return tensor.elem_type, tuple(dims)


def _carried(previous: dict[str, Entry], fresh: dict, run: int) -> dict[str, Entry]:
    """What an earlier inference run knew that the fresh one does not: its entries for tensors
    the fresh run lacks, and, for tensors both have, the fresh entry completed with the dims (or
    element type) only the earlier run knew. A tensor's name keeps denoting the same value
    across rewrites (a replacement takes over the names of what it replaces), so both runs
    describe one tensor; the fresh run can know less where shape inference stops at an
    operator it does not know (the com.microsoft ops a rule created) and everything after it
    is inferred anew without shapes. The dim names shape inference made up ('unk__3') are made
    unique to the earlier run: each run numbers them anew, and an equal name must keep meaning
    an equal dim (rules compare them to prove shapes equal)."""
    carried = {}
    for name, entry in previous.items():
        now = fresh.get(name)
        if now is None:
            carried[name] = _run_unique(entry, run)
        elif now != entry:  # most entries are the same in both runs: nothing to complete
            completed = _completed(now, entry, run)
            if completed is not None:
                carried[name] = completed
    return carried


def _run_unique(entry: Entry, run: int) -> Entry:
    elem_type, dims = entry
    if dims is None or not any(isinstance(d, str) and d.startswith("unk__") for d in dims):
        return entry
    return elem_type, tuple(f"run{run}.{d}" if isinstance(d, str) and d.startswith("unk__") else d for d in dims)


def _dim_knowledge(dim) -> int:
    """How much a dim says: a size, a name the model gave, a name inference made up, nothing."""
    if isinstance(dim, int):
        return 3
    if dim == "?":
        return 0
    made_up = dim.startswith("unk__") or (dim.startswith("run") and ".unk__" in dim)
    return 1 if made_up else 2


def _completed(fresh: Entry, earlier: Entry, run: int) -> Entry | None:
    """`fresh` with what `earlier` (the same tensor, an earlier run) knew beyond it; None when
    it adds nothing (or the two disagree, which leaves the fresh entry as it is)."""
    (new_type, new_dims), (old_type, old_dims) = fresh, _run_unique(earlier, run)
    if new_type and old_type and new_type != old_type:
        return None
    elem_type = new_type or old_type
    if old_dims is None:
        dims = new_dims
    elif new_dims is None:
        dims = old_dims
    elif len(new_dims) != len(old_dims):
        return None
    else:
        dims = tuple(b if _dim_knowledge(b) > _dim_knowledge(a) else a for a, b in zip(new_dims, old_dims))
    completed = (elem_type, dims)
    return None if completed == fresh else completed


def _np_dtype(data_type: int) -> np.dtype | None:
    """numpy's dtype for an ONNX element type; None for none or one numpy lacks."""
    if not data_type:
        return None
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(data_type)
    except (KeyError, ValueError, TypeError):
        return None


def _known_dims(table: dict[str, Entry]) -> int:
    return sum(1 for _, dims in table.values() if dims is not None for dim in dims if isinstance(dim, int))


@dataclass
class InferredTypes:
    """What one shape inference of a skeleton told: each tensor's Entry, the dim names the main
    graph's inputs declare, and the tensors produced that it could not type."""

    table: dict[str, Entry]
    input_symbols: set[str]
    untyped: set[str]


def inferred_types(model: onnx.ModelProto | bytes) -> InferredTypes:
    """The types in `model`, a skeleton as shape inference returned it (or serialized: read
    without building all of it, fuser/skim.py)."""
    model = skimmed(model if isinstance(model, bytes) else model.SerializeToString())
    # Most tensors of a graph share a handful of types: each is read once, by its bytes,
    # rather than dim by dim through protobuf for every tensor.
    entries: dict[bytes, Entry | None] = {}

    def entry_of(key: bytes) -> Entry | None:
        entry = entries.get(key, _UNREAD)
        if entry is _UNREAD:
            type_proto = onnx.TypeProto.FromString(key)
            entry = entries[key] = _entry_of(type_proto) if type_proto.HasField("tensor_type") else None
        return entry

    input_entries = {entry_of(value.type) for value in model.graph.input[:]} - {None}
    # "?" stands for a dim inference knows nothing of (_entry_of)
    input_symbols = {d for _, dims in input_entries if dims for d in dims if isinstance(d, str)} - {"?", ""}
    graphs, produced = graphs_and_outputs(model.graph)
    table: dict[str, Entry] = {}
    intern = sys.intern
    for graph in graphs:
        for value in itertools.chain(graph.value_info[:], graph.input[:], graph.output[:]):
            key = value.type
            entry = entries.get(key, _UNREAD)  # asked first here: a call per tensor costs, most types are known
            if entry is _UNREAD:
                entry = entry_of(key)
            if entry is not None:
                # The graph holds its tensor names interned: the table shares those strings.
                table[intern(value.name)] = entry
        for tensor in graph.initializer[:]:
            table.setdefault(intern(tensor.name), (tensor.data_type, tuple(tensor.dims[:])))
    untyped = set(produced)
    untyped.difference_update(table)
    untyped.discard("")
    return InferredTypes(table, input_symbols, untyped)


class TypeInfo:
    """Element types and shapes of tensors, from the model's annotations and shape inference."""

    def __init__(self, model_proto_factory, seed: InferredTypes | Callable[[], InferredTypes | None] | None = None):
        """model_proto_factory: the model's skeleton, for inference. seed: the types an inference
        of the model as it is now found (Model.take_inferred_types), the first table: held from
        the start, it also answers for the tensors a first rewrite leaves as they were. A
        function giving them is called when they are first needed (they may still be on their
        way from the load's check), and the table is what it would have been from the start."""
        self._factory = model_proto_factory
        self._table: dict[str, Entry] | None = None
        self._previous: dict[str, Entry] = {}
        self._stale = False
        self._runs = 0
        # Whether a query since learns_more last ran got an answer a new inference might complete.
        self._asked_unknown = False
        # Dim names the main graph's inputs declare: sizes the caller picks, which no inference
        # can ever replace by a number.
        self._input_symbols: set[str] = set()
        # Tensors the last inference saw produced and could not type.
        self._untyped: set[str] = set()
        # The function giving the first table until it is called, and what invalidate was told meanwhile.
        self._seed: Callable[[], InferredTypes | None] | None = None
        self._produced_before_seed: set[str] = set()
        # A refresh asked for while the first table was still to come, made when it comes.
        self._refresh_after_seed = False
        if callable(seed):
            self._seed = seed
        elif seed is not None:
            self._install(seed)

    def _settle(self) -> None:
        """Install the first table if it is still to come, as it would have been from the start."""
        if self._seed is None:
            return
        seed, self._seed = self._seed, None
        found = seed()
        if found is not None:
            self._install(found)
            self._untyped.difference_update(self._produced_before_seed)
        self._produced_before_seed = set()
        if self._refresh_after_seed:
            self._refresh_after_seed = False
            self.refresh()  # the first table is the previous one: the query infers anew

    def invalidate(self, produced=()) -> None:
        """The graph changed: tensors created since the last inference are looked up anew, and so
        are those of `produced`, the outputs of the nodes the change added (a replacement keeps
        the names of what it replaces, which inference may now be able to type)."""
        self._stale = True
        if self._seed is not None:
            self._produced_before_seed.update(produced)
        self._untyped.difference_update(produced)

    def refresh(self) -> None:
        """Infer every shape again at the next query: rewrites (folded Reshape targets, say)
        may have made shapes known that the previous inference could not know."""
        if self._seed is not None:
            # The first table is still to come (from the load's check, 0.28 s to read for the
            # 100k-node ResNet stack, whose rewrite asks nothing): fetched when a query needs it,
            # it is refreshed then, as it would have been now.
            self._refresh_after_seed = True
            return
        if self._table is not None:
            self._previous, self._table, self._stale = self._table, None, False

    def learns_more(self) -> bool:
        """Infer every shape again now; True when that fixed more dims than were known before.

        Without inferring when every answer given since the last call was complete (a type, and
        a size for every dim, or a dim name a graph input declares): a rule's decisions rest on
        the answers it got, and those cannot change. Another dim name can: inference puts a size
        in its place once a rewrite makes it computable."""
        asked_unknown, self._asked_unknown = self._asked_unknown, False
        if self._seed is not None:  # nothing has asked since the first table was handed over
            self.refresh()
            return False
        if self._table is None:
            return False
        if not asked_unknown:
            self.refresh()  # later queries still see what the rewrites made known
            return False
        known = _known_dims(self._table)
        self.refresh()
        return _known_dims(self._load()) > known

    def _entry(self, tensor: str | None) -> Entry | None:
        if not tensor:
            return None
        entry = self._load().get(tensor)
        if entry is None and self._stale and tensor not in self._untyped:
            # A tensor created since: re-infer, but keep what was known (shape inference stops
            # at operators it does not know, com.microsoft ones a rule created, and rewrites keep
            # the types of the tensors they replace). One the last inference saw and could not
            # type waits for the next refresh: asking again at every rewrite would infer the
            # whole graph once per layer of a model whose fused nodes onnx does not know.
            self._previous, self._table, self._stale = self._table, None, False
            entry = self._load().get(tensor)
        return entry

    def _load(self) -> dict[str, Entry]:
        if self._seed is not None:
            self._settle()
        if self._table is None:
            # Serialized at once, so that the skeleton is freed before inference makes its copy.
            skeleton_model = self._factory()
            skeleton = skeleton_model.SerializeToString() + valueless_long_vectors(skeleton_model.graph)
            del skeleton_model
            try:
                model = infer_serialized(skeleton, strict_mode=False, data_prop=True)
            except Exception:  # noqa: BLE001 - inference is best effort; annotations remain
                model = skeleton
            del skeleton
            found = inferred_types(model)
            del model
            self._install(found)
        return self._table

    def _install(self, found: InferredTypes) -> None:
        """Make an inference's types the table, completed with what earlier runs knew."""
        self._input_symbols, self._untyped = found.input_symbols, found.untyped
        self._runs += 1
        carried = _carried(self._previous, found.table, self._runs - 1)
        self._table = {**found.table, **carried} if carried else found.table
        self._previous = {}

    def dtype(self, tensor: str | None) -> np.dtype | None:
        entry = self._entry(tensor)
        dtype = None if entry is None else _np_dtype(entry[0])
        if dtype is None and tensor:
            self._asked_unknown = True
        return dtype

    def shape(self, tensor: str | None) -> tuple | None:
        entry = self._entry(tensor)
        dims = None if entry is None else entry[1]
        if tensor and (dims is None or not all(isinstance(d, int) or d in self._input_symbols for d in dims)):
            self._asked_unknown = True  # a later inference may put a size in place of a name
        return dims
