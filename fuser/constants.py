"""Evaluating nodes whose inputs are all constants (constant folding), bounded in size.

Exported models often compute weights in the graph (ConstantOfShape, Reshape of an
initializer, Cast, ...). Rules see through such subgraphs because the graph asks this
module for their values; results larger than a bound are never materialized.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import AttributeProto, NodeProto, numpy_helper

_NONDETERMINISTIC = {
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
}
# Ops whose output can be far larger than their inputs: bounded before evaluation.
_EXPANDING = {"ConstantOfShape", "Expand", "Tile", "Range", "Resize", "Upsample", "Pad"}


def is_foldable(info) -> bool:
    proto: NodeProto = info.proto
    if proto.domain not in ("", "ai.onnx"):
        return False
    if proto.op_type in _NONDETERMINISTIC:
        return False
    return not any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for a in proto.attribute)


def constant_node_value(node: NodeProto) -> np.ndarray | None:
    for attribute in node.attribute:
        if attribute.name == "value":
            return numpy_helper.to_array(attribute.t)
        if attribute.name == "value_float":
            return np.array(attribute.f, dtype=np.float32)
        if attribute.name == "value_floats":
            return np.array(list(attribute.floats), dtype=np.float32)
        if attribute.name == "value_int":
            return np.array(attribute.i, dtype=np.int64)
        if attribute.name == "value_ints":
            return np.array(list(attribute.ints), dtype=np.int64)
    return None


def _estimated_elements(node: NodeProto, inputs: list[np.ndarray | None]) -> int | None:
    try:
        if node.op_type == "ConstantOfShape":
            return math.prod(int(d) for d in inputs[0].reshape(-1))
        if node.op_type == "Expand":
            shape = np.broadcast_shapes(inputs[0].shape, tuple(int(d) for d in inputs[1]))
            return math.prod(shape)
        if node.op_type == "Tile":
            return inputs[0].size * math.prod(int(r) for r in inputs[1].reshape(-1))
        if node.op_type == "Range":
            start, limit, delta = (float(v) for v in inputs[:3])
            return max(0, math.ceil((limit - start) / delta)) if delta else None
    except (TypeError, ValueError, IndexError, AttributeError):
        return None
    return None  # unknown growth: evaluate and check afterwards


def evaluate_node(
    node: NodeProto, inputs: list[np.ndarray | None], opsets: dict[str, int], max_bytes: int
) -> list[np.ndarray] | None:
    """The node's outputs, or None if it cannot be evaluated or a result exceeds `max_bytes`."""
    if node.op_type == "Constant":
        value = constant_node_value(node)
        return None if value is None or value.nbytes > max_bytes else [value]
    if node.op_type in _EXPANDING:
        elements = _estimated_elements(node, inputs)
        if elements is None or elements * 8 > max_bytes:
            return None
    if any(isinstance(v, np.ndarray) and v.nbytes > max_bytes for v in inputs):
        return None
    try:
        from onnx.reference import ReferenceEvaluator

        feeds = {name: value for name, value in zip(node.input, inputs) if name}
        opset_imports = [onnx.helper.make_opsetid(d, v) for d, v in opsets.items()]
        graph = onnx.helper.make_graph(
            [node],
            "fold",
            [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in feeds],
            [onnx.helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output if o],
        )
        model = onnx.helper.make_model(graph, opset_imports=opset_imports)
        results = ReferenceEvaluator(model).run(None, feeds)
    except Exception:  # noqa: BLE001 - any failure means "not foldable", never a crash
        return None
    arrays = []
    for value in results:
        if not isinstance(value, np.ndarray) and not np.isscalar(value):
            return None
        value = np.asarray(value)
        if value.nbytes > max_bytes:
            return None
        arrays.append(value)
    return arrays
