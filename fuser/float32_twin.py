"""A 16-bit float model's float32 twin: the same graph computing in float32.

The check compares a float16 (or bfloat16) output with the tolerance of its dtype, but a
rewrite that only changes the order of the arithmetic (a fused attention scaling the query
before the product rather than the scores after it) moves such outputs by a few units in their
last place, and through a deep model by more than any fixed tolerance allows. The twin tells
that rounding apart from an error: run in float32, the original's twin is the closer answer
both 16-bit models are measured against, and the optimized model's twin must agree with it at
float32's tolerance (fuser/verify.py weighs the two).

The twin widens every float16 and bfloat16 tensor the model states, in every subgraph and
function: initializers, tensor attributes (Constant and ConstantOfShape values), the types of
inputs, outputs and value_info, and the integer attributes that name an element type
(_TYPE_ATTRIBUTES: `Cast.to`, `dtype`, a norm's `stash_type`, ...). Operators are unchanged;
every one that takes a 16-bit float also takes float32.
"""

from __future__ import annotations

import os
from collections import ChainMap
from pathlib import Path

import numpy as np
from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, TypeProto, numpy_helper

from fuser.graph import node_bodies, topological_positions
from fuser.tensors import TensorStore, uses_external_data

SIXTEEN_BIT_FLOATS = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
SIXTEEN_BIT_FLOAT_NAMES = ("float16", "bfloat16")
_NAMES = dict(zip(SIXTEEN_BIT_FLOATS, SIXTEEN_BIT_FLOAT_NAMES))
# Integer attributes that name an element type, as the standard operators spell them (the
# type a result is cast to or made in, and the one a norm or attention computes in).
_TYPE_ATTRIBUTES = ("to", "dtype", "output_dtype", "stash_type", "softmax_precision")
# The operators that bring a 16-bit float into a graph of none (looked for in every node of a
# large model: the others are not read).
_TYPE_MAKERS = frozenset({"Cast", "Constant", "ConstantOfShape", "EyeLike", "RandomNormal", "RandomUniform"})


# Operators whose results are no floats whatever they read (a float16 tensor's shape, a
# comparison of float16 values): 16-bit rounding does not reach past them.
NO_FLOAT_RESULTS = frozenset(
    {"Shape", "Size", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor"}
    | {"IsNaN", "IsInf", "ArgMax", "ArgMin", "NonZero"}
)
# Results of index outputs: TopK's and MaxPool's indices, Unique's indices and counts.
_INDEX_RESULTS = {"TopK": (1,), "MaxPool": (1,), "Unique": (1, 2, 3)}
_FLOATS = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16})


def computed_in_sixteen_bit_float(model: ModelProto) -> dict[str, str]:
    """The main graph's outputs computed through a 16-bit float, each with that float's name
    ("float16" or "bfloat16"): 16-bit outputs, and those of another type that a 16-bit tensor
    reaches (a model converted to float16 with its inputs and outputs kept float32 rounds in
    float16 all the same). A tensor is 16-bit when the graph states it so (an input, an
    initializer, an annotation, the type a node casts to or makes); a node reading one makes
    its float results so, not its integer or boolean ones (NO_FLOAT_RESULTS, _INDEX_RESULTS, a
    Cast to an integer). An If, Loop or Scan passes on what its bodies' outputs are, each body
    seeing its own inputs and the tensors of the scopes around it."""
    if sixteen_bit_float_in(model) is None:  # most models: no walk over their nodes
        return {}
    graph = model.graph
    reached: dict = {}
    _reach(graph, reached, {})
    computed = {}
    for value in graph.output:
        found = _sixteen_bit_type(value.type)
        kind = _NAMES[found] if found is not None else reached.get(value.name)
        if kind is not None:
            computed[value.name] = kind
    return computed


# A graph's names: a dict for the main graph, a ChainMap over the enclosing scopes' for a body.
Scope = dict | ChainMap


