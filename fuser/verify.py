"""Running the original and the optimized model in onnxruntime and comparing every output.

Sessions run on the CPU with onnxruntime's own graph optimizations disabled, so that its
fusions neither hide nor cause differences. This is the only module importing onnxruntime.
"""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import os
import re
import tempfile
import threading
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from fuser import ending
from fuser.check_apart import ChildFailed, OriginalApart, worth_apart
from fuser.errors import InputError, UsageError
from fuser.float32_twin import (
    SIXTEEN_BIT_FLOAT_NAMES,
    SIXTEEN_BIT_FLOATS,
    computed_in_sixteen_bit_float,
    float32_twin,
    is_sixteen_bit_float,
    widen_array,
)
from fuser.graph import ModelParts, all_graph_protos, as_proto, copy_fields_except, split_parts
from fuser.pieces import PIECE_NODES, started_in_pieces
from fuser.progress import silent
from fuser.tensors import TensorStore, external_data_fields, nbytes, uses_external_data

# (rtol, atol) for rewrites that are equal up to rounding; exact rewrites compare bit for bit
# (but for float16 and bfloat16 outputs: see compare).
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-9, 1e-12),
    "float32": (1e-4, 1e-5),
    "float16": (1e-2, 1e-3),
    "bfloat16": (2e-2, 1e-2),
}
# How much farther from the float32 answer a 16-bit output may be than the original's, its
# errors being rounding (fuser/float32_twin.py): computing the same thing in another order
# rounds differently but about as closely (1.25x on float16 Llama's fused attention); a rewrite
# that drops an upcast to float32 rounds far more (tests/test_float32_twin.py).
ROUNDING_FACTOR = 2.0
DEFAULT_DIM = 1
INT_RANGE = (0, 10)


@dataclass(frozen=True)
class CheckOptions:
    """How the numerics check runs: the inputs it synthesizes (or is given) and its tolerances.

    seed, runs: the first input set's seed and how many sets; dims: values of symbolic
    dimensions by name; shapes: whole input shapes by input name; ranges: (low, high) of an
    input's values; inputs: real inputs by name (or "#0", "#1", ... by position), used instead of
    synthesized ones; rtol, atol: override the per-dtype tolerances (TOLERANCES).
    """

    seed: int = 0
    runs: int = 1
    dims: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, tuple] = field(default_factory=dict)
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    inputs: dict[str, np.ndarray] | None = None
    rtol: float | None = None
    atol: float | None = None

    def __post_init__(self) -> None:
        problem = _options_problem(self)
        if problem is not None:  # caught here, not as a numpy error deep in the check
            raise UsageError(f"CheckOptions: {problem}")

    def replace(self, **changes) -> CheckOptions:
        return dataclasses.replace(self, **changes)


def _whole(value, least: int) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= least


def _finite(value) -> bool:
    return (
        isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and np.isfinite(value)
    )


def _options_problem(options: CheckOptions) -> str | None:
    """What makes `options` unusable, said as its field would be set right; None if nothing."""
    if not _whole(options.seed, 0):
        return f"seed must be a whole number, 0 or more, not {options.seed!r}"
    if not _whole(options.runs, 1):
        return f"runs must be a whole number, 1 or more, not {options.runs!r}"
    for name in ("rtol", "atol"):
        value = getattr(options, name)
        if value is not None and not (_finite(value) and value >= 0):
            return f"{name} must be a finite number, 0 or more, or None, not {value!r}"
    for name, size in options.dims.items():
        if not _whole(size, 0):
            return f"dims[{name!r}] must be a size, 0 or more, not {size!r}"
    for name, shape in options.shapes.items():
        if not isinstance(shape, (tuple, list)) or not all(_whole(d, 0) for d in shape):
            return f"shapes[{name!r}] must be a tuple of sizes, each 0 or more, not {shape!r}"
    for name, bounds in options.ranges.items():
        if not (isinstance(bounds, (tuple, list)) and len(bounds) == 2 and all(_finite(b) for b in bounds)):
            return f"ranges[{name!r}] must be (low, high), two finite numbers, not {bounds!r}"
        if not bounds[0] < bounds[1]:
            return f"ranges[{name!r}] must have low < high, not {tuple(bounds)!r}"
    return None


@dataclass
class OutputCheck:
    name: str
    dtype: str
    shape: tuple
    status: str  # "ok", "mismatch", "stabilized"
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    # The original's largest finite magnitude: the absolute tolerance scales with it, and an
    # error of 1e6 on outputs of 1e13 is a rounding.
    max_abs_expected: float = 0.0
    fraction_out_of_tolerance: float = 0.0
    worst_index: tuple | None = None
    rtol: float = 0.0
    atol: float = 0.0
    stabilized_elements: int = 0
    nonfinite_mismatches: int = 0  # elements inf/NaN in one model and different in the other
    # A 16-bit float output weighed against the float32 twins (fuser/float32_twin.py): each
    # model's largest error against the original's twin, and the twins' against each other.
    reference_error: float | None = None
    original_reference_error: float | None = None
    twins_error: float | None = None
    # The 16-bit float a float32 output was computed in (the model computes in it inside), whose
    # tolerance it gets.
    computed_in: str | None = None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "status": self.status,
            "max_abs_error": self.max_abs_error,
            "max_rel_error": self.max_rel_error,
            "max_abs_expected": self.max_abs_expected,
            "fraction_out_of_tolerance": self.fraction_out_of_tolerance,
            "worst_index": list(self.worst_index) if self.worst_index is not None else None,
            "rtol": self.rtol,
            "atol": self.atol,
            "stabilized_elements": self.stabilized_elements,
            "nonfinite_mismatches": self.nonfinite_mismatches,
            "reference_error": self.reference_error,
            "original_reference_error": self.original_reference_error,
            "twins_error": self.twins_error,
            "computed_in": self.computed_in,
        }

    def rounding_text(self) -> str:
        """Why a "rounding" output passed, in one line."""
        return (
            f"{self.computed_in or self.dtype} rounding: '{self.name}' differs by up to {self.max_abs_error:.3g}; against the "
            f"original computed in float32 it is {self.reference_error:.3g} off, the original itself "
            f"{self.original_reference_error:.3g}, and in float32 the two agree to {self.twins_error:.3g}"
        )


def _scaled(check: OutputCheck) -> str:
    """What atol is a fraction of, where that is not 1 (see compare's scale)."""
    return f" times the largest expected magnitude, {check.max_abs_expected:.3g}" if check.max_abs_expected > 1 else ""


INTERFACES_DIFFER = "the models' interfaces differ"


def _interface_differences(inputs: list[str], given: list[str], outputs: list[str], produced: list[str]) -> str:
    """What the second model takes or gives that the first does not, and the other way round;
    "" when their graph inputs and outputs have the same names."""
    parts = []
    for what, first, second in (("inputs", inputs, given), ("outputs", outputs, produced)):
        only_first = [name for name in first if name not in second]
        only_second = [name for name in second if name not in first]
        if only_first:
            parts.append(f"{what} only the first has: {', '.join(only_first)}")
        if only_second:
            parts.append(f"{what} only the second has: {', '.join(only_second)}")
    return "; ".join(parts)


@dataclass
class Verdict:
    outputs: list[OutputCheck] = field(default_factory=list)
    load_error: str | None = None  # onnxruntime could not load the optimized model
    input_shapes: dict[str, tuple] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    padded_masks: list[str] = field(default_factory=list)  # checked again with their last row padded

    @property
    def passed(self) -> bool:
        return self.load_error is None and all(o.status != "mismatch" for o in self.outputs)

    def summary(self) -> str:
        if self.load_error and self.load_error.startswith(INTERFACES_DIFFER):
            return self.load_error  # both models ran: they take or give other tensors
        if self.load_error:
            return f"onnxruntime cannot run the optimized model: {self.load_error}"
        failures = self.failures()
        if not failures:
            return "all outputs match"
        worst = failures[0]
        special = ""
        if worst.nonfinite_mismatches:  # their difference is not a number: say so instead of "error 0"
            special = f"{worst.nonfinite_mismatches} element(s) inf/NaN in one model and not the same in the other, "
        return (
            f"output '{worst.name}' differs: {special}max abs error {worst.max_abs_error:.3g}"
            f"{' among finite values' if special else ''}, "
            f"{worst.fraction_out_of_tolerance:.1%} of elements out of tolerance "
            f"(rtol={worst.rtol:g}, atol={worst.atol:g}{_scaled(worst)}), worst at {worst.worst_index}"
        )

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "load_error": self.load_error,
            "outputs": [o.to_dict() for o in self.outputs],
            "input_shapes": {name: list(shape) for name, shape in self.input_shapes.items()},
            "padded_masks": self.padded_masks,
            "warnings": self.warnings,
        }

    def inputs_text(self) -> str:
        """`input_ids[1,128], pixel_values[1,3,224,224]`: what the check ran on."""
        text = ", ".join(f"{name}{_shape_text(shape)}" for name, shape in self.input_shapes.items())
        if self.padded_masks:
            text += f" (again with the last row of {', '.join(self.padded_masks)} half padded)"
        return text

    @property
    def stabilized(self) -> list[str]:
        return [o.name for o in self.outputs if o.status == "stabilized"]

    @property
    def rounded(self) -> list[OutputCheck]:
        """The float outputs of a model computing in a 16-bit float, beyond their tolerance, that
        the float32 twins show to be rounding."""
        return [o for o in self.outputs if o.status == "rounding"]

    def failures(self) -> list[OutputCheck]:
        return [o for o in self.outputs if o.status == "mismatch"]


# onnxruntime's own log lines (errors included: trying input sizes provokes some) would reach
# the user before fuser's one-line message; 4 keeps only fatal ones. The CLI lowers it under --debug.
QUIET = 4
LOG_SEVERITY = QUIET
# Threads of each check session; 0 lets onnxruntime take every core. Workers that optimize
# several models at once share the cores out instead of each taking all of them.
SESSION_THREADS = 0


