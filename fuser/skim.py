"""What shape inference found, read from its serialized model without building all of it.

An inferred model of a large graph is mostly nodes whose inputs, attributes and names the type
table has no use for. Parsed as a ModelProto, every tensor's type is a message of its own that
is read field by field in Python: 0.65 s of the load check's 2 s for a 100k-node stack. Parsed
with the messages below, which declare only the fields the table reads (protobuf keeps the
others as unparsed bytes, in C) and a ValueInfoProto's type as its bytes, no message is made of
what the table does not read, and each distinct type is read once rather than once per tensor:
0.5 s there, and 5.9 s against 6.8 s for a million nodes.

The messages keep ONNX's field numbers and names, so a graph's bodies are found as
fuser.graph.all_graph_protos finds them in a GraphProto.
"""

from __future__ import annotations

import functools

import onnx
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from fuser.graph import node_bodies, op_may_hold_graphs

try:  # onnx's own binding: the inferred model as bytes, without a ModelProto made of them and serialized again
    from onnx.onnx_cpp2py_export import shape_inference as _inference
except ImportError:  # pragma: no cover - an onnx that moved it
    _inference = None

_OPTIONAL = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
_REPEATED = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
_KINDS = {
    "string": descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
    "bytes": descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
    "int32": descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
    "int64": descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
}

# message -> [(field, number, kind or message, repeated)], with onnx.proto's numbers.
_MESSAGES = {
    "Model": [("graph", 7, "Graph", False)],
    "Graph": [
        ("node", 1, "Node", True),
        ("initializer", 5, "Tensor", True),
        ("input", 11, "ValueInfo", True),
        ("output", 12, "ValueInfo", True),
        ("value_info", 13, "ValueInfo", True),
    ],
    "Node": [
        ("output", 2, "string", True),
        ("op_type", 4, "string", False),
        ("attribute", 5, "Attribute", True),
        ("domain", 7, "string", False),
    ],
    "Attribute": [("g", 6, "Graph", False), ("graphs", 11, "Graph", True), ("type", 20, "int32", False)],
    "Tensor": [("dims", 1, "int64", True), ("data_type", 2, "int32", False), ("name", 8, "string", False)],
    # The type kept as the bytes of its TypeProto: a submessage and a bytes field look alike on
    # the wire. (A type given twice in one ValueInfo, which protobuf merges as messages, would be
    # read as its last: neither onnx nor protobuf writes one so.)
    "ValueInfo": [("name", 1, "string", False), ("type", 2, "bytes", False)],
}


@functools.cache
def _model_class():
    package = "fuser.skim"
    # proto2, as onnx.proto is: names are not checked for UTF-8 here if onnx's parser does not check them.
    file = descriptor_pb2.FileDescriptorProto(name="fuser/skim.proto", package=package, syntax="proto2")
    for name, fields in _MESSAGES.items():
        message = file.message_type.add(name=name)
        for field, number, kind, repeated in fields:
            entry = message.field.add(name=field, number=number, label=_REPEATED if repeated else _OPTIONAL)
            if kind in _KINDS:
                entry.type = _KINDS[kind]
            else:
                entry.type = descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
                entry.type_name = f".{package}.{kind}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    descriptor = pool.FindMessageTypeByName(f"{package}.Model")
    if hasattr(message_factory, "GetMessageClass"):  # protobuf 4.21 and later
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)  # pragma: no cover - older protobuf


def skimmed(serialized: bytes):
    """The model in `serialized` with only the fields a type table reads: the graphs' value
    infos (each type as its TypeProto's bytes), inputs, outputs, initializers' names, types and
    dims, and nodes' outputs and the bodies they hold."""
    return _model_class().FromString(serialized)


def graphs_and_outputs(graph) -> tuple[list, list[str]]:
    """`graph` and every body nested in it, outermost first (as fuser.graph.all_graph_protos
    lists them), and the outputs of all their nodes: one pass over the nodes for both, which
    for a million nodes is most of the reading."""
    graphs: list = []
    outputs: list[str] = []

    def visit(graph) -> None:
        graphs.append(graph)
        for node in graph.node[:]:
            outputs.extend(node.output[:])
            if op_may_hold_graphs(node.op_type, node.domain):
                for body in node_bodies(node):
                    visit(body)

    visit(graph)
    return graphs, outputs


def infer_serialized(
    model: bytes, *, check_type: bool = False, strict_mode: bool = False, data_prop: bool = False
) -> bytes:
    """onnx.shape_inference.infer_shapes of a serialized model, serialized as onnx returns it."""
    if _inference is None:  # pragma: no cover
        return onnx.shape_inference.infer_shapes(
            model, check_type=check_type, strict_mode=strict_mode, data_prop=data_prop
        ).SerializeToString()
    return _inference.infer_shapes(model, check_type, strict_mode, data_prop)
