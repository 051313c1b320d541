"""Protobuf's wire format, as far as fuser writes and reads ONNX files without protobuf's help.

Writing: a model's initializers go out one at a time between the serialized rest of the model
(fuser.model.write_model), so the field keys and lengths around them are written here.
Reading: large weights inside a .onnx file are left where they lie (read_in_place): the file is
scanned for them, and protobuf parses the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError
from onnx import NodeProto, TensorProto, helper

# Weights of more than this many bytes inside a .onnx file are read where they lie in the file
# (as external data whose location is the file itself) instead of being parsed into memory:
# a single-file export then costs the memory of an external-data one. Not below the size of
# the tensors shape inference reads (fuser.graph.SKELETON_BYTES), which must stay inline.
IN_PLACE_BYTES = 64 << 10

# Field numbers in onnx.proto.
MODEL_IR_VERSION_FIELD = 1
MODEL_GRAPH_FIELD = 7
GRAPH_NODE_FIELD = 1
GRAPH_INITIALIZER_FIELD = 5
GRAPH_INPUT_FIELD = 11
GRAPH_SPARSE_INITIALIZER_FIELD = 15
NODE_ATTRIBUTE_FIELD = 5
VALUE_INFO_NAME_FIELD = 1
VALUE_INFO_TYPE_FIELD = 2
ATTRIBUTE_TENSOR_FIELD = 5
ATTRIBUTE_GRAPH_FIELD = 6
ATTRIBUTE_TENSORS_FIELD = 10
ATTRIBUTE_GRAPHS_FIELD = 11
TENSOR_DATA_TYPE_FIELD = 2
TENSOR_SEGMENT_FIELD = 3
TENSOR_RAW_DATA_FIELD = 9
TENSOR_EXTERNAL_DATA_FIELD = 13
TENSOR_DATA_LOCATION_FIELD = 14
# Wire types.
VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5


def encode_varint(value: int) -> bytes:
    """`value` in protobuf's base-128 varint encoding."""
    # The lengths of a model's nodes and small weights, one or two bytes, take the short way.
    if 0 <= value < 0x80:
        return _ONE_BYTE[value]
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


_ONE_BYTE = [bytes((value,)) for value in range(0x80)]