def session(
    model: onnx.ModelProto | ModelParts,
    base_dir: str | os.PathLike | None = None,
    weights: WeightFeeds | None = None,
    on_serialized: Callable[[bytes], None] | None = None,
    in_pieces: bool = False,
):
    """A CPU session with onnxruntime's graph optimizations off.

    External data is resolved against `base_dir` (the model's folder), whatever the
    current directory is: onnxruntime otherwise resolves it against the working directory
    for a model given as bytes. With `weights`, large weights are fed as inputs (WeightFeeds).
    `on_serialized` is given the session's copy of the model (the serialized model, weights fed
    as inputs left out) once it is made: from then on, changes to `model` do not reach the session.
    in_pieces: a large model's session may be made of sessions of pieces of it, started side by
    side (fuser/pieces.py); it gives the whole model's outputs.
    """
    if weights is not None:
        skeleton, feeds = weights.split(model, base_dir)
        if feeds:
            return FedSession(session(skeleton, base_dir, on_serialized=on_serialized, in_pieces=in_pieces), feeds)
    if in_pieces and on_serialized is None:
        proto, initializers = split_parts(model)
        cut = started_in_pieces(
            proto, initializers, lambda piece: session(piece, base_dir), lambda: session(model, base_dir)
        )
        if cut is not None:
            return cut
    model = as_proto(model)
    if keeps_initializers(model):
        try:
            with tempfile.TemporaryDirectory(prefix="fuser-session-", ignore_cleanup_errors=True) as folder:
                options = _session_options()
                options.optimized_model_filepath = os.path.join(folder, "model.onnx")
                return open_session(model, options, base_dir, on_serialized)
        except (OSError, InputError):
            pass  # no temporary folder onnxruntime could save to: start the usual, slower way
    return open_session(model, _session_options(), base_dir, on_serialized)


def _session_options():
    import onnxruntime as ort

    ort.set_default_logger_severity(LOG_SEVERITY)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = LOG_SEVERITY
    options.intra_op_num_threads = SESSION_THREADS
    # A session's idle threads spin waiting for work by default, taking a core from whatever
    # runs beside them: the rewrite beside the original's session, and the pieces of a large
    # model (fuser/pieces.py), each a session of its own whose threads spin while the next piece
    # runs. Without it the check of bench/scale.py's 100k-node stacks took 0.3 s less (six of
    # seven interleaved runs).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


# onnxruntime hands each initializer to the session and then removes it from its graph one at a
# time, searching the graph's list by name: starting a session takes time quadratic in their
# number (bench/ort_sessions.py: 20 s for 80k). A session that is to save its model keeps them,
# so a model of many small initializers is given a file in a temporary folder to save to. They
# then stay in memory twice, hence the cap on their size, lifted where the wait would be longest
# (a million-node stack's 330 MB of them would take some 20 minutes, extrapolated); their being
# external would have onnxruntime copy the data beside the saved model, so those models start
# as usual. Below 8k the two ways take about as long (0.50 s and 0.45 s for 10k), and saving
# writes a file: eight of the pieces of the optimized 100k-node MLP, one after the other, started
# in 0.18 s each as usual and 0.18 s saving as 16 pieces (4k initializers each), 0.068 s and
# 0.072 s as 32 (2k each).
MANY_INITIALIZERS = 8192
KEPT_INITIALIZER_BYTES = 64 << 20
TOO_MANY_TO_REMOVE = 65536  # about 12 s of removing them (bench/ort_sessions.py)


def keeps_initializers(model: onnx.ModelProto) -> bool:
    """Whether the session of `model` keeps its initializers rather than removing them one by one."""
    initializers = model.graph.initializer
    if len(initializers) < MANY_INITIALIZERS or any(uses_external_data(t) for t in initializers):
        return False
    if len(initializers) >= TOO_MANY_TO_REMOVE:
        return True
    return sum(nbytes(t) for t in initializers) <= KEPT_INITIALIZER_BYTES


def open_session(
    model: onnx.ModelProto,
    options,
    base_dir: str | os.PathLike | None = None,
    on_serialized: Callable[[bytes], None] | None = None,
):
    """An onnxruntime CPU session of `model` with `options`, its external data resolved against
    `base_dir`; a model onnxruntime cannot load is an InputError. `on_serialized`: see session()."""
    import onnxruntime as ort

    if base_dir is not None:
        options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(Path(base_dir).resolve())
        )
    data = model.SerializeToString()
    if on_serialized is not None:
        on_serialized(data)
    try:
        return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    except Exception as error:  # noqa: BLE001 - onnxruntime raises several unrelated types
        if base_dir is not None and any(uses_external_data(t) for t in model.graph.initializer):
            # An onnxruntime without the folder option looks in the working directory: hand it the bytes.
            try:
                inline = with_inline_weights(model, base_dir)
                return ort.InferenceSession(inline.SerializeToString(), options, providers=["CPUExecutionProvider"])
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
        raise InputError(f"onnxruntime cannot load the model: {_first_line(error)}") from error


# Element types whose numpy arrays onnxruntime takes as inputs as they are.
_FEEDABLE = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.INT8,
    onnx.TensorProto.INT16,
    onnx.TensorProto.INT32,
    onnx.TensorProto.INT64,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.UINT16,
    onnx.TensorProto.UINT32,
    onnx.TensorProto.UINT64,
    onnx.TensorProto.BOOL,
}
FEED_BYTES = 64 << 10  # smaller initializers stay in the model: shape tensors must be constants


def feedable(tensor: onnx.TensorProto) -> bool:
    """Whether `tensor` is large enough, and of a type, for WeightFeeds to hold it once for
    every session (if only standard operators read it); a smaller one is each session's own."""
    return tensor.data_type in _FEEDABLE and nbytes(tensor) >= FEED_BYTES


class WeightFeeds:
    """The large weights of the models one check compares, each held once and shared.

    Every session would otherwise hold its own copy of every weight (and the serialized model
    a third): a check compares two models, so a large model needed several times its size.
    Instead, a weight read only by standard operators becomes a graph input, fed from a numpy
    array onnxruntime reads in place; a weight the two models have in common (same type,
    dims and bytes) is one array. External data is memory-mapped, not read. Weights of
    com.microsoft operators stay initializers: some of their kernels need constant weights.
    """

    def __init__(self) -> None:
        self._arrays: dict[tuple, tuple[object, np.ndarray]] = {}

    def split(
        self, model: onnx.ModelProto | ModelParts, base_dir
    ) -> tuple[onnx.ModelProto | ModelParts, dict[str, np.ndarray]]:
        """The model with its feedable weights turned into inputs, and their values."""
        proto, initializers = split_parts(model)
        graph = proto.graph
        large = {t.name for t in initializers if feedable(t)}
        if not large:
            return model, {}
        read_by_other_domains = {
            name
            for scope in all_graph_protos(graph)
            for node in scope.node
            if node.domain not in ("", "ai.onnx")
            for name in node.input
            if name in large
        }
        listed = {value.name for value in graph.input}
        store = TensorStore(Path(base_dir)) if base_dir is not None else None
        feeds: dict[str, np.ndarray] = {}
        kept = []
        for tensor in initializers:
            array = None
            if tensor.name in large and tensor.name not in read_by_other_domains:
                array = self._array(tensor, store)
            if array is None:
                kept.append(tensor)
            else:
                feeds[tensor.name] = array
        if not feeds:
            return model, {}
        skeleton = onnx.ModelProto()
        copy_fields_except(proto, skeleton, {"graph"})
        copy_fields_except(graph, skeleton.graph, {"initializer"})
        skeleton.graph.initializer.extend(kept)
        skeleton.graph.input.extend(
            onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for name, a in feeds.items()
            if name not in listed
        )
        return skeleton, feeds

    def _array(self, tensor: onnx.TensorProto, store: TensorStore | None) -> np.ndarray | None:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
        shape = tuple(tensor.dims)
        if uses_external_data(tensor):
            if store is None:
                return None
            fields = external_data_fields(tensor)
            path = store.resolve(fields.get("location", ""))
            offset = int(fields.get("offset", 0))
            key = ("file", str(path), offset, dtype.str, shape)
            if key not in self._arrays:
                self._arrays[key] = (None, np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape))
            return self._arrays[key][1]
        if not tensor.HasField("raw_data"):
            return None  # typed fields: small in practice, and decoding them is a copy anyway
        raw = tensor.raw_data
        key = ("raw", dtype.str, shape, hash(raw))
        cached = self._arrays.get(key)
        if cached is not None and cached[0] == raw:
            return cached[1]
        array = np.frombuffer(raw, dtype=dtype).reshape(shape)
        self._arrays[key] = (raw, array)
        return array


