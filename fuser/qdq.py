"""Quantized models: the float operators between DequantizeLinear and QuantizeLinear stay as they are.

onnxruntime's quantization tools (and PyTorch's, and NVIDIA's) write an integer operator as
DequantizeLinear -> float operator -> QuantizeLinear. The runtime reads each such group as one
integer kernel (onnxruntime's QLinearConv, QLinearMatMul, an int8 MaxPool; TensorRT and QNN
likewise). A rewrite of the float operator in the middle into anything else leaves it a float
operator the runtime cannot quantize: torchvision's ResNet-18 quantized by onnxruntime's
`quantize_static` ran 15% slower once its quantized MaxPool became an NCHWc one. And a float
result rounded even slightly differently before a QuantizeLinear can move by a whole
quantization step, which the numerics check rightly refuses.

Dynamic quantization (onnxruntime's `quantize_dynamic`) has no DequantizeLinear before its
integer MatMuls, but the DynamicQuantizeLinear in front of each rounds the float result it
reads the same way: a GELU fused ahead of one failed the check of a dynamically quantized
BERT-base, max abs error 0.15 on outputs up to 3.1.

So a rewrite may replace an operator that reads a DequantizeLinear's result, or whose result a
QuantizeLinear or DynamicQuantizeLinear reads, only with an operator of the same type reading
the same dequantized tensors in the same places (a Reshape whose computed shape became a
constant stays the quantized Reshape it was), unless those nodes are part of the rewrite
itself. Shape and Size read only a tensor's shape and never belong to such a group. Optimize a
model before quantizing it, as onnxruntime's quantization pre-processing does.
"""

from __future__ import annotations

from onnx import NodeProto

from fuser.graph import Graph, NodeInfo

DEQUANTIZE = "DequantizeLinear"
QUANTIZE = "QuantizeLinear"
QUANTIZERS = (QUANTIZE, "DynamicQuantizeLinear")
# Standard ONNX, and onnxruntime's contrib operators of the same names (int4/int16 before opset 21).
DOMAINS = ("", "ai.onnx", "com.microsoft")
SHAPE_READERS = ("Shape", "Size")


def has_qdq(graph: Graph | None) -> bool:
    """Whether this scope or one enclosing it quantizes or dequantizes anything."""
    while graph is not None:
        if graph.has_op((*QUANTIZERS, DEQUANTIZE)) or graph.has_op((*QUANTIZERS, DEQUANTIZE), "com.microsoft"):
            return True
        graph = graph.outer
    return False


def quantized_unit(graph: Graph, replaced: list[int], replacement: list[NodeProto]) -> str | None:
    """Why replacing the nodes `replaced` with `replacement` would break a quantized group, or
    None when it does not (see the module's docstring)."""
    if not has_qdq(graph):
        return None
    removed = set(replaced)
    for node_id in removed:
        info = graph.node(node_id)
        if _is_qdq(info) or info.op_type in SHAPE_READERS:
            continue
        dequantized = {
            slot: tensor
            for slot, tensor in enumerate(info.inputs)
            if tensor and _read_from_dequantize(graph, tensor, removed)
        }
        quantizer = next(
            (
                reader.op_type
                for tensor in info.outputs
                if tensor
                for reader in map(graph.node, graph.op_consumers(tensor))
                if reader.id not in removed and reader.op_type in QUANTIZERS and (reader.domain or "") in DOMAINS
            ),
            None,
        )
        if not dequantized and quantizer is None:
            continue
        if any(_same_operator(info, node, dequantized) for node in replacement):
            continue
        if dequantized:
            tensor = next(iter(dequantized.values()))
            return (
                f"{info.label} reads '{tensor}' from a DequantizeLinear: it is a quantized (QDQ) operator, "
                "which runtimes run as an integer kernel"
            )
        return (
            f"{info.label} feeds a {quantizer}: rounded differently, its result can move by a whole quantization step"
        )
    return None


def _same_operator(info: NodeInfo, node: NodeProto, dequantized: dict[int, str]) -> bool:
    """Whether `node` is `info`'s operator again, reading the same dequantized tensors in the same slots."""
    if node.op_type != info.op_type or (node.domain or "") != (info.domain or ""):
        return False
    return all(slot < len(node.input) and node.input[slot] == tensor for slot, tensor in dequantized.items())


def _read_from_dequantize(graph: Graph, tensor: str, removed: set[int]) -> bool:
    """Whether `tensor` is a DequantizeLinear's result, from this scope (and not among `removed`)
    or an enclosing one."""
    scope = graph
    while scope is not None:
        kind = scope.source_kind(tensor)
        if kind == "op":
            node_id = scope.producer(tensor)
            return _is(scope.node(node_id), DEQUANTIZE) and not (scope is graph and node_id in removed)
        if kind != "outer":
            return False
        scope = scope.outer
    return False


def _is(info: NodeInfo, op_type: str) -> bool:
    return info.op_type == op_type and (info.domain or "") in DOMAINS


def _is_qdq(info: NodeInfo) -> bool:
    return (info.op_type in QUANTIZERS or info.op_type == DEQUANTIZE) and (info.domain or "") in DOMAINS
