"""Initializer values on demand, with external data confined to the model's folder.

Initializers stay as TensorProto references (for external data: a file name, an offset
and a length) until a rule asks for a value; only then are bytes read and decoded.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from fuser.errors import InputError, UnsafePathError

# The TensorProto field that holds each data type's values when raw_data is not used, and
# how many entries one element takes there.
_TYPED_FIELDS = {
    TensorProto.FLOAT: ("float_data", 1),
    TensorProto.DOUBLE: ("double_data", 1),
    TensorProto.INT64: ("int64_data", 1),
    TensorProto.UINT64: ("uint64_data", 1),
    TensorProto.UINT32: ("uint64_data", 1),
    TensorProto.COMPLEX64: ("float_data", 2),
    TensorProto.COMPLEX128: ("double_data", 2),
    TensorProto.STRING: ("string_data", 1),
}
_PACKED_4BIT = {getattr(TensorProto, name) for name in ("INT4", "UINT4", "FLOAT4E2M1") if hasattr(TensorProto, name)}


# Comparing tensors: the bytes read first, and the size of the chunks external data is read in.
FINGERPRINT_HEAD = 64
_CHUNK = 1 << 20


def external_data_fields(tensor: TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def uses_external_data(tensor: TensorProto) -> bool:
    return tensor.HasField("data_location") and tensor.data_location == TensorProto.EXTERNAL


class TensorStore:
    """Reads initializer values, resolving external data against `base_dir` only.

    `model_file`: the .onnx file the model was read from, whose large weights are read where
    they lie in it (read_in_place) rather than parsed into memory."""

    def __init__(
        self, base_dir: Path | None, model_file: Path | None = None, stated_default: frozenset[str] = frozenset()
    ):
        """stated_default: the weights read in place whose TensorProto in the file stated its
        data_location (DEFAULT), which they state again when written inline."""
        self.base_dir = base_dir.resolve() if base_dir is not None else None
        self.model_file_name = Path(model_file).name if model_file is not None else None
        self._stated_default = stated_default
        self._fingerprints: dict[tuple[int, bool], tuple[TensorProto, bytes]] = {}

    def in_model_file(self, tensor: TensorProto) -> bool:
        """Whether `tensor`'s data lies in the model's own file: data the file held inline, which
        a model written as one file keeps inline."""
        return (
            self.model_file_name is not None
            and uses_external_data(tensor)
            and external_data_fields(tensor).get("location") == self.model_file_name
        )

    def states_location(self, tensor: TensorProto) -> bool:
        """Whether `tensor`, its external data put inline, says data_location DEFAULT: as the file
        said it for a weight read in place from it; always for data from a file of its own."""
        return not self.in_model_file(tensor) or tensor.name in self._stated_default

    def kept_outside(self, tensor: TensorProto) -> bool:
        """Whether `tensor`'s data is in a file of its own beside the model (external data proper)."""
        return uses_external_data(tensor) and not self.in_model_file(tensor)

    def resolve(self, location: str) -> Path:
        """The file an external-data location names, refused if it escapes the model folder."""
        if self.base_dir is None:
            raise UnsafePathError(f"external data '{location}' cannot be read: the model was not loaded from a file")
        relative = Path(location)
        if relative.is_absolute() or ".." in relative.parts or location.startswith(("/", "\\")):
            raise UnsafePathError(
                f"external data location '{location}' points outside the model's folder; refusing to read it"
            )
        candidate = self.base_dir / relative
        resolved = Path(os.path.realpath(candidate))
        if resolved != self.base_dir and self.base_dir not in resolved.parents:
            raise UnsafePathError(
                f"external data location '{location}' resolves outside the model's folder "
                f"(through a symbolic link); refusing to read it"
            )
        if not resolved.is_file():
            raise UnsafePathError(f"external data file '{location}' does not exist beside the model")
        return resolved

    def check(self, tensor: TensorProto, label: str | None = None) -> None:
        """Refuse a tensor whose stored data cannot be its dtype and dims (InputError naming it).

        External data must resolve inside the model's folder and the file must hold the range.
        """
        label = label or f"initializer '{tensor.name}'"
        count = _element_count(tensor, label)
        if tensor.data_type == TensorProto.STRING:
            return
        needed = _byte_size(tensor.data_type, count)
        if needed is None:
            raise InputError(f"{label} has an unknown data type ({tensor.data_type})")
        if uses_external_data(tensor):
            fields = external_data_fields(tensor)
            path = self.resolve(fields.get("location", ""))
            try:
                offset = int(fields.get("offset", 0))
                length = int(fields["length"]) if "length" in fields else path.stat().st_size - offset
            except ValueError as error:
                raise InputError(f"{label} has a malformed external-data offset or length") from error
            if offset < 0 or length != needed or offset + length > path.stat().st_size:
                raise InputError(
                    f"{label}: its external data ({length} bytes at offset {offset} of "
                    f"'{fields.get('location', '')}', {path.stat().st_size} bytes) does not hold the {needed} bytes "
                    f"its dtype {_type_name(tensor.data_type)} and dims {list(tensor.dims)} need"
                )
            return
        if tensor.HasField("raw_data"):
            stored = len(tensor.raw_data)
        else:
            field, per_element = _TYPED_FIELDS.get(tensor.data_type, ("int32_data", 1))
            stored = len(getattr(tensor, field)) // per_element
            needed = (count + 1) // 2 if tensor.data_type in _PACKED_4BIT else count
            if stored == needed:
                return
            raise InputError(
                f"{label} holds {stored} values but its dtype {_type_name(tensor.data_type)} "
                f"and dims {list(tensor.dims)} need {needed}"
            )
        if stored != needed:
            raise InputError(
                f"{label} holds {stored} bytes but its dtype {_type_name(tensor.data_type)} "
                f"and dims {list(tensor.dims)} need {needed}"
            )

    def raw_bytes(self, tensor: TensorProto) -> bytes:
        """The tensor's data in ONNX's raw (little-endian) layout, wherever it is stored."""
        if uses_external_data(tensor):
            fields = external_data_fields(tensor)
            path = self.resolve(fields.get("location", ""))
            with open(path, "rb") as handle:
                handle.seek(int(fields.get("offset", 0)))
                return handle.read(int(fields["length"])) if "length" in fields else handle.read()
        if tensor.HasField("raw_data"):
            return tensor.raw_data
        return numpy_helper.from_array(numpy_helper.to_array(tensor)).raw_data

    def copy_raw(self, tensor: TensorProto, stream) -> int:
        """Write the tensor's raw data to `stream`, external data in chunks (never all of it in
        memory at once); returns the bytes written."""
        if not uses_external_data(tensor):
            raw = self.raw_bytes(tensor)
            stream.write(raw)
            return len(raw)
        fields = external_data_fields(tensor)
        written = 0
        with open(self.resolve(fields.get("location", "")), "rb") as handle:
            handle.seek(int(fields.get("offset", 0)))
            remaining = int(fields["length"]) if "length" in fields else -1
            while remaining != 0:
                chunk = handle.read(_CHUNK if remaining < 0 else min(remaining, _CHUNK))
                if not chunk:
                    break
                stream.write(chunk)
                written += len(chunk)
                remaining = remaining - len(chunk) if remaining > 0 else remaining
        return written

    def fingerprint(self, tensor: TensorProto, whole: bool = True) -> bytes:
        """Bytes that differ when two tensors' data differ: the first FINGERPRINT_HEAD bytes, or
        (whole) a BLAKE2b digest of all of them. Computed once per tensor; external data is read
        in chunks, so comparing weights never holds a second copy of them."""
        key = (id(tensor), whole)
        cached = self._fingerprints.get(key)
        if cached is not None and cached[0] is tensor:
            return cached[1]
        if uses_external_data(tensor):
            fields = external_data_fields(tensor)
            with open(self.resolve(fields.get("location", "")), "rb") as handle:
                handle.seek(int(fields.get("offset", 0)))
                remaining = int(fields["length"]) if "length" in fields else -1
                if not whole:
                    result = handle.read(FINGERPRINT_HEAD if remaining < 0 else min(remaining, FINGERPRINT_HEAD))
                else:
                    digest = hashlib.blake2b()
                    while remaining != 0:
                        chunk = handle.read(_CHUNK if remaining < 0 else min(remaining, _CHUNK))
                        if not chunk:
                            break
                        digest.update(chunk)
                        remaining = remaining - len(chunk) if remaining > 0 else remaining
                    result = digest.digest()
        else:
            raw = self.raw_bytes(tensor)
            result = hashlib.blake2b(raw).digest() if whole else raw[:FINGERPRINT_HEAD]
        self._fingerprints[key] = (tensor, result)  # the tensor is kept so its id is never reused
        return result

    def value(self, tensor: TensorProto, max_bytes: int | None = None) -> np.ndarray | None:
        """Decode `tensor`; None when it is larger than `max_bytes`."""
        if max_bytes is not None and nbytes(tensor) > max_bytes:
            return None
        self.check(tensor)  # a rule must never see bytes that do not fit the dtype and dims
        if not uses_external_data(tensor):
            return numpy_helper.to_array(tensor)
        raw = self.raw_bytes(tensor)
        inline = TensorProto()
        inline.CopyFrom(tensor)
        del inline.external_data[:]
        inline.data_location = TensorProto.DEFAULT
        inline.raw_data = raw
        return numpy_helper.to_array(inline)


