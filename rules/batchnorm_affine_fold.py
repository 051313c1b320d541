"""BatchNormalization -> Mul / Add (constant per-channel)  =>  one BatchNormalization.

Inference BatchNormalization is y = scale * (x - mean) / sqrt(var + eps) + shift: a
per-channel affine map. A per-channel Mul or Add after it only changes its scale and
shift (DenseNet's exports follow every BatchNormalization with both). Folding them
leaves BatchNormalization -> Relu, which onnxruntime runs as one NCHWc kernel.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._folding import cast_finite, per_channel

from fuser import Builder, Match, const, op, rule, var


@rule(
    "batchnorm-affine-fold",
    pattern=(op.Mul | op.Add)(
        op.BatchNormalization(var("x"), const("scale"), const("shift"), const("mean"), const("var"), name="bn"),
        const("c"),
        name="affine",
    ),
)
def batchnorm_affine_fold(m: Match, b: Builder):
    """BatchNormalization -> Mul/Add(per-channel constant)  =>  BatchNormalization with new scale/shift."""
    m.require(m.attr("bn", "training_mode", 0) == 0, "BatchNormalization is in training mode")
    m.require(m.attr("bn", "spatial", 1) == 1, "BatchNormalization is not spatial")
    scale, shift, constant = m.value("scale"), m.value("shift"), m.value("c")
    rank = m.rank("x")
    m.require(rank is not None and rank >= 2, "the input's rank is unknown")
    m.require(
        constant.dtype == m.dtype("bn"), f"the constant is {constant.dtype}, the normalized tensor {m.dtype('bn')}"
    )
    m.require(scale.ndim == 1 and shift.shape == scale.shape, "the scale and shift are not one value per channel")
    values = per_channel(constant, rank, scale.shape[0])
    m.require(values is not None, f"the constant of shape {constant.shape} is not one value per channel")
    values = values.astype(np.float64)
    # From opset 15 scale and shift may be narrower than x: the folded ones must not be.
    dtype = np.result_type(scale.dtype, m.dtype("x") or scale.dtype)
    new_scale, new_shift = scale.astype(np.float64), shift.astype(np.float64)
    if m.node("affine").op_type == "Mul":
        new_scale, new_shift = new_scale * values, new_shift * values
    else:
        new_shift = new_shift + values
    new_scale = cast_finite(m, "scale values", new_scale, dtype)
    new_shift = cast_finite(m, "shift values", new_shift, dtype)
    return b.BatchNormalization(
        m["x"],
        b.constant(new_scale, "scale"),
        b.constant(new_shift, "shift"),
        m["mean"],
        m["var"],
        **m.attrs("bn"),
    )
