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
    """Reads initializer values, resolving external data against `base_dir` only."""

    def __init__(self, base_dir: Path | None):
        self.base_dir = base_dir.resolve() if base_dir is not None else None
        self._fingerprints: dict[tuple[int, bool], tuple[TensorProto, bytes]] = {}

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
