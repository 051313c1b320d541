"""Matching a pattern at one root node, and what a rule sees of a match."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx

from fuser.graph import Graph, NodeInfo, all_graph_protos
from fuser.pattern import Const, OpPattern


class Decline(Exception):
    """A rule refuses a match; the message is the sentence the trace and report show."""


@dataclass
class Bindings:
    nodes: dict[str, int] = field(default_factory=dict)
    tensors: dict[str, str | None] = field(default_factory=dict)

    def copy(self) -> Bindings:
        return Bindings(dict(self.nodes), dict(self.tensors))


def find_matches(graph: Graph, pattern: OpPattern, root: int) -> Iterator[Bindings]:
    """Every way `pattern` matches with its root at node `root` (usually zero or one)."""
    yield from _match_op(graph, pattern, root, Bindings())


def _match_op(graph: Graph, pattern: OpPattern, node_id: int, bindings: Bindings) -> Iterator[Bindings]:
    info = graph.node(node_id)
    if info.op_type not in pattern.op_types:
        return
    if (info.domain or "") not in ((pattern.domain,) if pattern.domain else ("", "ai.onnx")):
        return
    bound = bindings.nodes.get(pattern.name)
    if bound is not None:
        if bound == node_id:
            yield bindings
        return
    if node_id in bindings.nodes.values():
        return
    for attr, expected in pattern.attrs:
        actual = info.attr(attr)
        if actual is None:
            actual = _default_attribute(graph, info, attr)
        if callable(expected):
            if not expected(actual):
                return
        elif not _same_attribute(actual, expected):
            return
    actual_inputs = list(info.proto.input)
    while actual_inputs and not actual_inputs[-1]:
        actual_inputs.pop()
    required = sum(1 for i in pattern.inputs if not getattr(i, "optional", False))
    if len(actual_inputs) > len(pattern.inputs) or len(actual_inputs) < required:
        return
    padded = actual_inputs + [None] * (len(pattern.inputs) - len(actual_inputs))
    orders = [pattern.inputs]
    if pattern.commutative:
        orders.append(tuple(reversed(pattern.inputs)))
    for order in orders:
        start = bindings.copy()
        start.nodes[pattern.name] = node_id
        yield from _match_inputs(graph, list(order), padded, start)


def _match_inputs(graph: Graph, patterns: list, tensors: list, bindings: Bindings) -> Iterator[Bindings]:
    if not patterns:
        yield bindings
        return
    for partial in _match_input(graph, patterns[0], tensors[0] or None, bindings):
        yield from _match_inputs(graph, patterns[1:], tensors[1:], partial)


def _match_input(graph: Graph, pattern, tensor: str | None, bindings: Bindings) -> Iterator[Bindings]:
    if isinstance(pattern, OpPattern):
        if tensor is None:
            if pattern.optional:
                yield bindings
            return
        producer = graph.producer(tensor)
        if producer is None:
            return
        outputs = graph.node(producer).proto.output
        if pattern.output >= len(outputs) or outputs[pattern.output] != tensor:
            return
        yield from _match_op(graph, pattern, producer, bindings)
        return
    if tensor is None:
        if pattern.optional and pattern.name not in bindings.tensors:
            result = bindings.copy()
            result.tensors[pattern.name] = None
            yield result
        return
    if pattern.name in bindings.tensors:
        if bindings.tensors[pattern.name] == tensor:
            yield bindings
        return
    if isinstance(pattern, Const) and not graph.is_constant(tensor):
        return
    result = bindings.copy()
    result.tensors[pattern.name] = tensor
    yield result


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
    the matched node; ``m.attr("conv", "group", 1)`` an attribute with a default.
    """

    def __init__(self, graph: Graph, pattern: OpPattern, bindings: Bindings, types: TypeInfo):
        self.graph = graph
        self.pattern = pattern
        self._bindings = bindings
        self._types = types
        self.root: NodeInfo = graph.node(bindings.nodes[pattern.name])
        self.absorbed: list[int] = []

    def __getitem__(self, name: str) -> str | None:
        if name in self._bindings.tensors:
            return self._bindings.tensors[name]
        if name in self._bindings.nodes:
            return self.node(name).proto.output[0]
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

    @property
    def bindings(self) -> Bindings:
        return self._bindings

    @property
    def node_ids(self) -> list[int]:
        return list(self._bindings.nodes.values())

    @property
    def nodes(self) -> list[NodeInfo]:
        return [self.graph.node(i) for i in self.node_ids]

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
        value = value.view()
        value.flags.writeable = False  # shared with the graph: rules build new tensors
        return value

    def dtype(self, name_or_tensor: str) -> np.dtype | None:
        tensor = self._tensor(name_or_tensor)
        value = self.graph.constant_value(tensor) if tensor is not None else None
        if value is not None:
            return value.dtype
        return self._types.dtype(tensor)

    def shape(self, name_or_tensor: str) -> tuple | None:
        """Known shape: ints for fixed dims, strings for symbolic ones, None if unknown."""
        tensor = self._tensor(name_or_tensor)
        value = self.graph.constant_value(tensor) if tensor is not None else None
        if value is not None:
            return value.shape
        return self._types.shape(tensor)

    def rank(self, name_or_tensor: str) -> int | None:
        shape = self.shape(name_or_tensor)
        return None if shape is None else len(shape)

    @property
    def opset(self) -> int:
        return self.graph.opset("") or 1

    def opset_of(self, domain: str) -> int | None:
        return self.graph.opset(domain)

    def consumers(self, name_or_tensor: str) -> int:
        return len(self.graph.consumers(self._tensor(name_or_tensor)))

    def is_graph_output(self, name_or_tensor: str) -> bool:
        return self.graph.is_graph_output(self._tensor(name_or_tensor))

    def require(self, condition: bool, reason: str) -> None:
        """Decline the match with `reason` unless `condition` holds."""
        if not condition:
            raise Decline(reason)

    def _tensor(self, name_or_tensor: str) -> str | None:
        if name_or_tensor in self._bindings.tensors or name_or_tensor in self._bindings.nodes:
            return self[name_or_tensor]
        return name_or_tensor


