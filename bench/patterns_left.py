"""Count the transformer patterns a model still computes from primitive operators.

    from bench.patterns_left import patterns_left
    patterns_left(onnx.load("model.onnx"))
    # {"layernorm": 0, "rmsnorm": 5, "gelu": 2, "silu": 2, "attention": 2, "rotary": 4}

Each counter names one decomposed pattern, counted once per occurrence, in the main graph and
every subgraph; operators in other domains (fused kernels) are never counted:

- layernorm: a ReduceMean feeding a Sub that subtracts it from the ReduceMean's own input
  (the mean-centering of a decomposed LayerNorm);
- rmsnorm: a ReduceMean of a square, Pow(y, 2) or Mul(y, y), where y is not such a centered
  Sub (that would be a LayerNorm's variance);
- gelu: an Erf or Tanh (GELU's exact and tanh forms; nothing else in these models uses them);
- silu: a Sigmoid whose output is multiplied by the Sigmoid's own input;
- attention: a Softmax (scaled dot-product attention has one per head group);
- rotary: a Neg whose result is the first input of a Concat: rotate_half(x) =
  Concat(-x[..., H/2:], x[..., :H/2]) of a rotary embedding, one per rotated tensor.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import numpy_helper

PATTERNS = ("layernorm", "rmsnorm", "gelu", "silu", "attention", "rotary")
DEFAULT_DOMAINS = ("", "ai.onnx")


def patterns_left(model: onnx.ModelProto) -> dict[str, int]:
    counts = dict.fromkeys(PATTERNS, 0)
    for graph in _graphs(model.graph):
        for name, value in _count_graph(graph).items():
            counts[name] += value
    return counts


def _graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    yield from _graphs(sub)


def _count_graph(graph: onnx.GraphProto) -> dict[str, int]:
    nodes = [n for n in graph.node if n.domain in DEFAULT_DOMAINS]
    producer = {out: n for n in nodes for out in n.output}
    consumers = defaultdict(list)
    for node in nodes:
        for name in node.input:
            consumers[name].append(node)
    constants = _constant_values(graph)

    def is_centering(sub: onnx.NodeProto) -> bool:
        """Sub(x, ReduceMean(x))."""
        mean = producer.get(sub.input[1]) if len(sub.input) > 1 else None
        return (
            sub.op_type == "Sub" and mean is not None and mean.op_type == "ReduceMean" and mean.input[0] == sub.input[0]
        )

    def squared_operand(node: onnx.NodeProto | None) -> str | None:
        if node is None:
            return None
        if node.op_type == "Pow" and _is_scalar(constants.get(node.input[1]), 2.0):
            return node.input[0]
        if node.op_type == "Mul" and node.input[0] == node.input[1]:
            return node.input[0]
        return None

    counts = dict.fromkeys(PATTERNS, 0)
    for node in nodes:
        if node.op_type == "ReduceMean":
            if any(is_centering(c) and c.input[1] == node.output[0] for c in consumers[node.output[0]]):
                counts["layernorm"] += 1
            base = squared_operand(producer.get(node.input[0]))
            if base is not None and not (base in producer and is_centering(producer[base])):
                counts["rmsnorm"] += 1
        elif node.op_type in ("Erf", "Tanh"):
            counts["gelu"] += 1
        elif node.op_type == "Sigmoid":
            x = node.input[0]
            for mul in consumers[node.output[0]]:
                if mul.op_type == "Mul" and x in mul.input:
                    counts["silu"] += 1
                    break
        elif node.op_type == "Softmax":
            counts["attention"] += 1
        elif node.op_type == "Neg":
            if any(c.op_type == "Concat" and c.input[0] == node.output[0] for c in consumers[node.output[0]]):
                counts["rotary"] += 1
    return counts


def _constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    values = {init.name: numpy_helper.to_array(init) for init in graph.initializer if _small(init.dims)}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS:
            for attribute in node.attribute:
                if attribute.name == "value" and _small(attribute.t.dims):
                    values[node.output[0]] = numpy_helper.to_array(attribute.t)
                elif attribute.name == "value_float":
                    values[node.output[0]] = np.array(attribute.f)
                elif attribute.name == "value_int":
                    values[node.output[0]] = np.array(attribute.i)
    for node in graph.node:  # the legacy exporter passes constants through Identity
        if node.op_type == "Identity" and node.input[0] in values:
            values[node.output[0]] = values[node.input[0]]
    return values


def _small(dims) -> bool:
    return int(np.prod(dims, dtype=np.int64)) <= 16


def _is_scalar(value, expected: float) -> bool:
    return value is not None and value.size == 1 and float(value.reshape(-1)[0]) == expected
