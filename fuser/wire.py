"""Protobuf's wire format, as far as fuser writes and reads ONNX files without protobuf's help.

Writing: a model's initializers go out one at a time between the serialized rest of the model
(fuser.model.write_model), so the field keys and lengths around them are written here.
Reading: large weights inside a .onnx file are left where they lie (read_in_place): the file is
scanned for them, and protobuf parses the rest.
"""

from __future__ import annotations

from onnx import TensorProto

# Weights of more than this many bytes inside a .onnx file are read where they lie in the file
# (as external data whose location is the file itself) instead of being parsed into memory:
# a single-file export then costs the memory of an external-data one. Not below the size of
# the tensors shape inference reads (fuser.graph.SKELETON_BYTES), which must stay inline.
IN_PLACE_BYTES = 64 << 10

# Field numbers in onnx.proto.
MODEL_IR_VERSION_FIELD = 1
MODEL_GRAPH_FIELD = 7
GRAPH_INITIALIZER_FIELD = 5
TENSOR_DATA_TYPE_FIELD = 2
TENSOR_SEGMENT_FIELD = 3
TENSOR_RAW_DATA_FIELD = 9
TENSOR_EXTERNAL_DATA_FIELD = 13
TENSOR_DATA_LOCATION_FIELD = 14
# Wire types.
VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5


def encode_varint(value: int) -> bytes:
    """`value` in protobuf's base-128 varint encoding."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


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
