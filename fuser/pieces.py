"""A large model's session started in pieces, side by side.

onnxruntime starts a session on one core, in a time that grows faster than the model
(bench/ort_sessions.py: 4.8 s for an 80k-node chain, 2.5 s for its two halves started at once).
The check's session of a large model is therefore made of consecutive pieces of it, each a
session of its own, started in threads (onnxruntime starts them without holding Python's lock);
a run feeds each piece what the pieces before it computed. A piece holds the same nodes reading
the same weights as the whole model, run by the same kernels: the outputs are the whole model's,
bit for bit.

A cut runs between two nodes of the main graph, in its order, through the tensors computed
before it and read after it. Their element types must be known without an inference (the
model's annotations, else element_types: from the operators' schemas), and numpy must hold them
as they are; float16 is not cut through (_CUT_TYPES), as onnxruntime computes much of it in
float32 and rounds only where a float16 tensor leaves its graph. What onnxruntime holds constant
stays constant in every piece: a weight goes into each piece that reads it, and so does a copy
of a Constant node (onnxruntime makes its value a weight at load, and kernels such as MatMul's
pack a constant operand, which changes the sums).
Each piece keeps the annotations of its tensors, so a wrong one fails as in the whole model. A
model with If/Loop/Scan bodies, sparse initializers or a name defined twice is not cut, nor where
a cut would copy more than SHARED_BYTES of weights into two pieces. Where a piece cannot be
started, or a run of the pieces fails, the whole model's session takes over, so every error is
the one the whole model gives.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import onnx
from onnx import GraphProto, ModelProto, TensorProto, helper

from fuser.graph import may_hold_graphs, opset_versions
from fuser.tensors import nbytes

# The fewest nodes of a piece, and the most pieces. onnxruntime's start grows faster than the
# model, so smaller pieces do less work in all: the 66k-node optimized MLP of bench/scale.py
# started in 2.3 to 2.9 s as 16 pieces, 1.9 to 2.6 s as 32 and 1.6 to 1.9 s as 64, its 71k-node
# optimized ResNet stack in 2.3 s, 2.1 s and 1.8 to 1.9 s, and 64 pieces held 0.1 GB less than
# 16 and ran as fast; a 6.6k-node model started in 0.29 s whole, 0.17 s as six pieces. So the
# pieces stay about that small however large the model: the million-node MLP's optimized 666k
# nodes started in 30 s at 6.0 GB as 64 pieces, in 20 s at 4.8 GB as 666, and its 200k-node
# sibling in 6.9 s as 64, 5.5 s as 200.
PIECE_NODES = 1_000
MAX_PIECES = 4_096
MAX_CUT = 64  # tensors crossing one cut
SHARED_BYTES = 16 << 20  # weights copied into more than one piece, in all
# How many pieces onnxruntime starts at the same time, each in a thread of its own. Two cores start
# 666 pieces of the million-node MLP in 19 to 21 s whether 2, 8 or 64 start at once. The check's
# child beside a rewrite (fuser/check_apart.py) starts one at a time, leaving it its core.
AT_ONCE = 64

# Element types a numpy array holds exactly, as onnxruntime hands them over and takes them back.
_NUMPY_TYPES = frozenset(
    {
        TensorProto.FLOAT,
        TensorProto.DOUBLE,
        TensorProto.FLOAT16,
        TensorProto.INT8,
        TensorProto.INT16,
        TensorProto.INT32,
        TensorProto.INT64,
        TensorProto.UINT8,
        TensorProto.UINT16,
        TensorProto.UINT32,
        TensorProto.UINT64,
        TensorProto.BOOL,
    }
)
# What a cut may run through. Not float16: onnxruntime computes a float16 operator that has no
# float16 kernel in float32, between casts, and drops the casts between two such operators, so
# the whole model does not round what they hand on; a cut there, as a piece's output, would.
_CUT_TYPES = _NUMPY_TYPES - {TensorProto.FLOAT16}
# As schemas spell them: "tensor(float)", "tensor(int64)", "tensor(bool)".
_TYPE_STRINGS = {f"tensor({TensorProto.DataType.Name(t).lower()})": t for t in _NUMPY_TYPES}


class PiecewiseSession:
    """Sessions of consecutive pieces of one model, run as the model's one session."""

    def __init__(self, pieces: list, inputs: list[str], outputs: list[str], whole: Callable[[], object]):
        self._pieces = pieces  # (session, the names it reads, the names it hands on)
        self._inputs, self._outputs = inputs, outputs
        self._whole_session = whole
        self._whole = None

    @property
    def pieces(self) -> int:
        """How many pieces run (none once the whole model's session took over)."""
        return len(self._pieces)

    @property
    def handed_over(self) -> bool:
        """Whether a run of the pieces failed, and the whole model's session runs instead."""
        return self._whole is not None

    def get_inputs(self):
        if self._whole is not None:
            return self._whole.get_inputs()
        specs = {spec.name: spec for session, _, _ in self._pieces for spec in session.get_inputs()}
        return [specs[name] for name in self._inputs]

    def get_outputs(self):
        if self._whole is not None:
            return self._whole.get_outputs()
        specs = {spec.name: spec for session, _, _ in self._pieces for spec in session.get_outputs()}
        return [specs[name] for name in self._outputs]

    def run(self, names, feeds, *args, **kwargs):
        """The outputs `names` for `feeds`. If the pieces fail, the whole model's session is started
        and runs from then on (its load error, an InputError, is raised as it is)."""
        if self._whole is None:
            values = dict(feeds)
            try:
                for session, reads, hands_on in self._pieces:
                    values.update(zip(hands_on, session.run(hands_on, {n: values[n] for n in reads}, *args, **kwargs)))
                return [values[name] for name in names]
            except Exception:  # noqa: BLE001 - the whole model's session says what is wrong, if anything
                self._whole = self._whole_session()
                self._pieces = []
        return self._whole.run(names, feeds, *args, **kwargs)


