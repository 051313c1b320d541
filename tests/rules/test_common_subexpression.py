"""Tests for common-subexpression (rules/common_subexpression.py); outputs bit-identical."""

from __future__ import annotations

import numpy as np
from fuser.rules.common_subexpression import common_subexpression, repeated_nodes
from onnx import helper

from fuser.model import Model
from tests.helpers import assert_declined, assert_rewritten, make_model

RULE = "common-subexpression"
X = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}


def twice(second_attrs=None, output_twice=False):
    nodes = [
        helper.make_node("LeakyRelu", ["x"], ["a"], alpha=0.1),
        helper.make_node("LeakyRelu", ["x"], ["b"], **(second_attrs or {"alpha": 0.1})),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    outputs = [("y", np.float32, ["n", 3])] + ([("b", np.float32, ["n", 3])] if output_twice else [])
    return make_model(nodes, [("x", np.float32, ["n", 3])], outputs)


def test_repeated_node_is_computed_once():
    after, _ = assert_rewritten(
        twice(), [common_subexpression], counts={RULE: 1}, expected_ops=["LeakyRelu", "Add"], feeds=X
    )
    assert list(after.graph.node[1].input) == ["a", "a"]


def test_repeated_node_that_is_a_graph_output_is_kept():
    assert_declined(twice(output_twice=True), common_subexpression, "is a graph output", check=False)


def test_other_attributes_are_not_merged_and_leave_no_decline():
    # A node without a twin is no candidate: the report gets no decline for it (one per node, else).
    assert_declined(twice({"alpha": 0.2}), common_subexpression, None, check=False)


def test_training_dropout_is_never_merged():
    nodes = [
        helper.make_node("Dropout", ["x", "r", "t"], ["a"]),
        helper.make_node("Dropout", ["x", "r", "t"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    inits = {"r": np.array(0.5, np.float32), "t": np.array(True)}
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], inits)
    assert_declined(model, common_subexpression, None, check=False)  # the Dropouts never even match


def test_twins_are_found_among_the_readers_of_their_least_read_input():
    # "w" is read by many nodes, "x" by the twins alone: the twins are found either way, and
    # nodes reading "w" with another input, or the same inputs in another order, are not twins.
    nodes = [helper.make_node("Mul", ["w", f"x{i}"], [f"m{i}"]) for i in range(4)]
    nodes += [
        helper.make_node("Mul", ["w", "x"], ["a"]),
        helper.make_node("Mul", ["x", "w"], ["swapped"]),
        helper.make_node("Mul", ["w", "x"], ["b"]),
        helper.make_node("Sum", [*(f"m{i}" for i in range(4)), "a", "b", "swapped"], ["y"]),
    ]
    shape = [2, 3]
    inputs = [("x", np.float32, shape)] + [(f"x{i}", np.float32, shape) for i in range(4)]
    model = make_model(nodes, inputs, [("y", np.float32, shape)], {"w": np.full(shape, 1.5, np.float32)})
    rng = np.random.default_rng(1)
    feeds = {name: rng.standard_normal(shape).astype(np.float32) for name, *_ in inputs}
    after, _ = assert_rewritten(model, [common_subexpression], counts={RULE: 1}, feeds=feeds)
    total = next(n for n in after.graph.node if n.op_type == "Sum")
    assert list(total.input)[4:] == ["a", "a", "swapped"]


def test_readers_of_the_same_inputs_with_other_op_types_are_not_twins():
    nodes = [
        helper.make_node("Add", ["x", "x"], ["a"]),
        helper.make_node("Mul", ["x", "x"], ["b"]),
        helper.make_node("Sub", ["a", "b"], ["y"]),
    ]
    model = make_model(nodes, [("x", np.float32, ["n", 3])], [("y", np.float32, ["n", 3])])
    assert_declined(model, common_subexpression, None, check=False)


def tensors_asked(monkeypatch, method: str) -> list[str]:
    """The tensors Graph.`method` is asked about from now on, in order."""
    import fuser.graph

    asked = []
    original = getattr(fuser.graph.Graph, method)

    def recording(graph, tensor):
        asked.append(tensor)
        return original(graph, tensor)

    monkeypatch.setattr(fuser.graph.Graph, method, recording)
    return asked


def test_only_the_readers_of_the_least_read_input_are_searched(monkeypatch):
    # Searching the readers of a tensor every layer reads would cost each of its readers a scan
    # of all the others: the twins' search lists the readers of "x", never those of "w".
    listed = tensors_asked(monkeypatch, "op_consumers")
    nodes = [helper.make_node("Mul", ["w", f"x{i}"], [f"m{i}"]) for i in range(4)]
    nodes += [helper.make_node("Mul", ["w", "x"], ["a"]), helper.make_node("Mul", ["w", "x"], ["b"])]
    nodes.append(helper.make_node("Sum", [*(f"m{i}" for i in range(4)), "a", "b"], ["y"]))
    shape = [2, 3]
    inputs = [("x", np.float32, shape)] + [(f"x{i}", np.float32, shape) for i in range(4)]
    model = make_model(nodes, inputs, [("y", np.float32, shape)], {"w": np.full(shape, 1.5, np.float32)})
    rng = np.random.default_rng(2)
    feeds = {name: rng.standard_normal(shape).astype(np.float32) for name, *_ in inputs}
    assert_rewritten(model, [common_subexpression], counts={RULE: 1}, feeds=feeds)
    assert "x" in listed and "w" not in listed


def test_a_pass_tries_only_the_nodes_that_repeat_another_nodes_op_and_inputs():
    # Attributes and outputs are left to the rule: the Transposes are tried, and declined.
    nodes = [
        helper.make_node("Shape", ["x"], ["s1"], name="shape1"),
        helper.make_node("Shape", ["x"], ["s2"], name="shape2"),
        helper.make_node("Size", ["x"], ["n"], name="size"),
        helper.make_node("Transpose", ["x"], ["t1"], name="t1", perm=[1, 0]),
        helper.make_node("Transpose", ["x"], ["t2"], name="t2", perm=[0, 1]),
        helper.make_node("Add", ["x", "y"], ["a1"], name="add1"),
        helper.make_node("Add", ["y", "x"], ["a2"], name="add2"),
    ]
    outputs = [("s1", np.int64, [2]), ("s2", np.int64, [2]), ("n", np.int64, [])]
    outputs += [(name, np.float32, [3, 3]) for name in ("t1", "t2", "a1", "a2")]
    model = make_model(nodes, [("x", np.float32, [3, 3]), ("y", np.float32, [3, 3])], outputs)
    graph = Model(model).graph
    assert sorted(graph.node(i).name for i in repeated_nodes(graph)) == ["shape1", "shape2", "t1", "t2"]


def test_a_pass_over_a_chain_without_repeats_looks_for_no_twin(monkeypatch):
    asked = tensors_asked(monkeypatch, "readers_at_most")
    nodes = [helper.make_node("Relu", [f"h{i}"], [f"h{i + 1}"]) for i in range(50)]
    model = make_model(nodes, [("h0", np.float32, [3])], [("h50", np.float32, [3])])
    assert_declined(model, common_subexpression, None, check=False)
    assert asked == []


def test_a_merge_that_leaves_one_reader_lets_that_reader_fuse_in_the_same_pass():
    # Two identical Adds read the Conv: conv-add-bias declines the first (the Conv output has
    # another reader); once the second is merged into it, it fuses, and a second pass has
    # nothing left to do.
    from fuser.rules.conv_add_bias import conv_add_bias

    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Add", ["c", "b"], ["a1"], name="add_1"),
        helper.make_node("Add", ["c", "b"], ["a2"], name="add_2"),
        helper.make_node("Relu", ["a1"], ["y1"]),
        helper.make_node("Sigmoid", ["a2"], ["y2"]),
    ]
    weights = {
        "w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "b": rng.standard_normal((1, 4, 1, 1)).astype(np.float32),
    }
    model = make_model(
        nodes,
        [("x", np.float32, [1, 3, 8, 8])],
        [("y1", np.float32, [1, 4, 6, 6]), ("y2", np.float32, [1, 4, 6, 6])],
        weights,
        opset=11,
    )
    feeds = {"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)}
    after, _ = assert_rewritten(
        model,
        [common_subexpression, conv_add_bias],
        counts={RULE: 1, "conv-add-bias": 1},
        expected_ops=["Conv", "Relu", "Sigmoid"],
        feeds=feeds,
        rtol=1e-5,
        atol=1e-6,
    )
    assert_declined(after, conv_add_bias, None, rules=[common_subexpression, conv_add_bias], check=False)


def test_dedicated_quantize_dequantize_pairs_are_never_merged():
    """A quantizer's pair per consumer (DedicatedQDQPair; a zero bias shared by two Adds) stays
    one pair per consumer: runtimes fuse each DequantizeLinear into its one reader."""
    nodes = [
        helper.make_node("QuantizeLinear", ["bias", "scale", "zero"], ["q1"]),
        helper.make_node("QuantizeLinear", ["bias", "scale", "zero"], ["q2"]),
        helper.make_node("DequantizeLinear", ["q1", "scale", "zero"], ["d1"]),
        helper.make_node("DequantizeLinear", ["q2", "scale", "zero"], ["d2"]),
        helper.make_node("Add", ["x", "d1"], ["a"]),
        helper.make_node("Add", ["x", "d2"], ["b"]),
        helper.make_node("Mul", ["a", "b"], ["y"]),
    ]
    inits = {"bias": np.zeros(3, np.float32), "scale": np.array(0.1, np.float32), "zero": np.array(0, np.int8)}
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], inits)
    assert_declined(model, common_subexpression, None, check=False)
