"""Quantized models: the float operators between DequantizeLinear and QuantizeLinear stay as they are.

onnxruntime's quantization tools (and PyTorch's, and NVIDIA's) write an integer operator as
DequantizeLinear -> float operator -> QuantizeLinear. The runtime reads each such group as one
integer kernel (onnxruntime's QLinearConv, QLinearMatMul, an int8 MaxPool; TensorRT and QNN
likewise), seeing through layout operators (Reshape, Transpose, ...) between them. A rewrite of
the float operator in the middle into anything else leaves it a float operator the runtime
cannot quantize: torchvision's ResNet-18 quantized by onnxruntime's `quantize_static` ran 15%
slower once its quantized MaxPool became an NCHWc one. And a float result rounded even slightly
differently before a QuantizeLinear can move by a whole quantization step, which the numerics
check rightly refuses.

Dynamic quantization (onnxruntime's `quantize_dynamic`) has no DequantizeLinear before its
integer MatMuls, but the DynamicQuantizeLinear in front of each rounds the float result it
reads the same way: a GELU fused ahead of one failed the check of a dynamically quantized
BERT-base, max abs error 0.15 on outputs up to 3.1. Its scale comes from the values themselves
(their largest magnitude), so a result rounded differently anywhere upstream can move every
element it quantizes, through any float operators in between: a dynamically quantized Llama
whose RMSNorm (then a Cast and the norm's scale) and rotary embedding (then the attention) were
fused passed its check on one input set and failed on another, 0.015 to 0.034 off on 92 to 99%
of the logits. A rewrite whose values reach a DynamicQuantizeLinear through float operators
counts as feeding it (not through a shape, an index or a condition they only select with), when
that quantizer is at most QUANTIZER_REACH operators on: in a quantized layer the next one is a
few operators away; a search without that bound made a model quantized only at its end take
quadratic time (74 s instead of 0.5 s for 10k nodes).

So a pattern rule may replace an operator whose result a QuantizeLinear or DynamicQuantizeLinear
reads only if the rule is exact (its rewrites give bit-identical results: rewiring, removing
an Identity). It may replace an operator that reads a DequantizeLinear's result if it is exact
or if the replacement has an operator of the same type reading the same dequantized tensors in
the same places (a Reshape whose computed shape became a constant stays the quantized Reshape it
was). Q/DQ nodes that are part of the rewrite itself do not count; Shape and Size read only a
tensor's shape and never belong to such a group. Optimize a model before quantizing it, as
onnxruntime's quantization pre-processing does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from onnx import NodeProto

from fuser.float32_twin import NO_FLOAT_RESULTS
from fuser.graph import SUBGRAPH_SLOT, Graph, NodeInfo

DEQUANTIZE = "DequantizeLinear"
QUANTIZERS = ("QuantizeLinear", "DynamicQuantizeLinear")
# Standard ONNX, and onnxruntime's contrib operators of the same names (int4/int16 before opset 21).
DOMAINS = ("", "ai.onnx", "com.microsoft")
SHAPE_READERS = ("Shape", "Size")
# Operators that move values without changing them: a quantized group reaches through them.
PASS_THROUGH = ("Identity", "Dropout", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten")
# How many float operators on a search for a DynamicQuantizeLinear the values reach looks (a
# quantized layer's next one is a few on; a rotary embedding's, past the attention, about ten),
# and at most how many tensors it visits on the way.
QUANTIZER_REACH = 24
QUANTIZER_SEARCH_TENSORS = 4096
# Inputs an operator reads for their shape, as indices or as a condition, not as values it computes with.
_NOT_VALUES = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4), "Unsqueeze": (1,), "Squeeze": (1,),
    "Pad": (1, 3), "Resize": (1, 2, 3), "Upsample": (1,), "Gather": (1,), "GatherElements": (1,),
    "GatherND": (1,), "ScatterND": (1,), "ScatterElements": (1,), "TopK": (1,), "Split": (1,),
    "CumSum": (1,), "Where": (0,), "ConstantOfShape": (0,), "Range": (0, 1, 2), "OneHot": (0, 1),
    "ReduceMean": (1,), "ReduceSum": (1,), "ReduceMax": (1,), "ReduceMin": (1,), "ReduceProd": (1,),
    "ReduceL2": (1,), "ReduceL1": (1,), "ReduceSumSquare": (1,), "ReduceLogSumExp": (1,),
}  # fmt: skip


def quantizes(graph: Graph) -> bool:
    """Whether this scope itself quantizes or dequantizes anything."""
    return graph.has_op((*QUANTIZERS, DEQUANTIZE)) or graph.has_op((*QUANTIZERS, DEQUANTIZE), "com.microsoft")


def is_qdq_op(op_type: str, domain: str) -> bool:
    return op_type in (*QUANTIZERS, DEQUANTIZE) and (domain or "") in DOMAINS


def has_qdq(graph: Graph | None) -> bool:
    """Whether this scope, one enclosing it or one nested in it quantizes or dequantizes anything."""
    scope = graph
    while scope is not None:
        if quantizes(scope):
            return True
        scope = scope.outer
    return graph is not None and any(_nested_qdq(sub) for sub in _bodies(graph))


def quantized_unit(graph: Graph, replaced: Iterable[int], replacement: list[NodeProto], exact: bool) -> str | None:
    """Why replacing the nodes `replaced` with `replacement` would break a quantized group, or
    None when it does not; `exact`: the rule's rewrites give bit-identical results. See the
    module's docstring."""
    if exact or not has_qdq(graph):
        return None
    removed = set(replaced)
    for node_id in removed:
        info = graph.node(node_id)
        if _is_qdq(info) or info.op_type in SHAPE_READERS:
            continue
        dequantized = {
            slot: tensor for slot, tensor in enumerate(info.inputs) if tensor and _dequantized(graph, tensor, removed)
        }
        if dequantized and not any(_same_operator(info, node, dequantized) for node in replacement):
            tensor = next(iter(dequantized.values()))
            return (
                f"{info.label} reads '{tensor}' from a DequantizeLinear: it is a quantized (QDQ) operator, "
                "which runtimes run as an integer kernel"
            )
        quantizer = next(filter(None, (_quantizer_reading(graph, t, removed) for t in info.outputs if t)), None)
        if quantizer is not None:
            return (
                f"{info.label} feeds a {quantizer}: rounded differently, its result can move by a whole "
                "quantization step"
            )
    return None


