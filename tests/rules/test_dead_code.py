"""Tests for dead-code (rules/dead_code.py): removals only, so outputs must be bit-identical."""

from __future__ import annotations

import numpy as np
from fuser.rules.dead_code import dead_code
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

import fuser
from fuser.model import Model
from tests.helpers import assert_declined, assert_rewritten, make_model, op_types

RULE = "dead-code"
RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3)).astype(np.float32)
FEEDS = {"x": X}


def _weights(*names):
    return {name: RNG.standard_normal((2, 3)).astype(np.float32) for name in names}


def test_a_dead_chain_goes_in_one_rewrite_with_the_weight_only_it_read():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Mul", ["r", "w_dead"], ["d1"], name="dead_mul"),
        helper.make_node("Abs", ["d1"], ["d2"], name="dead_abs"),
        helper.make_node("Add", ["r", "w"], ["y"], name="add"),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], _weights("w", "w_dead"))
    after, report = assert_rewritten(model, dead_code, counts={RULE: 1}, expected_ops=["Relu", "Add"], feeds=FEEDS)
    assert report.rewrites[0].matched == ["dead_mul", "dead_abs"]
    assert [t.name for t in after.graph.initializer] == ["w"]


def test_nodes_dead_only_through_other_dead_nodes_go_too():
    # `s` is read, but only by dead nodes: reachability, not a count of readers, decides.
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["s"], name="sig"),
        helper.make_node("Neg", ["s"], ["a"], name="neg"),
        helper.make_node("Exp", ["s"], ["b"], name="exp"),
        helper.make_node("Relu", ["x"], ["y"], name="relu"),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])])
    _, report = assert_rewritten(model, dead_code, counts={RULE: 1}, expected_ops=["Relu"], feeds=FEEDS)
    assert report.rewrites[0].matched == ["sig", "neg", "exp"]


def test_unused_initializers_go_in_one_rewrite():
    nodes = [helper.make_node("Add", ["x", "w"], ["y"])]
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], _weights("w", "old_a", "old_b"))
    after, report = assert_rewritten(model, dead_code, counts={RULE: 1}, expected_ops=["Add"], feeds=FEEDS)
    assert report.rewrites[0].matched == ["old_a", "old_b"]
    assert [t.name for t in after.graph.initializer] == ["w"]


def test_an_overridable_initializer_is_an_input_and_stays():
    # IR >= 4: an initializer listed as a graph input is a default the caller may replace.
    nodes = [helper.make_node("Add", ["x", "w"], ["y"])]
    model = make_model(
        nodes,
        [("x", np.float32, [2, 3]), ("bias", np.float32, [2, 3])],
        [("y", np.float32, [2, 3])],
        _weights("w", "bias"),
    )
    after, _ = assert_declined(model, dead_code, None)
    assert [t.name for t in after.graph.initializer] == ["w", "bias"]
    assert [i.name for i in after.graph.input] == ["x", "bias"]


def test_a_node_with_one_used_output_stays_whole():
    nodes = [helper.make_node("Split", ["x", "parts"], ["a", "b"], axis=1), helper.make_node("Relu", ["a"], ["y"])]
    model = make_model(
        nodes, [("x", np.float32, [2, 4])], [("y", np.float32, [2, 2])], {"parts": np.array([2, 2], np.int64)}
    )
    assert_declined(model, dead_code, None)


def test_graph_outputs_and_their_producers_stay():
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])]
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("r", np.float32, [2, 3]), ("y", np.float32, [2, 3])])
    assert_declined(model, dead_code, None)


def test_a_custom_domain_node_and_what_it_reads_stay():
    # Only standard operators are known to be free of side effects.
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Trace", ["r"], ["logged"], domain="my.company"),
        helper.make_node("Neg", ["x"], ["y"]),
    ]
    model = make_model(
        nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], extra_opsets={"my.company": 1}, check=False
    )
    after, _ = fuser.optimize(model, rules=[dead_code], check=False, trace=True)
    assert op_types(after) == ["Relu", "Trace", "Neg"]


def test_a_dead_ml_domain_node_goes():
    nodes = [
        helper.make_node("Normalizer", ["x"], ["n"], domain="ai.onnx.ml", norm="MAX"),
        helper.make_node("Neg", ["x"], ["y"]),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], extra_opsets={"ai.onnx.ml": 1})
    assert_rewritten(model, dead_code, counts={RULE: 1}, expected_ops=["Neg"], feeds=FEEDS)