def _reach(graph: GraphProto, reached: Scope, not_float: Scope) -> None:
    """Add `graph`'s 16-bit tensors to `reached` (name -> float name; None where a body's own
    input hides an outer tensor of its name), and its tensors annotated with another type to
    `not_float`. Nodes are taken in topological order: a graph's may be out of order
    (onnxruntime's float16 converter appends the casts of its kept float32 inputs at the end)."""
    for value in (*graph.input, *graph.value_info, *graph.output):
        found = _sixteen_bit_type(value.type)
        if found is not None:
            reached[value.name] = _NAMES[found]
        elif value.type.WhichOneof("value") == "tensor_type" and value.type.tensor_type.elem_type not in (0, *_FLOATS):
            not_float[value.name] = True  # an index an operator not listed here makes
    for tensor in graph.initializer:
        if tensor.data_type in SIXTEEN_BIT_FLOATS:
            reached[tensor.name] = _NAMES[tensor.data_type]
    nodes = graph.node
    for position in topological_positions(graph) or range(len(nodes)):
        node = nodes[position]
        kind = next(filter(None, map(reached.get, node.input)), None)
        if node.op_type in _TYPE_MAKERS:
            made = _made_type(node)
            if made is not None:
                kind = made
            elif node.op_type == "Cast" and not _casts_to_float(node):
                kind = None
        from_bodies = _body_results(node, reached, not_float)
        if from_bodies is not None:
            for index, body_kind in from_bodies.items():
                if index < len(node.output):
                    _mark(node.output[index], body_kind, reached, not_float)
            continue
        if kind is None or node.op_type in NO_FLOAT_RESULTS:
            continue
        skipped = _INDEX_RESULTS.get(node.op_type, ())
        for index, name in enumerate(node.output):
            if index not in skipped:
                _mark(name, kind, reached, not_float)


def _mark(name: str, kind: str, reached: Scope, not_float: Scope) -> None:
    if name and not not_float.get(name) and reached.get(name) is None:
        reached[name] = kind


def _body_results(node: NodeProto, reached: Scope, not_float: Scope) -> dict[int, str] | None:
    """For an If, Loop or Scan (any node with bodies): which of its outputs a 16-bit float
    reaches, by index; None for a node without bodies. A body's inputs are its own tensors,
    whatever the names around it: 16-bit when annotated so or, unannotated, when the node input
    that feeds them is (a Loop's and a Scan's inputs feed the body's in order)."""
    bodies = list(node_bodies(node))
    if not bodies:
        return None
    # A Loop's body outputs its condition first; the node's outputs are the rest.
    skipped_outputs = 1 if node.op_type == "Loop" else 0
    results: dict[int, str] = {}
    for body in bodies:
        scope, body_not_float = ChainMap({}, reached), ChainMap({}, not_float)
        for index, value in enumerate(body.input):
            fed = node.input[index] if index < len(node.input) else ""
            unannotated = not value.type.HasField("value")
            scope[value.name] = reached.get(fed) if unannotated and fed else None
            body_not_float[value.name] = False
        _reach(body, scope, body_not_float)
        for index, value in enumerate(body.output[skipped_outputs:]):
            kind = scope.get(value.name)
            if kind is not None:
                results.setdefault(index, kind)
    return results


def _casts_to_float(node: NodeProto) -> bool:
    return any(a.name == "to" and a.i in _FLOATS for a in node.attribute)


def _made_type(node: NodeProto) -> str | None:
    """The 16-bit float a type maker (Cast, Constant, ...) makes, if it makes one."""
    for a in node.attribute:
        if a.name in _TYPE_ATTRIBUTES and a.i in SIXTEEN_BIT_FLOATS:
            return _NAMES[a.i]
        if a.t.data_type in SIXTEEN_BIT_FLOATS:
            return _NAMES[a.t.data_type]
    return None


def sixteen_bit_float_in(model: ModelProto) -> str | None:
    """The 16-bit float ("float16" or "bfloat16") the model states first, if any: in an output,
    an input, an initializer, an annotation or the type a node casts to or makes, in the main
    graph or a body. A model converted to float16 with its inputs and outputs kept float32 rounds
    in float16 all the same."""
    return _stated_in(model.graph)


def _made_in(graph: GraphProto) -> str | None:
    """The 16-bit float a node of `graph` or of its bodies makes, or a body states."""
    for node in graph.node:
        if node.op_type in _TYPE_MAKERS:
            made = _made_type(node)
            if made is not None:
                return made
        for body in node_bodies(node):
            found = _stated_in(body)
            if found is not None:
                return found
    return None


def _stated_in(graph: GraphProto) -> str | None:
    for value in (*graph.output, *graph.input, *graph.value_info):
        found = _sixteen_bit_type(value.type)
        if found is not None:
            return _NAMES[found]
    for tensor in graph.initializer:
        if tensor.data_type in SIXTEEN_BIT_FLOATS:
            return _NAMES[tensor.data_type]
    return _made_in(graph)