class FedSession:
    """An onnxruntime session whose weight inputs are fed for every run and hidden from callers."""

    def __init__(self, inner, weights: dict[str, np.ndarray]):
        self._inner = inner
        self._weights = weights

    @property
    def weights(self) -> dict[str, np.ndarray]:
        return self._weights

    def get_inputs(self):
        return [spec for spec in self._inner.get_inputs() if spec.name not in self._weights]

    def run(self, names, feeds, *args, **kwargs):
        return self._inner.run(names, {**feeds, **self._weights}, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def with_inline_weights(model: onnx.ModelProto, base_dir: str | os.PathLike) -> onnx.ModelProto:
    """A copy of `model` whose main-graph external data is read from `base_dir` into the file."""
    store = TensorStore(Path(base_dir))
    inline = onnx.ModelProto()
    inline.CopyFrom(model)
    for tensor in inline.graph.initializer:
        if uses_external_data(tensor):
            raw = store.raw_bytes(tensor)
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
            tensor.raw_data = raw
    return inline


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _run_error(error: BaseException) -> str:
    """onnxruntime's reason a run failed, on one line: its first, and the dims that did not fit,
    which it lists on the lines below ("index: 1 Got: 8000 Expected: 16000")."""
    details = [line.strip() for line in str(error).splitlines()[1:] if line.strip().startswith("index:")]
    return "; ".join([_first_line(error), *details])


class UnmadeInputError(InputError):
    """An input of a type no check input is made of (strings, sequences): no size helps."""


def synthesize_inputs(
    sess,
    seed: int = 0,
    dims: dict[str, int] | None = None,
    shapes: dict[str, tuple] | None = None,
    ranges: dict[str, tuple[float, float]] | None = None,
    positive: bool = False,
) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input.

    Floats are standard normal, integers in `ranges` (default [0, 10)), bools random;
    integer and bool inputs named like an attention mask are all ones, as real masks mostly are.
    positive: floats not given a range are the normal values' magnitudes, and integers not given
    one are drawn from [1, 10) (for a model that takes the log of a power, or a count).
    """
    dims = dims or {}
    shapes = shapes or {}
    ranges = ranges or {}
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in sess.get_inputs():
        if spec.name in shapes:
            shape = tuple(shapes[spec.name])
        else:
            shape = tuple(
                d if isinstance(d, int) and d >= 0 else dims.get(str(d), DEFAULT_DIM) for d in (spec.shape or [])
            )
        dtype = _numpy_dtype(spec.type)
        if dtype is None:
            real = "give real inputs with --inputs, or " if str(spec.type).startswith("tensor(") else ""
            raise UnmadeInputError(
                f"input '{spec.name}' has type {spec.type}, which fuser cannot make up: {real}run with "
                "--no-check and check the result on your own inputs"
            )
        try:
            feeds[spec.name] = _synthesize(rng, spec.name, shape, dtype, ranges.get(spec.name), positive)
        except (MemoryError, ValueError) as error:
            raise InputError(
                f"cannot make a check input '{spec.name}' of shape {_shape_text(shape)}: {_first_line(error)}; "
                "choose smaller sizes with --dim or --input-shape"
            ) from error
    return feeds


def _synthesize(rng, name: str, shape: tuple, dtype, value_range, positive: bool = False) -> np.ndarray:
    if value_range is None and is_attention_mask(name, shape, dtype):
        # torch's key_padding_mask says True where a position is padding: none, at first.
        return (np.zeros if is_padding_mask(name) else np.ones)(shape, dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dtype == np.uint8 and value_range is None and len(shape) >= 3:
        value_range = (0, 256)  # an image's pixels, not the few darkest of them
    if np.issubdtype(dtype, np.integer):
        low, high = value_range or ((1, INT_RANGE[1]) if positive else INT_RANGE)
        if int(high) <= int(low):
            raise InputError(f"input range {low},{high} of '{name}' holds no integer")
        return rng.integers(int(low), int(high), size=shape, endpoint=False).astype(dtype)
    if value_range is not None:
        return rng.uniform(value_range[0], value_range[1], size=shape).astype(dtype)
    values = rng.standard_normal(size=shape)
    return (np.abs(values) if positive else values).astype(dtype)


def is_mask_name(name: str) -> bool:
    return "mask" in name.lower()


def is_padding_mask(name: str) -> bool:
    return "padding_mask" in name.lower()


def is_attention_mask(name: str, shape: tuple, dtype) -> bool:
    """An input named like a mask, of integers or bools, or of floats [batch, sequence] (a float
    attention mask of ones and zeros: not an image's mask)."""
    if not is_mask_name(name):
        return False
    integral = dtype == np.bool_ or np.issubdtype(dtype, np.integer)
    return integral or len(shape) == 2


def padded_masks(feeds: dict[str, np.ndarray], ranges: dict | None) -> tuple[dict[str, np.ndarray], list[str]]:
    """`feeds` with the last row of every synthesized attention mask padded (its second half
    zero, as a shorter sequence in a right-padded batch has it; one in a key_padding_mask, which
    marks the padding), and the names of those masks."""
    padded, names = dict(feeds), []
    for name, value in feeds.items():
        if (
            not is_attention_mask(name, value.shape, value.dtype)
            or name in (ranges or {})
            or value.ndim < 2
            or value.shape[-1] < 2
        ):
            continue
        mask = value.copy()
        mask[(-1, Ellipsis, slice(value.shape[-1] // 2, None))] = 1 if is_padding_mask(name) else 0
        padded[name] = mask
        names.append(name)
    return padded, names


def _shape_text(shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


# Ops through which an integer input keeps indexing the same table (values move, not meaning).
_INDEX_PASSTHROUGH = {
    "Cast", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Identity", "Expand", "Slice", "Concat",
    "Transpose", "Tile", "Add", "Sub", "Gather", "Where", "Clip",
}  # fmt: skip


# A table read through these has the stored table's shape: a quantized model's embedding is
# DequantizeLinear of an int8 table, a float16 export's may be Cast up.
_SAME_SHAPE = {"DequantizeLinear", "Cast", "Identity"}


def index_ranges(model: onnx.ModelProto) -> dict[str, tuple[int, int]]:
    """[0, rows) for each integer graph input that indexes an embedding table (Gather's indices).

    The input is followed through Cast/Unsqueeze/Add and the like, into If/Loop/Scan bodies
    that read it by name; when it reaches several tables the smallest one bounds it. Only tables
    of known size count: initializers and Constants, read directly or through _SAME_SHAPE ops.
    """
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    indices = [
        spec.name
        for spec in graph.input
        if spec.name not in initializers and spec.type.tensor_type.elem_type in _INTEGER_TYPES
    ]
    if not indices:
        return {}
    # Tensors are keyed by the scope that declares them: a body reads an outer tensor by its
    # name, unless it declares that name itself (a Loop body's own input may shadow it).
    scopes = _scopes(graph)
    declared = [
        {v.name for v in g.input} | {t.name for t in g.initializer} | {o for n in g.node for o in n.output}
        for g, _ in scopes
    ]

    def key(scope: int | None, name: str) -> tuple[int | None, str]:
        while scope is not None and name not in declared[scope]:
            scope = scopes[scope][1]
        return scope, name

    consumers: dict[tuple, list[tuple[int, onnx.NodeProto]]] = {}
    rows: dict[tuple, list[int]] = {}
    for index, (scope, _) in enumerate(scopes):
        rows.update({(index, t.name): list(t.dims) for t in scope.initializer})
        for node in scope.node:
            for name in node.input[:]:
                consumers.setdefault(key(index, name), []).append((index, node))
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                rows[(index, node.output[0])] = list(node.attribute[0].t.dims)
            elif node.op_type in _SAME_SHAPE and node.input and key(index, node.input[0]) in rows and node.output:
                rows[(index, node.output[0])] = rows[key(index, node.input[0])]
    offsets = _integer_constants(scopes)
    computed = _Computed(model)
    result = {}
    for name in indices:
        bounds = []
        start = key(0, name)
        # With the largest constant added on the way: a codebook's codes + k * size index one table.
        seen, frontier = {start}, [(start, 0)]
        while frontier:
            tensor, offset = frontier.pop()
            for index, node in consumers.get(tensor, []):
                if node.op_type in _GATHERS and len(node.input) > 1 and key(index, node.input[1]) == tensor:
                    axis = next((a.i for a in node.attribute[:] if a.name == "axis"), 0)
                    table = rows.get(key(index, node.input[0]))
                    if table is None and index == 0:
                        table = computed.dims(node.input[0])  # a computed tensor: a label picked from logits
                    if table and -len(table) <= axis < len(table) and table[axis] - offset > 0:
                        bounds.append(table[axis] - offset)
                        continue
                if node.op_type in _INDEX_PASSTHROUGH:
                    added = _added(node, tensor[1], lambda name, index=index: offsets.get(key(index, name)))
                    for output in node.output[:]:
                        if output and (index, output) not in seen:
                            seen.add((index, output))
                            frontier.append(((index, output), offset + added))
        if bounds:
            result[name] = (0, min(bounds))
    return result


# Operators whose input 1 indexes input 0 along `axis`.
_GATHERS = ("Gather", "GatherElements")


class _Computed:
    """The main graph's tensors' dims as onnx's shape inference finds them, inferred on first ask
    (of a model without its weights)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self._model = model
        self._dims: dict[str, list] | None = None

    def dims(self, name: str) -> list[int] | None:
        if self._dims is None:
            self._dims = {}
            try:
                from fuser.graph import weightless_model

                inferred = onnx.shape_inference.infer_shapes(weightless_model(self._model))
            except Exception:  # noqa: BLE001 - no bound then, as before
                return None
            for value in (*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input):
                if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape"):
                    dims = [d.dim_value if d.HasField("dim_value") else 0 for d in value.type.tensor_type.shape.dim]
                    self._dims[value.name] = dims
        return self._dims.get(name)


def _integer_constants(scopes) -> dict[tuple, np.ndarray]:
    """The small integer initializers and Constants of every scope, by (scope, name)."""
    found = {}
    for index, (scope, _) in enumerate(scopes):
        tensors = [(t.name, t) for t in scope.initializer]
        tensors += [
            (n.output[0], n.attribute[0].t)
            for n in scope.node
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
        ]
        for name, tensor in tensors:
            small = tensor.data_location != onnx.TensorProto.EXTERNAL and np.prod(tensor.dims, dtype=np.int64) <= 4096
            if small and tensor.data_type in _INTEGER_TYPES:
                found[(index, name)] = onnx.numpy_helper.to_array(tensor)
    return found


def _added(node: onnx.NodeProto, tensor: str, constant) -> int:
    """The most an Add or Sub of a constant adds to `tensor`'s values on the way to its output."""
    if node.op_type not in ("Add", "Sub") or len(node.input) != 2:
        return 0
    other = node.input[1] if node.input[0] == tensor else node.input[0]
    value = constant(other)
    if value is None or not value.size:
        return 0
    if node.op_type == "Add":
        return max(int(value.max()), 0)
    return max(-int(value.min()), 0) if node.input[0] == tensor else 0


def _scopes(graph: onnx.GraphProto) -> list[tuple[onnx.GraphProto, int | None]]:
    """`graph` and every If/Loop/Scan body in it, each with the index of the scope it is in."""
    found: list[tuple[onnx.GraphProto, int | None]] = []

    def visit(scope: onnx.GraphProto, outer: int | None) -> None:
        index = len(found)
        found.append((scope, outer))
        for node in scope.node:
            for attribute in node.attribute:
                for body in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
                    visit(body, index)

    visit(graph, None)
    return found


_INTEGER_TYPES = {
    onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.INT16, onnx.TensorProto.INT8,
    onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64,
}  # fmt: skip

# Sizes tried for symbolic dims, in order, image and sequence sizes side by side; the first the
# original model runs on is kept. After them, sequences of LONG_SEQUENCE_SIZES (images at their
# first size): an audio window of 512 samples (32 ms at 16 kHz), which a model reading raw
# samples through a wide strided convolution needs (Silero VAD's is 256 samples wide).
IMAGE_SIZES = (224, 640, 320, 64, 32)
SEQUENCE_SIZES = (128, 64, 32, 16)
LONG_SEQUENCE_SIZES = (512,)
_IMAGE_SIZE_KEYS = ("imgsz", "image_size", "img_size", "input_size")


def shape_candidates(
    sess, model: onnx.ModelProto, dims: dict[str, int] | None = None, shapes: dict[str, tuple] | None = None
) -> list[dict[str, tuple]]:
    """Input shapes to try, most plausible first.

    Leading (batch) dims are 1; symbolic image dims (axes 2, 3 of a 4-D input) take the size
    in the model's metadata if it says one, then IMAGE_SIZES; other symbolic dims take
    SEQUENCE_SIZES; dims named like `a + b` follow the values of `a` and `b`; `dims` and
    `shapes` given by the user are kept in every candidate (the symbols of a shape given
    count as given too).

    A named dim found once among the inputs (a lone dim) may be a sum the exporter did not
    write down: a KV-cache export's attention mask spans the past and the new tokens, and the
    dynamo exporter names its length `s53` when asked for a dynamic dim. Where the sizes chosen
    fail, each lone dim in turn next takes each sum the model's outputs state of the inputs'
    dims (`past_sequence + sequence`; the dims a sum names are its parts, not lone), then each
    sum of two other dims' sizes.

    An unnamed sequence-like dim may be a batch too: a recurrent state is [layers, batch, hidden]
    (Silero VAD's `state` is [2, '', 128]). Where the sizes chosen fail, each unnamed dim in turn
    next takes 1.
    """
    dims, shapes = dict(dims or {}), shapes or {}
    for spec in sess.get_inputs():
        if spec.name in shapes:
            for d, size in zip(spec.shape or [], shapes[spec.name]):
                if isinstance(d, str) and d and not _expression_names(d):
                    dims.setdefault(d, int(size))
    for key, size in dims_read_by_weights(model).items():
        dims.setdefault(key, size)
    specs = [spec for spec in sess.get_inputs() if spec.name not in shapes]
    kinds: dict[str, str] = {}  # symbol -> "batch" | "image" | "sequence"
    unnamed: list[str] = []
    for spec in specs:
        shape = list(spec.shape or [])
        for axis, d in enumerate(shape):
            if isinstance(d, int) and d >= 0:
                continue
            key = _symbol(spec.name, axis, d)
            if key in dims or _expression_names(key):
                continue
            if _is_batch(key, axis, len(shape), isinstance(d, str) and bool(d)):
                kind = "batch"
            elif len(shape) == 4 and axis >= 2:
                kind = "image"
            else:
                kind = "sequence"
                if not (isinstance(d, str) and d):
                    unnamed.append(key)
            kinds.setdefault(key, kind)
    image_sizes = list(IMAGE_SIZES)
    declared = _metadata_image_size(model)
    if declared is not None:
        image_sizes.insert(0, declared)
    has_free = any(kind != "batch" for kind in kinds.values())
    attempts = max(len(image_sizes), len(SEQUENCE_SIZES)) if has_free else 0
    ladder = [
        {
            "image": image_sizes[min(i, len(image_sizes) - 1)],
            "sequence": SEQUENCE_SIZES[min(i, len(SEQUENCE_SIZES) - 1)],
        }
        for i in range(attempts)
    ]
    if any(kind == "sequence" for kind in kinds.values()):
        ladder += [{"image": image_sizes[0], "sequence": size} for size in LONG_SEQUENCE_SIZES]
    sums = _stated_sums(model, set(kinds) | set(dims))
    parts = {name for total in sums for name in _expression_names(total)}
    lone = [key for key in _lone_dims(sess.get_inputs(), kinds) if key not in parts]
    candidates = []
    # The last attempt sets every free dim to 1, as fuser always did, for models no typical size fits.
    for sizes in [*ladder, None]:
        values = dict(dims)
        for key, kind in kinds.items():
            values[key] = DEFAULT_DIM if kind == "batch" or sizes is None else sizes[kind]
        alternatives = [values]
        for key in lone:
            others = sorted({values[k] for k, kind in kinds.items() if kind != "batch" and k != key})
            pairs = [a + b for i, a in enumerate(others) for b in others[i:]]
            for size in dict.fromkeys([_dim_value(total, values) for total in sums] + pairs):
                if 1 <= size <= MAX_LONE_SIZE and size != values[key]:
                    alternatives.append({**values, key: size})
        alternatives += [{**values, key: DEFAULT_DIM} for key in unnamed if values[key] != DEFAULT_DIM]
        for chosen in alternatives:
            candidate = {name: tuple(shape) for name, shape in shapes.items()}
            for spec in specs:
                candidate[spec.name] = tuple(
                    d if isinstance(d, int) and d >= 0 else _dim_value(_symbol(spec.name, axis, d), chosen)
                    for axis, d in enumerate(spec.shape or [])
                )
            if candidate not in candidates:
                candidates.append(candidate)
    return candidates


# Operators whose result keeps their first input's axes in place (with a constant of at most
# its rank, for the binary ones): a weight that reads the result fixes the input's size there.
_AXES_KEPT = {
    "Cast", "Identity", "Relu", "Clip", "Sigmoid", "Tanh", "LeakyRelu", "Neg", "Abs", "Sqrt", "Exp",
    "Add", "Sub", "Mul", "Div", "Pow",
}  # fmt: skip


def dims_read_by_weights(model: onnx.ModelProto) -> dict[str, int]:
    """Free dims of the main graph's inputs that a stored weight fixes, by symbol: the channels a
    Conv's filter reads (axis 1; transformers' vision exports name it `num_channels` and leave it
    free), the features a MatMul's or Gemm's weight contracts (the last axis), the channels a
    BatchNormalization scales. Followed through operators that keep the axes in place
    (normalizing an image: Sub, Div)."""
    graph = model.graph
    shapes = {t.name: tuple(t.dims) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            shapes[node.output[0]] = tuple(node.attribute[0].t.dims)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input[:]:
            consumers.setdefault(name, []).append(node)
    fixed: dict[str, int] = {}
    for value in graph.input:
        if value.name in shapes or not value.type.HasField("tensor_type"):
            continue
        dims = value.type.tensor_type.shape.dim
        free = {
            axis: _symbol(value.name, axis, d.dim_param) for axis, d in enumerate(dims) if not d.HasField("dim_value")
        }
        if not free:
            continue
        rank, frontier, seen = len(dims), [value.name], {value.name}
        while frontier:
            tensor = frontier.pop()
            for node in consumers.get(tensor, []):
                read = _size_a_weight_reads(node, tensor, shapes, rank)
                if read is not None and read[0] in free and read[1] > 0:
                    fixed.setdefault(free[read[0]], read[1])
                elif (
                    node.op_type in _AXES_KEPT
                    and node.input[0] == tensor
                    and all(len(shapes.get(i, (0,) * (rank + 1))) <= rank for i in node.input[1:] if i)
                    and node.output[0] not in seen
                ):
                    seen.add(node.output[0])
                    frontier.append(node.output[0])
    return fixed


def _size_a_weight_reads(node: onnx.NodeProto, tensor: str, shapes: dict, rank: int) -> tuple[int, int] | None:
    """(axis of `tensor`, size) that `node`'s stored weight fixes, if it does."""
    inputs = node.input[:]
    weight = shapes.get(inputs[1]) if len(inputs) > 1 else None
    if not inputs or inputs[0] != tensor or weight is None:
        return None
    attributes = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
    if node.op_type == "Conv" and rank >= 3 and len(weight) == rank:
        return 1, weight[1] * attributes.get("group", 1)
    if node.op_type == "ConvTranspose" and rank >= 3 and len(weight) == rank:
        return 1, weight[0]
    if node.op_type == "MatMul" and rank >= 2 and len(weight) == 2:
        return rank - 1, weight[0]
    if node.op_type == "Gemm" and rank == 2 and len(weight) == 2 and not attributes.get("transA", 0):
        return 1, weight[1] if attributes.get("transB", 0) else weight[0]
    if node.op_type in ("BatchNormalization", "InstanceNormalization") and rank >= 2 and len(weight) == 1:
        return 1, weight[0]
    return None


# Names of a first axis that is a sequence, not a batch (nn.LSTM's and nn.Transformer's
# default layout, ONNX LSTM's own: [time, batch, features]).
_SEQUENCE_NAMES = ("seq", "time", "len", "frame", "step")


def _is_batch(symbol: str, axis: int, rank: int, named: bool) -> bool:
    """Whether a free dim is taken for a batch (size 1 in every candidate): named so, or the
    first of several axes unless it is named like a sequence. Only a dim's own name counts: an
    unnamed dim's symbol holds its input's (`time_ids:0`, `batch_tokens:1`)."""
    name = symbol.lower() if named else ""
    if "batch" in name:
        return True
    sequence = any(word in name for word in _SEQUENCE_NAMES)
    return axis == 0 and rank >= 2 and not sequence


def sizes_all_one(sess, candidate: dict[str, tuple], dims: dict[str, int], shapes: dict[str, tuple]) -> bool:
    """Whether `candidate` sets every free dim but the batch to 1 (where no typical size fits)
    although the model has such dims: dims neither given nor read by a weight."""
    free = []
    for spec in sess.get_inputs():
        if spec.name in shapes:
            continue
        shape = list(spec.shape or [])
        for axis, d in enumerate(shape):
            key = _symbol(spec.name, axis, d)
            if isinstance(d, int) and d >= 0 or key in dims or _expression_names(key):
                continue
            if not _is_batch(key, axis, len(shape), isinstance(d, str) and bool(d)):
                free.append(candidate[spec.name][axis])
    return bool(free) and all(size == 1 for size in free)


# A lone dim takes sums of other sizes up to this (two image sizes of 640, say).
MAX_LONE_SIZE = 4096


def _lone_dims(specs, kinds: dict[str, str]) -> list[str]:
    """The free sequence-like symbols named at one axis of one input only, in input order (an
    image's height and width are lone by nature, and an unnamed dim has no name to share)."""
    seen: dict[str, int] = {}
    for spec in specs:
        for d in spec.shape or []:
            if isinstance(d, str) and d:
                seen[d] = seen.get(d, 0) + 1
    return [key for key, count in seen.items() if count == 1 and kinds.get(key) == "sequence"]


def _stated_sums(model: onnx.ModelProto, known: set[str]) -> list[str]:
    """The dims of the model's outputs written as sums of the inputs' symbols only."""
    stated = []
    for output in model.graph.output:
        for d in output.type.tensor_type.shape.dim:
            if d.dim_param and d.dim_param not in stated and _is_sum(d.dim_param, known):
                stated.append(d.dim_param)
    return stated


def _is_sum(symbol: str, known: set[str]) -> bool:
    """Whether `symbol` reads `a + b (+ ...)` of names in `known`."""
    try:
        tree = ast.parse(symbol, mode="eval").body
    except SyntaxError:
        return False
    terms = []
    while isinstance(tree, ast.BinOp) and isinstance(tree.op, ast.Add):
        terms.append(tree.right)
        tree = tree.left
    terms.append(tree)
    return len(terms) > 1 and all(isinstance(t, ast.Name) and t.id in known for t in terms)


def _symbol(input_name: str, axis: int, dim) -> str:
    return dim if isinstance(dim, str) and dim else f"{input_name}:{axis}"


def _expression_names(symbol: str) -> list[str]:
    """The names in a dim like `past_sequence + sequence`; [] for a plain name."""
    try:
        tree = ast.parse(symbol, mode="eval")
    except SyntaxError:
        return []
    if isinstance(tree.body, ast.Name):
        return []
    return [node.id for node in ast.walk(tree) if isinstance(node, ast.Name)]


def _dim_value(symbol: str, values: dict[str, int]) -> int:
    if symbol in values:
        return values[symbol]
    names = _expression_names(symbol)
    if names and all(name in values for name in names):
        try:
            return int(_evaluate(ast.parse(symbol, mode="eval").body, values))
        except (ValueError, ZeroDivisionError):
            pass
    return DEFAULT_DIM


def _evaluate(node, values: dict[str, int]) -> int:
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, values), _evaluate(node.right, values)
        operations = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__, ast.FloorDiv: int.__floordiv__}
        if type(node.op) in operations:
            return operations[type(node.op)](left, right)
    raise ValueError("not a dimension expression")


def _metadata_image_size(model: onnx.ModelProto) -> int | None:
    """The image size an exporter recorded (ultralytics writes imgsz: '[640, 640]')."""
    for prop in model.metadata_props:
        if prop.key.lower() in _IMAGE_SIZE_KEYS:
            numbers = [int(n) for n in re.findall(r"\d+", prop.value)]
            if numbers and 0 < numbers[0] <= 8192:
                return numbers[0]
    return None


def _numpy_dtype(ort_type: str):
    table = {
        "tensor(float)": np.float32,
        "tensor(double)": np.float64,
        "tensor(float16)": np.float16,
        "tensor(int64)": np.int64,
        "tensor(int32)": np.int32,
        "tensor(int16)": np.int16,
        "tensor(int8)": np.int8,
        "tensor(uint8)": np.uint8,
        "tensor(uint16)": np.uint16,
        "tensor(uint32)": np.uint32,
        "tensor(uint64)": np.uint64,
        "tensor(bool)": np.bool_,
    }
    return table.get(ort_type)


def run(sess, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    options = ort.RunOptions()
    options.log_severity_level = LOG_SEVERITY  # a failing kernel logs through the run's logger
    outputs = sess.get_outputs()
    names = [o.name for o in outputs]
    values = sess.run(names, feeds, options)
    return {o.name: as_array(value, _innermost_dtype(o.type)) for o, value in zip(outputs, values)}


def as_array(value, dtype=None) -> np.ndarray:
    """An output as one array: a tensor as it is; a map (a dict from onnxruntime) as its values
    in the order of its sorted keys; a sequence (a list) as its items' arrays stacked, or joined
    flat when their shapes differ; `dtype`, the element type the output declares, for the
    values onnxruntime hands a map's as Python numbers. What the array alone does not show (a
    map's keys, the shapes of a sequence's items) is its `layout`, which compare() compares too.
    scikit-learn classifiers exported by skl2onnx return their probabilities as a sequence of
    maps (ZipMap), one {class: probability} per row."""
    if isinstance(value, dict):
        keys = sorted(value)
        return _laid_out(np.asarray([value[key] for key in keys], dtype=dtype), ("map", tuple(keys)))
    if isinstance(value, list):
        items = [as_array(item, dtype) for item in value]
        if not items:
            return np.zeros((0,), dtype or np.float32)
        layouts = tuple(getattr(item, "layout", None) for item in items)
        shapes = tuple(item.shape for item in items)
        if len(set(shapes)) == 1:
            stacked = np.stack([np.asarray(item) for item in items])
            return _laid_out(stacked, ("items", layouts)) if any(layouts) else stacked
        return _laid_out(np.concatenate([np.asarray(item).ravel() for item in items]), ("ragged", shapes, layouts))
    return np.asarray(value)


class _LaidOut(np.ndarray):
    """An array with the `layout` of the sequence or map it was made from (as_array)."""

    layout: tuple = ()


def _laid_out(array: np.ndarray, layout: tuple) -> np.ndarray:
    view = array.view(_LaidOut)
    view.layout = layout
    return view


def _innermost_dtype(ort_type: str):
    """The element type of a tensor, or of the tensors a sequence or map holds ("seq(map(int64,tensor(float)))")."""
    start = ort_type.rfind("tensor(")
    return None if start < 0 else _numpy_dtype(ort_type[start : ort_type.index(")", start) + 1])


def compare(
    name: str,
    expected: np.ndarray,
    actual: np.ndarray,
    exact: bool,
    rtol: float | None = None,
    atol: float | None = None,
    allow_stabilized: bool = True,
    computed_in: str | None = None,
) -> OutputCheck:
    """Compare one output; NaN/Inf positions compare as values, not as comparison failures.

    With allow_stabilized, a finite value where the original is inf/NaN counts as
    "stabilized"; without it (no applied rule claims to stabilize), as a mismatch.
    computed_in: the 16-bit float the output is computed through, if any: a float32 output
    computed so is no more precise than that, and gets its tolerance.
    """
    same_layout = getattr(expected, "layout", None) == getattr(actual, "layout", None)
    expected = np.asarray(expected)
    actual = np.asarray(actual)
    dtype = str(expected.dtype)
    check = OutputCheck(name=name, dtype=dtype, shape=expected.shape, status="ok")
    if computed_in is not None and dtype == "float32" and rtol is None and atol is None:
        check.computed_in = computed_in  # whose tolerance it gets: those the user gave are the contract
    if not same_layout or expected.shape != actual.shape or expected.dtype != actual.dtype:
        check.status = "mismatch"
        check.fraction_out_of_tolerance = 1.0
        return check
    if expected.size == 0:
        return check
    floating = np.issubdtype(expected.dtype, np.floating) or dtype == "bfloat16"
    # onnxruntime's CPU runs many 16-bit float operators in float32, and which ones (so where it
    # rounds back) depends on the graph around them: removing the Identity between a weight and
    # a LayerNormalization that shares it with a Conv moves float16 results by an ulp or two,
    # which grow through the layers after it. Rewiring of 16-bit floats gets their tolerance.
    precision = check.computed_in or dtype
    bit_exact = exact and precision not in SIXTEEN_BIT_FLOAT_NAMES
    if not floating or bit_exact:
        default_rtol = default_atol = 0.0
    else:
        default_rtol, default_atol = TOLERANCES.get(precision, TOLERANCES["float32"])
    check.rtol = default_rtol if rtol is None else rtol
    check.atol = default_atol if atol is None else atol
    if not floating:
        bad = expected != actual
        check.fraction_out_of_tolerance = float(bad.mean())
        if bad.any() and expected.dtype.kind in "OSU":  # strings: equal or not, no distance
            check.status = "mismatch"
            check.worst_index = tuple(int(i) for i in np.unravel_index(np.argmax(bad), bad.shape))
        elif bad.any():
            check.status = "mismatch"
            diff = np.abs(expected.astype(np.float64) - actual.astype(np.float64))
            check.max_abs_error = float(diff.max())
            check.max_rel_error = float((diff / np.maximum(np.abs(expected.astype(np.float64)), 1.0)).max())
            check.worst_index = tuple(int(i) for i in np.unravel_index(np.argmax(diff), diff.shape))
        return check

    e = expected.astype(np.float64)
    a = actual.astype(np.float64)
    e_finite, a_finite = np.isfinite(e), np.isfinite(a)
    stabilized = ~e_finite & a_finite
    if not allow_stabilized:
        stabilized = np.zeros_like(stabilized)
    same_special = (np.isnan(e) & np.isnan(a)) | (np.isinf(e) & (e == a))
    comparable = e_finite & a_finite
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is masked out below
        diff = np.where(comparable, np.abs(e - a), 0.0)
        rel = np.where(comparable, np.minimum(diff / np.maximum(np.abs(e), 1e-30), 1e300), 0.0)
    # atol is relative to the output's scale: a float32 output in the thousands cannot be
    # accurate to 1e-5 in absolute terms, whatever the rewrite.
    check.max_abs_expected = float(np.abs(e[e_finite]).max()) if e_finite.any() else 0.0
    scale = max(1.0, check.max_abs_expected)
    with np.errstate(invalid="ignore", over="ignore"):
        within = np.where(comparable, diff <= check.atol * scale + check.rtol * np.abs(e), same_special)
    bad = ~within & ~stabilized
    check.max_abs_error = float(diff.max())
    check.max_rel_error = float(rel.max())
    check.fraction_out_of_tolerance = float(bad.mean())
    check.stabilized_elements = int(stabilized.sum())
    check.nonfinite_mismatches = int((bad & ~comparable).sum())
    if bad.any():
        check.status = "mismatch"
        score = np.where(bad, np.where(comparable, diff, np.inf), -1.0)
        check.worst_index = tuple(int(i) for i in np.unravel_index(np.argmax(score), bad.shape))
    elif stabilized.any():
        check.status = "stabilized"
    if check.worst_index is None and diff.size:
        check.worst_index = tuple(int(i) for i in np.unravel_index(np.argmax(diff), diff.shape))
    return check


def load_inputs(path: str) -> dict[str, np.ndarray]:
    """Real inputs: an .npz file (arrays named like the graph inputs) or a folder of input_*.pb."""
    import glob
    import os

    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "input_*.pb")), key=lambda p: int(p.rsplit("_", 1)[1][:-3]))
        if not files:
            raise InputError(f"{path}: no input_*.pb files in the folder")
        feeds = {}
        for index, name in enumerate(files):
            tensor = onnx.TensorProto()
            try:
                with open(name, "rb") as handle:
                    tensor.ParseFromString(handle.read())
            except Exception as error:  # noqa: BLE001
                raise InputError(f"{name}: not a serialized TensorProto") from error
            feeds[tensor.name or f"#{index}"] = onnx.numpy_helper.to_array(tensor)
        return feeds
    try:
        if not Path(path).exists():
            raise FileNotFoundError(path)
        if not zipfile.is_zipfile(path):  # numpy takes any other file for a pickle, and says so
            raise InputError(f"{path}: not a .npz file (a zip archive of arrays, as numpy.savez writes)")
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except FileNotFoundError as error:
        raise InputError(f"{path}: no such file") from error
    except InputError:
        raise
    except Exception as error:  # noqa: BLE001 - numpy raises several types for bad files
        raise InputError(f"{path}: not a .npz file of arrays ({error})") from error


def _all_empty(outputs: dict[str, np.ndarray]) -> bool:
    return all(not value.size for value in outputs.values())


def _something_to_compare(outputs: dict[str, np.ndarray]) -> bool:
    """Whether some output has an element to compare: not empty, and for floats finite."""
    return any(
        value.size and (not _is_float(value) or np.isfinite(value.astype(np.float64)).any())
        for value in outputs.values()
    )


@dataclass
class OriginalRuns:
    """What the original model gave a check: the input sets, its outputs for each, its graph
    inputs' names, and what the check says of them. Made where its session ran, in this process
    or in another (fuser/check_apart.py)."""

    feeds: list[dict[str, np.ndarray]]
    expected: list[dict[str, np.ndarray]]
    input_names: list[str]
    warnings: list[str]
    padded_masks: list[str]


class Checker:
    """The original model's inputs and outputs, reused for every candidate model (its session
    is closed once they are known)."""

    def __init__(
        self,
        original: onnx.ModelProto,
        options: CheckOptions = CheckOptions(),
        *,
        base_dir: str | os.PathLike | None = None,
        on_serialized: Callable[[], None] | None = None,
        weights: WeightFeeds | None = None,
        retire: Callable[[object], None] | None = None,
        own: bool = False,
        copy: bytes | None = None,
    ):
        """on_serialized: called once the original's session has its own copy of `original`.
        weights: the WeightFeeds the candidates' sessions share with the original's.
        retire: given the original's session once its outputs are known, before it is let go.
        own: `original` is this Checker's, unchanged by anyone while it runs and never run again:
        no copy of it is made, and a large one's session is started in pieces (fuser/pieces.py).
        copy: `original` serialized, kept should a mismatch need it run again (own: there is no
        other copy)."""
        self._prepare(options, base_dir, weights if weights is not None else WeightFeeds())
        check_names(original, options)
        # The outputs computed through a 16-bit float, and what the original's float32 twin is
        # made of, should one of them differ: copied now, as the caller may change `original`
        # once the session has its copy.
        self._computed_in = computed_in_sixteen_bit_float(original)
        self._twin_source = _twin_source(original, base_dir, self.weights) if self._computed_in else None
        copied: list[bytes] = []

        def serialized(data: bytes) -> None:
            copied.append(data)
            if on_serialized is not None:
                on_serialized()

        try:
            if own:
                self.session = session(original, base_dir, self.weights, in_pieces=True)
            else:
                self.session = session(original, base_dir, self.weights, serialized)
        except InputError as error:
            if "is not a registered function/op" not in str(error):
                raise
            hint = "an operator onnxruntime does not know: --no-check optimizes without the check"
            raise InputError(f"{error} ({hint})") from error
        # What opens the session again should a mismatch need the original run anew: the
        # caller's `original` may have changed since (unsteady_outputs).
        fed = self.session.weights if isinstance(self.session, FedSession) else {}
        if copied:
            self._original_copy = (copied[0], fed)
        else:
            self._original_copy = None if copy is None else (copy, {})
        self._take(self._original_runs(original, options))
        # Its outputs are known: the session is closed. Open, it would hold its memory through
        # every check, and onnxruntime starts the next session of a large model slower while it
        # lives (the optimized 100k-node MLP of bench/scale.py: 6.1 s beside it, 4.8 s alone).
        if retire is not None:
            retire(self.session)
        self.session = None
        return_freed_memory()

    @classmethod
    def of_runs(
        cls,
        runs: OriginalRuns,
        copy: bytes,
        options: CheckOptions,
        *,
        base_dir=None,
        weights=None,
        twin_source=None,
        computed_in: dict[str, str] | None = None,
    ) -> Checker:
        """A Checker of what a session of the original made elsewhere gave (fuser/check_apart.py).
        copy: the serialized original it ran; twin_source: see _twin_source; computed_in: the
        original's outputs computed through a 16-bit float (computed_in_sixteen_bit_float)."""
        checker = cls.__new__(cls)
        checker._prepare(options, base_dir, weights if weights is not None else WeightFeeds())
        checker._twin_source = twin_source
        checker._computed_in = computed_in or {}
        checker._original_copy = (copy, {})
        checker._take(runs)
        return checker

    def _prepare(self, options: CheckOptions, base_dir, weights: WeightFeeds) -> None:
        self.rtol, self.atol = options.rtol, options.atol
        self.base_dir = base_dir
        self.weights = weights
        self.session = None
        self._reference = None  # the original's float32 twin, once a check needed it
        self._widened: dict[int, np.ndarray] = {}  # its weights, by id of the fed array

    def _original_runs(self, original: onnx.ModelProto, options: CheckOptions) -> OriginalRuns:
        seed, runs, inputs = options.seed, options.runs, options.inputs
        ranges = options.ranges
        self._early_warnings: list[str] = []
        if inputs is not None:
            self.feeds = [self._named(inputs)]
            self.expected = [self._run_original(self.feeds[0])]
        else:
            # Embedding indices stay inside their table unless the user says otherwise.
            ranges = {**index_ranges(original), **(ranges or {})}
            self.feeds, self.expected = self._synthesize(original, seed, runs, options.dims, options.shapes, ranges)
        self.input_shapes = {name: tuple(value.shape) for name, value in self.feeds[0].items()}
        self.warnings = self._early_warnings + self._meaningless_outputs(
            seed + runs, ranges if inputs is None else None
        )
        self.padded_masks: list[str] = []
        if inputs is None:
            self._add_padded_masks(ranges)
        names = [spec.name for spec in self.session.get_inputs()]
        return OriginalRuns(self.feeds, self.expected, names, self.warnings, self.padded_masks)

    def _take(self, runs: OriginalRuns) -> None:
        self.runs = runs
        self.feeds, self.expected = runs.feeds, runs.expected
        self.input_names = runs.input_names
        self.input_shapes = {name: tuple(value.shape) for name, value in runs.feeds[0].items()}
        self.warnings, self.padded_masks = runs.warnings, runs.padded_masks

    def _add_padded_masks(self, ranges) -> None:
        """One more input set for a model with attention-mask inputs of ones: the first set with
        each mask's last row padded. Masks of ones never exercise the masking, and rewrites of
        attention differ most where a row is masked."""
        padded, names = padded_masks(self.feeds[0], ranges)
        if not names:
            return
        try:
            expected = self._run_original(padded)
        except InputError:
            return  # a model that cannot take a padded mask is checked on masks of ones only
        self.feeds.append(padded)
        self.expected.append(expected)
        self.padded_masks = names

    def _synthesize(self, original, seed, runs, dims, shapes, ranges):
        """Feeds of the first candidate shapes the original runs on, and its outputs for them.
        Where every output is empty or inf/NaN on them (the log of a power given negative values,
        a TopK given k = 0), positive values (synthesize_inputs) of the same shapes are taken if
        they give something to compare; where inf or NaN remain (a sum that overflows at that
        length), the next shapes are tried too. Else the first inputs are kept, and the outputs
        that tell nothing are warned of (_meaningless_outputs). Empty outputs alone (a detector
        finding nothing in noise) are not worth running the model at every other size."""
        candidates = shape_candidates(self.session, original, dims, shapes)
        given = {**dims_read_by_weights(original), **(dims or {})}
        first = None  # the first inputs the original ran on, and its outputs for them
        for number, candidate in enumerate(candidates):
            try:
                found = self._run_on(candidate, seed, runs, ranges, positive=False)
            except UnmadeInputError:
                raise
            except InputError as error:
                if number < len(candidates) - 1:
                    continue
                if first is not None:
                    break
                if number == 0:  # the shapes were given: nothing else was tried
                    raise
                raise InputError(
                    f"{error} (the last of {len(candidates)} input shapes fuser tried; give the sizes the "
                    "model takes with --dim NAME=SIZE or --input-shape NAME:D1,D2, or real inputs with --inputs)"
                ) from error
            if first is None and not _something_to_compare(found[1][0]):
                try:
                    positive = self._run_on(candidate, seed, runs, ranges, positive=True)
                except InputError:
                    positive = None
                if positive is not None and _something_to_compare(positive[1][0]):
                    found = positive
            if _something_to_compare(found[1][0]):
                first = found
                break
            if first is None:
                first = found
            if _all_empty(found[1][0]):
                break
        if sizes_all_one(self.session, {n: tuple(v.shape) for n, v in first[0][0].items()}, given, shapes or {}):
            self._early_warnings.append(
                "every free size but the batch is 1 on the check inputs (no typical size fits the "
                "model): a check at size 1 tells little; give the sizes it takes with --dim NAME=SIZE, "
                "or real inputs with --inputs"
            )
        return first

    def _run_on(self, candidate, seed, runs, ranges, positive: bool):
        feeds = [
            synthesize_inputs(self.session, seed=seed + i, shapes=candidate, ranges=ranges, positive=positive)
            for i in range(runs)
        ]
        return feeds, [self._run_original(f) for f in feeds]

    def _run_original(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            return run(self.session, feeds)
        except Exception as error:  # noqa: BLE001 - onnxruntime's errors for feeds that do not fit
            shapes = ", ".join(f"{name}{_shape_text(value.shape)}" for name, value in feeds.items())
            raise InputError(
                f"the original model cannot run on these inputs ({shapes}): {_run_error(error)}"
            ) from error

    def _meaningless_outputs(self, probe_seed: int, ranges) -> list[str]:
        """Outputs whose comparison proves little: empty, non-finite everywhere, or blind to the inputs."""
        warnings = []
        first = self.expected[0]
        for name, value in first.items():
            if not value.size:  # a size of 0 given for it (--dim batch=0): nothing of it is compared
                warnings.append(f"output '{name}' is empty on the check inputs {_shape_text(value.shape)}")
            elif _is_float(value) and not np.isfinite(value.astype(np.float64)).any():
                warnings.append(f"output '{name}' is entirely inf/NaN on the check inputs")
        if ranges is None and len(self.feeds) < 2:
            return warnings  # real inputs: one set, nothing to vary
        if len(self.feeds) >= 2:
            other_feeds, other = self.feeds[1], self.expected[1]
        else:
            other_feeds = synthesize_inputs(self.session, seed=probe_seed, shapes=self.input_shapes, ranges=ranges)
            try:
                other = run(self.session, other_feeds)
            except Exception:  # noqa: BLE001 - a probe only; the check itself ran
                return warnings
        if all(np.array_equal(other_feeds[n], v) for n, v in self.feeds[0].items()):
            return warnings  # the inputs cannot vary (only masks, say): nothing to conclude
        for name, value in first.items():
            if value.size and np.array_equal(value, other[name], equal_nan=_is_float(value)):
                warnings.append(
                    f"output '{name}' is the same for different inputs (constant or independent of them): "
                    "the check compares it but cannot tell much from it"
                )
        return warnings

    def unsteady_outputs(self) -> list[str]:
        """The outputs the original gives differently, beyond the check's tolerance, when run
        again on the first input set. Random operators (Dropout in training mode, RandomNormal,
        ...) make such a model: its outputs differ from any other model's, the same one's
        included, and no rewrite is to blame. (Within the tolerance: the order in which threads
        add up a sum may move the last bits, which an exact rewrite's check would still catch.)

        The session is opened anew, from the copy the first one was made of, and may start its
        random streams where the first did: it runs twice, and an output either run changes is
        unsteady."""
        data, fed = self._original_copy
        opened = session(onnx.load_from_string(data), self.base_dir)
        self.session = FedSession(opened, fed) if fed else opened
        try:
            runs = [self._run_original(self.feeds[0]) for _ in range(2)]
        finally:
            self.session = None
        return [
            name
            for name, value in self.expected[0].items()
            if any(
                compare(
                    name, value, again[name], False, self.rtol, self.atol, False, self._computed_in.get(name)
                ).status
                != "ok"
                for again in runs
            )
        ]

    def _named(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        specs = self.session.get_inputs()
        feeds = {}
        for index, spec in enumerate(specs):
            value = inputs.get(spec.name, inputs.get(f"#{index}"))
            if value is None:
                raise InputError(f"the given inputs have no value for graph input '{spec.name}'")
            feeds[spec.name] = value
        return feeds

    def check(
        self,
        candidate: onnx.ModelProto | ModelParts,
        exact: bool,
        stabilizing: bool = True,
        base_dir=None,
        progress=None,
        started: Callable[[], object] | None = None,
    ) -> Verdict:
        """Compare `candidate` (external data beside `base_dir`, default the original's folder);
        `progress` (fuser.progress) is told each input set run. started: its session, started
        ahead (PreparedChecker.start_beside)."""
        verdict = self._check(candidate, exact, stabilizing, base_dir or self.base_dir, progress or silent, started)
        verdict.input_shapes = dict(self.input_shapes)
        verdict.padded_masks = list(self.padded_masks)
        verdict.warnings = [*self.warnings, *verdict.warnings]
        return verdict

    def _check(
        self, candidate: onnx.ModelProto | ModelParts, exact: bool, stabilizing: bool, base_dir, progress, started
    ) -> Verdict:
        ending.hold("check session", None)  # the last check's session goes before the next is made
        try:
            after = started() if started is not None else candidate_session(candidate, base_dir, self.weights)
        except InputError as error:
            return Verdict(load_error=str(error).removeprefix("onnxruntime cannot load the model: "))
        ending.hold("check session", after)
        verdict = Verdict()
        given = [spec.name for spec in after.get_inputs()]
        produced = [spec.name for spec in after.get_outputs()]
        expected = list(self.expected[0]) if self.expected else produced
        differences = _interface_differences(self.input_names, given, expected, produced)
        if differences:
            return Verdict(load_error=f"{INTERFACES_DIFFER}: {differences}")
        actuals = []
        for done, (feeds, expected) in enumerate(zip(self.feeds, self.expected), 1):
            try:
                actual = run(after, feeds)
            except InputError as error:  # a session started in pieces handed over to the whole model's
                return Verdict(load_error=str(error).removeprefix("onnxruntime cannot load the model: "))
            except Exception as error:  # noqa: BLE001
                return Verdict(load_error=f"onnxruntime fails running it: {_first_line(error)}")
            actuals.append(actual)
            for name, value in expected.items():
                check = compare(
                    name, value, actual[name], exact, self.rtol, self.atol, stabilizing, self._computed_in.get(name)
                )
                previous = next((o for o in verdict.outputs if o.name == name), None)
                if previous is None:
                    verdict.outputs.append(check)
                elif (_severity(check), check.max_abs_error) > (_severity(previous), previous.max_abs_error):
                    verdict.outputs[verdict.outputs.index(previous)] = check
            progress("check", done, len(self.feeds))
        self._weigh_rounding(verdict, candidate, base_dir, actuals)
        return verdict

    def _weigh_rounding(
        self, verdict: Verdict, candidate: onnx.ModelProto | ModelParts, base_dir, actuals: list[dict]
    ) -> None:
        """Call an output beyond its tolerance "rounding" when the float32 twins show it to be: in
        float32 the optimized model computes what the original does (float32's tolerance), and
        as it is, it is at worst and on average at most ROUNDING_FACTOR times as far from the
        original's twin as the original is. The outputs weighed are the 16-bit float ones, and
        the float32 ones computed through a 16-bit float (computed_in). Tolerances the user gave
        are the contract: they are not weighed."""
        suspects = [
            o
            for o in verdict.outputs
            if o.status == "mismatch"
            and (o.dtype in SIXTEEN_BIT_FLOAT_NAMES or o.computed_in)
            and not o.nonfinite_mismatches
        ]
        if not suspects or self._twin_source is None or self.rtol is not None or self.atol is not None:
            return
        from fuser.jobs import available_memory

        skeleton, feeds = self._twin_source
        needed = sum(2 * array.nbytes for array in feeds.values() if is_sixteen_bit_float(array))
        needed += sum(2 * nbytes(t) for t in skeleton.graph.initializer if t.data_type in SIXTEEN_BIT_FLOATS)
        available = available_memory()
        if available is not None and needed > available // 2:
            verdict.warnings.append(
                f"{suspects[0].dtype} output '{suspects[0].name}' differs beyond its tolerance; telling rounding "
                f"from error takes float32 copies of the weights ({needed / 1e9:.1f} GB), more than half the "
                "memory available, so it was not tried"
            )
            return
        # A twin that cannot be built, loaded or run (beyond protobuf's 2 GB, say) decides
        # nothing: the mismatch stands.
        try:
            candidate_source = _twin_source(candidate, base_dir, self.weights)
            if self._reference is None:
                self._reference = _twin_session(*self._twin_source, base_dir=self.base_dir, widened=self._widened)
            # The weights both models share are widened once; the candidate's own, for this check only.
            twin = _twin_session(*candidate_source, base_dir=base_dir, widened=dict(self._widened))
            weighed = {o.name: _Weighing() for o in suspects}
            for feeds, expected, actual in zip(self.feeds, self.expected, actuals):
                wide = {name: widen_array(value) for name, value in feeds.items()}
                reference, twins = run(self._reference, wide), run(twin, wide)
                for name, weighing in weighed.items():
                    weighing.add(expected[name], actual[name], reference[name], twins[name])
        except Exception:  # noqa: BLE001 - onnxruntime, protobuf and numpy raise many types
            return
        for check in suspects:
            weighed[check.name].settle(check)


class _Weighing:
    """One output's errors against the original's float32 twin, over the input sets."""

    def __init__(self) -> None:
        self.comparable = True  # same dtype, shape and inf/NaN in every input set: rounding can explain the rest
        self.twins_agree = True
        self.twins_error = 0.0
        self.original = [0.0, 0.0, 0]  # largest error, sum of errors, elements
        self.optimized = [0.0, 0.0, 0]

    def add(self, original: np.ndarray, optimized: np.ndarray, reference: np.ndarray, twin: np.ndarray) -> None:
        if original.dtype != optimized.dtype or original.shape != optimized.shape or reference.shape != original.shape:
            self.comparable = False
            return
        values = [original.astype(np.float64), optimized.astype(np.float64)]
        finite = np.isfinite(values[0])
        if not np.array_equal(finite, np.isfinite(values[1])) or not np.array_equal(
            values[0][~finite], values[1][~finite], equal_nan=True
        ):
            self.comparable = False  # inf/NaN where the other has none, or another one: never rounding
            return
        agreement = compare("", reference, twin, exact=False, allow_stabilized=False)
        self.twins_agree &= agreement.status == "ok"
        self.twins_error = max(self.twins_error, agreement.max_abs_error)
        wide = reference.astype(np.float64)
        finite &= np.isfinite(wide)
        for errors, value in zip((self.original, self.optimized), values):
            difference = np.abs(value[finite] - wide[finite])
            if difference.size:
                errors[0] = max(errors[0], float(difference.max()))
                errors[1] += float(difference.sum())
                errors[2] += difference.size

    def settle(self, check: OutputCheck) -> None:
        if not self.comparable:
            return
        (worst, total, count), (own_worst, own_total, _) = self.optimized, self.original
        check.reference_error, check.original_reference_error = worst, own_worst
        check.twins_error = self.twins_error
        if self.twins_agree and count and worst <= ROUNDING_FACTOR * own_worst and total <= ROUNDING_FACTOR * own_total:
            check.status = "rounding"


def _twin_source(model: onnx.ModelProto | ModelParts, base_dir, weights: WeightFeeds):
    """A model's float32 twin's makings, for a model computing in a 16-bit float: a copy of the
    model without the weights `weights` feeds, and those weights."""
    skeleton, feeds = weights.split(model, base_dir)
    if skeleton is not model:
        return skeleton, feeds  # built by split: a copy already
    if isinstance(model, ModelParts):
        return model.joined(), feeds
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy, feeds


def _twin_session(skeleton: onnx.ModelProto, feeds: dict[str, np.ndarray], *, base_dir, widened: dict):
    """A session of the float32 twin of `skeleton` fed `feeds` (widened, each array once)."""
    for array in feeds.values():
        if id(array) not in widened:
            widened[id(array)] = widen_array(array)
    inner = session(float32_twin(skeleton, base_dir), base_dir)
    return FedSession(inner, {name: widened[id(a)] for name, a in feeds.items()}) if feeds else inner


def return_freed_memory() -> None:
    """Hand the memory a closed session freed back to the system, where the C library allows.

    glibc keeps memory freed by another thread in that thread's arena, for that thread to reuse:
    the original's session, built in PreparedChecker's thread, left its gigabyte there, and the
    optimized model's session took as much again beside it (the 100k-node ResNet stack of
    bench/scale.py peaked at 2.60 GB rather than 1.87). A C library without malloc_trim (macOS,
    musl) returns it by its own rules."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):  # TypeError: Windows opens no library by None
        return
    trim(0)


def candidate_session(candidate: onnx.ModelProto | ModelParts, base_dir, weights: WeightFeeds):
    """The check's session of `candidate`: in pieces if it is large, fed the weights it shares
    with the original; a model onnxruntime cannot load is an InputError."""
    return session(candidate, base_dir, weights, in_pieces=True)


# From this many nodes, an original whose side of the check runs in this process (no child: one
# core, not the memory, or weights the sessions here share) starts its session in pieces too,
# though cutting it takes Python's lock from the rewrite: onnxruntime's start of a whole model
# grows faster than the model. The MLP stack of bench/scale.py started whole in 5.7 s at 100k
# nodes (0.78 GB), 27.3 s at 300k (2.3 GB) and in about 4 minutes at a million, beside its
# rewrite; in pieces in 2.2 s (0.56 GB) and 6.2 s (1.56 GB), its optimized 666k nodes in 20 s.
# `fuser optimize` with the check in this process, two runs each: at 150k nodes 18.1 s at 1.64
# GB in pieces, 15.9 and 17.3 s at 2.60 GB whole (the rewrite 11.1 s against 7.0 to 7.7 s); at
# 300k 34.9 and 35.2 s at 3.13 GB against 38.5 and 39.2 s at 5.09 GB.
PIECES_HERE_NODES = 200_000
# What starting the original whole in this process adds to a run, per node, with a margin: 13 KB
# measured, and pieces hold less (the 100k-node MLP stack with the check under a cgroup memory
# limit: 1.75 GB at its peak with the original whole, 1.10 to 1.15 GB in pieces, 0.45 GB once
# loaded). Where the memory available is short of this, the original starts in pieces wherever
# it can be cut: under a 1.5 GB limit the system stopped the run with the original whole, and in
# pieces it passed (16.1 s; under 1.8 GB, 11.8 s whole and 13.4 s in pieces).
WHOLE_ORIGINAL_BYTES_PER_NODE = 16_000


def pieces_here(nodes: int) -> bool:
    """Whether an original of `nodes` nodes checked in this process starts in pieces: a large
    one always (PIECES_HERE_NODES), another where the memory available could not hold its
    whole session (WHOLE_ORIGINAL_BYTES_PER_NODE)."""
    from fuser.jobs import available_memory

    if nodes >= PIECES_HERE_NODES:
        return True
    if nodes < 2 * PIECE_NODES:  # not cut anyway
        return False
    available = available_memory()
    return available is not None and available < nodes * WHOLE_ORIGINAL_BYTES_PER_NODE


def check_written(
    original: str | os.PathLike,
    candidate: str | os.PathLike,
    options: CheckOptions,
    exact: bool,
    stabilizing: bool = True,
    progress=None,
) -> Verdict:
    """The check of `candidate` against `original`, two model files read without their graphs
    (fuser.model.load_for_sessions), each session started in pieces where the model is large:
    a check that holds no more than its sessions and the two models' protobufs (fuser.jobs checks
    a result so where memory is short, once it is written and its graph let go)."""
    from fuser.model import load_for_sessions

    (reference, reference_folder), (written, written_folder) = load_for_sessions([original, candidate])
    checker = Checker(reference, options, base_dir=reference_folder, own=True)
    del reference  # the checker's session has what it needs of it
    return checker.check(written, exact, stabilizing, base_dir=written_folder, progress=progress)


class PreparedChecker:
    """A Checker built in a thread of its own while the caller goes on (the rewrite runs).

    Most of the work, onnxruntime building the original's session and running it, is done
    without holding the GIL, so on a machine of two cores or more it costs the rewrite little
    and the check after it only the optimized model's part. A large model's original is run by
    a child interpreter instead, its session started in pieces (fuser/check_apart.py), and the
    thread waits for its answer. The constructor returns once the session, or the child, has
    its own copy of `original`: whatever happens to it afterwards, the check compares against
    the model as it was. `options` is what it was built with: a caller whose options changed
    since builds a new Checker instead.
    """

    def __init__(self, original: onnx.ModelProto, options: CheckOptions, base_dir=None):
        self.options = options
        self.base_dir = base_dir
        # Shared with the candidates' sessions, some started while the thread still runs
        # (start_beside): the thread is done with it once the original's session has its copy.
        self.weights = WeightFeeds()
        self._beside = False  # a candidate's session is being started beside the thread
        self._checker: Checker | None = None
        self._error: BaseException | None = None
        self._copied = threading.Event()
        self._apart = None
        self.answered_apart = False  # the original's side was the child's (fuser/check_apart.py)
        build, args = self._build, (original, options, base_dir)
        if worth_apart(original):
            computed_in = computed_in_sixteen_bit_float(original)
            twin_source = _twin_source(original, base_dir, self.weights) if computed_in else None
            data = original.SerializeToString()
            try:
                self._apart = OriginalApart(data, options, base_dir)
            except ChildFailed:
                build, args = self._build_own, (data, options, base_dir)
            else:
                build, args = self._build_apart, (data, twin_source, computed_in, options, base_dir)
            self._copied.set()
        elif pieces_here(len(original.graph.node)):
            build, args = self._build_own, (original.SerializeToString(), options, base_dir)
            self._copied.set()
        # A daemon: a run cut short (Ctrl-C) does not wait at its end for onnxruntime to finish
        # starting a session nobody will use (the optimize caller waits for it otherwise).
        self._thread = threading.Thread(target=build, args=args, name="fuser-check-original", daemon=True)
        self._thread.start()
        self._copied.wait()

    def _build(self, original, options, base_dir) -> None:
        try:
            self._checker = Checker(
                original,
                options,
                base_dir=base_dir,
                on_serialized=self._copied.set,
                weights=self.weights,
                retire=self._retire,
            )
        except BaseException as error:  # noqa: BLE001 - raised in the caller's thread by get()
            self._error = error
        finally:
            self._copied.set()

    def _build_own(self, data: bytes, options, base_dir) -> None:
        """The Checker of `data`, the serialized original, parsed anew: a copy of its own, whose
        session starts in pieces where pieces_here says so."""
        try:
            own = onnx.load_from_string(data)
            cut = pieces_here(len(own.graph.node))
            self._checker = Checker(own, options, base_dir=base_dir, weights=self.weights, own=cut, copy=data)
        except BaseException as error:  # noqa: BLE001 - raised in the caller's thread by get()
            self._error = error

    def _build_apart(self, data: bytes, twin_source, computed_in, options, base_dir) -> None:
        """The Checker of what the child gives; where it gives nothing, of this process's own work."""
        try:
            try:
                runs = self._apart.result()
            except ChildFailed:
                if not self._apart.stopped:
                    self._build_own(data, options, base_dir)
                return
            self._checker = Checker.of_runs(
                runs,
                data,
                options,
                base_dir=base_dir,
                weights=self.weights,
                twin_source=twin_source,
                computed_in=computed_in,
            )
            self.answered_apart = True
        except BaseException as error:  # noqa: BLE001 - raised in the caller's thread by get()
            self._error = error

    def _retire(self, session) -> None:
        """Keep the original's session, in a process that ends soon, while a candidate's is being
        started beside: onnxruntime frees a session holding Python's lock (0.9 s for the 100k-node
        MLP's original), and cutting the candidate into pieces waited for it."""
        if self._beside:
            ending.hold("original session", session)

    def start_beside(self, candidate: onnx.ModelProto | ModelParts) -> Callable[[], object] | None:
        """If the Checker is still being built, start the check's session of `candidate` now,
        beside it, and return what gives it to Checker.check (or raises the InputError starting it
        raised). The original's side ends on one core (its session, then its runs) while the
        other would wait: the 100k-node MLP of bench/scale.py waited 0.8 s. Once it is built,
        None: the original's session is closed, and the candidate's starts as usual."""
        if not self._thread.is_alive():
            return None
        self._beside = True
        try:
            started = candidate_session(candidate, self.base_dir, self.weights)
        except InputError as error:
            refused = error

            def reraised():
                raise refused

            return reraised
        return lambda: started

    def get(self) -> Checker:
        """The Checker, once built; what building it raised is raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._checker

    def discard(self) -> None:
        """Wait for the thread and drop what it built, errors included: no check is needed."""
        if self._apart is not None:
            self._apart.stop()  # its answer is not awaited
        self._thread.join()
        self._checker = self._error = None


RANDOM_OPS = ("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli")


def random_nodes(model: onnx.ModelProto) -> list[str]:
    """The nodes of `model` whose results are random: the operators above, and Dropout whose
    training_mode is a constant true (exporters write it so for a module left in training mode)."""
    found = []
    for graph in all_graph_protos(model.graph):
        constants = {t.name: t for t in graph.initializer}
        constants.update(
            (n.output[0], a.t) for n in graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"
        )
        for node in graph.node:
            if node.op_type in RANDOM_OPS:
                found.append(f"{node.op_type} '{node.name or node.output[0]}'")
            elif node.op_type == "Dropout" and len(node.input) > 2 and node.input[2] in constants:
                if bool(onnx.numpy_helper.to_array(constants[node.input[2]]).reshape(-1)[0]):
                    found.append(f"Dropout '{node.name or node.output[0]}' in training mode")
    return found


def _is_float(value: np.ndarray) -> bool:
    return np.issubdtype(value.dtype, np.floating)


def input_names(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    """The graph inputs a caller may feed, and the symbolic dimension names in their shapes."""
    initializers = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in initializers]
    symbols = sorted(
        {
            d.dim_param
            for i in model.graph.input
            if i.name not in initializers
            for d in i.type.tensor_type.shape.dim
            if d.HasField("dim_param") and d.dim_param
        }
    )
    return names, symbols


def check_names(model: onnx.ModelProto, options: CheckOptions) -> None:
    """Refuse settings that name no graph input or symbolic dim (a typo would silently do nothing)."""
    dims, shapes, ranges, inputs = options.dims, options.shapes, options.ranges, options.inputs
    names, symbols = input_names(model)
    listed = ", ".join(names) or "none"
    for option, given in (("--input-shape", shapes), ("--input-range", ranges)):
        unknown = sorted(set(given or {}) - set(names))
        if unknown:
            raise UsageError(f"{option}: the model has no input {', '.join(unknown)} (its inputs: {listed})")
    unknown = sorted(set(dims or {}) - set(symbols))
    if unknown:
        raise UsageError(
            f"--dim: the model's inputs have no symbolic dimension {', '.join(unknown)} "
            f"(symbolic dimensions: {', '.join(symbols) or 'none'})"
        )
    positional = {f"#{index}" for index in range(len(names))}
    unknown = sorted(set(inputs or {}) - set(names) - positional)
    if unknown:
        raise UsageError(f"--inputs: the model has no input {', '.join(unknown)} (its inputs: {listed})")


def _severity(check: OutputCheck) -> int:
    return {"ok": 0, "stabilized": 1, "mismatch": 2}[check.status]


def onnxruntime_default_domain_ops() -> frozenset[str]:
    """Operators the installed onnxruntime registers in the default ONNX domain, its own
    additions included (SimplifiedLayerNormalization), which onnx.checker does not know."""
    from onnxruntime.capi import onnxruntime_pybind11_state as runtime

    return frozenset(s.name for s in runtime.get_all_operator_schema() if s.domain in ("", "ai.onnx"))
