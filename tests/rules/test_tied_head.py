"""Tests for tied-head (rules/tied_head.py): an LM head that multiplies by the transposed token
embedding reads the embedding itself through com.microsoft FusedMatMul(transB=1).

Positive cases run the original and the rewritten model in onnxruntime (graph optimizations
off). Runtime facts relied on (onnxruntime 1.32, CPU): FusedMatMul runs float32 with a batched
A and a 2-D B; with float16 it runs, but 1.6x slower than MatMul with optimizations off, so the
rule takes float32 only."""

from __future__ import annotations

import numpy as np
from fuser.rules.tied_head import tied_head
from onnx import helper

import fuser
from tests.helpers import assert_declined, assert_rewritten, attrs_of, make_model

RULE = "tied-head"
VOCAB, HIDDEN = 50, 8
TABLE = np.random.default_rng(0).standard_normal((VOCAB, HIDDEN)).astype(np.float32)
FEEDS = {
    "h": np.random.default_rng(1).standard_normal((2, 3, HIDDEN)).astype(np.float32),
    "ids": np.random.default_rng(2).integers(0, VOCAB, (2, 3)),
}


def decoder(spelling: str, *, head=None, extra_reader: bool = False, dtype=np.float32):
    """embedded = Gather(table, ids); logits = h @ tableᵀ, the transpose stored as a second
    initializer (the legacy exporter) or computed by a Transpose (the dynamo exporter)."""
    table = TABLE.astype(dtype)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["embedded"], name="embedding")]
    constants = {"table": table}
    if spelling == "legacy":
        constants["head"] = np.ascontiguousarray(table.T) if head is None else head
        nodes.append(helper.make_node("MatMul", ["h", "head"], ["logits"], name="lm_head"))
    else:
        nodes.append(helper.make_node("Transpose", ["table"], ["head"], name="transpose", perm=[1, 0]))
        nodes.append(helper.make_node("MatMul", ["h", "head"], ["logits"], name="lm_head"))
    outputs = [("logits", dtype, [2, 3, VOCAB]), ("embedded", dtype, [2, 3, HIDDEN])]
    if extra_reader:
        nodes.append(helper.make_node("ReduceSum", ["head"], ["head_sum"], keepdims=0))
        outputs.append(("head_sum", dtype, []))
    inputs = [("h", dtype, [2, 3, HIDDEN]), ("ids", np.int64, [2, 3])]
    return make_model(nodes, inputs, outputs, constants)


def test_the_legacy_exporters_transposed_copy_goes():
    model = decoder("legacy")
    after, _ = assert_rewritten(
        model, [tied_head], counts={RULE: 1}, expected_ops=["Gather", "FusedMatMul"], feeds=FEEDS, target="onnxruntime"
    )
    head = after.graph.node[1]
    assert list(head.input) == ["h", "table"] and attrs_of(head)["transB"] == 1
    assert [t.name for t in after.graph.initializer] == ["table"]
    assert after.ByteSize() < model.ByteSize() - TABLE.nbytes // 2


def test_the_dynamo_exporters_transpose_goes():
    after, _ = assert_rewritten(
        decoder("dynamo"),
        [tied_head],
        counts={RULE: 1},
        expected_ops=["Gather", "FusedMatMul"],
        feeds=FEEDS,
        target="onnxruntime",
    )
    assert list(after.graph.node[1].input) == ["h", "table"]


def test_all_rules_on_both_spellings():
    for spelling in ("legacy", "dynamo"):
        after, report = fuser.optimize(decoder(spelling), target="onnxruntime")
        assert report.counts.get(RULE) == 1 and report.verdict.passed
        assert [n.op_type for n in after.graph.node] == ["Gather", "FusedMatMul"]


def test_a_weight_that_is_not_exactly_the_transposed_table_declines():
    head = np.ascontiguousarray(TABLE.T).copy()
    head[3, 7] += 1e-3
    model = decoder("legacy", head=head)
    assert_declined(model, tied_head, "no embedding table", target="onnxruntime", check=False)


def test_a_transposed_copy_read_elsewhere_declines():
    model = decoder("legacy", extra_reader=True)
    assert_declined(model, tied_head, "read elsewhere", target="onnxruntime", check=False)


def test_float16_declines():
    model = decoder("legacy", dtype=np.float16)
    assert_declined(model, tied_head, "takes float32", target="onnxruntime", check=False)


def test_the_onnx_target_keeps_the_matmul():
    after, report = fuser.optimize(decoder("legacy"), rules=[tied_head], target="onnx", check=False)
    assert report.counts == {} and [n.op_type for n in after.graph.node] == ["Gather", "MatMul"]


def test_a_transpose_of_a_higher_rank_constant_declines():
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["h", "wt"], ["y"]),
    ]
    w = np.random.default_rng(3).standard_normal((2, 5, HIDDEN)).astype(np.float32)
    model = make_model(nodes, [("h", np.float32, [2, 3, HIDDEN])], [("y", np.float32, [2, 3, 5])], {"w": w})
    assert_declined(model, tied_head, "not a matrix", target="onnxruntime", check=False)
