"""Preconditions and small helpers the rules share, so each rule file states only its own logic."""

from __future__ import annotations

import numpy as np

from fuser import Decline, Match

FLOAT_DTYPES = ("float16", "float32", "float64", "bfloat16")


def is_float(dtype) -> bool:
    """float16/32/64 and bfloat16 (which numpy does not count as floating)."""
    return dtype is not None and (np.issubdtype(dtype, np.floating) or np.dtype(dtype).name == "bfloat16")


def reduced_axes(m: Match, node: str, axes_input: str) -> list[int] | None:
    """A Reduce* node's axes: an attribute up to the opset that made them an input (13 for
    ReduceSum, 18 for the others), then an optional constant input."""
    if m.node(node).op_type == "ReduceSum" and m.opset >= 13 or m.opset >= 18:
        value = m.value(axes_input)
        return None if value is None else [int(a) for a in value.reshape(-1)]
    axes = m.attr(node, "axes")
    return None if axes is None else [int(a) for a in axes]


def require_float(m: Match, tensor: str, allowed=FLOAT_DTYPES) -> np.dtype:
    """The tensor's dtype, declining unless it is one of `allowed` (names of float dtypes)."""
    dtype = m.dtype(tensor)
    m.require(dtype is not None, "the input's element type is unknown")
    name = np.dtype(dtype).name
    m.require(name in allowed, f"the input is {name}; the fused op takes {', '.join(allowed)}")
    return np.dtype(dtype)


def scalar(m: Match, name: str) -> float | None:
    """The value of a one-element constant bound to `name`, else None."""
    value = m.value(name)
    if value is None or value.size != 1:
        return None
    return float(np.asarray(value, dtype=np.float64).reshape(()))


def require_no_broadcast(m: Match, name: str, tensor: str, what: str) -> None:
    """Decline unless the one-element constant `name` has at most `tensor`'s rank: a [1, 1, 1, 1]
    constant combined with a 3-D activation makes the result 4-D, which the fused op would not."""
    ndim = m.value(name).ndim
    rank = m.rank(tensor)
    m.require(ndim == 0 or (rank is not None and ndim <= rank), f"{what} may broadcast {tensor} to a higher rank")


def require_scalar(m: Match, name: str, expected: float, what: str, rtol: float = 1e-4) -> None:
    """Decline unless `name` is a one-element constant within `rtol` of `expected`, or as
    near it as the constant's own dtype can be (float16 holds sqrt(2) as 1.4140625), of at most
    the rank of the pattern's input "x", which it is combined with."""
    value = scalar(m, name)
    m.require(value is not None, f"{what} is not a single constant")
    require_no_broadcast(m, name, "x", what)
    dtype = m.value(name).dtype
    if is_float(dtype):
        rtol = max(rtol, 2 * float(np.finfo(np.float16 if dtype.name == "bfloat16" else dtype).eps))
        if dtype.name == "bfloat16":
            rtol = max(rtol, 2**-7)
    m.require(abs(value - expected) <= rtol * abs(expected), f"{what} is {value:g}, not {expected:g}")


def trailing_axes(m: Match, axes: list[int] | None, tensor: str) -> int:
    """The first axis of `axes` when they are the trailing axes of `tensor` (normalized by a
    LayerNormalization-style op from `axis` to the end); declines otherwise."""
    m.require(bool(axes), "the reduction has no explicit axes")
    rank = m.rank(tensor)
    m.require(rank is not None, "the input's rank is unknown")
    positive = sorted(a % rank for a in axes)
    m.require(positive == list(range(rank - len(positive), rank)), f"axes {axes} are not the trailing axes")
    return positive[0] - rank


def static_dims(m: Match, tensor: str, first_axis: int) -> tuple[int, ...]:
    """The sizes of `tensor` from `first_axis` (negative) to the end; declines if any is symbolic."""
    shape = m.shape(tensor)
    m.require(shape is not None, "the input's shape is unknown")
    dims = tuple(shape[first_axis:])
    m.require(all(isinstance(d, int) for d in dims), f"the normalized dimensions {dims} are not fixed sizes")
    return dims


def broadcast_over(m: Match, value: np.ndarray, dims: tuple[int, ...], rank: int, what: str) -> np.ndarray:
    """`value` (a Mul/Add operand) as an array of shape `dims` when it varies only along the
    trailing `dims` of a rank-`rank` tensor and does not grow the result; declines otherwise."""
    m.require(value.ndim <= rank, f"{what} has more dimensions than the tensor it multiplies")
    leading = value.shape[: max(0, value.ndim - len(dims))]
    m.require(all(d == 1 for d in leading), f"{what} of shape {value.shape} varies outside the normalized axes")
    try:
        return np.broadcast_to(value.reshape(value.shape[len(leading) :]), dims)
    except ValueError:
        raise Decline(f"{what} of shape {value.shape} does not broadcast to {dims}") from None


def same_dim(a, b) -> bool:
    """Whether two dims from shape inference are provably equal: the same fixed size, or the same
    symbolic name (Match.shape keeps made-up names like 'unk__3' unique to their inference run)."""
    return a == b and a != "?"


def same_shape(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(same_dim(x, y) for x, y in zip(a, b))


def written_out_norm(m: Match, reductions: dict[str, str]) -> tuple[np.dtype, int, tuple[int, ...], float]:
    """dtype, axis, normalized dims and epsilon of a written-out layer or RMS norm.

    reductions: the pattern's ReduceMean nodes and their axes inputs ({"mean": "mean_axes"}).
    The constants the patterns bind (an exponent "two", a reciprocal's numerator "one") must
    have their exact values, every mean keeps its dims and reduces the same trailing axes, and
    "eps" is one small non-negative number of at most x's rank."""
    dtype = require_float(m, "x")
    if m.has("two"):
        require_scalar(m, "two", 2.0, "the exponent")
    if m.has("one"):
        require_scalar(m, "one", 1.0, "the numerator of the reciprocal")
    axes = []
    for node, axes_input in reductions.items():
        m.require(m.attr(node, "keepdims", 1) == 1, "a ReduceMean drops the reduced axes (keepdims=0)")
        axes.append(reduced_axes(m, node, axes_input))
    m.require(all(a == axes[0] for a in axes), "the mean and the variance reduce different axes")
    axis = trailing_axes(m, axes[0], "x")
    dims = static_dims(m, "x", axis)
    epsilon = m.value("eps")
    m.require(epsilon.size == 1, "epsilon is not a single value")
    require_no_broadcast(m, "eps", "x", "epsilon")
    epsilon = float(np.asarray(epsilon, np.float64).reshape(()))
    m.require(0 <= epsilon < 1, f"epsilon {epsilon:g} is not a small non-negative number")
    # Added to a variance, an epsilon float32 rounds by 1e-11 or less moves a float64 norm within
    # float64's check tolerance: 1e-5 (rounded by 2.5e-13) and 1e-4 (2.5e-12) passed it, 1e-3
    # (4.7e-11) and 0.1 (1.5e-9, the norm moved by 3e-9) failed it.
    require_float_attribute(m, epsilon, "epsilon", atol=1e-11)
    return dtype, axis, dims, epsilon


def require_float_attribute(m: Match, value: float, what: str, atol: float = 0.0) -> None:
    """Decline unless `value` is exact (within `atol`) as a float attribute, a float32: the
    fused op of a float64 model would compute with another value."""
    m.require(abs(float(np.float32(value)) - value) <= atol, f"{what} {value!r} is not exact as a float32 attribute")
