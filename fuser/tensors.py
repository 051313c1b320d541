"""Initializer values on demand, with external data confined to the model's folder.

Initializers stay as TensorProto references (for external data: a file name, an offset
and a length) until a rule asks for a value; only then are bytes read and decoded.
"""

from __future__ import annotations

import hashlib
import os
import sys
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
# Element types narrower than a byte, packed in raw data: bits per element.
_PACKED_BITS = {
    getattr(TensorProto, name): bits
    for name, bits in (
        ("INT4", 4),
        ("UINT4", 4),
        ("FLOAT4E2M1", 4),
        ("INT2", 2),
        ("UINT2", 2),
        ("FLOAT6E2M3", 6),
        ("FLOAT6E3M2", 6),
    )
    if hasattr(TensorProto, name)
}
# Stored as typed values, 4-bit elements go two to an int32 and 2-bit ones four (6-bit ones one).
_PER_TYPED_VALUE = {data_type: {4: 2, 2: 4}.get(bits, 1) for data_type, bits in _PACKED_BITS.items()}


# Element types stored one numpy element per raw element, little-endian as ONNX's raw data is.
_PLAIN_DTYPES = (
    {
        getattr(TensorProto, name): onnx.helper.tensor_dtype_to_np_dtype(getattr(TensorProto, name))
        for name in (
            "FLOAT",
            "DOUBLE",
            "FLOAT16",
            "BFLOAT16",
            "INT8",
            "UINT8",
            "INT16",
            "UINT16",
            "INT32",
            "UINT32",
            "INT64",
            "UINT64",
            "BOOL",
        )
    }
    if sys.byteorder == "little"
    else {}
)


def plain_dtype(data_type: int) -> np.dtype | None:
    """The numpy dtype that reads ONNX's raw data of `data_type` element by element, for the
    plain types (_PLAIN_DTYPES); None for any other (packed, 8-bit float, string)."""
    return _PLAIN_DTYPES.get(data_type)


# Comparing tensors: the bytes read first, and the size of the chunks external data is read in.
FINGERPRINT_HEAD = 64
# A tensor held inline whose data is at most this many bytes has its fingerprint computed again at each ask.
KEPT_FINGERPRINT_BYTES = 1 << 12
_CHUNK = 1 << 20


