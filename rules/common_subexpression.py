"""Two nodes computing the same op on the same inputs with the same attributes  =>  one of them.

Exporters repeat computations (the same Shape read once per use, the same Transpose of a
weight for each of its consumers). The later node's consumers read the earlier node's
outputs instead. Random operators and nodes holding subgraphs are never merged.

Runs in phase 1, after the fusions: merging two decomposed softmaxes' Exp nodes first would
give each Exp two consumers, and neither softmax could fuse; after the fusions the two
Softmax nodes merge instead.

QuantizeLinear and DequantizeLinear nodes are never merged: quantizers write a pair for each
consumer on purpose (onnxruntime's DedicatedQDQPair, for runtimes that fuse a DequantizeLinear
into its one reader). Merged, onnxruntime no longer made QLinearAdd of a quantized BERT's bias
Adds that shared zero biases: 22 became 2.
"""

from __future__ import annotations

import functools
import operator

from fuser.rules._simplify import foldable_op_types

from fuser import Builder, Match, op, rule, var


MAX_INPUTS = 32

# Dropout in training mode draws a new mask each time; Constant nodes are constant-fold's.
NEVER_MERGED = ("Constant", "Dropout", "QuantizeLinear", "DequantizeLinear")
ANY_OP = functools.reduce(operator.or_, (getattr(op, name) for name in foldable_op_types() if name not in NEVER_MERGED))


def _signature(info) -> tuple:
    return (
        info.domain or "",
        info.op_type,
        tuple(info.inputs),
        tuple(sorted(a.SerializeToString(deterministic=True) for a in info.proto.attribute[:])),
        len(info.outputs),
    )


def repeated_nodes(graph) -> list[int]:
    """The nodes that read the same inputs as another node of their op type: only these can
    have a twin, and a pass over a large graph need not try the rule at the others."""
    groups: dict[tuple, list[int]] = {}
    for info in graph.nodes():
        if any(info.input_names):
            groups.setdefault((info.domain, info.op_type, info.input_names), []).append(info.id)
    return [node_id for group in groups.values() if len(group) > 1 for node_id in group]


@rule(
    "common-subexpression",
    pattern=ANY_OP(*[var(f"input{i}", optional=True) for i in range(MAX_INPUTS)], name="node"),
    phase=1,
    exact=True,
    candidates=repeated_nodes,
)
def common_subexpression(m: Match, b: Builder):
    """A node that repeats an earlier node  =>  the earlier node's outputs."""
    node = m.node("node")
    inputs = [name for name in node.inputs if name]
    m.only_if(bool(inputs))
    graph = m.graph
    position = graph.sort_key(node.id)
    # Op type and inputs first, among the readers of its least-read input: a tensor read by
    # many nodes (a mask, a shared constant) would otherwise cost each of its readers a scan of
    # all the others, and their attributes.
    rarest = min(dict.fromkeys(inputs), key=graph.readers_at_most)
    twins = [
        other
        for other in graph.op_consumers(rarest)
        if other != node.id
        and graph.node(other).op_type == node.op_type
        and graph.node(other).proto.input == node.proto.input
        and graph.sort_key(other) < position
    ]
    if twins:
        signature = _signature(node)
        twins = [other for other in twins if _signature(graph.node(other)) == signature]
    # Nearly every node has no twin: that is no decline worth a line in the report.
    m.only_if(bool(twins))
    m.require(
        not any(m.graph.is_graph_output(o) for o in node.outputs if o),
        "its output is a graph output, which would become a copy of the earlier node's",
    )
    earlier = graph.node(min(twins, key=graph.sort_key))
    m.require([bool(o) for o in node.outputs] == [bool(o) for o in earlier.outputs], "the nodes name other outputs")
    return [e for e in earlier.outputs if e]