def _same_operator(info: NodeInfo, node: NodeProto, dequantized: dict[int, str]) -> bool:
    """Whether `node` is `info`'s operator again, reading the same dequantized tensors in the same slots."""
    if node.op_type != info.op_type or _domain(node.domain) != _domain(info.domain):
        return False
    return all(slot < len(node.input) and node.input[slot] == tensor for slot, tensor in dequantized.items())


def _dequantized(graph: Graph, tensor: str, removed: set[int]) -> bool:
    """Whether `tensor` is a DequantizeLinear's result, directly or through PASS_THROUGH operators,
    from this scope or an enclosing one; nodes among `removed` (this scope's) end the search."""
    scope = graph
    for _ in range(64):  # a chain of layout operators is short; the bound keeps a malformed graph from looping
        kind = scope.source_kind(tensor)
        if kind == "outer":
            scope = scope.outer
            continue
        if kind != "op":
            return False
        node_id = scope.producer(tensor)
        if scope is graph and node_id in removed:
            return False
        producer = scope.node(node_id)
        if _is(producer, (DEQUANTIZE,)):
            return True
        if producer.op_type not in PASS_THROUGH or not producer.inputs or not producer.inputs[0]:
            return False
        tensor = producer.inputs[0]
    return False


def _quantizer_reading(graph: Graph, tensor: str, removed: set[int]) -> str | None:
    """The op type of a quantizer reading `tensor`, directly or through PASS_THROUGH operators,
    inside a subgraph that reads it, or where a body's output goes on (_after_body); or of a
    DynamicQuantizeLinear it reaches through any float operators (`... by way of the operators
    after it`). None if none does. Nodes among `removed` are not looked at; the nearest
    quantizers are found first."""
    dynamic = _has_dynamic_quantizer(graph)
    pending = deque([(graph, tensor, 0)])  # (scope, tensor, float operators passed on the way)
    seen = set()
    while pending:
        scope, name, computed = pending.popleft()
        if (id(scope), name) in seen or computed > QUANTIZER_REACH or len(seen) >= QUANTIZER_SEARCH_TENSORS:
            continue
        seen.add((id(scope), name))
        for consumer, slot in scope.consumers(name):
            if not scope.has_node(consumer) or (scope is graph and consumer in removed):
                continue
            reader = scope.node(consumer)
            if _is(reader, QUANTIZERS):
                if not computed:
                    return reader.op_type
                if reader.op_type == "DynamicQuantizeLinear":
                    return f"{reader.op_type} by way of the operators after it"
                continue
            if slot == SUBGRAPH_SLOT:
                pending.extend((body, name, computed) for bodies in reader.subgraphs.values() for body in bodies)
            elif reader.op_type in PASS_THROUGH and slot == 0:
                pending.extend((scope, output, computed) for output in reader.outputs[:1] if output)
            elif dynamic and _computes_with(reader, slot):
                pending.extend((scope, output, computed + 1) for output in reader.outputs if output)
        if scope.is_graph_output(name):
            pending.extend((outer, result, computed) for outer, result in _after_body(scope, name))
    return None