def external_data_fields(tensor: TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def uses_external_data(tensor: TensorProto) -> bool:
    return tensor.data_location == _EXTERNAL  # an unset data_location reads as DEFAULT


_EXTERNAL = TensorProto.EXTERNAL


def names_a_file_inside(location: str) -> bool:
    """Whether an external-data location, read as written, stays inside the model's folder."""
    relative = Path(location)
    return not (relative.is_absolute() or ".." in relative.parts or location.startswith(("/", "\\")))


class TensorStore:
    """Reads initializer values, resolving external data against `base_dir` only."""

    def __init__(
        self,
        base_dir: Path | None,
        model_file: Path | None = None,
        stated_default: frozenset[int] = frozenset(),
        identity: tuple | None = None,
    ):
        """model_file: the .onnx file the model was read from, whose large weights are read where
        they lie in it (fuser.wire.read_in_place); identity: the file's (file_identity) when it
        was read, which it must keep while they are; stated_default: the offsets of those weights
        whose TensorProto in the file stated its data_location (DEFAULT), which they state again
        when written inline."""
        self.base_dir = base_dir.resolve() if base_dir is not None else None
        self.model_file_name = Path(model_file).name if model_file is not None else None
        self.model_file = Path(os.path.realpath(model_file)) if model_file is not None else None
        self._model_file_identity = identity
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
        if not self.in_model_file(tensor):
            return True
        return int(external_data_fields(tensor).get("offset", -1)) in self._stated_default

    def kept_outside(self, tensor: TensorProto) -> bool:
        """Whether `tensor`'s data is in a file of its own beside the model (external data proper)."""
        return uses_external_data(tensor) and not self.in_model_file(tensor)

    def data_file(self, tensor: TensorProto) -> tuple[Path, int, int | None]:
        """The file, offset and length (None: to its end) of an external tensor's data; refused
        if it escapes the model's folder, or is the model's own file and that changed since it
        was read (its weights would no longer be where they were)."""
        fields = external_data_fields(tensor)
        path = self.resolve(fields.get("location", ""))
        if (
            self._model_file_identity is not None
            and path == self.model_file
            and file_identity(os.stat(path)) != self._model_file_identity
        ):
            raise InputError(
                f"{path}: the file changed since the model was read from it, and its weights are read "
                "from it where they lay; load the model again"
            )
        return path, int(fields.get("offset", 0)), int(fields["length"]) if "length" in fields else None

    def resolve(self, location: str) -> Path:
        """The file an external-data location names, refused if it escapes the model folder."""
        if self.base_dir is None:
            raise UnsafePathError(f"external data '{location}' cannot be read: the model was not loaded from a file")
        if "\0" in location:
            raise UnsafePathError(f"external data location {location!r} holds a NUL byte, which names no file")
        relative = Path(location)
        if not names_a_file_inside(location):
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
        if not _misfit(tensor):
            return  # asked again at every decode of a weight: the common case is settled at once
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
            if self.in_model_file(tensor) and length != needed:  # inline in the file: say it as for inline data
                raise InputError(
                    f"{label} holds {length} bytes but its dtype {_type_name(tensor.data_type)} "
                    f"and dims {list(tensor.dims)} need {needed}"
                )
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
            per_value = _PER_TYPED_VALUE.get(tensor.data_type, 1)
            needed = -(-count // per_value)
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
            path, offset, length = self.data_file(tensor)
            with open(path, "rb") as handle:
                handle.seek(offset)
                return handle.read() if length is None else handle.read(length)
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
        written = 0
        for chunk in self._chunks(tensor):
            stream.write(chunk)
            written += len(chunk)
        return written

    def fingerprint(self, tensor: TensorProto, whole: bool = True) -> bytes:
        """Bytes that differ when two tensors' data differ: the first FINGERPRINT_HEAD bytes, or
        (whole) a BLAKE2b digest of all of them. Computed once for a tensor whose data is read
        from a file or is large (KEPT_FINGERPRINT_BYTES); a small inline one's, at each ask (the
        666k weights of the million-node stack held 49 MB of them). External data is read in
        chunks, so comparing weights never holds a second copy of them."""
        key = (id(tensor), whole)
        cached = self._fingerprints.get(key)
        if cached is not None and cached[0] is tensor:
            return cached[1]
        if uses_external_data(tensor):
            if whole:
                digest = hashlib.blake2b()
                for chunk in self._chunks(tensor):
                    digest.update(chunk)
                result = digest.digest()
            else:
                result = next(self._chunks(tensor, limit=FINGERPRINT_HEAD), b"")
        else:
            raw = self.raw_bytes(tensor)
            result = hashlib.blake2b(raw).digest() if whole else raw[:FINGERPRINT_HEAD]
            if len(raw) <= KEPT_FINGERPRINT_BYTES:
                return result
        self._fingerprints[key] = (tensor, result)  # the tensor is kept so its id is never reused
        return result

    def _chunks(self, tensor: TensorProto, limit: int | None = None):
        """An external tensor's data in chunks of at most _CHUNK bytes (its first `limit` bytes)."""
        path, offset, remaining = self.data_file(tensor)
        if limit is not None:
            remaining = limit if remaining is None else min(remaining, limit)
        with open(path, "rb") as handle:
            handle.seek(offset)
            while remaining != 0:
                chunk = handle.read(_CHUNK if remaining is None else min(remaining, _CHUNK))
                if not chunk:
                    return
                yield chunk
                if remaining is not None:
                    remaining -= len(chunk)

    def value(self, tensor: TensorProto, max_bytes: int | None = None) -> np.ndarray | None:
        """Decode `tensor`; None when it is larger than `max_bytes`."""
        plain = _plain_value(tensor, max_bytes)
        if plain is not None:
            return None if plain is _TOO_LARGE else plain
        if max_bytes is not None and nbytes(tensor) > max_bytes:
            return None
        self.check(tensor)  # a rule must never see bytes that do not fit the dtype and dims
        if not uses_external_data(tensor):
            dtype = _PLAIN_DTYPES.get(tensor.data_type)
            if dtype is not None and tensor.HasField("raw_data") and not tensor.HasField("segment"):
                # What numpy_helper.to_array does for these, without its per-call type lookups.
                return np.frombuffer(tensor.raw_data, dtype).reshape(tuple(tensor.dims[:]))
            return numpy_helper.to_array(tensor)
        raw = self.raw_bytes(tensor)
        inline = TensorProto()
        inline.CopyFrom(tensor)
        del inline.external_data[:]
        inline.data_location = TensorProto.DEFAULT
        inline.raw_data = raw
        return numpy_helper.to_array(inline)


_TOO_LARGE = np.empty(0)
_PLAIN_TYPES = {dtype: data_type for data_type, dtype in _PLAIN_DTYPES.items()}


def from_array(array: np.ndarray, name: str) -> TensorProto:
    """numpy_helper.from_array's TensorProto, made at once for a plain dtype (raw little-endian
    bytes, what from_array writes for them): rewrites of a large model make hundreds of
    thousands of small weights, and from_array takes 10 microseconds for each."""
    data_type = _PLAIN_TYPES.get(array.dtype)
    if data_type is None:
        return numpy_helper.from_array(array, name)
    return TensorProto(name=name, data_type=data_type, dims=array.shape, raw_data=array.tobytes())


def _plain_value(tensor: TensorProto, max_bytes: int | None) -> np.ndarray | None:
    """What almost every stored tensor is, decoded with each protobuf field read once: inline
    raw data of a plain dtype, exactly as long as its dims call for (_TOO_LARGE past
    `max_bytes`); None for anything else, which the full check and decoding handle."""
    dtype = _PLAIN_DTYPES.get(tensor.data_type)
    if dtype is None or tensor.data_location == TensorProto.EXTERNAL or tensor.HasField("segment"):
        return None
    raw = tensor.raw_data
    dims = tuple(tensor.dims[:])
    count = 1
    for dim in dims:
        if dim < 0:
            return None
        count *= dim
    if not raw or len(raw) != count * dtype.itemsize:
        return None
    if max_bytes is not None and len(raw) > max_bytes:
        return _TOO_LARGE
    return np.ndarray(dims, dtype, raw)  # over the bytes themselves: read-only for good (read_only)


def read_only(value: np.ndarray) -> np.ndarray:
    """`value` as a rule may be handed it: itself where it is an array over immutable bytes (a
    weight decoded by _plain_value, which nothing can make writeable), else a read-only view,
    which cannot be made writeable either, while the array it shows stays the holder's."""
    if type(value.base) is bytes:  # setting a flag takes longer than the rest of reading a small weight
        return value
    view = value.view()
    view.flags.writeable = False
    return view


def nbytes(tensor: TensorProto) -> int:
    count = 1
    for dim in tensor.dims[:]:
        count *= dim
    itemsize = _itemsize(tensor.data_type)
    return count * (8 if itemsize is None else itemsize)


def file_identity(status: os.stat_result) -> tuple[int, int, int, int]:
    """What tells a file from the same path rewritten: device, inode, size, modification time."""
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def raw_size(tensor: TensorProto) -> int | None:
    """The bytes of `tensor`'s data in ONNX's raw layout (4-bit types packed two to a byte)."""
    count = 1
    for dim in tensor.dims[:]:
        count *= dim
    return _byte_size(tensor.data_type, count)


def _misfit(tensor: TensorProto) -> bool:
    """Whether `tensor` needs the full check: anything but inline raw data of the size its dims
    and dtype call for (which is what almost every stored tensor is)."""
    count = 1
    for dim in tensor.dims[:]:
        if dim < 0:
            return True
        count *= dim
    needed = _byte_size(tensor.data_type, count)
    return (
        needed is None
        or tensor.data_location == TensorProto.EXTERNAL
        or not tensor.HasField("raw_data")
        or len(tensor.raw_data) != needed
    )


def _element_count(tensor: TensorProto, label: str) -> int:
    if any(d < 0 for d in tensor.dims[:]):
        raise InputError(f"{label} has a negative dimension: {list(tensor.dims)}")
    count = 1
    for dim in tensor.dims[:]:
        count *= dim
    return count


def _byte_size(data_type: int, count: int) -> int | None:
    bits = _PACKED_BITS.get(data_type)
    if bits is not None:
        return -(-count * bits // 8)
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
