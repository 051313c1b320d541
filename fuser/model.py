"""Loading, holding and writing an ONNX model around its Graph.

Everything outside the main graph (ir_version, opset imports, producer fields, doc
strings, metadata, functions) is kept as loaded and written back unchanged; the
ir_version is never bumped, because runtimes accept only the IR versions they know.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import ModelProto

from fuser.errors import InputError, UsageError
from fuser.graph import Graph, Names, all_graph_protos, copy_fields_except
from fuser.tensors import TensorStore, external_data_fields, uses_external_data


class Model:
    """An ONNX model whose main graph (and every subgraph) is a rewritable Graph."""

    def __init__(self, proto: ModelProto, base_dir: Path | None = None, path: Path | None = None):
        self.path = path
        self.base_dir = base_dir
        self._shell = ModelProto()
        copy_fields_except(proto, self._shell, {"graph"})
        self.opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in proto.opset_import}
        self.names = Names()
        self.tensors = TensorStore(base_dir)
        self.graph = Graph(
            proto.graph,
            names=self.names,
            tensors=self.tensors,
            opsets=self.opsets,
            constant_initializer_inputs=proto.ir_version < 4,
        )
        self.check_external_data()

    @classmethod
    def load(cls, path: str | os.PathLike) -> Model:
        path = Path(path)
        return cls(read_model(path), base_dir=path.parent, path=path)

    def initializers(self):
        for g in self.graph.all_graphs():
            yield from g.initializers()

    def check_external_data(self) -> None:
        for tensor in self.initializers():
            self.tensors.check(tensor)

    def to_proto(self) -> ModelProto:
        model = ModelProto()
        model.CopyFrom(self._shell)
        model.graph.CopyFrom(self.graph.to_proto())
        return model

    def require_opset(self, domain: str, version: int) -> None:
        """Declare that rewritten nodes use `domain` at `version` (adds the import if missing)."""
        key = "" if domain == "ai.onnx" else domain
        if key in self.opsets:
            return
        self.opsets[key] = version
        self._shell.opset_import.append(onnx.helper.make_opsetid(domain, version))

    def node_count(self) -> int:
        return sum(g.node_count() for g in self.graph.all_graphs())

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically; external-data references stay valid only beside the input."""
        write_model(self.to_proto(), Path(path), source_dir=self.base_dir)


def read_model(path: Path) -> ModelProto:
    """Parse and validate an ONNX file, turning every failure into a one-line InputError."""
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if path.is_dir():
        raise InputError(f"{path}: is a directory, not an ONNX model")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise InputError(f"{path}: cannot read ({error.strerror})") from error
    if not data:
        raise InputError(f"{path}: file is empty, not an ONNX model")
    model = ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as error:
        raise InputError(f"{path}: not an ONNX model (the file is not a valid protobuf)") from error
    if not model.HasField("graph") or model.ir_version <= 0:
        raise InputError(f"{path}: not an ONNX model (no graph or IR version in the file)")
    store = TensorStore(path.parent)
    for graph in all_graph_protos(model.graph):
        for tensor in graph.initializer:
            store.check(tensor)  # refuse unsafe external-data paths before anything reads them
    try:
        # The path form resolves external data against the model's folder and handles >2 GB.
        onnx.checker.check_model(str(path))
    except (onnx.checker.ValidationError, ValueError, RuntimeError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InputError(f"{path}: invalid ONNX model: {first_line}") from error
    return model


def check_writable_to(initializers, path: Path, source_dir: Path | None) -> None:
    """External-data references are relative to the model's folder: refuse to move them."""
    first = next((t for t in initializers if uses_external_data(t)), None)
    if first is not None and (source_dir is None or path.parent.resolve() != source_dir.resolve()):
        location = external_data_fields(first).get("location", "")
        raise UsageError(
            f"the model keeps weights in external data ('{location}'); write the output into "
            f"the input's folder ({source_dir}) so those references stay valid"
        )


def write_model(model: ModelProto, path: Path, source_dir: Path | None) -> None:
    """Serialize deterministically to a temporary file beside `path`, then rename over it."""
    check_writable_to((t for g in all_graph_protos(model.graph) for t in g.initializer), path, source_dir)
    data = model.SerializeToString(deterministic=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