def _carried(previous: dict[str, onnx.TypeProto], fresh: dict, run: int) -> dict[str, onnx.TypeProto]:
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
        if name in fresh:
            completed = _completed(fresh[name], entry, run)
            if completed is not None:
                carried[name] = completed
        else:
            carried[name] = _run_unique(entry, run)
    return carried


def _run_unique(entry: onnx.TypeProto, run: int) -> onnx.TypeProto:
    dims = entry.tensor_type.shape.dim if entry.HasField("tensor_type") else ()
    if not any(d.dim_param.startswith("unk__") for d in dims):
        return entry
    entry = onnx.TypeProto.FromString(entry.SerializeToString())
    for dim in entry.tensor_type.shape.dim:
        if dim.dim_param.startswith("unk__"):
            dim.dim_param = f"run{run}.{dim.dim_param}"
    return entry


def _dim_knowledge(dim) -> int:
    """How much a dim says: a size, a name the model gave, a name inference made up, nothing."""
    if dim.HasField("dim_value"):
        return 3
    if dim.HasField("dim_param"):
        made_up = dim.dim_param.startswith("unk__") or (dim.dim_param.startswith("run") and ".unk__" in dim.dim_param)
        return 1 if made_up else 2
    return 0


def _completed(fresh: onnx.TypeProto, earlier: onnx.TypeProto, run: int) -> onnx.TypeProto | None:
    """`fresh` with what `earlier` (the same tensor, an earlier run) knew beyond it; None when
    it adds nothing (or the two disagree, which leaves the fresh entry as it is)."""
    if not fresh.HasField("tensor_type") or not earlier.HasField("tensor_type"):
        return None
    new, old = fresh.tensor_type, earlier.tensor_type
    if new.elem_type and old.elem_type and new.elem_type != old.elem_type:
        return None
    takes_type = not new.elem_type and old.elem_type
    if not old.HasField("shape"):
        takes = []
    elif not new.HasField("shape"):
        takes = None  # the whole shape
    elif len(new.shape.dim) != len(old.shape.dim):
        return None
    else:
        takes = [
            i for i, (a, b) in enumerate(zip(new.shape.dim, old.shape.dim)) if _dim_knowledge(b) > _dim_knowledge(a)
        ]
    if not takes_type and takes == []:
        return None
    earlier = _run_unique(earlier, run)
    completed = onnx.TypeProto.FromString(fresh.SerializeToString())
    if takes_type:
        completed.tensor_type.elem_type = old.elem_type
    if takes is None:
        completed.tensor_type.shape.CopyFrom(earlier.tensor_type.shape)
    for i in takes or ():
        completed.tensor_type.shape.dim[i].CopyFrom(earlier.tensor_type.shape.dim[i])
    return completed


