"""The explicit opset upgrade behind `--opset N`: onnx's version converter, never silent.

Newer standard ops (LayerNormalization 17, Gelu 20, RMSNormalization and Attention 23,
Swish 24) exist only from their opset on, so the portable target can emit them only in a
model of that opset. fuser changes a model's opset only when asked, and the converted
model is checked against the original like any rewrite.
"""

from __future__ import annotations

import numbers

import onnx
from onnx import version_converter

from fuser.errors import InputError, UsageError
from fuser.model import Model


def upgrade(model: Model, version: int) -> Model:
    """`model` converted to default-domain opset `version` (the same object when it has it)."""
    if isinstance(version, bool) or not isinstance(version, numbers.Integral):
        raise UsageError(f"the opset must be a whole number, not {version!r}")
    version = int(version)  # onnx's converter takes a Python int only
    current = model.opsets.get("", 1)
    latest = onnx.defs.onnx_opset_version()
    if version < current:
        raise UsageError(f"--opset {version} is below the model's opset {current}; fuser only upgrades")
    if version > latest:
        raise UsageError(f"--opset {version} is beyond the newest opset this onnx knows ({latest})")
    if version == current:
        return model
    original = model.to_proto(in_place=True)
    try:
        converted = version_converter.convert_version(original, version)
    except Exception as error:  # noqa: BLE001 - the converter raises bare RuntimeErrors
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InputError(f"onnx's version converter cannot bring this model from opset {current} to {version}: {detail}") from error
    _keep_annotations(original, converted)
    return Model(converted, base_dir=model.base_dir, path=model.path, tensors=model.tensors)


def _keep_annotations(original: onnx.ModelProto, converted: onnx.ModelProto) -> None:
    """The converter replaces the exporter's shape annotations (symbolic dims named after the
    model's inputs) with what its own inference manages, often unnamed dims. An upgrade changes no
    tensor's type, so the original annotations of the tensors that remain are kept instead."""
    produced = {o for n in converted.graph.node for o in n.output}
    kept = [v for v in original.graph.value_info if v.name in produced]
    del converted.graph.value_info[:]
    converted.graph.value_info.extend(kept)