def _computes_with(reader: NodeInfo, slot: int) -> bool:
    """Whether `reader` computes float values with what it reads at `slot`."""
    if reader.op_type in NO_FLOAT_RESULTS or _is_qdq(reader):
        return False
    return slot not in _NOT_VALUES.get(reader.op_type, ())


def _has_dynamic_quantizer(graph: Graph) -> bool:
    """Whether this scope, one enclosing it or one nested in it has a DynamicQuantizeLinear."""
    scope = graph
    while scope is not None:
        if _quantizes_dynamically(scope):
            return True
        scope = scope.outer
    return any(_nested_dynamic(body) for body in _bodies(graph))


def _quantizes_dynamically(graph: Graph) -> bool:
    return graph.has_op(("DynamicQuantizeLinear",)) or graph.has_op(("DynamicQuantizeLinear",), "com.microsoft")


def _nested_dynamic(graph: Graph) -> bool:
    return _quantizes_dynamically(graph) or any(_nested_dynamic(body) for body in _bodies(graph))


def _after_body(body: Graph, tensor: str) -> list[tuple[Graph, str]]:
    """Where an If, Loop or Scan body's output `tensor` goes once the body has run: into the
    holding node's output, and a Loop's or Scan's state into the body's own input for the next
    iteration. Empty for the main graph."""
    outer, owner = body.outer, body.owner
    if outer is None or owner is None or not outer.has_node(owner):
        return []
    holder = outer.node(owner)
    body_inputs = [value.name for value in body.feedable_inputs()]
    found = []
    for position, value in enumerate(body.output_values()):
        if value.name != tensor:
            continue
        result, carried = _body_output_slots(outer, holder, position)
        if result is not None and 0 <= result < len(holder.outputs) and holder.outputs[result]:
            found.append((outer, holder.outputs[result]))
        if carried is not None and carried < len(body_inputs):
            found.append((body, body_inputs[carried]))
    return found


def _body_output_slots(outer: Graph, holder: NodeInfo, position: int) -> tuple[int | None, int | None]:
    """For the body output at `position`: the holder's output it becomes, and the body input it
    becomes in the next iteration (None where there is none)."""
    if holder.op_type == "If":
        return position, None
    if holder.op_type == "Loop":
        # Body inputs: iteration, condition, states; outputs: condition, states, scanned values.
        # The Loop's outputs are the final states, then the scanned values.
        states = len(holder.inputs) - 2
        return position - 1, (position + 1 if 1 <= position <= states else None)
    if holder.op_type == "Scan":
        # States come first in the body's inputs and outputs and in the Scan's outputs; Scan
        # before opset 9 reads the sequence lengths first.
        lengths = 1 if (outer.opset("") or 9) < 9 else 0
        states = len(holder.inputs) - lengths - (holder.attr("num_scan_inputs") or 0)
        return position, (position if position < states else None)
    return None, None


def _bodies(graph: Graph) -> list[Graph]:
    return [body for info in graph.nodes_with_subgraphs() for bodies in info.subgraphs.values() for body in bodies]


def _nested_qdq(graph: Graph) -> bool:
    return quantizes(graph) or any(_nested_qdq(sub) for sub in _bodies(graph))


def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def _is(info: NodeInfo, op_types: tuple[str, ...]) -> bool:
    return info.op_type in op_types and (info.domain or "") in DOMAINS


def _is_qdq(info: NodeInfo) -> bool:
    return is_qdq_op(info.op_type, info.domain)
