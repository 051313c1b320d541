"""MatMul(a, Eᵀ) of a weight the model also holds untransposed  =>  FusedMatMul(a, E, transB=1)
(onnxruntime target).

A decoder whose LM head shares the token embedding E multiplies by Eᵀ. The legacy torch
exporter writes Eᵀ as an initializer of its own beside E, which the embedding's Gather reads:
the model holds the table twice (154 MB more for OPT-125m or GPT-2). The dynamo exporter
writes Transpose(E), which constant-fold leaves alone for the same reason. onnxruntime's
FusedMatMul reads E as it is (transB), as fast as MatMul reads a transposed copy, so the
copy and the Transpose go. Only where E is read by a Gather (the embedding lookup) and holds
exactly the transposed values.
"""

from __future__ import annotations

import numpy as np

from fuser import Builder, Match, const, op, rule, var


def _table_transposed_to(m: Match, weight: str) -> str | None:
    """The stored embedding table (read by a Gather) whose transpose equals `weight`."""
    graph = m.graph
    shape = m.shape_of(weight)
    tables = {graph.node(g).inputs[0] for g in graph.nodes_of_type("Gather")}
    for table in sorted(t for t in tables if graph.source_kind(t) == "initializer"):
        if shape is None or m.shape_of(table) != shape[::-1]:
            continue  # sizes first: most weights have no table to compare with
        value, transposed = graph.constant_value(table), graph.constant_value(weight)
        if value is not None and transposed is not None and value.dtype == transposed.dtype:
            if np.array_equal(value.T, transposed):
                return table
    return None


@rule(
    "tied-head",
    pattern=(
        op.MatMul(var("a"), op.Transpose(const("table"), name="transpose"), name="matmul"),
        op.MatMul(var("a"), const("weight"), name="matmul"),
    ),
    target="onnxruntime",
    emits={"com.microsoft": 1},
)
def tied_head(m: Match, b: Builder):
    """MatMul(a, Transpose(E)), or MatMul(a, Eᵀ) beside E  =>  FusedMatMul(a, E, transB=1)."""
    dtype = m.dtype_of(m["a"])
    m.require(dtype == np.dtype(np.float32), "onnxruntime's FusedMatMul on CPU takes float32, not %s", dtype)
    if m.has("transpose"):
        table = m["table"]
        m.require(m.rank("table") == 2, "the transposed constant is not a matrix")
        perm = m.attr("transpose", "perm")
        m.require(perm is None or list(perm) == [1, 0], "the Transpose keeps the axes")
    else:
        m.require(m.rank("weight") == 2, "the weight is not a matrix")
        m.require(m.consumers("weight") == 1, "the transposed copy is read elsewhere too: it would stay")
        found = _table_transposed_to(m, m["weight"])
        m.require(found is not None, "no embedding table the model holds is this weight transposed")
        table = found
    return b.op("FusedMatMul", m["a"], table, domain="com.microsoft", transB=1, alpha=1.0)