def _known_dims(table: dict[str, onnx.TypeProto]) -> int:
    return sum(
        1
        for entry in table.values()
        if entry.HasField("tensor_type")
        for dim in entry.tensor_type.shape.dim
        if dim.HasField("dim_value")
    )


class TypeInfo:
    """Element types and shapes of tensors, from the model's annotations and shape inference."""

    def __init__(self, model_proto_factory):
        self._factory = model_proto_factory
        self._table: dict[str, onnx.TypeProto] | None = None
        self._previous: dict[str, onnx.TypeProto] = {}
        self._stale = False
        self._runs = 0

    def invalidate(self) -> None:
        """The graph changed: tensors created since the last inference are looked up anew."""
        self._stale = True

    def refresh(self) -> None:
        """Infer every shape again at the next query: rewrites (folded Reshape targets, say)
        may have made shapes known that the previous inference could not know."""
        if self._table is not None:
            self._previous, self._table, self._stale = self._table, None, False

    def learns_more(self) -> bool:
        """Infer every shape again now; True when that fixed more dims than were known before."""
        if self._table is None:
            return False
        known = _known_dims(self._table)
        self.refresh()
        return _known_dims(self._load()) > known

    def _entry(self, tensor: str | None) -> onnx.TypeProto | None:
        if not tensor:
            return None
        entry = self._load().get(tensor)
        if entry is None and self._stale:
            # Re-infer, but keep what was known: shape inference stops at operators it does
            # not know (com.microsoft ones a rule created), and rewrites keep the types of
            # the tensors they replace.
            self._previous, self._table, self._stale = self._table, None, False
            entry = self._load().get(tensor)
        return entry

    def _load(self) -> dict[str, onnx.TypeProto]:
        if self._table is None:
            model = self._factory()
            try:
                model = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
            except Exception:  # noqa: BLE001 - inference is best effort; annotations remain
                pass
            table: dict[str, onnx.TypeProto] = {}
            for graph in all_graph_protos(model.graph):
                for value in list(graph.value_info) + list(graph.input) + list(graph.output):
                    if value.type.HasField("tensor_type"):
                        table[value.name] = value.type
                for tensor in graph.initializer:
                    proto = onnx.helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims))
                    table.setdefault(tensor.name, proto)
            self._runs += 1
            self._table = {**table, **_carried(self._previous, table, self._runs - 1)}
            self._previous = {}
        return self._table

    def dtype(self, tensor: str | None) -> np.dtype | None:
        entry = self._entry(tensor)
        if entry is None or not entry.tensor_type.elem_type:
            return None
        try:
            return onnx.helper.tensor_dtype_to_np_dtype(entry.tensor_type.elem_type)
        except (KeyError, ValueError, TypeError):
            return None

    def shape(self, tensor: str | None) -> tuple | None:
        entry = self._entry(tensor)
        if entry is None or not entry.tensor_type.HasField("shape"):
            return None
        dims = []
        for dim in entry.tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                dims.append(dim.dim_value)
            elif dim.HasField("dim_param"):
                dims.append(dim.dim_param)
            else:
                dims.append("?")
        return tuple(dims)
