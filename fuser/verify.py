"""Running the original and the optimized model in onnxruntime and comparing every output.

Sessions run on the CPU with onnxruntime's own graph optimizations disabled, so that its
fusions neither hide nor cause differences. This is the only module importing onnxruntime.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from fuser.errors import InputError

# (rtol, atol) for rewrites that are equal up to rounding; exact rewrites compare bit for bit.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-9, 1e-12),
    "float32": (1e-4, 1e-5),
    "float16": (1e-2, 1e-3),
    "bfloat16": (2e-2, 1e-2),
}
DEFAULT_DIM = 1
INT_RANGE = (0, 10)


@dataclass
class OutputCheck:
    name: str
    dtype: str
    shape: tuple
    status: str  # "ok", "mismatch", "stabilized"
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    fraction_out_of_tolerance: float = 0.0
    worst_index: tuple | None = None
    rtol: float = 0.0
    atol: float = 0.0
    stabilized_elements: int = 0

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "status": self.status,
            "max_abs_error": self.max_abs_error,
            "max_rel_error": self.max_rel_error,
            "fraction_out_of_tolerance": self.fraction_out_of_tolerance,
            "worst_index": list(self.worst_index) if self.worst_index is not None else None,
            "rtol": self.rtol,
            "atol": self.atol,
            "stabilized_elements": self.stabilized_elements,
        }


@dataclass
class Verdict:
    outputs: list[OutputCheck] = field(default_factory=list)
    load_error: str | None = None  # onnxruntime could not load the optimized model

    @property
    def passed(self) -> bool:
        return self.load_error is None and all(o.status != "mismatch" for o in self.outputs)

    def summary(self) -> str:
        if self.load_error:
            return f"onnxruntime cannot run the optimized model: {self.load_error}"
        failures = self.failures()
        if not failures:
            return "all outputs match"
        worst = failures[0]
        return (
            f"output '{worst.name}' differs: max abs error {worst.max_abs_error:.3g}, "
            f"{worst.fraction_out_of_tolerance:.1%} of elements out of tolerance "
            f"(rtol={worst.rtol:g}, atol={worst.atol:g}), worst at {worst.worst_index}"
        )

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "load_error": self.load_error,
            "outputs": [o.to_dict() for o in self.outputs],
        }

    @property
    def stabilized(self) -> list[str]:
        return [o.name for o in self.outputs if o.status == "stabilized"]

    def failures(self) -> list[OutputCheck]:
        return [o for o in self.outputs if o.status == "mismatch"]


def session(model: onnx.ModelProto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # noqa: BLE001 - onnxruntime raises several unrelated types
        raise InputError(f"onnxruntime cannot load the model: {_first_line(error)}") from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def synthesize_inputs(
    sess,
    seed: int = 0,
    dims: dict[str, int] | None = None,
    shapes: dict[str, tuple] | None = None,
    ranges: dict[str, tuple[float, float]] | None = None,
) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input: normal floats, small non-negative ints, random bools."""
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
            raise InputError(f"input '{spec.name}' has type {spec.type}, which fuser cannot synthesize")
        if dtype == np.bool_:
            value = rng.integers(0, 2, size=shape).astype(np.bool_)
        elif np.issubdtype(dtype, np.integer):
            low, high = ranges.get(spec.name, INT_RANGE)
            if int(high) <= int(low):
                raise InputError(f"input range {low},{high} of '{spec.name}' holds no integer")
            value = rng.integers(int(low), int(high), size=shape, endpoint=False).astype(dtype)
        elif spec.name in ranges:
            low, high = ranges[spec.name]
            value = rng.uniform(low, high, size=shape).astype(dtype)
        else:
            value = rng.standard_normal(size=shape).astype(dtype)
        feeds[spec.name] = value
    return feeds


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
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def compare(
    name: str,
    expected: np.ndarray,
    actual: np.ndarray,
    exact: bool,
    rtol: float | None = None,
    atol: float | None = None,
    allow_stabilized: bool = True,
) -> OutputCheck:
    """Compare one output; NaN/Inf positions compare as values, not as comparison failures.

    With allow_stabilized, a finite value where the original is inf/NaN counts as
    "stabilized"; without it (no applied rule claims to stabilize), as a mismatch.
    """
    expected = np.asarray(expected)
    actual = np.asarray(actual)
    dtype = str(expected.dtype)
    check = OutputCheck(name=name, dtype=dtype, shape=expected.shape, status="ok")
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        check.status = "mismatch"
        check.fraction_out_of_tolerance = 1.0
        return check
    if expected.size == 0:
        return check
    floating = np.issubdtype(expected.dtype, np.floating) or dtype == "bfloat16"
    if not floating or exact:
        default_rtol = default_atol = 0.0
    else:
        default_rtol, default_atol = TOLERANCES.get(dtype, TOLERANCES["float32"])
    check.rtol = default_rtol if rtol is None else rtol
    check.atol = default_atol if atol is None else atol
    if not floating:
        bad = expected != actual
        check.fraction_out_of_tolerance = float(bad.mean())
        if bad.any():
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
    scale = max(1.0, float(np.abs(e[e_finite]).max())) if e_finite.any() else 1.0
    with np.errstate(invalid="ignore", over="ignore"):
        within = np.where(comparable, diff <= check.atol * scale + check.rtol * np.abs(e), same_special)
    bad = ~within & ~stabilized
    check.max_abs_error = float(diff.max())
    check.max_rel_error = float(rel.max())
    check.fraction_out_of_tolerance = float(bad.mean())
    check.stabilized_elements = int(stabilized.sum())
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
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except FileNotFoundError as error:
        raise InputError(f"{path}: no such file") from error
    except Exception as error:  # noqa: BLE001 - numpy raises several types for bad files
        raise InputError(f"{path}: not a .npz file of arrays ({error})") from error


