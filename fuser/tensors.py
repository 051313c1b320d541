"""Initializer values on demand, with external data confined to the model's folder.

Initializers stay as TensorProto references (for external data: a file name, an offset
and a length) until a rule asks for a value; only then are bytes read and decoded.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from fuser.errors import UnsafePathError


def external_data_fields(tensor: TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def uses_external_data(tensor: TensorProto) -> bool:
    return tensor.HasField("data_location") and tensor.data_location == TensorProto.EXTERNAL


class TensorStore:
    """Reads initializer values, resolving external data against `base_dir` only."""

    def __init__(self, base_dir: Path | None):
        self.base_dir = base_dir.resolve() if base_dir is not None else None

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

    def check(self, tensor: TensorProto) -> None:
        if uses_external_data(tensor):
            self.resolve(external_data_fields(tensor).get("location", ""))

    def value(self, tensor: TensorProto, max_bytes: int | None = None) -> np.ndarray | None:
        """Decode `tensor`; None when it is larger than `max_bytes`."""
        if max_bytes is not None and nbytes(tensor) > max_bytes:
            return None
        if not uses_external_data(tensor):
            return numpy_helper.to_array(tensor)
        fields = external_data_fields(tensor)
        path = self.resolve(fields.get("location", ""))
        offset = int(fields.get("offset", 0))
        length = int(fields["length"]) if "length" in fields else None
        with open(path, "rb") as handle:
            handle.seek(offset)
            raw = handle.read() if length is None else handle.read(length)
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
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, ValueError, TypeError):
        itemsize = 8
    return count * itemsize