def nbytes(tensor: TensorProto) -> int:
    count = 1
    for dim in tensor.dims:
        count *= dim
    itemsize = _itemsize(tensor.data_type)
    return count * (8 if itemsize is None else itemsize)


def raw_size(tensor: TensorProto) -> int | None:
    """The bytes of `tensor`'s data in ONNX's raw layout (4-bit types packed two to a byte)."""
    count = 1
    for dim in tensor.dims:
        count *= dim
    return _byte_size(tensor.data_type, count)


def _element_count(tensor: TensorProto, label: str) -> int:
    if any(d < 0 for d in tensor.dims):
        raise InputError(f"{label} has a negative dimension: {list(tensor.dims)}")
    count = 1
    for dim in tensor.dims:
        count *= dim
    return count


def _byte_size(data_type: int, count: int) -> int | None:
    if data_type in _PACKED_4BIT:
        return (count + 1) // 2
    itemsize = _itemsize(data_type)
    return None if itemsize is None else count * itemsize


_ITEMSIZES: dict[int, int | None] = {}


def _itemsize(data_type: int) -> int | None:
    """Bytes per element of an ONNX data type (None if unknown), looked up once per type:
    onnx's mapping is slow, and a large model asks for every initializer."""
    if data_type not in _ITEMSIZES:
        try:
            _ITEMSIZES[data_type] = onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize
        except (KeyError, ValueError, TypeError):
            _ITEMSIZES[data_type] = None
    return _ITEMSIZES[data_type]