def float32_twin(model: ModelProto, base_dir: str | os.PathLike | None = None) -> ModelProto:
    """A copy of `model` computing in float32 wherever it computes in a 16-bit float; its
    16-bit initializers stored in external data are read from `base_dir` into the copy."""
    twin = ModelProto()
    twin.CopyFrom(model)
    store = TensorStore(None if base_dir is None else Path(base_dir))
    _widen_graph(twin.graph, store)
    for function in twin.functions:
        for node in function.node:
            _widen_node(node, store)
        for value in function.value_info:
            _widen_type(value.type)
    return twin


def is_sixteen_bit_float(array: np.ndarray) -> bool:
    return array.dtype == np.float16 or str(array.dtype) == "bfloat16"


def widen_array(array: np.ndarray) -> np.ndarray:
    """A 16-bit float array as float32; any other array as it is."""
    return array.astype(np.float32) if is_sixteen_bit_float(array) else array


def _widen_graph(graph: GraphProto, store: TensorStore) -> None:
    for tensor in graph.initializer:
        _widen_tensor(tensor, store)
    for sparse in graph.sparse_initializer:
        _widen_tensor(sparse.values, store)
    for value in (*graph.input, *graph.output, *graph.value_info):
        _widen_type(value.type)
    for node in graph.node:
        _widen_node(node, store)


def _widen_node(node: NodeProto, store: TensorStore) -> None:
    for attribute in node.attribute[:]:
        if attribute.type == AttributeProto.TENSOR:
            _widen_tensor(attribute.t, store)
        elif attribute.type == AttributeProto.TENSORS:
            for tensor in attribute.tensors:
                _widen_tensor(tensor, store)
        elif attribute.type == AttributeProto.SPARSE_TENSOR:
            _widen_tensor(attribute.sparse_tensor.values, store)
        elif attribute.type == AttributeProto.SPARSE_TENSORS:
            for sparse in attribute.sparse_tensors:
                _widen_tensor(sparse.values, store)
        elif attribute.type == AttributeProto.INT and attribute.name in _TYPE_ATTRIBUTES:
            if attribute.i in SIXTEEN_BIT_FLOATS:
                attribute.i = TensorProto.FLOAT
        elif attribute.type == AttributeProto.TYPE_PROTO:
            _widen_type(attribute.tp)
        elif attribute.type == AttributeProto.TYPE_PROTOS:
            for type_proto in attribute.type_protos:
                _widen_type(type_proto)
        elif attribute.type == AttributeProto.GRAPH:
            _widen_graph(attribute.g, store)
        elif attribute.type == AttributeProto.GRAPHS:
            for graph in attribute.graphs:
                _widen_graph(graph, store)


def _widen_tensor(tensor: TensorProto, store: TensorStore) -> None:
    if tensor.data_type not in SIXTEEN_BIT_FLOATS:
        return
    if uses_external_data(tensor):
        inline = TensorProto()
        inline.CopyFrom(tensor)
        del inline.external_data[:]
        inline.data_location = TensorProto.DEFAULT
        inline.raw_data = store.raw_bytes(tensor)
        source = inline
    else:
        source = tensor
    value = numpy_helper.to_array(source).astype(np.float32)
    tensor.CopyFrom(numpy_helper.from_array(value, tensor.name))


def _widen_type(type_proto: TypeProto) -> None:
    kind = type_proto.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        inner = getattr(type_proto, kind)
        if inner.elem_type in SIXTEEN_BIT_FLOATS:
            inner.elem_type = TensorProto.FLOAT
    elif kind == "sequence_type":
        _widen_type(type_proto.sequence_type.elem_type)
    elif kind == "optional_type":
        _widen_type(type_proto.optional_type.elem_type)
    elif kind == "map_type":
        _widen_type(type_proto.map_type.value_type)


def _sixteen_bit_type(type_proto: TypeProto) -> int | None:
    """The 16-bit float element type `type_proto` names, if it names one."""
    kind = type_proto.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        elem_type = getattr(type_proto, kind).elem_type
        return elem_type if elem_type in SIXTEEN_BIT_FLOATS else None
    if kind == "sequence_type":
        return _sixteen_bit_type(type_proto.sequence_type.elem_type)
    if kind == "optional_type":
        return _sixteen_bit_type(type_proto.optional_type.elem_type)
    return None