def varint_size(value: int) -> int:
    """The bytes encode_varint(value) takes, for a non-negative `value`."""
    return max(1, (value.bit_length() + 6) // 7)


def field_key(number: int, wire: int = LENGTH_DELIMITED) -> bytes:
    """The key protobuf writes before a field: its number and wire type."""
    return encode_varint(number << 3 | wire)


class _Unreadable(Exception):
    """The bytes are not a protobuf encoding this reader follows: protobuf's parser decides."""


def read_in_place(buffer: memoryview, file_name: str) -> tuple[bytes, frozenset[int]] | None:
    """The model in `buffer` (the bytes of the .onnx file `file_name`) with the raw data of each
    main-graph initializer of more than IN_PLACE_BYTES replaced by a reference to where it lies
    in the file: parsing the result reads no weights. With it, the offsets of those that stated
    their data_location DEFAULT in the file (fuser.tensors.TensorStore's stated_default). None
    when there is no such initializer, or the bytes are not a model this reader can follow
    (protobuf's own parser then reports it).

    No slice of `buffer` outlives the call: the caller can close the memory map under it."""
    try:
        location = file_name.encode()
    except UnicodeEncodeError:
        return None
    try:
        return _in_place(buffer, location)
    except (_Unreadable, IndexError):
        return None


def _in_place(buffer: memoryview, location: bytes) -> tuple[bytes, frozenset[int]] | None:
    fields = list(_fields(buffer, 0, len(buffer)))
    graphs = [field for field in fields if field[0] == MODEL_GRAPH_FIELD]
    if len(graphs) != 1 or graphs[0][1] != LENGTH_DELIMITED:
        return None  # a graph given in pieces is merged by protobuf: leave it to protobuf
    versions = [_read_varint(buffer, start)[0] for number, _, _, start, _ in fields if number == MODEL_IR_VERSION_FIELD]
    if not versions or versions[-1] < 4:
        return None  # before IR 4 every weight is also a graph input, which the checker reads
    _, _, graph_key, graph_start, graph_end = graphs[0]
    graph = bytearray()
    stated: set[int] = set()
    copied_to = graph_start
    for number, wire, key_start, value_start, value_end in _fields(buffer, graph_start, graph_end):
        if number != GRAPH_INITIALIZER_FIELD or wire != LENGTH_DELIMITED or value_end - value_start <= IN_PLACE_BYTES:
            continue
        referenced = _tensor_in_place(buffer, value_start, value_end, location)
        if referenced is not None:
            tensor, offset, states_location = referenced
            graph += buffer[copied_to:key_start]
            graph += field_key(GRAPH_INITIALIZER_FIELD) + encode_varint(len(tensor)) + tensor
            copied_to = value_end
            if states_location:
                stated.add(offset)
    if copied_to == graph_start:
        return None
    graph += buffer[copied_to:graph_end]
    model = bytearray(buffer[:graph_key])
    model += field_key(MODEL_GRAPH_FIELD) + encode_varint(len(graph))
    model += graph
    del graph
    model += buffer[graph_end:]
    return bytes(model), frozenset(stated)


def _tensor_in_place(buffer: memoryview, start: int, end: int, location: bytes) -> tuple[bytes, int, bool] | None:
    """The TensorProto in buffer[start:end] with its raw data referenced in place, the data's
    offset, and whether it stated its data_location; None to keep it as it is."""
    raw = None
    states_location = False
    kept = bytearray()
    for number, wire, key_start, value_start, value_end in _fields(buffer, start, end):
        if number in (TENSOR_EXTERNAL_DATA_FIELD, TENSOR_SEGMENT_FIELD):
            return None  # already external, or a segment of a tensor: as it is
        if number == TENSOR_DATA_TYPE_FIELD and _read_varint(buffer, value_start)[0] == TensorProto.STRING:
            return None
        if number == TENSOR_DATA_LOCATION_FIELD:
            if wire != VARINT or _read_varint(buffer, value_start)[0] != TensorProto.DEFAULT:
                return None
            states_location = True  # DEFAULT, written out: replaced by EXTERNAL below
        elif number == TENSOR_RAW_DATA_FIELD:
            if raw is not None or wire != LENGTH_DELIMITED:
                return None  # repeated: protobuf keeps the last one; let it
            raw = (value_start, value_end)
        else:
            kept += buffer[key_start:value_end]
    if raw is None or raw[1] - raw[0] <= IN_PLACE_BYTES:
        return None
    for key, value in ((b"location", location), (b"offset", b"%d" % raw[0]), (b"length", b"%d" % (raw[1] - raw[0]))):
        kept += _string_entry(key, value)
    kept += field_key(TENSOR_DATA_LOCATION_FIELD, VARINT) + encode_varint(TensorProto.EXTERNAL)
    return bytes(kept), raw[0], states_location


def _fields(buffer: memoryview, start: int, end: int):
    """(number, wire type, key offset, value offset, value end) of each field in buffer[start:end]."""
    position = start
    while position < end:
        key_start = position
        key, position = _read_varint(buffer, position)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise _Unreadable  # no field has number 0: not protobuf (a file of zeros, say)
        if wire == LENGTH_DELIMITED:
            length, value_start = _read_varint(buffer, position)
            value_end = value_start + length
        elif wire == VARINT:
            value_start, value_end = position, _read_varint(buffer, position)[1]
        elif wire == FIXED64:
            value_start, value_end = position, position + 8
        elif wire == FIXED32:
            value_start, value_end = position, position + 4
        else:
            raise _Unreadable  # groups: onnx.proto has none
        if value_end > end:
            raise _Unreadable
        yield number, wire, key_start, value_start, value_end
        position = value_end


def _read_varint(buffer: memoryview, position: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buffer[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, position
        shift += 7
        if shift > 63:
            raise _Unreadable


def _string_entry(key: bytes, value: bytes) -> bytes:
    """A StringStringEntryProto (key = 1, value = 2) as a TensorProto.external_data field."""
    entry = field_key(1) + encode_varint(len(key)) + key + field_key(2) + encode_varint(len(value)) + value
    return field_key(TENSOR_EXTERNAL_DATA_FIELD) + encode_varint(len(entry)) + entry


# ------------------------------------------------------------------------------------ census

# The shape a ConstantOfShape reads is a handful of int64s, and a tensor whose data is in another
# file is a few names and numbers: initializers up to this size are parsed to see which they are.
SMALL_TENSOR_BYTES = 1024
# protobuf refuses 100 levels of messages, some 33 of graphs in nodes; the scan stops well past that.
MAX_NESTING = 100
# A length or element count beyond this is no tensor a file holds or a machine makes.
MAX_TENSOR_BYTES = 1 << 48
MODEL_FUNCTIONS_FIELD = 25
FUNCTION_NODE_FIELD = 7
TENSOR_DIMS_FIELD = 1
# The key of NodeProto.attribute: a node without this byte has no attribute to look into.
_ATTRIBUTE_KEY = bytes(field_key(NODE_ATTRIBUTE_FIELD))


@dataclass
class Census:
    """What a model file holds, counted from its bytes without parsing the model: what it costs
    to optimize one grows with these (fuser.jobs.estimated_peak)."""

    ir_version: int = 0
    nodes: int = 0  # in every graph and function, subgraphs included
    weight_bytes: int = 0  # initializers and tensor attributes, in the file or in external data
    held_bytes: int = 0  # of which parsed into memory when loaded (not read in place, not external)
    filter_bytes: int = 0  # of which in initializers of 3 or more dimensions (convolution filters)
    computed_bytes: int = 0  # ConstantOfShape results of a shape the file fixes: weights made at run time
    locations: set[str] = field(default_factory=set)  # external data files, as the model names them
    unsized: set[str] = field(default_factory=set)  # of which those a tensor names without its length


def census(buffer: memoryview) -> Census | None:
    """The Census of the serialized ModelProto in `buffer`, or None if it is not one this
    reader follows."""
    counts = Census()
    try:
        for number, wire, _, start, end in _fields(buffer, 0, len(buffer)):
            if number == MODEL_GRAPH_FIELD and wire == LENGTH_DELIMITED:
                _graph_census(buffer, start, end, counts, depth=0)
            elif number == MODEL_FUNCTIONS_FIELD and wire == LENGTH_DELIMITED:
                # onnxruntime inlines a function at each call; counted once, it is a lower bound
                counts.nodes += sum(1 for f in _fields(buffer, start, end) if f[0] == FUNCTION_NODE_FIELD)
            elif number == MODEL_IR_VERSION_FIELD and wire == VARINT:
                counts.ir_version = _read_varint(buffer, start)[0]
    except (_Unreadable, IndexError, DecodeError, ValueError):
        return None
    return counts


def _graph_census(buffer: memoryview, start: int, end: int, counts: Census, depth: int) -> None:
    if depth > MAX_NESTING:
        raise _Unreadable
    fills: list[tuple[str, int]] = []  # (shape tensor, bytes per element) of each ConstantOfShape
    shapes: dict[str, int] = {}  # small constant -> the element count it names as a shape
    for number, wire, _, value_start, value_end in _fields(buffer, start, end):
        if wire != LENGTH_DELIMITED:
            continue
        length = value_end - value_start
        if number == GRAPH_NODE_FIELD:
            counts.nodes += 1
            if length <= SMALL_TENSOR_BYTES:
                node_bytes = bytes(buffer[value_start:value_end])
                if _ATTRIBUTE_KEY not in node_bytes and b"ConstantOfShape" not in node_bytes:
                    continue
                node = NodeProto.FromString(node_bytes)  # a small node: parsing it is quicker than walking it
                if not any(a.HasField("g") or a.graphs for a in node.attribute[:]):
                    held = sum(a.t.ByteSize() + sum(t.ByteSize() for t in a.tensors) for a in node.attribute[:])
                    counts.weight_bytes += held
                    counts.held_bytes += held
                    _constant_node(node, fills, shapes)
                    continue
            _attribute_census(buffer, value_start, value_end, counts, depth)
        elif number == GRAPH_SPARSE_INITIALIZER_FIELD:
            counts.weight_bytes += length
            counts.held_bytes += length
        elif number == GRAPH_INITIALIZER_FIELD:
            small = length <= SMALL_TENSOR_BYTES
            rank, external = (0, False) if small else _tensor_layout(buffer, value_start, value_end)
            if small or external:  # external with a long name, say: still small without its data
                _small_tensor(TensorProto.FromString(bytes(buffer[value_start:value_end])), length, counts, shapes)
                continue
            counts.weight_bytes += length
            # What loading leaves in the file is what read_in_place takes: main-graph raw data
            # over IN_PLACE_BYTES (not float_data, not strings); the rest is parsed into memory.
            if depth or _tensor_in_place(buffer, value_start, value_end, b"") is None:
                counts.held_bytes += length
            if rank >= 3:
                counts.filter_bytes += length
    counts.computed_bytes += sum(shapes[name] * size for name, size in fills if name in shapes)


def _attribute_census(buffer: memoryview, start: int, end: int, counts: Census, depth: int) -> None:
    """The tensors and subgraphs in the attributes of the NodeProto in buffer[start:end]."""
    for number, wire, _, attribute_start, attribute_end in _fields(buffer, start, end):
        if number != NODE_ATTRIBUTE_FIELD or wire != LENGTH_DELIMITED:
            continue
        for inner, inner_wire, _, value_start, value_end in _fields(buffer, attribute_start, attribute_end):
            if inner_wire != LENGTH_DELIMITED:
                continue
            if inner in (ATTRIBUTE_TENSOR_FIELD, ATTRIBUTE_TENSORS_FIELD):
                counts.weight_bytes += value_end - value_start
                counts.held_bytes += value_end - value_start
            elif inner in (ATTRIBUTE_GRAPH_FIELD, ATTRIBUTE_GRAPHS_FIELD):
                _graph_census(buffer, value_start, value_end, counts, depth + 1)


def _tensor_layout(buffer: memoryview, start: int, end: int) -> tuple[int, bool]:
    """How many dims the TensorProto in buffer[start:end] lists, and whether its data is in
    another file (its own data is stepped over, not read)."""
    rank, external = 0, False
    for number, wire, _, value_start, value_end in _fields(buffer, start, end):
        if number == TENSOR_EXTERNAL_DATA_FIELD:
            external = True
        elif number == TENSOR_DATA_LOCATION_FIELD and wire == VARINT:
            external = external or _read_varint(buffer, value_start)[0] == TensorProto.EXTERNAL
        elif number == TENSOR_DIMS_FIELD and wire == VARINT:
            rank += 1
        elif number == TENSOR_DIMS_FIELD and wire == LENGTH_DELIMITED:  # packed
            position = value_start
            while position < value_end:
                position = _read_varint(buffer, position)[1]
                rank += 1
    return rank, external


def _constant_node(node: NodeProto, fills: list[tuple[str, int]], shapes: dict[str, int]) -> None:
    """Note a ConstantOfShape's shape input and element size, or a Constant's value as a shape."""
    if node.domain not in ("", "ai.onnx") or not node.output:
        return
    value = next((a.t for a in node.attribute[:] if a.name == "value" and a.HasField("t")), None)
    if node.op_type == "ConstantOfShape" and node.input:
        element_type = value.data_type if value is not None else TensorProto.FLOAT
        try:
            size = np.dtype(helper.tensor_dtype_to_np_dtype(element_type)).itemsize
        except (KeyError, TypeError):
            size = 4
        fills.append((node.input[0], size))
    elif node.op_type == "Constant" and value is not None:
        _note_shape(value, node.output[0], shapes)


def _note_shape(tensor: TensorProto, name: str, shapes: dict[str, int]) -> None:
    """Remember the element count a 1-D int64 tensor names, were it a shape."""
    if tensor.data_type != TensorProto.INT64 or len(tensor.dims) != 1:
        return
    if tensor.raw_data:
        if len(tensor.raw_data) != 8 * tensor.dims[0]:
            return
        values = np.frombuffer(tensor.raw_data, dtype="<i8")
    else:
        values = tensor.int64_data
    if len(values) == tensor.dims[0] and all(v >= 0 for v in values):
        count = math.prod(int(v) for v in values)
        if count <= MAX_TENSOR_BYTES:
            shapes[name] = count


def _small_tensor(tensor: TensorProto, length: int, counts: Census, shapes: dict[str, int]) -> None:
    """Count an initializer small enough to parse, or one whose data is in another file."""
    if tensor.data_location != TensorProto.EXTERNAL:
        counts.weight_bytes += length
        counts.held_bytes += length
        if len(tensor.dims) >= 3:
            counts.filter_bytes += length
        _note_shape(tensor, tensor.name, shapes)
        return
    entries = {entry.key: entry.value for entry in tensor.external_data}
    counts.locations.add(entries.get("location", ""))
    try:
        size = int(entries["length"])
    except (KeyError, ValueError):
        size = -1
    if not 0 <= size <= MAX_TENSOR_BYTES:
        counts.unsized.add(entries.get("location", ""))
        return
    counts.weight_bytes += size
    if len(tensor.dims) >= 3:
        counts.filter_bytes += size
