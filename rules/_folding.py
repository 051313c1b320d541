"""Shared by the rules that fold constants into new weights (conv-bn-fold, conv-mul-scale,
conv-add-bias, batchnorm-affine-fold): which constants fold per channel, and whether a
folded value survives the cast back to the weights' dtype."""

from __future__ import annotations

import numpy as np

from fuser import Match

# The folding arithmetic runs in float64 and casts back to the weights' dtype.
FOLDABLE_WEIGHT_DTYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))


def require_float_weights(m: Match, weight: np.ndarray) -> None:
    """Decline unless the weights are of a float type the fold can cast back to (the reason is
    formatted only on a decline: this runs once per matched convolution)."""
    if weight.dtype not in FOLDABLE_WEIGHT_DTYPES:
        m.require(False, f"weights are {weight.dtype}, not a float type")


def per_channel(addend: np.ndarray, output_rank: int, channels: int) -> np.ndarray | None:
    """The addend as one value per output channel, or None if it varies along another axis."""
    if addend.ndim > output_rank:
        return None
    shape = (1,) * (output_rank - addend.ndim) + addend.shape
    if shape[0] != 1 or any(d != 1 for d in shape[2:]) or shape[1] not in (1, channels):
        return None
    return np.broadcast_to(addend.reshape(-1), (channels,))


def cast_finite(m: Match, what: str, value: np.ndarray, dtype) -> np.ndarray:
    """`value` (folded in float64) cast to `dtype`; the match declines when that is not finite.

    float16 tops out at 65504: a BatchNormalization with a tiny variance can scale weights past
    it, and an inf weight would give inf outputs the original never had.
    """
    cast = np.asarray(value)
    if cast.dtype != dtype:  # folded values the caller cast already need no second cast
        with np.errstate(over="ignore", invalid="ignore"):
            cast = cast.astype(dtype)
    if np.isfinite(cast).all():  # asked once per folded tensor of a large model: the plain case first
        return cast
    bad = ~np.isfinite(cast)
    if bad.any():
        largest = float(np.nanmax(np.abs(np.asarray(value, np.float64)))) if np.isfinite(value).any() else float("nan")
        m.require(
            False,
            f"the folded {what} are not finite in {np.dtype(dtype)} ({int(bad.sum())} of {cast.size} values; "
            f"largest magnitude {largest:.3g})",
        )
    return cast