def _type_name(data_type: int) -> str:
    try:
        return TensorProto.DataType.Name(data_type).lower()
    except ValueError:
        return str(data_type)


# Weights of more than this many bytes inside a .onnx file are read where they lie in the file
# (as external data whose location is the file itself) instead of being parsed into memory:
# a single-file export then costs the memory of an external-data one. Not below the size of
# the tensors shape inference reads (fuser.graph.SKELETON_BYTES), which must stay inline.
IN_PLACE_BYTES = 64 << 10

# Field numbers and wire types in onnx.proto and protobuf's encoding.
_MODEL_IR_VERSION = 1
MODEL_GRAPH_FIELD = 7  # ModelProto.graph
GRAPH_INITIALIZER_FIELD = 5  # GraphProto.initializer
_TENSOR_DATA_TYPE = 2
_TENSOR_SEGMENT = 3
_TENSOR_NAME = 8
_TENSOR_RAW_DATA = 9
_TENSOR_EXTERNAL_DATA = 13
_TENSOR_DATA_LOCATION = 14
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


class _Unreadable(Exception):
    """The bytes are not a protobuf encoding this reader follows: protobuf's parser decides."""


def read_in_place(buffer: memoryview, file_name: str) -> tuple[bytes, frozenset[str]] | None:
    """The model in `buffer` (the bytes of the .onnx file `file_name`) with the raw data of each
    main-graph initializer of more than IN_PLACE_BYTES replaced by a reference to where it lies in
    the file: parsing the result reads no weights. With it, the names of those initializers that
    stated their data_location (TensorStore's stated_default). None when there is no such
    initializer, or the bytes are not a model this reader can follow (protobuf's own parser then
    reports it)."""
    try:
        return _in_place(buffer, file_name)
    except (_Unreadable, IndexError, UnicodeDecodeError):
        return None


