"""Activations onnxruntime's FusedConv / FusedGemm can apply, and their parameters."""

from __future__ import annotations

import numpy as np

from fuser import Match, const, op

ACTIVATION_OPS = op.Relu | op.LeakyRelu | op.Sigmoid | op.Tanh | op.HardSigmoid | op.Clip


def activation(inner, name: str = "act"):
    """An activation node over `inner`; Clip's optional min/max inputs are constants."""
    return ACTIVATION_OPS(inner, const("clip_min", optional=True), const("clip_max", optional=True), name=name)


def activation_params(m: Match, name: str = "act") -> tuple[str, list[float]]:
    """The activation's onnxruntime name and parameters; declines what cannot be expressed."""
    node = m.node(name)
    kind = node.op_type
    if kind == "LeakyRelu":
        return kind, [float(m.attr(name, "alpha", 0.01))]
    if kind == "HardSigmoid":
        return kind, [float(m.attr(name, "alpha", 0.2)), float(m.attr(name, "beta", 0.5))]
    if kind == "Clip":
        if m.opset < 11:
            low = m.attr(name, "min", float(np.finfo(np.float32).min))
            high = m.attr(name, "max", float(np.finfo(np.float32).max))
        else:
            low_value, high_value = m.value("clip_min"), m.value("clip_max")
            for value in (low_value, high_value):
                m.require(value is None or value.size == 1, "Clip bounds are not scalars")
            low = float(low_value.reshape(())) if low_value is not None else float(np.finfo(np.float32).min)
            high = float(high_value.reshape(())) if high_value is not None else float(np.finfo(np.float32).max)
        return kind, [float(low), float(high)]
    return kind, []


def fusable_dtype(m: Match, tensor: str) -> None:
    dtype = m.dtype_of(tensor)
    m.require(
        dtype in (np.dtype(np.float32), np.dtype(np.float16)),
        f"onnxruntime's fused kernels take float32/float16, this tensor is {dtype}",
    )
