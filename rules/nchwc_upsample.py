"""Resize by whole factors of a NCHWc result  =>  NCHWc Upsample (onnxruntime target).

The necks of YOLO detectors, PP-OCR's DB head and PicoDet upsample a feature map by 2
between convolutions. A Resize there closes the blocked region: a ReorderOutput before it,
a ReorderInput after the Concat it feeds. onnxruntime's NCHWc Upsample repeats each
blocked pixel (nearest) or interpolates between them (linear) by integer factors on the
spatial axes, so the feature map stays blocked. Only what it computes exactly as Resize
does: factors of 1 on the batch and channel axes; for nearest, the coordinate and rounding
modes that pick pixel o // factor at every factor; for linear, the coordinate modes the
kernel knows.
"""

from __future__ import annotations

import math

from fuser import Builder, Match, op, rule, var
from fuser.rules._nchwc import EMITS, NCHWC, channels_of, nchwc, reorder_output

# With a whole factor s, output pixel o = k * s + r (0 <= r < s) maps to k + r / s (asymmetric),
# k + (r + 0.5) / s (tf_half_pixel_for_nn) or k + (r + 0.5) / s - 0.5 (half_pixel; and
# pytorch_half_pixel and half_pixel_symmetric, which differ from it only for outputs of length 1
# or of a size that is not a whole multiple). These (coordinate_transformation_mode, nearest_mode)
# pairs round all of them to k, so nearest Resize repeats each pixel.
REPEATING = {
    ("asymmetric", "floor"),
    ("tf_half_pixel_for_nn", "floor"),
    *(
        (half, rounding)
        for half in ("half_pixel", "pytorch_half_pixel", "half_pixel_symmetric")
        for rounding in ("round_prefer_floor", "round_prefer_ceil")
    ),
}
# Coordinate modes of linear Resize the NCHWc kernel computes, by the name it knows them by.
LINEAR_MODES = {
    "half_pixel": "half_pixel",
    "pytorch_half_pixel": "half_pixel",
    "half_pixel_symmetric": "half_pixel",
    "align_corners": "align_corners",
    "asymmetric": "asymmetric",
}


def _text(value, default: str) -> str:
    return value.decode() if isinstance(value, bytes) else (value or default)


def _factors(m: Match) -> list[int]:
    """The per-axis factors, from the scales (or the sizes and the input's shape); declines
    unless they are whole numbers, 1 on the batch and channel axes."""
    resize = m.node("resize")
    m.require(m.attr("resize", "axes") is None, "Resize names its axes")
    attribute = m.attr("resize", "scales") if resize.op_type == "Upsample" else None  # Upsample before opset 9
    factors = [float(f) for f in attribute] if attribute is not None else _given_factors(m, resize)
    m.require(len(factors) == 4, "the scales are not 4 factors")
    m.require(
        all(math.isfinite(f) and f >= 1 and f == int(f) for f in factors),
        f"the factors {factors} are not whole numbers",
    )
    m.require(factors[0] == 1 and factors[1] == 1, "it resizes the batch or channel axis")
    return [int(f) for f in factors]


def _given_factors(m: Match, resize) -> list[float]:
    inputs = resize.inputs + [""] * 4
    if resize.op_type == "Upsample" or m.opset < 11:
        scales, sizes = inputs[1], ""
    else:
        scales, sizes = inputs[2], inputs[3]
    given = m.graph.constant_value(scales) if scales else None
    m.require(not scales or given is not None, "the scales are not a constant")
    if given is not None and given.size:
        return [float(f) for f in given]
    # No scales, or the empty tensor the exporters write for opsets 11 and 12 beside sizes.
    policy = _text(m.attr("resize", "keep_aspect_ratio_policy"), "stretch")
    m.require(policy == "stretch", f"the sizes are read with keep_aspect_ratio_policy {policy}")
    value = m.graph.constant_value(sizes) if sizes else None
    shape = m.shape_of(resize.inputs[0])
    m.require(value is not None and value.size == 4, "neither scales nor sizes are a constant of 4 values")
    m.require(shape is not None and all(isinstance(d, int) and d > 0 for d in shape), "the input's size is not fixed")
    m.require(all(s % d == 0 for s, d in zip(value.tolist(), shape)), "the sizes are not whole multiples")
    return [float(s // d) for s, d in zip(value.tolist(), shape)]


def _mode_attrs(m: Match) -> dict:
    """The NCHWc Upsample's mode attributes for this Resize; declines where they would differ."""
    resize = m.node("resize")
    mode = _text(m.attr("resize", "mode"), "nearest")
    legacy = resize.op_type == "Upsample" or m.opset < 11  # no coordinate modes: asymmetric, floor
    if mode == "nearest":
        if not legacy:
            coordinates = _text(m.attr("resize", "coordinate_transformation_mode"), "half_pixel")
            rounding = _text(m.attr("resize", "nearest_mode"), "round_prefer_floor")
            m.require(
                (coordinates, rounding) in REPEATING,
                f"nearest with {coordinates} coordinates and {rounding} rounding does not repeat each pixel",
            )
        return {}
    m.require(mode == "linear", f"{mode} interpolation")
    # Before opset 11, Resize and Upsample had no coordinate modes: linear was asymmetric.
    coordinates = "asymmetric" if legacy else _text(m.attr("resize", "coordinate_transformation_mode"), "half_pixel")
    m.require(coordinates in LINEAR_MODES, f"NCHWc Upsample has no {coordinates} coordinates")
    return {"mode": "linear", "coordinate_transformation_mode": LINEAR_MODES[coordinates]}


@rule(
    "nchwc-upsample",
    pattern=(op.Resize | op.Upsample)(
        nchwc.ReorderOutput(var("x"), name="to_plain"),
        var("second", optional=True),
        var("third", optional=True),
        var("fourth", optional=True),
        name="resize",
    ),
    target="onnxruntime",
    emits=EMITS,
    phase=1,
    shared_interior=True,
)
def nchwc_upsample(m: Match, b: Builder):
    """Resize(ReorderOutput(x)) by whole factors  =>  ReorderOutput(NCHWc Upsample(x))."""
    channels = channels_of(m, "to_plain")
    attrs = _mode_attrs(m)
    factors = _factors(m)
    blocked = b.op("Upsample", m["x"], domain=NCHWC, scales=factors, **attrs)
    return reorder_output(b, blocked, channels)