def _in_place(buffer: memoryview, file_name: str) -> tuple[bytes, frozenset[str]] | None:
    fields = list(_fields(buffer, 0, len(buffer)))
    graphs = [field for field in fields if field[0] == MODEL_GRAPH_FIELD]
    if len(graphs) != 1 or graphs[0][1] != _LENGTH_DELIMITED:
        return None  # a graph given in pieces is merged by protobuf: leave it to protobuf
    versions = [_read_varint(buffer, start)[0] for number, wire, _, start, _ in fields if number == _MODEL_IR_VERSION]
    if not versions or versions[-1] < 4:
        return None  # before IR 4 every weight is also a graph input, which the checker reads
    _, _, graph_key, graph_start, graph_end = graphs[0]
    pieces: list = []
    stated: set[str] = set()
    copied_to = graph_start
    for number, wire, key_start, value_start, value_end in _fields(buffer, graph_start, graph_end):
        if number != GRAPH_INITIALIZER_FIELD or wire != _LENGTH_DELIMITED or value_end - value_start <= IN_PLACE_BYTES:
            continue
        tensor = _tensor_in_place(buffer, value_start, value_end, file_name, stated)
        if tensor is not None:
            pieces += [
                buffer[copied_to:key_start],
                field_key(GRAPH_INITIALIZER_FIELD, _LENGTH_DELIMITED),
                encode_varint(len(tensor)),
            ]
            pieces.append(tensor)
            copied_to = value_end
    if not pieces:
        return None
    pieces.append(buffer[copied_to:graph_end])
    graph = b"".join(pieces)
    head = field_key(MODEL_GRAPH_FIELD, _LENGTH_DELIMITED) + encode_varint(len(graph))
    return b"".join([buffer[:graph_key], head, graph, buffer[graph_end:]]), frozenset(stated)


def _tensor_in_place(buffer: memoryview, start: int, end: int, file_name: str, stated: set[str]) -> bytes | None:
    """The TensorProto in buffer[start:end] with its raw data referenced in place, or None to keep
    it; adds its name to `stated` if it states its data_location."""
    raw = name = None
    states_location = False
    kept = []
    for number, wire, key_start, value_start, value_end in _fields(buffer, start, end):
        if number in (_TENSOR_EXTERNAL_DATA, _TENSOR_SEGMENT):
            return None  # already external, or a segment of a tensor: as it is
        if number == _TENSOR_DATA_TYPE and _read_varint(buffer, value_start)[0] == TensorProto.STRING:
            return None
        if number == _TENSOR_DATA_LOCATION:
            if wire != _VARINT or _read_varint(buffer, value_start)[0] != TensorProto.DEFAULT:
                return None
            states_location = True  # DEFAULT, written out: replaced by EXTERNAL below
            continue
        if number == _TENSOR_NAME:
            name = bytes(buffer[value_start:value_end]).decode()
        if number == _TENSOR_RAW_DATA:
            if raw is not None or wire != _LENGTH_DELIMITED:
                return None  # repeated: protobuf keeps the last one; let it
            raw = (value_start, value_end)
        else:
            kept.append(buffer[key_start:value_end])
    if raw is None or raw[1] - raw[0] <= IN_PLACE_BYTES:
        return None
    if states_location:
        stated.add(name or "")
    where = (("location", file_name), ("offset", str(raw[0])), ("length", str(raw[1] - raw[0])))
    kept += [_string_entry(key, value) for key, value in where]
    kept.append(field_key(_TENSOR_DATA_LOCATION, _VARINT) + encode_varint(TensorProto.EXTERNAL))
    return b"".join(kept)


def _fields(buffer: memoryview, start: int, end: int):
    """(number, wire type, key offset, value offset, value end) of each field in buffer[start:end]."""
    position = start
    while position < end:
        key_start = position
        key, position = _read_varint(buffer, position)
        number, wire = key >> 3, key & 7
        if wire == _LENGTH_DELIMITED:
            length, value_start = _read_varint(buffer, position)
            value_end = value_start + length
        elif wire == _VARINT:
            value_start, value_end = position, _read_varint(buffer, position)[1]
        elif wire == _FIXED64:
            value_start, value_end = position, position + 8
        elif wire == _FIXED32:
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


def field_key(number: int, wire: int = _LENGTH_DELIMITED) -> bytes:
    """The key protobuf writes before a field: its number and wire type."""
    return encode_varint(number << 3 | wire)


def _string_entry(key: str, value: str) -> bytes:
    """A StringStringEntryProto (key = 1, value = 2) as a TensorProto.external_data field."""
    entry = b"".join(
        field_key(number, _LENGTH_DELIMITED) + encode_varint(len(text.encode())) + text.encode()
        for number, text in ((1, key), (2, value))
    )
    return field_key(_TENSOR_EXTERNAL_DATA, _LENGTH_DELIMITED) + encode_varint(len(entry)) + entry