class Checker:
    """The original model's session, inputs and outputs, reused for every candidate model."""

    def __init__(
        self,
        original: onnx.ModelProto,
        *,
        seed: int = 0,
        runs: int = 1,
        dims: dict[str, int] | None = None,
        shapes: dict[str, tuple] | None = None,
        ranges: dict[str, tuple[float, float]] | None = None,
        inputs: dict[str, np.ndarray] | None = None,
        rtol: float | None = None,
        atol: float | None = None,
    ):
        self.rtol, self.atol = rtol, atol
        self.session = session(original)
        if inputs is not None:
            self.feeds = [self._named(inputs)]
        else:
            self.feeds = [
                synthesize_inputs(self.session, seed=seed + i, dims=dims, shapes=shapes, ranges=ranges)
                for i in range(runs)
            ]
        try:
            self.expected = [run(self.session, feeds) for feeds in self.feeds]
        except Exception as error:  # noqa: BLE001 - onnxruntime's errors for feeds that do not fit
            raise InputError(f"the original model cannot run on these inputs: {_first_line(error)}") from error

    def _named(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        specs = self.session.get_inputs()
        feeds = {}
        for index, spec in enumerate(specs):
            value = inputs.get(spec.name, inputs.get(f"#{index}"))
            if value is None:
                raise InputError(f"the given inputs have no value for graph input '{spec.name}'")
            feeds[spec.name] = value
        return feeds

    def check(self, candidate: onnx.ModelProto, exact: bool, stabilizing: bool = True) -> Verdict:
        try:
            after = session(candidate)
        except InputError as error:
            return Verdict(load_error=str(error).removeprefix("onnxruntime cannot load the model: "))
        verdict = Verdict()
        wanted = {spec.name for spec in self.session.get_inputs()}
        given = {spec.name for spec in after.get_inputs()}
        produced = {spec.name for spec in after.get_outputs()}
        missing = [name for name in self.expected[0] if name not in produced] if self.expected else []
        if given != wanted or missing:
            return Verdict(
                load_error=(
                    f"the models' interfaces differ: inputs {sorted(wanted)} vs {sorted(given)}, "
                    f"outputs missing from the second: {missing}"
                )
            )
        for feeds, expected in zip(self.feeds, self.expected):
            try:
                actual = run(after, feeds)
            except Exception as error:  # noqa: BLE001
                return Verdict(load_error=f"onnxruntime fails running it: {_first_line(error)}")
            for name, value in expected.items():
                check = compare(name, value, actual[name], exact, self.rtol, self.atol, stabilizing)
                previous = next((o for o in verdict.outputs if o.name == name), None)
                if previous is None:
                    verdict.outputs.append(check)
                elif (_severity(check), check.max_abs_error) > (_severity(previous), previous.max_abs_error):
                    verdict.outputs[verdict.outputs.index(previous)] = check
        return verdict


def verify(
    original: onnx.ModelProto,
    optimized: onnx.ModelProto,
    *,
    exact: bool,
    seed: int = 0,
    runs: int = 1,
    dims: dict[str, int] | None = None,
    shapes: dict[str, tuple] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> Verdict:
    """Run both models on the same seeded inputs and compare every graph output."""
    checker = Checker(original, seed=seed, runs=runs, dims=dims, shapes=shapes, rtol=rtol, atol=atol)
    return checker.check(optimized, exact)


def _severity(check: OutputCheck) -> int:
    return {"ok": 0, "stabilized": 1, "mismatch": 2}[check.status]