def started_in_pieces(
    model: ModelProto,
    initializers: Iterable[TensorProto],
    start: Callable[[ModelProto], object],
    whole: Callable[[], object],
):
    """A PiecewiseSession of `model` with its main graph's `initializers` (those of the model, or
    held apart: fuser.graph.split_parts), its pieces started by `start` side by side; None where
    the model is not cut, or a piece cannot be started. `whole` starts the whole model's session."""
    graph = model.graph
    count = min(MAX_PIECES, len(graph.node) // PIECE_NODES)
    if count < 2 or graph.sparse_initializer:
        return None
    wiring = Wiring(graph, initializers)
    if any(v.name in wiring.weights for v in graph.input):
        return None  # an initializer a graph input can override is left to the whole model
    bodies = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    if any(may_hold_graphs(n) and any(a.type in bodies for a in n.attribute) for n in graph.node):
        return None
    types = element_types(graph, opset_versions(model), wiring)
    cuts = cut_positions(graph, count, types, wiring)
    if cuts is None:
        return None
    sessions: list = []
    pieces: list = []
    waiting: queue.SimpleQueue = queue.SimpleQueue()
    workers: list[threading.Thread] = []

    def work() -> None:
        while (item := waiting.get()) is not None:
            proto, index = item
            try:
                sessions[index] = start(proto)
            except Exception:  # noqa: BLE001 - the whole model is started instead, and says why if it cannot be
                pass

    # Each piece starts as soon as it is cut out and a worker is free: the next is cut while
    # onnxruntime starts it. AT_ONCE workers at most, however many pieces: a thread each would be
    # thousands for a model of millions of nodes, past what a container may allow a process.
    try:
        for proto, reads, hands_on in _pieces(model, cuts, types, wiring):
            sessions.append(None)
            pieces.append((reads, hands_on))
            waiting.put((proto, len(pieces) - 1))
            if len(workers) < AT_ONCE:
                workers.append(threading.Thread(target=work, name="fuser-piece", daemon=True))
                workers[-1].start()
    finally:
        for _ in workers:
            waiting.put(None)
    for worker in workers:
        worker.join()
    if any(session is None for session in sessions):
        return None
    return PiecewiseSession(
        [(session, reads, hands_on) for session, (reads, hands_on) in zip(sessions, pieces)],
        [v.name for v in graph.input],
        [v.name for v in graph.output],
        whole,
    )


class Wiring:
    """The tensor names each node of a graph reads and writes, read from protobuf once (each
    read of a field makes new strings); the graph's weights and annotations by name, and the
    positions of its Constant nodes."""

    def __init__(self, graph: GraphProto, initializers: Iterable[TensorProto] | None = None):
        self.inputs = [tuple(node.input[:]) for node in graph.node]
        self.outputs = [tuple(node.output[:]) for node in graph.node]
        self.weights = {t.name: t for t in (graph.initializer if initializers is None else initializers)}
        self.annotations = {value.name: value for value in graph.value_info}
        self.constants = {
            position
            for position, node in enumerate(graph.node)
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx")
        }

    def type_of(self, tensor: str, types: dict[str, int]) -> int | None:
        """The element type a piece declares `tensor` with: its annotation's, else the derived one."""
        annotation = self.annotations.get(tensor)
        if annotation is not None and annotation.type.HasField("tensor_type"):
            return annotation.type.tensor_type.elem_type
        return types.get(tensor)

    def declared(self, tensor: str, types: dict[str, int]) -> onnx.ValueInfoProto:
        """`tensor` as a piece's input or output: its annotation, else its derived element type."""
        annotation = self.annotations.get(tensor)
        if annotation is not None and annotation.type.HasField("tensor_type"):
            return annotation
        return helper.make_tensor_value_info(tensor, types[tensor], None)


def element_types(graph: GraphProto, opsets: dict[str, int], wiring: Wiring | None = None) -> dict[str, int]:
    """The element type of each tensor of `graph` that its inputs, initializers and annotations
    give, and the schemas of the operators computing it: an output typed by a type parameter that
    an input of known type binds, or one that allows a single type (Shape's int64), or Cast's `to`."""
    wiring = wiring or Wiring(graph)
    known: dict[str, int] = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            known[value.name] = value.type.tensor_type.elem_type
    known.update((name, t.data_type) for name, t in wiring.weights.items())
    typings: dict[tuple, _Typing | None] = {}
    for node, inputs, outputs in zip(graph.node, wiring.inputs, wiring.outputs):
        key = (node.domain, node.op_type)
        typing = typings.get(key, _UNSEEN)
        if typing is _UNSEEN:
            typing = typings[key] = _typing(key, opsets)
        if typing is None:
            continue
        if typing.from_attributes:
            elem = _attribute_type(node)
            if elem and outputs and outputs[0]:
                known[outputs[0]] = elem
            continue
        bound: dict[str, int] = {}
        params, listed = typing.inputs, len(typing.inputs)
        for slot, name in enumerate(inputs):
            param = params[slot] if slot < listed else typing.variadic
            if param is not None and name in known:
                bound.setdefault(param, known[name])
        for name, (param, fixed) in zip(outputs, typing.output_types(len(outputs))):
            elem = bound.get(param) or fixed
            if name and elem:
                known[name] = elem
    return known


@dataclass(frozen=True)
class _Typing:
    """What an operator's schema says of its element types, as element_types reads it."""

    inputs: tuple[str | None, ...]  # per input slot, the type parameter typing it
    variadic: str | None  # the parameter of inputs past the listed ones
    outputs: tuple[tuple[str | None, int], ...]  # per output, (its type parameter, or its one type)
    variadic_outputs: bool = False  # outputs past the listed ones are typed as the last (Split's)
    from_attributes: bool = False  # the output's type is an attribute's (_attribute_type)

    def output_types(self, count: int) -> tuple[tuple[str | None, int], ...]:
        if self.variadic_outputs and count > len(self.outputs):
            return self.outputs + (self.outputs[-1],) * (count - len(self.outputs))
        return self.outputs


_UNSEEN = object()
_ATTRIBUTE_TYPED = ("Cast", "Constant", "ConstantOfShape")
_CONSTANT_TYPES = {
    "value_float": TensorProto.FLOAT,
    "value_floats": TensorProto.FLOAT,
    "value_int": TensorProto.INT64,
    "value_ints": TensorProto.INT64,
}


def _attribute_type(node) -> int:
    """The element type of a Cast's `to`, a Constant's value or a ConstantOfShape's (float by
    default); 0 when the attributes do not say."""
    if node.op_type == "Cast":
        return next((a.i for a in node.attribute[:] if a.name == "to"), 0)
    for attribute in node.attribute[:]:
        if attribute.name == "value" and attribute.type == onnx.AttributeProto.TENSOR:
            return attribute.t.data_type
        if node.op_type == "Constant" and attribute.name in _CONSTANT_TYPES:
            return _CONSTANT_TYPES[attribute.name]
    return TensorProto.FLOAT if node.op_type == "ConstantOfShape" else 0


def _typing(key: tuple[str, str], opsets: dict[str, int]) -> _Typing | None:
    domain, op_type = key
    domain = "" if domain == "ai.onnx" else domain
    version = opsets.get(domain)
    if version is None:
        return None
    try:
        schema = onnx.defs.get_schema(op_type, version, domain)
    except onnx.defs.SchemaError:
        return None
    if domain == "" and op_type in _ATTRIBUTE_TYPED:
        return _Typing((), None, (), from_attributes=True)
    params = {c.type_param_str for c in schema.type_constraints}
    single = {
        c.type_param_str: c.allowed_type_strs[0] for c in schema.type_constraints if len(c.allowed_type_strs) == 1
    }
    variadic_option = onnx.defs.OpSchema.FormalParameterOption.Variadic
    inputs = tuple(f.type_str if f.type_str in params else None for f in schema.inputs)
    last = schema.inputs[-1] if schema.inputs else None
    variadic = last.type_str if last is not None and last.option == variadic_option and last.is_homogeneous else None
    outputs = tuple(
        (f.type_str if f.type_str in params else None, _TYPE_STRINGS.get(single.get(f.type_str, f.type_str), 0))
        for f in schema.outputs
    )
    if variadic not in params:
        variadic = None
    tail = schema.outputs[-1] if schema.outputs else None
    variadic_outputs = tail is not None and tail.option == variadic_option and tail.is_homogeneous
    return _Typing(inputs, variadic, outputs, variadic_outputs)


def cut_positions(
    graph: GraphProto, count: int, types: dict[str, int], wiring: Wiring | None = None
) -> list[int] | None:
    """Node positions to cut `graph` at into `count` pieces of about equal size, each where the
    tensors crossing the cut are few, of known element types it may run through, or into half
    as many, and so on, where that many cannot be cut (or would copy too many weights); None if
    not even two can, or the nodes are not in topological order."""
    wiring = wiring or Wiring(graph)
    total = len(wiring.inputs)
    sources = {v.name for v in graph.input} | wiring.weights.keys()
    produced: set[str] = set()
    last_read: dict[str, int] = {}
    for position, (inputs, outputs) in enumerate(zip(wiring.inputs, wiring.outputs)):
        for name in inputs:
            if name:
                if name not in produced and name not in sources:
                    return None  # read before it is computed (or never): not an order to cut
                last_read[name] = position
        for name in outputs:
            if name in produced or name in sources:
                return None  # defined twice: the whole model's session refuses it, and says so
            if name:
                produced.add(name)
    if any(value.name not in produced for value in graph.output):
        return None  # an output no node computes (a graph input handed through)
    while count >= 2:
        cuts = _cuts(wiring, count, types, last_read)
        if cuts is not None:
            return cuts
        count = 1 if count == 2 else max(2, count // 2)
    return None


def _cuts(wiring: Wiring, count: int, types: dict[str, int], last_read: dict[str, int]) -> list[int] | None:
    """cut_positions for exactly `count` pieces, or None."""
    total = len(wiring.inputs)
    span = total // (4 * count)
    targets = [round(total * i / count) for i in range(1, count)]
    best: dict[int, tuple] = {}
    live: set[str] = set()
    blocking: set[str] = set()  # the live tensors of a type no cut may run through
    for position in range(1, total):
        previous = position - 1
        if previous not in wiring.constants:  # a Constant is copied into the pieces that read it
            for output in wiring.outputs[previous]:
                if output and last_read.get(output, -1) >= position:
                    live.add(output)
                    if wiring.type_of(output, types) not in _CUT_TYPES:
                        blocking.add(output)
        for name in wiring.inputs[previous]:
            if last_read.get(name) == previous:
                live.discard(name)
                blocking.discard(name)
        # Targets lie a piece apart and a span is under half a piece: only the nearest can be in reach.
        nearest = round(position * count / total) - 1
        if not 0 <= nearest < len(targets) or abs(position - targets[nearest]) > span:
            continue
        target = targets[nearest]
        if len(live) > MAX_CUT or blocking:
            continue
        score = (len(live), abs(position - target))
        if target not in best or score < best[target][0]:
            best[target] = (score, position)
    if len(best) != len(targets):
        return None
    cuts = sorted({best[target][1] for target in targets})
    if len(cuts) != len(targets):
        return None
    bounds = [0, *cuts, total]
    weights = wiring.weights
    readers: dict[str, int] = {}
    shared = 0
    for piece, (start, end) in enumerate(zip(bounds, bounds[1:])):
        for name in {i for inputs in wiring.inputs[start:end] for i in inputs if i in weights}:
            if readers.setdefault(name, piece) != piece:
                shared += nbytes(weights[name])
    return None if shared > SHARED_BYTES else cuts


def _pieces(model: ModelProto, cuts: list[int], types: dict[str, int], wiring: Wiring):
    """The pieces between `cuts`, one at a time: each piece's model, the names it reads (the
    model's inputs and what earlier pieces computed) and the names it hands on (to later pieces,
    and the model's outputs)."""
    graph = model.graph
    bounds = [0, *cuts, len(wiring.inputs)]
    spans = list(zip(bounds, bounds[1:]))
    declared = {v.name: v for v in graph.input}
    outputs = {v.name: v for v in graph.output}
    weights = wiring.weights
    constant_of = {o: position for position in wiring.constants for o in wiring.outputs[position] if o}
    last_reader: dict[str, int] = {}  # per tensor, the last piece reading it
    for index, (start, end) in enumerate(spans):
        for inputs in wiring.inputs[start:end]:
            for name in inputs:
                if name:
                    last_reader[name] = index
    for index, (start, end) in enumerate(spans):
        # In node order (a dict, not a set): a piece's model is the same from run to run.
        made = dict.fromkeys(o for names in wiring.outputs[start:end] for o in names if o)
        reads = list(dict.fromkeys(i for names in wiring.inputs[start:end] for i in names if i and i not in made))
        # Constants computed in an earlier piece are computed again here, as constants.
        copied = sorted({constant_of[name] for name in reads if name in constant_of})
        reads = [name for name in reads if name not in constant_of]
        if index == 0:  # the whole model's session takes them too, though nothing reads them
            reads += [name for name in declared if name not in last_reader]
        hands_on = [
            o
            for position in range(start, end)
            for o in wiring.outputs[position]
            if o and (o in outputs or (last_reader.get(o, -1) > index and position not in wiring.constants))
        ]
        proto = ModelProto()
        proto.ir_version = model.ir_version
        proto.opset_import.extend(model.opset_import)
        proto.functions.extend(model.functions)
        piece = proto.graph
        piece.name = f"{graph.name}_piece{index}"
        piece.node.extend(graph.node[position] for position in copied)
        piece.node.extend(graph.node[start:end])
        piece.initializer.extend(weights[name] for name in reads if name in weights)
        fed = [name for name in reads if name not in weights]
        piece.input.extend(declared[name] if name in declared else wiring.declared(name, types) for name in fed)
        piece.output.extend(outputs[name] if name in outputs else wiring.declared(name, types) for name in hands_on)
        boundary = set(reads) | set(hands_on)
        piece.value_info.extend(
            wiring.annotations[name]
            for name in dict.fromkeys([*made, *(o for position in copied for o in wiring.outputs[position])])
            if name in wiring.annotations and name not in boundary
        )
        yield proto, fed, hands_on
