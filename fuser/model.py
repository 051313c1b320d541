"""Loading, holding and writing an ONNX model around its Graph.

Everything outside the main graph (ir_version, opset imports, producer fields, doc
strings, metadata, functions) is kept as loaded and written back unchanged; the
ir_version is never bumped, because runtimes accept only the IR versions they know.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import mmap
import os
import re
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO

import onnx
from google.protobuf.message import DecodeError
from onnx import ModelProto, TensorProto

from fuser import leftovers, stops
from fuser.errors import FuserError, InputError, OutputPathError, UsageError
from fuser.graph import (
    Graph,
    ModelParts,
    Names,
    NodeInfo,
    all_graph_protos,
    as_proto,
    copy_fields_except,
    nested_graph_protos,
    opset_versions,
    shape_relevant,
)
from fuser.match import InferredTypes
from fuser.progress import Progress, Ticker
from fuser.tensors import TensorStore, external_data_fields, file_identity, nbytes, raw_size, uses_external_data
from fuser.validation import Validation
from fuser.wire import (
    GRAPH_INITIALIZER_FIELD,
    GRAPH_NODE_FIELD,
    IN_PLACE_BYTES,
    MODEL_GRAPH_FIELD,
    TENSOR_RAW_DATA_FIELD,
    encode_varint,
    field_key,
    read_in_place,
    varint_size,
)


class Model:
    """An ONNX model whose main graph (and every subgraph) is a rewritable Graph."""

    def __init__(
        self,
        proto: ModelProto,
        base_dir: Path | None = None,
        path: Path | None = None,
        progress: Progress | None = None,
        initializers_checked: bool = False,
        tensors: TensorStore | None = None,
        inferred: InferredTypes | None = None,
    ):
        """tensors: where the weights' data is read from (default: external data beside
        `base_dir`); Model.load gives the one that knows the weights read in place from the
        file, and a model derived from another (opset, fix-shapes) shares its store.
        inferred: the types shape inference found in `proto` (Model.load's check infers them),
        the engine's first table of types (take_inferred_types)."""
        self.path = path
        # What gives the types the engine starts from (take_inferred_types): those given here or
        # (Model.load) the load's check, which may still be inferring them.
        self._types_source: InferredTypes | Validation | None = inferred
        self._validation: Validation | None = None  # the load's check of the file (Model.load)
        self.base_dir = base_dir
        self._source = proto
        self._shell = ModelProto()
        copy_fields_except(proto, self._shell, {"graph"})
        self._added_domains: set[str] = set()  # imported by require_opset
        self.opsets = opset_versions(proto)
        self.names = Names()
        self.tensors = tensors if tensors is not None else TensorStore(base_dir)
        # Weights read in place from the model's own file were inline in it, and stay so when written.
        self.had_external_data = any(
            self.tensors.kept_outside(t) for g in all_graph_protos(proto.graph) for t in g.initializer
        )
        # External-data files read into memory when the model was loaded (_place_external_data).
        self.files_read_in: frozenset[Path] = frozenset()
        self.graph = Graph(
            proto.graph,
            names=self.names,
            tensors=self.tensors,
            opsets=self.opsets,
            constant_initializer_inputs=proto.ir_version < 4,
            progress=progress,
        )
        self.check_external_data(initializers=not initializers_checked)

    @classmethod
    def load(cls, path: str | os.PathLike, progress: Progress | None = None, *, validated: bool = True) -> Model:
        """`progress("load", nodes, total)` while the graph is built (parsing the file comes first).

        The file passes onnx's full check (fuser/validation.py), which for a large model runs in
        a child process while the graph is built. validated=False returns the model while that
        check may still run: `validate()` waits for its verdict, and the types it infers wait for
        it only when a rule first asks for one (take_inferred_types). A caller that asks for
        this makes sure that nothing comes of a model the check refuses but that refusal."""
        path = Path(path)
        # read_model has checked the initializers before anything could read them
        proto, stated, identity, validation, read_in = _read_model(path)
        # The folder resolved: weights are read from it later, whatever the working directory is by then.
        folder = path.parent.resolve()
        try:
            try:
                model = cls(
                    proto,
                    base_dir=folder,
                    path=path,
                    progress=progress,
                    initializers_checked=True,
                    tensors=TensorStore(folder, model_file=path, stated_default=stated, identity=identity),
                )
            except Exception:
                validation.verdict()  # an invalid model is said to be one, not what building its graph tripped on
                raise
            model._validation = model._types_source = validation
            model.files_read_in = read_in
            if validated:
                model.validate()
        except BaseException:
            validation.close()
            raise
        return model

    def validate(self) -> None:
        """Wait for the verdict of onnx's check of the file the model was read from, if it is
        still to come (Model.load's validated=False): InputError if the check refused it."""
        if self._validation is not None:
            if self._types_source is None:  # handed out, and taken or not by now: not to be held
                # (nor read from the child: the 100k-node ResNet stack's rewrite asks none, and
                # reading them at its end took 0.28 s)
                self._validation.forget_types()
            self._validation.verdict()

    def take_inferred_types(self) -> Callable[[], InferredTypes | None] | None:
        """A function giving the types inferred from the model as it was built, while nothing
        has changed it since (None otherwise): they may still be on their way from the load's
        check, which the function waits for. Given once, and dropped either way."""
        source, self._types_source = self._types_source, None
        usable = (
            source is not None
            and self.unchanged_proto() is not None
            # The check inferred with annotations the rewrite's skeleton leaves out (a body's
            # tensors annotated in the main graph), which may type what it cannot.
            and len(self.graph.live_value_info()) == len(self._source.graph.value_info)
        )
        if isinstance(source, Validation):
            if usable and not source.gave_no_types():
                return source.take_types
            source.forget_types()
            return None
        return (lambda: source) if usable else None

    def initializers(self):
        for g in self.graph.all_graphs():
            yield from g.initializers()

    def check_external_data(self, initializers: bool = True) -> None:
        """Every stored tensor (initializers unless told otherwise, Constant values) fits its dtype
        and dims, and its external data stays inside the model's folder."""
        if initializers:
            for tensor in self.initializers():
                self.tensors.check(tensor)
        for node, tensor in self._constant_values():
            self.tensors.check(tensor, f"the value of Constant node '{node.name}'")

    def _constant_values(self) -> Iterator[tuple[NodeInfo, TensorProto]]:
        for g in self.graph.all_graphs():
            for node in map(g.node, g.nodes_of_type("Constant")):
                for attribute in node.proto.attribute[:]:
                    if attribute.name == "value" and attribute.HasField("t"):
                        yield node, attribute.t

    def stored_tensors(self) -> Iterator[TensorProto]:
        """The tensors the model stores, where external data may hold them: its initializers and
        its Constant values, in every graph."""
        yield from self.initializers()
        yield from (tensor for _, tensor in self._constant_values())

    def data_files(self) -> set[Path]:
        """The files beside the model its data is read from: the external data of the tensors it
        stores, and the files it read into memory when it was loaded (_place_external_data)."""
        return external_files(self.stored_tensors(), self.tensors) | self.files_read_in

    def to_proto(self, weights: bool = True, in_place: bool = False) -> ModelProto:
        """The model as ONNX; weights=False gives its skeleton (Graph.to_proto). Weights read in
        place from the model's file are put back inline, unless `in_place`: then they stay
        references to the file, for onnxruntime sessions told the model's folder."""
        model = ModelProto()
        model.CopyFrom(self._written_shell())
        self.graph.fill_proto(model.graph, weights)
        return model if in_place or not weights else self.self_contained(model)

    def parts(self) -> ModelParts:
        """The model as ONNX with its main graph's initializers held apart, not copied (ModelParts)."""
        proto = ModelProto()
        proto.CopyFrom(self._written_shell())
        nodes = self.graph.fill_proto(proto.graph, apart=True)
        return ModelParts(proto, self.graph.initializers(), self.tensors, nodes)

    def self_contained(self, proto: ModelProto) -> ModelProto:
        """`proto`, a model built from this one (changed in place), with every weight it reads
        from a file put inline: those read in place from this model's file, as the file held
        them, and those of its external data. A ModelProto handed to a caller must not depend on
        the files (their paths are relative to the model's folder, not to where it is used)."""
        for graph in all_graph_protos(proto.graph):
            for tensor in graph.initializer:
                if uses_external_data(tensor):
                    _inline(tensor, self.tensors.raw_bytes(tensor), self.tensors.states_location(tensor))
        return proto

    def _read_in(self, tensors) -> None:
        """Put the data of those `tensors` read in place from the model's file inline in them."""
        for tensor in tensors:
            if self.tensors.in_model_file(tensor):
                _inline(tensor, self.tensors.raw_bytes(tensor), self.tensors.states_location(tensor))

    def unchanged_proto(self) -> ModelProto | None:
        """The ModelProto this model was built from, while nothing has changed the model since:
        the model to_proto() gives (up to node order and stale annotations) without a copy of
        its weights. None once anything changed."""
        if self.graph.is_modified() or list(self._shell.opset_import) != list(self._source.opset_import):
            return None
        return self._source

    def interface(self) -> ModelProto:
        """The model's main-graph inputs a caller feeds and its outputs, without nodes or weights
        (a skeleton lists the weights it leaves out as inputs, so it cannot say which are inputs)."""
        model = ModelProto()
        model.CopyFrom(self._shell)
        model.graph.input.extend(self.graph.feedable_inputs())
        model.graph.output.extend(self.graph.output_values())
        return model

    def require_opset(self, domain: str, version: int) -> None:
        """Declare that rewritten nodes use `domain` at `version` (adds the import if missing)."""
        key = "" if domain == "ai.onnx" else domain
        if key in self.opsets:
            return
        self.opsets[key] = version
        self._added_domains.add(domain)
        self._shell.opset_import.append(onnx.helper.make_opsetid(domain, version))

    def _written_shell(self) -> ModelProto:
        """The model without its graph, as written: an import a rewrite added for a domain that
        no node uses any more (FusedConv's com.microsoft, once NCHWc Convs replaced every
        FusedConv) is left out; the model's own imports all stay."""
        unused = self._added_domains - {d for g in self.graph.all_graphs() for d in g.domains()}
        if not unused:
            return self._shell
        shell = ModelProto()
        shell.CopyFrom(self._shell)
        kept = [o for o in shell.opset_import if o.domain not in unused]
        del shell.opset_import[:]
        shell.opset_import.extend(kept)
        return shell

    def node_count(self) -> int:
        return sum(g.node_count() for g in self.graph.all_graphs())

    def op_counts(self) -> dict[str, int]:
        """How many nodes of each op type (domain-qualified outside ai.onnx), subgraphs included."""
        counts: dict[str, int] = {}
        for g in self.graph.all_graphs():  # counted per op type, not per node: asked before and after a rewrite
            for (domain, op_type), count in g.op_type_counts().items():
                key = _op_type_key(domain, op_type)
                counts[key] = counts.get(key, 0) + count
        return _most_frequent_first(counts)

    def save(self, path: str | os.PathLike, external_data: str = "auto") -> None:
        """Write atomically, with the weights of a model kept in external data in a file beside it."""
        if external_data == "auto" and self.had_external_data:
            external_data = "always"
        # Its own file, whose weights are read in place, it may replace: they are read in first (below).
        read = self.data_files() - {self.tensors.model_file}
        if Path(path).resolve() in read:
            raise UsageError(f"{path}: refusing to overwrite a file the model's data is read from")
        if writes_external_data(self, external_data):  # write_model looks at the initializers' files only
            refuse_input_data_file(external_data_path(Path(path)), set(self.files_read_in))
        own = self.tensors.model_file
        if own is not None and own.exists() and Path(path).exists() and os.path.samefile(path, own):
            self._read_in(self.graph.initializers())  # over the file they are read from: into memory first
        write_model(
            self.parts(), Path(path), source_dir=self.base_dir, external_data=external_data, tensors=self.tensors
        )


def count_op_types(nodes) -> dict[str, int]:
    """Nodes per op type, most frequent first; op types outside ai.onnx carry their domain."""
    counts: dict[str, int] = {}
    for node in nodes:
        key = _op_type_key(node.domain, node.op_type)
        counts[key] = counts.get(key, 0) + 1
    return _most_frequent_first(counts)


def _op_type_key(domain: str, op_type: str) -> str:
    return f"{domain}.{op_type}" if domain not in ("", "ai.onnx") else op_type


def _most_frequent_first(counts: dict[str, int]) -> dict[str, int]:
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def read_model(path: Path) -> ModelProto:
    """Parse and validate an ONNX file, turning every failure into a one-line InputError. Its
    large weights stay in the file, read in place (TensorStore.in_model_file)."""
    model, _, _, validation, _ = _read_model(path, apart=False)
    validation.verdict()
    return model


def require_model_file(path: Path) -> None:
    """Refuse, as an InputError, a model path that names nothing, a folder, or what the system
    will not look at (a folder on the way that may not be searched, a name too long, a loop of
    links)."""
    try:
        status = path.stat()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (OSError, ValueError) as error:  # ValueError: a NUL in the name
        raise InputError(f"{path}: cannot read ({getattr(error, 'strerror', None) or error})") from error
    if stat.S_ISDIR(status.st_mode):
        raise InputError(f"{path}: is a directory, not an ONNX model")


def _read_model(
    path: Path, apart: bool = True
) -> tuple[ModelProto, frozenset[int], tuple | None, Validation, frozenset[Path]]:
    """The parsed model, the offsets of the weights read in place that stated their
    data_location (TensorStore's stated_default), the identity of the file they were read in
    place from (None when none were), its check, under way (fuser/validation.py; in a child
    process if `apart` and that pays), and the external-data files read into memory
    (_place_external_data)."""
    require_model_file(path)
    try:
        with open(path, "rb") as handle:
            status = os.fstat(handle.fileno())
            identity = None  # of the file whose weights are read in place, whatever the path names later
            mapped = None
            if stat.S_ISREG(status.st_mode) and status.st_size and found_as_external_data(path):
                try:
                    mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
                except (OSError, ValueError):
                    pass  # a file system that cannot map files: read it whole
            if mapped is not None:
                identity = file_identity(status)
                with mapped:
                    model, stated, locations = _parse(path, mapped, in_place=True)
            else:
                # A pipe, a link into another folder, or an unmappable file: its weights could not
                # be read again from beside the model later, so they are read now.
                data = handle.read()
                if not data:
                    raise InputError(f"{path}: file is empty, not an ONNX model")
                model, stated, locations = _parse(path, data, in_place=False)
                del data
    except OSError as error:
        raise InputError(f"{path}: cannot read ({error.strerror})") from error
    if not model.HasField("graph") or model.ir_version <= 0:
        raise InputError(f"{path}: not an ONNX model (no graph or IR version in the file)")
    store = TensorStore(path.parent, model_file=path)
    for graph in all_graph_protos(model.graph):
        for tensor in graph.initializer:
            store.check(tensor)  # refuse unsafe external-data paths before anything reads them
    # Every tensor whose data is elsewhere names its file once: more names than the main graph's
    # initializers kept outside means others are (a model saved with convert_attribute=True).
    elsewhere = locations > 0 and locations > _kept_outside_by_main_graph(model.graph)
    read_in = _place_external_data(model, store) if elsewhere else frozenset()
    return model, stated, identity, Validation(model, path, apart=apart), read_in


def load_for_sessions(paths: list[str | os.PathLike]) -> list[tuple[ModelProto, Path]]:
    """Each model, read and checked as Model.load reads and checks it, without a graph: what
    onnxruntime sessions of it need (fuser compare), and the folder they read its weights from.
    Weights read in place stay references into the model's file. The models' checks run side by
    side (in child processes, where that pays) while the next model is read; InputError for the
    first a check refuses."""
    read = []
    try:
        for path in map(Path, paths):
            proto, _, _, validation, _ = _read_model(path)
            read.append((proto, path.parent.resolve(), validation))
        for _, _, validation in read:
            validation.forget_types()
            validation.verdict()
    finally:
        for _, _, validation in read:
            validation.close()
    return [(proto, folder) for proto, folder, _ in read]


def _kept_outside_by_main_graph(graph: onnx.GraphProto) -> int:
    """How many initializers (and parts of sparse ones) of the main graph keep their data elsewhere."""
    count = sum(1 for tensor in graph.initializer if uses_external_data(tensor))
    return count + sum(uses_external_data(s.values) + uses_external_data(s.indices) for s in graph.sparse_initializer)


def _place_external_data(model: ModelProto, store: TensorStore) -> frozenset[Path]:
    """Give the tensors with external data that are not main-graph initializers a place fuser
    reads from beside the model; returns the files read into memory.

    fuser reads external data lazily, checks it, and writes it out again only for the main
    graph's initializers. Left as references, the others (held by nodes as attributes, or
    initializers of If/Loop/Scan bodies) were read by onnx's checker against the working
    directory (a model loaded from elsewhere was refused as invalid), and a node's were written
    unchanged, naming a file beside the output that does not exist. So a large main-graph
    Constant whose value is elsewhere becomes an initializer of its name where that changes
    nothing (_movable_constants), still read lazily (a 2 GB one stays out of memory, out of the
    check's model and of the skeleton onnx's checker reads); every other such tensor (a shape's
    Constant, a ConstantOfShape's fill, a custom op's table, a body's weights: small, as a rule)
    is read in now."""
    files = set()
    main = model.graph

    def read_in(tensor: TensorProto, label: str | None = None) -> None:
        store.check(tensor, label)
        files.add(store.data_file(tensor)[0])
        _inline(tensor, store.raw_bytes(tensor), states_location=False)

    graphs = _stored_graphs(model)
    for graph in graphs:
        if graph is main:
            continue
        for tensor in (*graph.initializer, *(p for s in graph.sparse_initializer for p in (s.values, s.indices))):
            if uses_external_data(tensor):
                read_in(tensor, f"initializer '{tensor.name}' of graph '{graph.name}'")
    movable = _movable_constants(main) if model.ir_version >= 4 else set()
    for graph in (*graphs, *model.functions):
        moved = []
        for index, node in enumerate(graph.node):
            for attribute in node.attribute[:]:
                for tensor in _attribute_tensors(attribute):
                    if not uses_external_data(tensor):
                        continue
                    label = f"the {attribute.name} of {node.op_type} node '{node.name}'"
                    if graph is main and index in movable:
                        store.check(tensor, label)
                        moved.append(index)
                    else:
                        read_in(tensor, label)
        for index in reversed(moved):
            node = graph.node[index]
            weight = main.initializer.add()
            weight.CopyFrom(node.attribute[0].t)
            weight.name = node.output[0]
            del graph.node[index]
    return frozenset(files)


def _movable_constants(graph: onnx.GraphProto) -> set[int]:
    """The positions of the Constant nodes in `graph` that can become initializers of their names
    with their values left where they are: a `value` kept outside too large for shape inference
    to read (a shape it must see stays a Constant, read in) and too large to be kept inline
    (IN_PLACE_BYTES), whose name no input, initializer, output or other node has and no node
    before it reads (an invalid model stays as onnx's check refuses it)."""
    outside = [
        index
        for index, node in enumerate(graph.node)
        if node.op_type == "Constant"
        and node.domain in ("", "ai.onnx")
        and len(node.attribute) == 1
        and node.attribute[0].name == "value"
        and uses_external_data(node.attribute[0].t)
        and len(node.output) == 1
        and node.output[0]
        and not shape_relevant(node.attribute[0].t)
        and nbytes(node.attribute[0].t) > IN_PLACE_BYTES
    ]
    if not outside:
        return set()
    named = [v.name for v in (*graph.input, *graph.output)] + [t.name for t in graph.initializer]
    produced: dict[str, int] = {}
    first_read: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        for name in node.output:
            produced[name] = produced.get(name, 0) + 1
        for name in node.input:
            first_read.setdefault(name, index)
    taken = set(named)
    return {
        index
        for index in outside
        if (name := graph.node[index].output[0]) not in taken
        and produced[name] == 1
        and first_read.get(name, index + 1) > index
    }


def external_data_files(path: Path) -> set[Path]:
    """The files the model file at `path` names as external data of any tensor it holds (an
    initializer, a node's attribute, a sparse tensor's parts, in every graph), as onnxruntime
    would find them: beside the path given, links followed, wherever they lead (fuser's own load
    refuses some of them; onnxruntime reads them). No files when `path` is not a regular file that
    parses as a model: its load will say why (a pipe's bytes are that load's to read).
    Read without its large inline weights (read_in_place), and not checked."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # asked before opening: a pipe opened once is spent
            return set()
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            model, _, _ = _parse(path, mapped, in_place=True)
    except (OSError, ValueError, InputError):
        return set()
    folder = os.path.dirname(os.path.abspath(path))
    files = set()
    for tensor in _held_tensors(model):
        if uses_external_data(tensor):
            location = external_data_fields(tensor).get("location", "")
            if location and "\0" not in location:
                files.add(Path(os.path.realpath(os.path.join(folder, location))))
    return files


def _held_tensors(model: ModelProto) -> Iterator[TensorProto]:
    """Every tensor stored in `model`: in its graph, its functions, and the graphs nested in them."""
    graphs = _stored_graphs(model)
    for nested in graphs:
        yield from nested.initializer
        for sparse in nested.sparse_initializer:
            yield from (sparse.values, sparse.indices)
    for holder in (*graphs, *model.functions):
        for node in holder.node:
            for attribute in node.attribute[:]:
                yield from _attribute_tensors(attribute)


def _stored_graphs(model: ModelProto) -> list[onnx.GraphProto]:
    """The model's graph, the graphs nested in it, and those nested in its functions' nodes."""
    return [*all_graph_protos(model.graph), *(g for f in model.functions for g in nested_graph_protos(f.node))]


def _attribute_tensors(attribute: onnx.AttributeProto) -> Iterator[TensorProto]:
    """The tensors an attribute holds: its tensor or tensors, and the parts of its sparse ones."""
    if attribute.HasField("t"):
        yield attribute.t
    yield from attribute.tensors
    single = [attribute.sparse_tensor] if attribute.HasField("sparse_tensor") else []
    for sparse in (*single, *attribute.sparse_tensors):
        yield from (sparse.values, sparse.indices)


def found_as_external_data(path: Path) -> bool:
    """Whether the file's name, as external data of its own folder, finds the file again: not
    through a symbolic link to a file elsewhere (a Hugging Face cache's snapshots), and not a
    name TensorStore refuses as a location."""
    return not path.name.startswith("\\") and os.path.realpath(path) == os.path.join(
        os.path.realpath(path.parent), path.name
    )


def _parse(path: Path, data, in_place: bool) -> tuple[ModelProto, frozenset[int], int]:
    """The ModelProto in `data` (the file's bytes, or a memory map of them); with `in_place`, its
    large weights left in the file (read_in_place): a memory-mapped file's are never read in.
    Also returns the offsets of those that stated their data_location (none when none was left in
    the file), and how many times the bytes parsed name an external-data file (the weights left
    in the file are not looked through)."""
    view = memoryview(data)
    try:
        referenced = read_in_place(view, path.name) if in_place and len(view) > IN_PLACE_BYTES else None
        parsed = data if referenced is None else referenced[0]
        model = ModelProto()
        try:
            model.ParseFromString(view if referenced is None else referenced[0])
        except (DecodeError, RuntimeError, ValueError) as error:
            raise InputError(f"{path}: not an ONNX model (the file is not a valid protobuf)") from error
        stated = frozenset() if referenced is None else referenced[1]
        return model, stated, _occurrences(parsed, _EXTERNAL_LOCATION_ENTRY)
    finally:
        view.release()


# How a TensorProto's external_data names its file (the key "location"), in protobuf's bytes.
_EXTERNAL_LOCATION_ENTRY = b"\x0a\x08location"


def _occurrences(buffer, pattern: bytes) -> int:
    """How many times `pattern` occurs in `buffer` (bytes, or a memory map, which has no count)."""
    if isinstance(buffer, bytes):
        return buffer.count(pattern)
    return len(re.findall(re.escape(pattern), buffer))


EXTERNAL_DATA_MODES = ("auto", "always", "never")
# Protobuf cannot serialize a message of 2 GB or more: such models keep their weights outside.
PROTOBUF_LIMIT = 2**31 - 1
# In a model written with external data, tensors smaller than this stay inline (as onnx does).
EXTERNAL_DATA_THRESHOLD = 1024


def external_data_path(path: Path) -> Path:
    """The file beside `path` that holds the weights of a model written with external data."""
    return path.with_name(f"{path.name}.data")


def writes_external_data(model: ModelProto | ModelParts | Model, mode: str, store: TensorStore | None = None) -> bool:
    """Whether `mode` ("auto", "always", "never") writes `model`'s weights to a file beside it.

    auto: when the input kept its weights outside, or when the model is too large for protobuf.
    Weights the store (a Model's or ModelParts' own, else `store`) finds in the model's own file
    (TensorStore.in_model_file) were inside it.
    """
    if isinstance(model, Model):
        return _writes_outside(list(model.initializers()), mode, model.tensors)
    _, main, _ = _written_parts(model)
    return _writes_outside([*main, *_nested_initializers(model)], mode, _store_of(model, store))


def _writes_outside(tensors: list[TensorProto], mode: str, store: TensorStore) -> bool:
    """writes_external_data for a model of `tensors`, its weights and its bodies' weights."""
    if mode not in EXTERNAL_DATA_MODES:
        raise UsageError(f"external data mode must be one of {', '.join(EXTERNAL_DATA_MODES)}, not '{mode}'")
    if mode == "always":
        return True
    # A weight's size is the length of its bytes where it holds them inline, as nearly all do:
    # reading its dims instead took 1 us a weight (0.06 s for the 100k MLP stack's, at each ask).
    too_large = sum(len(t.raw_data) or nbytes(t) for t in tensors) > PROTOBUF_LIMIT
    if mode == "never":
        if too_large:
            raise UsageError("the model's weights exceed 2 GB, which ONNX can only store as external data")
        return False
    return too_large or any(store.kept_outside(t) for t in tensors)


def _nested_initializers(model: ModelProto | ModelParts) -> list[TensorProto]:
    """The weights of the If/Loop/Scan bodies nested in `model`."""
    return [t for g in list(_graph_protos(model))[1:] for t in g.initializer]


def _store_of(model: ModelProto | ModelParts, store: TensorStore | None, source_dir: Path | None = None) -> TensorStore:
    """The store `model`'s weights are read from: `store`, a ModelParts' own, or one of `source_dir`."""
    if store is None and isinstance(model, ModelParts):
        store = model.tensors
    return store if store is not None else TensorStore(source_dir)


def write_model(
    model: ModelProto | ModelParts,
    path: Path,
    source_dir: Path | None,
    external_data: str = "auto",
    progress: Progress | None = None,
    tensors: TensorStore | None = None,
    digests: dict[Path, str] | None = None,
) -> list[Path]:
    """Serialize deterministically to temporary files beside `path`, then rename them into place.

    External data of the input (resolved against `source_dir`) is copied into the output's own
    file, `external_data_path(path)`, referenced relatively; the output never points into the
    input's files, so it can be written to any folder. The main graph's initializers are
    written one at a time (see _write_streaming): the model is never held twice in memory.
    Returns the files written: the model, and its data file if it has one. `progress("write",
    done, total)` counts the tensors written (those kept outside count twice: data, then pointer).
    `tensors`: the store of the Model it comes from (Model.tensors), which knows the weights read
    in place from its file: those are inline weights (TensorStore.in_model_file); by default,
    a ModelParts' own, or a store of `source_dir`. `digests`, if given, gets the model file's
    SHA-256 (hex) under `path`, worked out beside the writing (_DigestingFile).
    """
    path = Path(path)
    store = _store_of(model, tensors, source_dir)
    proto, main, nodes = _written_parts(model)
    nested = _nested_initializers(model)
    external = _writes_outside([*main, *nested], external_data, store)
    _make_parent(path)
    if any(uses_external_data(t) for t in nested) or (external and nested):
        # weights inside If/Loop/Scan bodies: rare and small
        return _write_copy(as_proto(model), path, store, external, digests)
    if not external:
        ticker = Ticker(progress, "write", total=len(main))
        _write_atomically(
            path,
            lambda stream: _write_streaming(proto, main, stream, ticker, inline_from=store, nodes=nodes),
            digests,
        )
        return [path]
    data_path = external_data_path(path)
    refuse_input_data_file(data_path, external_files(main, store))
    outside = [
        index
        for index, tensor in enumerate(main)
        if tensor.data_type != TensorProto.STRING
        and (uses_external_data(tensor) or nbytes(tensor) >= EXTERNAL_DATA_THRESHOLD)
    ]
    pointers: dict[int, TensorProto] = {}
    ticker = Ticker(progress, "write", every=100, total=len(main) + len(outside))

    def write_data(stream) -> None:
        offset = 0
        for index in outside:
            length = store.copy_raw(main[index], stream)
            pointers[index] = _pointer(main[index], data_path.name, offset, length)
            offset += length
            ticker.tick()

    emitted = _LazyList(main, pointers)
    model_file = (path, lambda stream: _write_streaming(proto, emitted, stream, ticker, nodes=nodes))
    _write_files([(data_path, write_data), model_file] if outside else [model_file], digests)
    return [path, data_path] if outside else [path]


def _written_parts(model: ModelProto | ModelParts) -> tuple[ModelProto, list[TensorProto], list | None]:
    """What write_model streams: the model without (or, for a ModelProto, beside) its main
    graph's initializers, those initializers, and the main graph's nodes a ModelParts holds
    apart (None when they are in the model)."""
    if isinstance(model, ModelParts):
        return model.shell, model.initializers, model.nodes
    return model, model.graph.initializer, None


def _graph_protos(model: ModelProto | ModelParts):
    """The model's main graph and every body nested in it, without putting a ModelParts' nodes in it."""
    return model.graph_protos() if isinstance(model, ModelParts) else all_graph_protos(model.graph)


class _LazyList:
    """The main graph's initializers with some replaced by their external-data pointers."""

    def __init__(self, tensors, replaced: dict[int, TensorProto]):
        self._tensors = tensors
        self._replaced = replaced

    def __iter__(self):
        for index, tensor in enumerate(self._tensors):
            yield self._replaced.get(index, tensor)


def _write_copy(
    model: ModelProto, path: Path, store: TensorStore, external: bool, digests: dict[Path, str] | None
) -> list[Path]:
    model_copy = ModelProto()
    model_copy.CopyFrom(model)
    tensors = [t for g in all_graph_protos(model_copy.graph) for t in g.initializer]
    if not external:
        for tensor in tensors:
            if uses_external_data(tensor):
                _inline(tensor, store.raw_bytes(tensor), store.states_location(tensor))
        _write_atomically(path, lambda stream: stream.write(model_copy.SerializeToString(deterministic=True)), digests)
        return [path]
    data_path = external_data_path(path)
    refuse_input_data_file(data_path, external_files(tensors, store))
    outside = [
        t
        for t in tensors
        if t.data_type != TensorProto.STRING and (uses_external_data(t) or nbytes(t) >= EXTERNAL_DATA_THRESHOLD)
    ]

    def write_data(stream) -> None:
        offset = 0
        for tensor in outside:
            raw = store.raw_bytes(tensor)
            stream.write(raw)
            _point_to(tensor, data_path.name, offset, len(raw))
            offset += len(raw)

    model_file = (path, lambda stream: stream.write(model_copy.SerializeToString(deterministic=True)))
    _write_files([(data_path, write_data), model_file] if outside else [model_file], digests)
    return [path, data_path] if outside else [path]


def _write_streaming(
    model: ModelProto,
    initializers,
    stream,
    ticker: Ticker | None = None,
    inline_from: TensorStore | None = None,
    nodes=None,
) -> None:
    """Write `model` with `initializers` as its main graph's initializers, one tensor at a time;
    with `inline_from`, those in external data are written inline, read one at a time; `nodes`,
    if given, as its main graph's nodes (the model then has none).

    The bytes equal model.SerializeToString(deterministic=True) of that model: protobuf writes
    fields in field-number order, so the parts before and after the initializers are serialized
    on their own and the initializers, each a length-delimited field, go between them.
    """
    graph = model.graph
    model_head, model_tail = _split_fields(model, MODEL_GRAPH_FIELD, skip={MODEL_GRAPH_FIELD})
    # The nodes, field 1, come first and go out one at a time too: a copy of them all in the
    # graph's head was the write's largest allocation (a million-node model's nodes).
    graph_head, graph_tail = _split_fields(
        graph, GRAPH_INITIALIZER_FIELD, skip={GRAPH_NODE_FIELD, GRAPH_INITIALIZER_FIELD}
    )
    nodes = graph.node if nodes is None else nodes
    node_sizes = [node.ByteSize() for node in nodes]

    # For each tensor whose data is read in: what comes before and after the data, and its size.
    inlined = [
        _inline_parts(t, inline_from) if inline_from is not None and uses_external_data(t) else None
        for t in initializers
    ]
    sizes = [t.ByteSize() if parts is None else parts[2] for t, parts in zip(initializers, inlined)]
    graph_size = graph_head.ByteSize() + graph_tail.ByteSize()
    graph_size += sum(1 + varint_size(size) + size for size in (*node_sizes, *sizes))
    stream.write(model_head.SerializeToString(deterministic=True))
    stream.write(field_key(MODEL_GRAPH_FIELD) + encode_varint(graph_size))
    # One call per node and weight: a large model has a million of them.
    node_key, initializer_key = field_key(GRAPH_NODE_FIELD), field_key(GRAPH_INITIALIZER_FIELD)
    write = stream.write
    for node, size in zip(nodes, node_sizes):
        write(node_key + encode_varint(size) + node.SerializeToString(deterministic=True))
    write(graph_head.SerializeToString(deterministic=True))
    for tensor, size, parts in zip(initializers, sizes, inlined):
        # The prefix goes out on its own: joined to a large weight's bytes, it would copy them.
        write(initializer_key + encode_varint(size))
        if parts is not None:
            _write_inline(tensor, parts, inline_from, stream)
        else:
            write(tensor.SerializeToString(deterministic=True))
        if ticker is not None:
            ticker.tick()
    write(graph_tail.SerializeToString(deterministic=True))
    write(model_tail.SerializeToString(deterministic=True))
    if ticker is not None:
        ticker.finish()


def _split_fields(message, boundary: int, skip: set[int]):
    """Two copies of `message`: its fields numbered below `boundary`, and those above, both
    without the fields numbered in `skip` (written by the caller)."""
    numbers = {descriptor.name: descriptor.number for descriptor, _ in message.ListFields()}
    head, tail = type(message)(), type(message)()
    copy_fields_except(message, head, {name for name, n in numbers.items() if n >= boundary or n in skip})
    copy_fields_except(message, tail, {name for name, n in numbers.items() if n < boundary or n in skip})
    return head, tail


def _inline_parts(tensor: TensorProto, store: TensorStore) -> tuple[bytes, bytes, int]:
    """What `tensor` with its data inline (as _inline puts it) serializes to before the data and
    after it, and its whole size, without reading the data (TensorStore.check has made sure it
    is as long as its dtype and dims say)."""
    meta = TensorProto()
    copy_fields_except(tensor, meta, {"external_data", "data_location", "raw_data"})
    if store.states_location(tensor):
        meta.data_location = TensorProto.DEFAULT
    head, tail = _split_fields(meta, TENSOR_RAW_DATA_FIELD, skip={TENSOR_RAW_DATA_FIELD})
    head_bytes, tail_bytes = head.SerializeToString(deterministic=True), tail.SerializeToString(deterministic=True)
    length = raw_size(tensor) or 0
    key = field_key(TENSOR_RAW_DATA_FIELD) + encode_varint(length)
    return head_bytes + key, tail_bytes, len(head_bytes) + len(key) + length + len(tail_bytes)


def _write_inline(tensor: TensorProto, parts: tuple[bytes, bytes, int], store: TensorStore, stream) -> None:
    """Write `tensor` with its data inline (as _inline puts it, `parts` from _inline_parts), the
    data copied from its file in chunks."""
    head, tail, size = parts
    stream.write(head)
    copied = store.copy_raw(tensor, stream)
    if len(head) + copied + len(tail) != size:  # the length is already written: the file would be corrupt
        raise FuserError(f"the external data of initializer '{tensor.name}' changed while it was copied")
    stream.write(tail)


def _pointer(tensor: TensorProto, location: str, offset: int, length: int) -> TensorProto:
    """A copy of `tensor`'s metadata that points at its data in `location` (the data is not copied)."""
    pointer = TensorProto()
    copy_fields_except(tensor, pointer, {*_DATA_FIELDS, "external_data", "data_location"})
    _point_to(pointer, location, offset, length)
    return pointer


_DATA_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "raw_data", "string_data")


def external_files(tensors: Iterable[TensorProto], store: TensorStore) -> set[Path]:
    """The files `tensors` keep their data in, resolved as `store` reads them."""
    return {store.resolve(external_data_fields(t).get("location", "")) for t in tensors if uses_external_data(t)}


def refuse_input_data_file(data_path: Path, input_files: set[Path]) -> None:
    """The output's data file must never be one the input reads its weights from."""
    if data_path.resolve() in input_files:
        raise UsageError(
            f"{data_path.with_suffix('')}: its weights would go to {data_path.name}, which is the input's own data "
            "file; choose another output name"
        )


def _inline(tensor: TensorProto, raw: bytes, states_location: bool = True) -> None:
    del tensor.external_data[:]
    tensor.data_location = TensorProto.DEFAULT
    if not states_location:
        tensor.ClearField("data_location")
    tensor.raw_data = raw


def _point_to(tensor: TensorProto, location: str, offset: int, length: int) -> None:
    for name in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "raw_data"):
        tensor.ClearField(name)
    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _make_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputPathError(f"{path}: cannot create its folder ({error.strerror or error})") from error


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _write_atomically(path: Path, write: Callable[[IO[bytes]], object], digests: dict[Path, str] | None = None) -> None:
    """Write through a temporary file in the same folder, then rename: readers never see half a file.

    The file gets the permissions any tool's new file gets (0666 minus the umask), not mkstemp's 0600.
    `digests`, if given, gets the file's SHA-256 under `path`.
    """
    _write_files([(path, write)], digests)


def _write_files(files: list[tuple[Path, Callable[[IO[bytes]], object]]], digests: dict[Path, str] | None) -> None:
    """Write each of `files` (path, write) through a temporary file beside it, in order, and put
    them in place only once all are written: a write that fails or is interrupted leaves the files
    that were there as they were (a model's new data file is not left beside its old model file).
    `digests`, if given, gets the SHA-256 of the last, the model file."""
    written: list[tuple[str, Path]] = []
    keepers: list[int | None] = []  # each temporary's lock, held until it is in place or removed
    digest = None
    try:
        for index, (path, write) in enumerate(files):
            temporary, digest = _write_temporary(path, write, digests is not None and index == len(files) - 1, keepers)
            written.append((temporary, path))
        put_in_place(written)
    except BaseException:
        for temporary, _ in written:
            _remove(temporary)  # gone already where it was put in place
        raise
    finally:
        for keeper in keepers:
            leftovers.release(keeper)
    if digest is not None:
        digests[files[-1][0]] = digest


def put_in_place(moves: list[tuple[str | Path, Path]]) -> None:
    """Rename each (file, path) of `moves` over its path, in order, as one change: Ctrl-C and
    SIGTERM wait until all are done, and should a rename fail, the files the earlier ones replaced
    are put back (kept meanwhile under a second name, a hard link) and those they added removed,
    so that a model is never left beside another one's data file. OutputPathError names the path
    that could not be written. Where the folder cannot hold a second name for a file, what an
    earlier rename replaced stays replaced."""
    with stops.held():  # a stop is taken before the renames begin or once all are done
        _put_in_place(moves)


def _put_in_place(moves: list[tuple[str | Path, Path]]) -> None:
    placed: list[tuple[Path, str | None]] = []  # (path, its former file's second name; "" if it had none)
    pending = None  # the second name of the file the rename under way replaces
    complete = False
    try:
        for position, (source, path) in enumerate(moves):
            pending = _aside(path) if position < len(moves) - 1 else None  # the last one's failure undoes
            try:
                os.replace(source, path)
            except OSError as error:
                raise OutputPathError(f"{path}: cannot write it ({error.strerror or error})") from error
            placed.append((path, pending))
            pending = None
        complete = True
    finally:
        if pending:
            _remove(pending)
        if not complete:
            for path, kept in reversed(placed):
                with contextlib.suppress(OSError):  # what cannot be undone stays as it is
                    if kept:
                        os.replace(kept, path)
                    elif kept == "":
                        os.unlink(path)
        for _, kept in placed:
            if kept:
                _remove(kept)


def _aside(path: Path) -> str | None:
    """A second name (a hard link) for the file at `path`, to put it back by; "" where there is
    no file there, None where the link cannot be made."""
    if not os.path.lexists(path):
        return ""
    for _ in range(8):
        name = str(path.parent / f".{path.name}.{os.urandom(4).hex()}.tmp")
        try:
            os.link(path, name, follow_symlinks=False)
            return name
        except FileExistsError:
            continue
        except OSError:
            return None
    return None


def _write_temporary(
    path: Path, write: Callable[[IO[bytes]], object], digest: bool, keepers: list[int | None]
) -> tuple[str, str | None]:
    """A temporary file beside `path` holding what `write` writes, synced to disk; its name, and
    with `digest` its SHA-256 (None if that could not be worked out). Its lock (fuser/leftovers.py)
    is added to `keepers` as it is made: the caller releases it once the file is gone or in place."""
    try:
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise OutputPathError.refused(path, error) from error
    keepers.append(leftovers.held(handle))
    try:
        os.fchmod(handle, 0o666 & ~_umask())
        raw = _DigestingFile(handle) if digest else io.FileIO(handle, "wb")
        try:
            stream = io.BufferedWriter(raw, buffer_size=WRITE_BUFFER)
        except BaseException:
            raw.close()
            raise
        with stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
            found = raw.hexdigest() if digest else None
        return temporary, found
    except OSError as error:
        _remove(temporary)
        raise OutputPathError(f"{path}: cannot write it ({error.strerror or error})") from error
    except BaseException:
        _remove(temporary)
        raise


# What a model file is written in: the node records and small weights of a large model are
# joined into writes of this size (and a digest's thread is woken once per write).
WRITE_BUFFER = 1 << 20
DIGEST_CHUNK = 4 << 20


class _DigestingFile(io.RawIOBase):
    """A new file, written through, whose SHA-256 a thread works out beside the writing: it reads
    back what each finished write put there (from the system's cache; a second descriptor, so
    closing the file never hands it another's). The report names its output by the digest, and
    reading a 500 MB model back to hash it after the write took 0.5 s of GPT-2's 2.5 s run."""

    def __init__(self, handle: int) -> None:
        super().__init__()
        self._file = io.FileIO(handle, "wb")
        self._reader = -1
        self._written = 0
        self._finished = False  # no more writes: the thread reads what is there and stops
        self._abandoned = False  # the writing failed: the thread stops at once
        self._changed = threading.Condition()
        self._digest = hashlib.sha256()
        self._failed = False
        # Started by the first write, made inside the writer's `with`: whatever interrupts the
        # writing then closes this file, which stops the thread.
        self._thread: threading.Thread | None = None

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._file.fileno()

    def write(self, data) -> int:
        if self._thread is None:
            self._start()
        count = self._file.write(data)
        with self._changed:
            self._written += count
            self._changed.notify()
        return count

    def hexdigest(self) -> str | None:
        """The digest of all that was written, once the writing is over; None if the thread could
        not read it back (the caller reads the file instead)."""
        self._finish()
        if self._thread is not None:
            self._thread.join()
        return None if self._failed else self._digest.hexdigest()

    def close(self) -> None:
        if not self.closed:
            if not self._finished:  # the writing failed: nothing will ask for the digest
                self._abandoned = True
                self._finish()
            self._file.close()
        super().close()

    def _start(self) -> None:
        self._reader = os.dup(self._file.fileno())  # mkstemp's descriptor can read
        try:
            self._thread = threading.Thread(target=self._follow, name="fuser-digest", daemon=True)
            self._thread.start()
        except BaseException:
            if self._thread is None or not self._thread.is_alive():
                os.close(self._reader)
            raise

    def _finish(self) -> None:
        with self._changed:
            self._finished = True
            self._changed.notify()

    def _follow(self) -> None:
        offset = 0
        try:
            while True:
                with self._changed:
                    while offset == self._written and not self._finished:
                        self._changed.wait()
                    end, finished = self._written, self._finished
                while offset < end and not self._abandoned:
                    chunk = os.pread(self._reader, min(DIGEST_CHUNK, end - offset), offset)
                    if not chunk:
                        raise OSError(f"the file being written ended at {offset} bytes, before {end}")
                    self._digest.update(chunk)
                    offset += len(chunk)
                if finished or self._abandoned:
                    return
        except Exception:  # noqa: BLE001 - whatever stopped it, what it read is not the file
            self._failed = True
        finally:
            os.close(self._reader)


def _remove(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)


def write_bytes_atomically(path: Path, data: bytes) -> None:
    _make_parent(Path(path))
    _write_atomically(Path(path), lambda stream: stream.write(data))