def _if_model(then_nodes, then_output, else_nodes, else_output, outer_nodes=(), initializers=None, outputs=("out",)):
    def branch(name, body, output):
        return helper.make_graph(list(body), name, [], [helper.make_tensor_value_info(output, onnx_float, [2, 3])])

    onnx_float = helper.np_dtype_to_tensor_dtype(np.dtype(np.float32))
    nodes = [
        *outer_nodes,
        helper.make_node(
            "If",
            ["cond"],
            ["out"],
            name="if",
            then_branch=branch("then", then_nodes, then_output),
            else_branch=branch("else", else_nodes, else_output),
        ),
    ]
    return make_model(
        nodes,
        [("x", np.float32, [2, 3]), ("cond", np.bool_, [])],
        [(o, np.float32, [2, 3]) for o in outputs],
        initializers or {},
    )


def test_a_dead_node_inside_an_if_branch_goes():
    then_nodes = [
        helper.make_node("Relu", ["x"], ["t"], name="then_relu"),
        helper.make_node("Mul", ["x", "w_branch"], ["t_dead"], name="then_dead"),
    ]
    model = _if_model(then_nodes, "t", [helper.make_node("Neg", ["x"], ["e"])], "e", initializers=_weights("w_branch"))
    feeds = [{"x": X, "cond": np.array(value)} for value in (True, False)]
    after, report = assert_rewritten(model, dead_code, counts={RULE: 1}, feeds=feeds[0])
    assert [r.scope for r in report.rewrites] == ["main/if.then_branch"]
    assert [r.matched for r in report.rewrites] == [["then_dead"]]
    then_branch = next(a.g for a in after.graph.node[0].attribute if a.name == "then_branch")
    assert [n.op_type for n in then_branch.node] == ["Relu"]
    # The main graph's weight that only the dead branch node read is gone too.
    assert [t.name for t in after.graph.initializer] == []
    from tests.helpers import assert_same_outputs

    assert_same_outputs(model, after, feeds[1])


def test_an_initializer_read_only_inside_a_subgraph_is_not_dead():
    then_nodes = [helper.make_node("Mul", ["x", "w_branch"], ["t"])]
    model = _if_model(then_nodes, "t", [helper.make_node("Neg", ["x"], ["e"])], "e", initializers=_weights("w_branch"))
    after, _ = assert_declined(model, dead_code, None)
    assert [t.name for t in after.graph.initializer] == ["w_branch"]


def test_a_dead_if_goes_with_what_its_branches_read():
    then_nodes = [helper.make_node("Mul", ["s", "w_branch"], ["t"])]
    outer = [
        helper.make_node("Sigmoid", ["x"], ["s"], name="feeds_only_the_branch"),
        helper.make_node("Relu", ["x"], ["y"], name="relu"),
    ]
    model = _if_model(
        then_nodes, "t", [helper.make_node("Neg", ["x"], ["e"])], "e", outer, _weights("w_branch"), outputs=("y",)
    )
    after, report = assert_rewritten(
        model, dead_code, counts={RULE: 1}, expected_ops=["Relu"], feeds={"x": X, "cond": np.array(True)}
    )
    assert report.rewrites[0].matched == ["feeds_only_the_branch", "if"]
    assert list(after.graph.initializer) == []


def test_check_mode_lists_dead_code_as_work():
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Neg", ["x"], ["unused"], name="neg")]
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])])
    result = fuser.find_opportunities(model, rules=[dead_code])
    assert [(o.rule, o.nodes) for o in result.opportunities] == [(RULE, ["neg"])]


@st.composite
def _wired_graphs(draw):
    """A DAG of unary and binary nodes, some of a custom domain, with some outputs read by nothing."""
    tensors, nodes = ["x"], []
    for index in range(draw(st.integers(1, 12))):
        reads = draw(st.lists(st.sampled_from(tensors), min_size=1, max_size=2))
        op, domain = draw(st.sampled_from([("Neg", ""), ("Relu", ""), ("Trace", "my.company")]))
        if len(reads) == 2 and not domain:
            op = "Add"
        nodes.append(helper.make_node(op, reads[:1] if op != "Add" else reads, [f"t{index}"], domain=domain))
        tensors.append(f"t{index}")
    outputs = draw(st.lists(st.sampled_from(tensors[1:]), min_size=1, max_size=3, unique=True))
    return make_model(
        nodes,
        [("x", np.float32, [2, 3])],
        [(name, np.float32, [2, 3]) for name in outputs],
        extra_opsets={"my.company": 1},
        check=False,
    )


@given(_wired_graphs())
@settings(max_examples=200, deadline=None)
def test_the_look_for_unread_nodes_finds_dead_code_wherever_the_whole_walk_does(model):
    from fuser.rules.dead_code import _dead_groups

    graph = Model(model).graph
    quick = [change.nodes for change in dead_code.sweep(graph) if change.nodes]
    assert quick == [change.nodes for change in _dead_groups(graph)]
