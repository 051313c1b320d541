"""The rewrite engine with small hand-built models and test-only rules.

Rules are written with the public API only; numerics are compared in onnxruntime
(bit for bit for exact rules).
"""

from __future__ import annotations

import hashlib
import heapq
import os
import struct
import subprocess
import sys

import numpy as np
import onnx
import pytest
from fuser.rules.conv_bn_fold import conv_bn_fold
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import fuser
from fuser import Builder, Decline, Match, const, op, rule, var
from fuser.engine import Engine, _VisitQueue
from fuser.errors import FuserError, RewriteLimitExceeded, RuleError
from fuser.model import Model
from fuser.pattern import PatternError
from tests.helpers import assert_same_outputs, make_model, op_types, run

F32 = np.float32
RNG = np.random.default_rng(0)


def feeds_for(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    initializers = {t.name for t in model.graph.initializer}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        elem = value.type.tensor_type.elem_type
        if elem == TensorProto.BOOL:
            feeds[value.name] = np.array(True).reshape(shape)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(helper.tensor_dtype_to_np_dtype(elem))
    return feeds


def check_valid(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)
    names = [n.name for n in _all_nodes(model.graph) if n.name]
    assert len(names) == len(set(names)), f"duplicate node names: {names}"


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attribute.g)


def unary_chain(ops, names=None, *, output="y", source="x", prefix="t"):
    """source -> ops[0] -> t0 -> ops[1] -> t1 ... -> output."""
    nodes, previous = [], source
    for index, op_type in enumerate(ops):
        out = output if index == len(ops) - 1 else f"{prefix}{index}"
        name = names[index] if names else f"n{index}"
        nodes.append(helper.make_node(op_type, [previous], [out], name=name))
        previous = out
    return nodes


def io(*names, shape=(2, 3)):
    return [(n, F32, list(shape)) for n in names]


# ------------------------------------------------------------------ test rules


@rule("relu-relu", pattern=op.Relu(op.Relu(var("x"), name="inner"), name="outer"), exact=True)
def relu_relu(m: Match, b: Builder):
    """Relu(Relu(x)) => Relu(x)."""
    return b.Relu(m["x"])


@rule(
    "relu-relu-shared",
    pattern=op.Relu(op.Relu(var("x"), name="inner"), name="outer"),
    exact=True,
    shared_interior=True,
)
def relu_relu_shared(m: Match, b: Builder):
    """Relu(Relu(x)) => Relu(x), keeping a shared inner Relu."""
    return b.Relu(m["x"])


@rule("neg-neg", pattern=op.Neg(op.Neg(var("x"), name="inner"), name="outer"), exact=True)
def neg_neg(m: Match, b: Builder):
    """Neg(Neg(x)) => x."""
    return m["x"]


@rule("identity-drop", pattern=op.Identity(var("x")), exact=True)
def identity_drop(m: Match, b: Builder):
    """Identity(x) => x."""
    m.require(not m.is_graph_output(m.root.outputs[0]), "the Identity produces a graph output")
    return m["x"]


# ------------------------------------------------------------ a simple exact rule


def test_exact_rule_fires_with_a_full_report():
    proto = make_model(unary_chain(["Relu", "Relu", "Sigmoid"], ["r1", "r2", "s"]), io("x"), io("y"))
    out, report = fuser.optimize(proto, rules=[relu_relu], check=True, trace=True)
    assert op_types(out) == ["Relu", "Sigmoid"]
    assert report.counts == {"relu-relu": 1}
    (rewrite,) = report.rewrites
    assert rewrite.rule == "relu-relu"
    assert rewrite.scope == "main"
    assert rewrite.matched == ["r2", "r1"]
    assert rewrite.created == ["r2/Relu"]
    assert rewrite.index == 0
    # the replacement took over the root's output name
    relu = out.graph.node[0]
    assert list(relu.input) == ["x"] and list(relu.output) == ["t1"] and relu.name == "r2/Relu"
    assert report.nodes_before == 3 and report.nodes_after == 2
    assert report.checked and report.verdict.passed
    assert all(o.rtol == 0 and o.atol == 0 for o in report.verdict.outputs)  # compared bit for bit
    check_valid(out)
    assert_same_outputs(proto, out, feeds_for(proto))


def test_rewrites_reach_a_fixed_point():
    proto = make_model(unary_chain(["Relu"] * 4), io("x"), io("y"))
    out, report = fuser.optimize(proto, rules=[relu_relu])
    assert op_types(out) == ["Relu"]
    assert report.counts == {"relu-relu": 3}
    assert [r.index for r in report.rewrites] == [0, 1, 2]
    assert list(out.graph.node[0].input) == ["x"] and list(out.graph.node[0].output) == ["y"]
    assert_same_outputs(proto, out, feeds_for(proto))


def test_identity_removal_rewires_the_consumer_and_creates_nothing():
    proto = make_model(unary_chain(["Identity", "Relu"], ["id", "relu"]), io("x"), io("y"))
    out, report = fuser.optimize(proto, rules=[identity_drop])
    assert op_types(out) == ["Relu"]
    assert list(out.graph.node[0].input) == ["x"]
    assert report.counts == {"identity-drop": 1}
    assert report.rewrites[0].matched == ["id"] and report.rewrites[0].created == []
    assert_same_outputs(proto, out, feeds_for(proto))


@rule("identity-drop-naive", pattern=op.Identity(var("x")), exact=True)
def identity_drop_naive(m: Match, b: Builder):
    """Identity(x) => x, without a graph-output guard."""
    return m["x"]


def test_identity_removal_on_a_graph_output_reaches_a_fixed_point():
    """BUG (engine): when the Identity produces a graph output the engine inserts
    Identity(x) -> y to keep the name, i.e. the very node it removed, counts it as a
    rewrite and queues it again, so the natural Identity-removal rule ends in
    RewriteLimitExceeded instead of leaving that Identity alone."""
    proto = make_model(unary_chain(["Relu", "Identity"], ["relu", "id"]), io("x"), io("y"))
    out, report = fuser.optimize(proto, rules=[identity_drop_naive])
    assert op_types(out) == ["Relu", "Identity"]
    assert [o.name for o in out.graph.output] == ["y"]
    assert len(report.rewrites) <= 1
    assert_same_outputs(proto, out, feeds_for(proto))


def test_rule_that_matches_nothing_leaves_the_model_byte_identical():
    proto = make_model(unary_chain(["Relu", "Sigmoid", "Relu"]), io("x"), io("y"))
    out, report = fuser.optimize(proto, rules=[relu_relu, neg_neg])
    assert report.rewrites == [] and report.counts == {}
    assert not report.checked
    assert out.SerializeToString(deterministic=True) == proto.SerializeToString(deterministic=True)


# --------------------------------------------------------- graph output names


def test_graph_output_name_survives_via_identity_when_the_replacement_exists():
    proto = make_model(unary_chain(["Neg", "Neg"], ["n1", "n2"]), io("x"), io("y"))
    out, report = fuser.optimize(proto, rules=[neg_neg])
    assert [o.name for o in out.graph.output] == ["y"]
    assert op_types(out) == ["Identity"]
    identity = out.graph.node[0]
    assert list(identity.input) == ["x"] and list(identity.output) == ["y"]
    assert report.rewrites[0].matched == ["n2", "n1"]
    assert report.rewrites[0].created == [identity.name] == ["y/identity"]
    check_valid(out)
    assert_same_outputs(proto, out, feeds_for(proto))


def test_graph_output_name_survives_when_the_replacement_is_new():
    proto = make_model(unary_chain(["Relu", "Relu"]), io("x"), io("y"))
    out, _ = fuser.optimize(proto, rules=[relu_relu])
    assert op_types(out) == ["Relu"]  # no Identity needed: the new node writes "y" itself
    assert list(out.graph.node[0].output) == ["y"]
    assert [o.name for o in out.graph.output] == ["y"]
    assert_same_outputs(proto, out, feeds_for(proto))


def test_every_consumer_of_a_replaced_tensor_is_rewired():
    nodes = [
        helper.make_node("Neg", ["x"], ["a"], name="n1"),
        helper.make_node("Neg", ["a"], ["t"], name="n2"),
        helper.make_node("Add", ["t", "t"], ["y"], name="add"),
        helper.make_node("Relu", ["t"], ["z"], name="relu"),
        helper.make_node("Mul", ["w", "t"], ["v"], name="mul"),
    ]
    proto = make_model(nodes, io("x"), io("y", "z", "v"), {"w": RNG.standard_normal((2, 3)).astype(F32)})
    out, report = fuser.optimize(proto, rules=[neg_neg])
    assert report.counts == {"neg-neg": 1}
    by_name = {n.name: n for n in out.graph.node}
    assert set(by_name) == {"add", "relu", "mul"}
    assert list(by_name["add"].input) == ["x", "x"]
    assert list(by_name["relu"].input) == ["x"]
    assert list(by_name["mul"].input) == ["w", "x"]
    assert [o.name for o in out.graph.output] == ["y", "z", "v"]
    check_valid(out)
    assert_same_outputs(proto, out, feeds_for(proto))


def test_a_replaced_graph_output_with_other_consumers_keeps_them():
    nodes = [
        helper.make_node("Neg", ["x"], ["a"], name="n1"),
        helper.make_node("Neg", ["a"], ["y"], name="n2"),
        helper.make_node("Relu", ["y"], ["z"], name="relu"),
    ]
    proto = make_model(nodes, io("x"), io("y", "z"))
    out, _ = fuser.optimize(proto, rules=[neg_neg])
    assert [o.name for o in out.graph.output] == ["y", "z"]
    assert sorted(op_types(out)) == ["Identity", "Relu"]
    by_type = {n.op_type: n for n in out.graph.node}
    assert list(by_type["Identity"].input) == ["x"] and list(by_type["Identity"].output) == ["y"]
    assert list(by_type["Relu"].input) == ["y"]  # still reads the (preserved) output
    check_valid(out)
    assert_same_outputs(proto, out, feeds_for(proto))


# ------------------------------------------------------------ interior check


def _shared_interior_model(interior_is_output: bool):
    nodes = unary_chain(["Relu", "Relu"], ["r1", "r2"])  # x -> r1 -> t0 -> r2 -> y
    outputs = io("y")
    if interior_is_output:
        outputs += io("t0")
    else:
        nodes.append(helper.make_node("Sigmoid", ["t0"], ["s"], name="side"))
        outputs += io("s")
    return make_model(nodes, io("x"), outputs)


@pytest.mark.parametrize(
    "interior_is_output, reason",
    [(False, "'t0' (output of r1) is used outside the match"), (True, "'t0' (output of r1) is a graph output")],
)
def test_interior_tensor_with_another_reader_is_declined(interior_is_output, reason):
    proto = _shared_interior_model(interior_is_output)
    out, report = fuser.optimize(proto, rules=[relu_relu], trace=True)
    assert report.rewrites == []
    assert out.SerializeToString(deterministic=True) == proto.SerializeToString(deterministic=True)
    (declined,) = report.engine.declined
    assert declined.rule == "relu-relu"
    assert declined.node == "r2"
    assert declined.scope == "main"
    assert declined.reason == reason


def test_declines_are_recorded_only_with_trace():
    _, report = fuser.optimize(_shared_interior_model(False), rules=[relu_relu], trace=False)
    assert report.engine.declined == []


@pytest.mark.parametrize("interior_is_output", [False, True])
def test_shared_interior_rule_fires_and_keeps_the_interior_node(interior_is_output):
    proto = _shared_interior_model(interior_is_output)
    out, report = fuser.optimize(proto, rules=[relu_relu_shared], trace=True)
    assert report.counts == {"relu-relu-shared": 1}
    assert report.rewrites[0].matched == ["r2", "r1"]
    names = {n.name: n for n in out.graph.node}
    assert "r1" in names and "r2" not in names  # interior kept, root replaced
    assert list(names["r2/Relu"].input) == ["x"] and list(names["r2/Relu"].output) == ["y"]
    if not interior_is_output:
        assert list(names["side"].input) == ["t0"]
    check_valid(out)
    assert_same_outputs(proto, out, feeds_for(proto))


@rule(
    "relu3-shared",
    pattern=op.Relu(op.Relu(op.Relu(var("x"), name="c"), name="b"), name="a"),
    exact=True,
    shared_interior=True,
)
def relu3_shared(m: Match, b: Builder):
    """Relu(Relu(Relu(x))) => Relu(x)."""
    return b.Relu(m["x"])


def test_shared_interior_keeps_what_a_kept_node_reads():
    """BUG: with shared_interior only the shared node is kept; the matched node feeding it
    is removed, so the kept node reads a tensor nobody produces (FuserError)."""
    nodes = unary_chain(["Relu", "Relu", "Relu"], ["c", "b", "a"])  # x -> c -> t0 -> b -> t1 -> a -> y
    nodes.append(helper.make_node("Sigmoid", ["t1"], ["s"], name="side"))
    proto = make_model(nodes, io("x"), io("y", "s"))
    out, report = fuser.optimize(proto, rules=[relu3_shared])
    assert report.counts == {"relu3-shared": 1}
    check_valid(out)
    assert_same_outputs(proto, out, feeds_for(proto))


# ------------------------------------------------------------------ matching


MATCHED: list[dict] = []


@rule("mul-add", pattern=op.Add(op.Mul(var("a"), var("b"), name="mul"), var("c"), name="add"))
def mul_add(m: Match, b: Builder):
    """Add(Mul(a, b), c): records the bindings."""
    MATCHED.append({"a": m["a"], "b": m["b"], "c": m["c"]})
    return b.Add(b.Mul(m["a"], m["b"]), m["c"])


def _opportunities(proto, rules):
    MATCHED.clear()
    result = fuser.find_opportunities(proto, rules=rules)
    return [(o.rule, o.nodes) for o in result.opportunities]


@pytest.mark.parametrize("add_inputs", [["p", "c"], ["c", "p"]])
def test_commutative_match_in_either_operand_order(add_inputs):
    nodes = [
        helper.make_node("Mul", ["a", "b"], ["p"], name="mul"),
        helper.make_node("Add", add_inputs, ["y"], name="add"),
    ]
    proto = make_model(nodes, io("a", "b", "c"), io("y"))
    assert _opportunities(proto, [mul_add]) == [("mul-add", ["add", "mul"])]
    assert MATCHED == [{"a": "a", "b": "b", "c": "c"}]


def test_commutative_match_needs_the_operand_op():
    nodes = [
        helper.make_node("Sub", ["a", "b"], ["p"], name="sub"),
        helper.make_node("Add", ["c", "p"], ["y"], name="add"),
    ]
    proto = make_model(nodes, io("a", "b", "c"), io("y"))
    assert _opportunities(proto, [mul_add]) == []
    assert MATCHED == []


def test_non_commutative_ops_keep_their_operand_order():
    @rule("mul-sub", pattern=op.Sub(op.Mul(var("a"), var("b"), name="mul"), var("c"), name="sub"))
    def mul_sub(m, b):
        """Sub(Mul(a, b), c)."""
        return b.Sub(b.Mul(m["a"], m["b"]), m["c"])

    def model(sub_inputs):
        nodes = [
            helper.make_node("Mul", ["a", "b"], ["p"], name="mul"),
            helper.make_node("Sub", sub_inputs, ["y"], name="sub"),
        ]
        return make_model(nodes, io("a", "b", "c"), io("y"))

    assert _opportunities(model(["p", "c"]), [mul_sub]) == [("mul-sub", ["sub", "mul"])]
    assert _opportunities(model(["c", "p"]), [mul_sub]) == []


@rule("act-of-abs", pattern=(op.Relu | op.LeakyRelu)(op.Abs(var("x"), name="abs"), name="act"), exact=True)
def act_of_abs(m: Match, b: Builder):
    """Relu(Abs(x)) or LeakyRelu(Abs(x)) => Abs(x)."""
    return b.Abs(m["x"])


def test_alternatives_match_each_op_type():
    nodes = [
        helper.make_node("Abs", ["x"], ["a1"], name="abs1"),
        helper.make_node("Relu", ["a1"], ["y1"], name="relu"),
        helper.make_node("Abs", ["x"], ["a2"], name="abs2"),
        helper.make_node("LeakyRelu", ["a2"], ["y2"], name="leaky", alpha=0.3),
        helper.make_node("Abs", ["x"], ["a3"], name="abs3"),
        helper.make_node("Sigmoid", ["a3"], ["y3"], name="sigmoid"),
    ]
    proto = make_model(nodes, io("x"), io("y1", "y2", "y3"))
    out, report = fuser.optimize(proto, rules=[act_of_abs])
    assert report.counts == {"act-of-abs": 2}
    assert sorted(r.matched[0] for r in report.rewrites) == ["leaky", "relu"]
    assert sorted(op_types(out)) == ["Abs", "Abs", "Abs", "Sigmoid"]
    check_valid(out)
    assert_same_outputs(proto, out, feeds_for(proto))


CLIPS: list[tuple] = []


@rule("clip-bounds", pattern=op.Clip(var("x"), const("lo", optional=True), const("hi", optional=True), name="clip"))
def clip_bounds(m: Match, b: Builder):
    """Clip with optional constant bounds: records what was bound."""
    lo = None if m.value("lo") is None else float(m.value("lo"))
    hi = None if m.value("hi") is None else float(m.value("hi"))
    CLIPS.append((m.has("lo"), m["lo"], lo, m.has("hi"), m["hi"], hi))
    # Not the match itself again: check mode lists only what optimize would apply.
    return b.Clip(b.Identity(m["x"]), m["lo"], m["hi"])


@pytest.mark.parametrize(
    "inputs, expected",
    [
        (["x"], (False, None, None, False, None, None)),
        (["x", "lo"], (True, "lo", -1.0, False, None, None)),
        (["x", "", "hi"], (False, None, None, True, "hi", 2.0)),
        (["x", "lo", "hi"], (True, "lo", -1.0, True, "hi", 2.0)),
        (["x", "lo", ""], (True, "lo", -1.0, False, None, None)),
        (["x", "dyn"], None),  # a bound that is not a constant does not match const()
    ],
)
def test_optional_inputs_present_and_absent(inputs, expected):
    nodes = [helper.make_node("Clip", inputs, ["y"], name="clip")]
    inits = {"lo": np.array(-1.0, F32), "hi": np.array(2.0, F32)}
    proto = make_model(nodes, [("x", F32, [4]), ("dyn", F32, [])], [("y", F32, [4])], inits)
    CLIPS.clear()
    found = fuser.find_opportunities(proto, rules=[clip_bounds]).opportunities
    if expected is None:
        assert found == [] and CLIPS == []
    else:
        assert [o.nodes for o in found] == [["clip"]]
        assert CLIPS == [expected]


def test_optional_pattern_input_does_not_accept_extra_inputs():
    @rule("relu-one", pattern=op.Clip(var("x"), const("lo", optional=True), name="clip"))
    def relu_one(m, b):
        """Clip with at most a lower bound."""
        return b.Clip(m["x"], m["lo"])

    nodes = [helper.make_node("Clip", ["x", "lo", "hi"], ["y"], name="clip")]
    inits = {"lo": np.array(-1.0, F32), "hi": np.array(2.0, F32)}
    proto = make_model(nodes, [("x", F32, [4])], [("y", F32, [4])], inits)
    assert fuser.find_opportunities(proto, rules=[relu_one]).opportunities == []


def _leaky(alpha=None, opset=17):
    attrs = {} if alpha is None else {"alpha": alpha}
    return make_model(
        [helper.make_node("LeakyRelu", ["x"], ["y"], name="leaky", **attrs)], io("x"), io("y"), opset=opset
    )


def _matches(proto, pattern) -> bool:
    @rule("probe", pattern=pattern)
    def probe(m, b):
        """Matches the pattern."""
        return b.Identity(m["x"])

    return bool(fuser.find_opportunities(proto, rules=[probe]).opportunities)


def test_attribute_value_constraint():
    pattern = op.LeakyRelu(var("x"), alpha=0.5)
    assert _matches(_leaky(0.5), pattern)
    assert not _matches(_leaky(0.2), pattern)
    assert not _matches(_leaky(None), pattern)  # the default is 0.01


def test_attribute_predicate_constraint_with_schema_default():
    small = op.LeakyRelu(var("x"), alpha=lambda a: a < 0.1)
    assert _matches(_leaky(0.05), small)
    assert not _matches(_leaky(0.5), small)
    assert _matches(_leaky(None), small)  # absent: the schema default 0.01 is checked
    assert _matches(_leaky(None), op.LeakyRelu(var("x"), alpha=lambda a: abs(a - 0.01) < 1e-6))


def test_attribute_default_follows_the_model_opset():
    def softmax(opset, **attrs):
        return make_model(
            [helper.make_node("Softmax", ["x"], ["y"], name="sm", **attrs)], io("x"), io("y"), opset=opset
        )

    last_axis = op.Softmax(var("x"), axis=-1)
    assert _matches(softmax(17), last_axis)  # default axis is -1 since opset 13
    assert not _matches(softmax(11), last_axis)  # and 1 before
    assert _matches(softmax(11), op.Softmax(var("x"), axis=1))
    assert not _matches(softmax(17, axis=1), last_axis)
    assert _matches(softmax(17, axis=-1), last_axis)


def test_same_var_twice_binds_one_tensor():
    pattern = op.Mul(var("x"), var("x"), name="mul")

    def mul(a, b):
        return make_model([helper.make_node("Mul", [a, b], ["y"], name="mul")], io("a", "b"), io("y"))

    assert _matches(mul("a", "a"), pattern)
    assert not _matches(mul("a", "b"), pattern)


def test_same_var_across_nodes_binds_one_tensor():
    pattern = op.Add(op.Relu(var("x"), name="relu"), var("x"), name="add")
    nodes = [helper.make_node("Relu", ["a"], ["r"], name="relu")]
    same = make_model(nodes + [helper.make_node("Add", ["a", "r"], ["y"], name="add")], io("a", "b"), io("y"))
    other = make_model(nodes + [helper.make_node("Add", ["r", "b"], ["y"], name="add")], io("a", "b"), io("y"))
    assert _matches(same, pattern)
    assert not _matches(other, pattern)


def _split_model():
    nodes = [
        helper.make_node("Split", ["x"], ["a", "b"], name="split", num_outputs=2, axis=0),
        helper.make_node("Relu", ["b"], ["y"], name="relu"),
    ]
    return make_model(nodes, [("x", F32, [4])], [("y", F32, [2])], opset=18)  # "a" is unused


def test_output_index_selects_which_output_is_matched():
    assert _matches(_split_model(), op.Relu(op.Split(var("x"), name="split", output=1), name="relu"))
    assert not _matches(_split_model(), op.Relu(op.Split(var("x"), name="split", output=0), name="relu"))


def test_an_output_index_beyond_the_producers_outputs_does_not_match():
    """BUG: match.py indexes proto.output[pattern.output] without a bounds check, so a
    pattern naming output 2 of a two-output Split crashes with IndexError (outside the
    engine's try block, so not even a RuleError) instead of not matching."""
    assert not _matches(_split_model(), op.Relu(op.Split(var("x"), name="split", output=2), name="relu"))


# ------------------------------------------------------------ pattern validation


def _define(name, pattern):
    @rule(name, pattern=pattern)
    def build(m, b):
        """A rule."""
        return m["x"]

    return build


def test_two_different_nodes_with_one_name_are_refused():
    with pytest.raises(PatternError, match="two different nodes are named 'Relu'"):
        _define("two-relus", op.Add(op.Relu(var("x")), op.Relu(var("y"))))


def test_a_name_used_as_var_and_const_is_refused():
    with pytest.raises(PatternError, match="both as var"):
        _define("var-const", op.Add(var("x"), const("x")))


def test_a_name_used_for_a_node_and_a_tensor_is_refused():
    with pytest.raises(PatternError, match="names both a node and a tensor"):
        _define("node-tensor", op.Relu(var("x"), name="x"))


@pytest.mark.parametrize("name", ["Relu_Relu", "relu_relu", "ReluRelu", "relu--relu", "-relu", "relu relu", ""])
def test_rule_names_must_be_kebab_case(name):
    with pytest.raises(PatternError, match="kebab-case"):
        _define(name, op.Relu(var("x")))


def test_a_valid_rule_definition_passes():
    defined = _define("relu-2-relu", op.Add(op.Relu(var("x"), name="r1"), op.Relu(var("x"), name="r2")))
    assert defined.name == "relu-2-relu" and defined.depth == 2


# ---------------------------------------------------------- fixed point limit


@rule("neg-to-mul", pattern=op.Neg(var("x")))
def neg_to_mul(m: Match, b: Builder):
    """Neg(x) => Mul(x, -1)."""
    return b.Mul(m["x"], np.array(-1.0, F32))


@rule("mul-to-neg", pattern=op.Mul(var("x"), const("c")))
def mul_to_neg(m: Match, b: Builder):
    """Mul(x, -1) => Neg(x)."""
    c = m.value("c")
    m.require(c.size == 1 and float(c.reshape(-1)[0]) == -1.0, "not a multiplication by -1")
    return b.Neg(m["x"])


def test_rules_undoing_each_other_hit_the_rewrite_limit():
    proto = make_model(unary_chain(["Neg", "Relu"]), io("x"), io("y"))
    engine = Engine(Model(proto), [neg_to_mul, mul_to_neg], max_rewrites=50)
    with pytest.raises(RewriteLimitExceeded) as caught:
        engine.run()
    message = str(caught.value)
    assert "'neg-to-mul'" in message and "'mul-to-neg'" in message
    assert "50" in message
    assert caught.value.exit_code == 4
    assert len(engine.result.rewrites) == 51


def test_each_of_the_two_rules_alone_terminates():
    proto = make_model(unary_chain(["Neg", "Relu"]), io("x"), io("y"))
    out, report = fuser.optimize(proto, rules=[neg_to_mul])
    assert report.counts == {"neg-to-mul": 1} and op_types(out) == ["Mul", "Relu"]
    again, report = fuser.optimize(out, rules=[mul_to_neg])
    assert report.counts == {"mul-to-neg": 1} and op_types(again) == ["Neg", "Relu"]
    assert [t.name for t in again.graph.initializer] == []  # the -1 constant was dropped


# ------------------------------------------------ determinism and idempotence


def _conv_bn_model():
    rng = np.random.default_rng(1)
    inits = {
        "w": rng.standard_normal((4, 3, 3, 3)).astype(F32),
        "b": rng.standard_normal(4).astype(F32),
        "scale": rng.uniform(0.5, 1.5, 4).astype(F32),
        "beta": rng.standard_normal(4).astype(F32),
        "mean": rng.standard_normal(4).astype(F32),
        "var": rng.uniform(0.5, 1.5, 4).astype(F32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "beta", "mean", "var"], ["n"], name="bn"),
        helper.make_node("Relu", ["n"], ["y"], name="relu"),
    ]
    return make_model(nodes, [("x", F32, [1, 3, 5, 5])], [("y", F32, [1, 4, 5, 5])], inits)


def test_optimizing_twice_gives_identical_bytes_and_is_idempotent():
    proto = _conv_bn_model()
    first, report = fuser.optimize(proto, rules=[conv_bn_fold])
    second, _ = fuser.optimize(proto, rules=[conv_bn_fold])
    assert report.counts == {"conv-bn-fold": 1}
    assert report.rewrites[0].matched == ["bn", "conv"]
    assert op_types(first) == ["Conv", "Relu"]
    assert first.SerializeToString(deterministic=True) == second.SerializeToString(deterministic=True)
    third, again = fuser.optimize(first, rules=[conv_bn_fold])
    assert again.rewrites == [] and again.counts == {}
    assert third.SerializeToString(deterministic=True) == first.SerializeToString(deterministic=True)
    check_valid(first)
    assert_same_outputs(proto, first, feeds_for(proto), rtol=1e-4, atol=1e-5)


_DETERMINISM_SCRIPT = """
import hashlib, sys
import fuser
from fuser.rules.conv_bn_fold import conv_bn_fold
from tests.test_engine import relu_relu, neg_neg
out, _ = fuser.optimize(sys.argv[1], rules=[conv_bn_fold, relu_relu, neg_neg], check=False)
print(hashlib.sha256(out.SerializeToString(deterministic=True)).hexdigest())
"""


def test_output_does_not_depend_on_the_hash_seed(tmp_path):
    proto = _conv_bn_model()
    # y -> Relu -> Relu -> Neg -> Neg -> extra, beside the Conv -> BN -> Relu -> y
    proto.graph.node.extend(
        unary_chain(["Relu", "Relu", "Neg", "Neg"], ["e1", "e2", "e3", "e4"], output="extra", source="y", prefix="u")
    )
    proto.graph.output.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, [1, 4, 5, 5]))
    onnx.checker.check_model(proto, full_check=True)
    path = tmp_path / "model.onnx"
    onnx.save(proto, str(path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digests = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=root)
        result = subprocess.run(
            [sys.executable, "-c", _DETERMINISM_SCRIPT, str(path)],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        digests.add(result.stdout.strip())
    out, report = fuser.optimize(proto, rules=[conv_bn_fold, relu_relu, neg_neg], check=False)
    assert report.counts == {"conv-bn-fold": 1, "relu-relu": 1, "neg-neg": 1}
    assert digests == {hashlib.sha256(out.SerializeToString(deterministic=True)).hexdigest()}


# ----------------------------------------------------------------- rule errors


@rule("boom", pattern=op.Relu(var("x")))
def boom(m: Match, b: Builder):
    """Always crashes."""
    return {}["missing"]


def test_a_crashing_rule_is_reported_as_rule_error():
    proto = make_model(unary_chain(["Relu"]), io("x"), io("y"))
    with pytest.raises(RuleError) as caught:
        fuser.optimize(proto, rules=[boom])
    assert caught.value.rule_name == "boom"
    assert "rule 'boom' failed" in str(caught.value) and "KeyError" in str(caught.value)
    assert caught.value.exit_code == 4
    assert isinstance(caught.value.__cause__, KeyError)


def test_a_declining_rule_is_not_an_error():
    @rule("never", pattern=op.Relu(var("x")))
    def never(m, b):
        """Always declines."""
        raise Decline("not today")

    proto = make_model(unary_chain(["Relu"], ["r"]), io("x"), io("y"))
    _, report = fuser.optimize(proto, rules=[never], trace=True)
    assert report.rewrites == []
    assert [(d.rule, d.node, d.reason) for d in report.engine.declined] == [("never", "r", "not today")]


@pytest.mark.parametrize("how", ["augmented", "item", "slice"])
def test_values_are_read_only(how):
    @rule("mutate", pattern=op.Add(var("x"), const("w"), name="add"))
    def mutate(m, b):
        """Tries to change a weight in place."""
        w = m.value("w")
        if how == "augmented":
            w += 1
        elif how == "item":
            w[0, 0] = 100.0
        else:
            w[...] = 0
        return b.Add(m["x"], b.constant(w))

    w = RNG.standard_normal((2, 3)).astype(F32)
    nodes = [helper.make_node("Add", ["x", "w"], ["y"], name="add")]
    proto = make_model(nodes, io("x"), io("y"), {"w": w.copy()})
    model = Model(proto)
    with pytest.raises(RuleError) as caught:
        fuser.optimize(model, rules=[mutate])
    assert caught.value.rule_name == "mutate"
    assert "read-only" in str(caught.value)
    np.testing.assert_array_equal(numpy_helper.to_array(proto.graph.initializer[0]), w)
    np.testing.assert_array_equal(model.graph.constant_value("w"), w)
    np.testing.assert_array_equal(numpy_helper.to_array(model.to_proto().graph.initializer[0]), w)


def test_values_from_constant_nodes_are_read_only_too():
    @rule("mutate-constant", pattern=op.Add(var("x"), const("w"), name="add"))
    def mutate_constant(m, b):
        """Tries to change a Constant's value in place."""
        m.value("w")[0] = 5.0
        return b.Add(m["x"], m["w"])

    nodes = [
        helper.make_node("Constant", [], ["w"], value_floats=[1.0, 2.0, 3.0]),
        helper.make_node("Add", ["x", "w"], ["y"], name="add"),
    ]
    model = Model(make_model(nodes, [("x", F32, [3])], [("y", F32, [3])]))
    with pytest.raises(RuleError, match="read-only"):
        fuser.optimize(model, rules=[mutate_constant])
    np.testing.assert_array_equal(model.graph.constant_value("w"), [1.0, 2.0, 3.0])


@pytest.mark.parametrize("source", ["weight", "computed"])
def test_a_value_cannot_be_made_writeable(source):
    """A weight's value is an array over the tensor's own bytes, handed over as it is; a
    computed constant's is a view of the array the graph keeps: neither can be turned writeable."""

    @rule("unlock", pattern=op.Add(var("x"), const("w"), name="add"))
    def unlock(m, b):
        """Tries to make a value writeable, then change it."""
        w = m.value("w")
        w.flags.writeable = True
        w[0] = 5.0
        return b.Add(m["x"], b.constant(w))

    values = np.array([1.0, 2.0, 3.0], F32)
    io_ = ([("x", F32, [3])], [("y", F32, [3])])
    if source == "weight":
        model = Model(make_model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], *io_, {"w": values.copy()}))
        expected = values
    else:  # evaluated by numpy: an array that owns its data, kept by the graph
        nodes = [helper.make_node("Neg", ["c"], ["w"]), helper.make_node("Add", ["x", "w"], ["y"], name="add")]
        model = Model(make_model(nodes, *io_, {"c": values.copy()}))
        expected = -values
    with pytest.raises(RuleError, match="WRITEABLE"):
        fuser.optimize(model, rules=[unlock])
    np.testing.assert_array_equal(model.graph.constant_value("w"), expected)


def _two_relus_with_tail():
    nodes = unary_chain(["Relu", "Relu", "Neg"], ["r1", "r2", "tail"])
    return make_model(nodes, io("x"), io("y"))


def test_reading_a_tensor_that_does_not_exist_is_rule_error():
    @rule("read-ghost", pattern=op.Relu(op.Relu(var("x"), name="inner"), name="outer"))
    def read_ghost(m, b):
        """Builds on a tensor that is nowhere."""
        return b.Relu("no-such-tensor")

    with pytest.raises(RuleError, match="'no-such-tensor', which does not exist") as caught:
        fuser.optimize(_two_relus_with_tail(), rules=[read_ghost])
    assert caught.value.rule_name == "read-ghost"


def test_reading_a_removed_tensor_is_rule_error():
    @rule("read-removed", pattern=op.Relu(op.Relu(var("x"), name="inner"), name="outer"))
    def read_removed(m, b):
        """Builds on the interior tensor the rewrite removes."""
        return b.Neg(m["inner"])

    with pytest.raises(RuleError, match="'t0', which it removes") as caught:
        fuser.optimize(_two_relus_with_tail(), rules=[read_removed])
    assert caught.value.rule_name == "read-removed"


def test_returning_a_tensor_that_does_not_exist_is_rule_error():
    """BUG: a returned existing-looking name is redirected to without any check when the root
    output is not a graph output: no RuleError, the consumer silently reads a tensor nobody
    produces (onnxruntime then refuses the model)."""

    @rule("return-ghost", pattern=op.Relu(op.Relu(var("x"), name="inner"), name="outer"))
    def return_ghost(m, b):
        """Returns a name that is nowhere."""
        return "no-such-tensor"

    with pytest.raises(RuleError) as caught:
        fuser.optimize(_two_relus_with_tail(), rules=[return_ghost], check=False)
    assert caught.value.rule_name == "return-ghost"


def test_returning_a_tensor_the_rewrite_removes_is_rule_error():
    """BUG: returning the interior tensor redirects the consumers to it, then removes its
    producer: a plain FuserError ('still used but no longer produced'), not a RuleError."""

    @rule("return-removed", pattern=op.Relu(op.Relu(var("x"), name="inner"), name="outer"))
    def return_removed(m, b):
        """Returns the interior tensor the rewrite removes."""
        return m["inner"]

    with pytest.raises(FuserError) as caught:
        fuser.optimize(_two_relus_with_tail(), rules=[return_removed], check=False)
    assert isinstance(caught.value, RuleError), f"{type(caught.value).__name__}: {caught.value}"
    assert caught.value.rule_name == "return-removed"


def test_returning_a_missing_tensor_for_a_graph_output_is_rule_error():
    @rule("return-ghost-out", pattern=op.Relu(op.Relu(var("x"), name="inner"), name="outer"))
    def return_ghost_out(m, b):
        """Returns a name that is nowhere, for a graph output."""
        return "no-such-tensor"

    proto = make_model(unary_chain(["Relu", "Relu"]), io("x"), io("y"))
    with pytest.raises(RuleError, match="does not exist"):
        fuser.optimize(proto, rules=[return_ghost_out])


@pytest.mark.parametrize(
    "result, message",
    [(["a", "b"], "returned 2 output"), (42, "output tensor name"), ("t1", "unchanged")],
)
def test_malformed_results_are_rule_errors(result, message):
    @rule("bad-result", pattern=op.Relu(op.Relu(var("x"), name="inner"), name="outer"))
    def bad_result(m, b):
        """Returns something unusable."""
        return result

    with pytest.raises(RuleError, match=message) as caught:
        fuser.optimize(_two_relus_with_tail(), rules=[bad_result])
    assert caught.value.rule_name == "bad-result"


def test_a_crashing_attribute_predicate_is_rule_error():
    """BUG: attribute predicates run in find_matches, outside the engine's try block, so
    their exceptions escape raw instead of as a RuleError naming the rule."""

    @rule("bad-predicate", pattern=op.LeakyRelu(var("x"), alpha=lambda a: 1 / 0))
    def bad_predicate(m, b):
        """Never reached."""
        return b.Relu(m["x"])

    with pytest.raises(RuleError) as caught:
        fuser.optimize(_leaky(0.5), rules=[bad_predicate])
    assert caught.value.rule_name == "bad-predicate"


# ------------------------------------------------------------------ opset range


def test_rule_outside_its_opset_range_is_skipped_with_a_reason():
    @rule("relu-relu-13", pattern=op.Relu(op.Relu(var("x"), name="inner"), name="outer"), opsets=(13, 99))
    def relu_relu_13(m, b):
        """Relu(Relu(x)) => Relu(x), opsets 13 to 99."""
        return b.Relu(m["x"])

    old = make_model(unary_chain(["Relu", "Relu"]), io("x"), io("y"), opset=11)
    out, report = fuser.optimize(old, rules=[relu_relu_13])
    assert report.rewrites == []
    assert op_types(out) == ["Relu", "Relu"]
    reason = report.engine.skipped_rules["relu-relu-13"]
    assert "opset 11" in reason and "13 to 99" in reason

    new = make_model(unary_chain(["Relu", "Relu"]), io("x"), io("y"), opset=13)
    _, report = fuser.optimize(new, rules=[relu_relu_13])
    assert report.counts == {"relu-relu-13": 1}
    assert report.engine.skipped_rules == {}


# ------------------------------------------------------------------ builder


@rule("relu-to-max", pattern=op.Relu(var("x")), exact=True)
def relu_to_max(m: Match, b: Builder):
    """Relu(x) => Max(x, 0) with a scalar 0 given as a numpy array."""
    return b.Max(m["x"], np.array(0.0, F32))


def test_builder_arrays_become_initializers_with_their_shape():
    """BUG: Builder.constant passes values through np.ascontiguousarray, which returns at
    least 1-d arrays, so a 0-d (scalar) value becomes a [1] initializer: Max(scalar, [1])
    has shape [1], the checker refuses the model and the numerics check reports a mismatch."""
    proto = make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [("x", F32, [])], [("y", F32, [])])
    out, report = fuser.optimize(proto, rules=[relu_to_max], check=False)
    assert report.counts == {"relu-to-max": 1}
    assert op_types(out) == ["Max"]
    (zero,) = out.graph.initializer
    assert zero.name == "relu/max_input"  # named after the root node and the op it feeds
    assert list(zero.dims) == [], f"a scalar became shape {list(zero.dims)}"
    check_valid(out)
    assert_same_outputs(proto, out, {"x": np.array(-2.5, F32)})
    assert_same_outputs(proto, out, {"x": np.array(1.5, F32)})


def test_builder_like_keeps_the_nodes_type_domain_and_attributes_with_those_given_replaced():
    conv = helper.make_node(
        "Conv", ["x", "w"], ["y"], name="conv", strides=[2, 2], pads=[1, 1, 1, 1], group=1, dilations=[1, 1]
    )
    norm = helper.make_node("LayerNormalization", ["x", "s"], ["n"], domain="ai.onnx", axis=-1, epsilon=1e-5)
    graph = Model(chain_model([conv, norm], ["x", "w", "s"], ["y", "n"])).graph
    builder = Builder(graph, "anchor")
    conv_info, norm_info = (graph.node(graph.producer(t)) for t in ("y", "n"))
    builder.like(conv_info, "x", "w", "bias")
    builder.like(conv_info, "x", "w", pads=[0, 0, 0, 0], group=None, auto_pad="SAME_UPPER")
    builder.like(norm_info, "x", "s", outputs=3)
    same, changed, renorm = builder.nodes
    assert (same.op_type, same.domain, list(same.input)) == ("Conv", "", ["x", "w", "bias"])
    expected = helper.make_node("Conv", [], [], strides=[2, 2], pads=[1, 1, 1, 1], group=1, dilations=[1, 1])
    assert [a.SerializeToString() for a in same.attribute] == [a.SerializeToString() for a in expected.attribute]
    assert {a.name: helper.get_attribute_value(a) for a in changed.attribute} == {
        "auto_pad": b"SAME_UPPER",
        "dilations": [1, 1],
        "pads": [0, 0, 0, 0],
        "strides": [2, 2],
    }
    assert [a.name for a in changed.attribute] == sorted(a.name for a in changed.attribute)  # as op() orders them
    assert (renorm.domain, len(renorm.output)) == ("ai.onnx", 3)
    assert [(a.name, helper.get_attribute_value(a)) for a in renorm.attribute] == [
        ("axis", -1),
        ("epsilon", pytest.approx(1e-5)),
    ]


def test_builder_like_refuses_to_drop_a_nodes_bodies():
    body = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["o"])], "b", [], [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2])]
    )
    branch = helper.make_node("If", ["c"], ["y"], name="if", then_branch=body, else_branch=body)
    graph = Model(chain_model([branch], ["c", "x"], ["y"])).graph
    node = graph.node(graph.producer("y"))
    with pytest.raises(ValueError, match="else_branch, then_branch"):
        Builder(graph, "anchor").like(node, "c")
    Builder(graph, "anchor").like(node, "c", then_branch=body, else_branch=body)  # given: built


# ------------------------------------------------------------------ fresh names


@rule("relu-relu-scaled", pattern=op.Relu(op.Relu(var("x"), name="inner"), name="outer"), exact=True)
def relu_relu_scaled(m: Match, b: Builder):
    """Relu(Relu(x)) => Relu(Mul(x, 1)) with a new constant."""
    return b.Relu(b.Mul(m["x"], np.ones((), F32)))


def test_new_names_never_collide_with_existing_ones():
    # The Builder names a node "<root>/<Op>", its outputs "<node>:<i>", a constant
    # "<root>/<op>_input", and on a clash appends "__<n>". Pre-populate those names, some
    # only inside an If branch (names are unique across scopes too).
    taken = ["r2/Mul", "r2/Mul__1", "r2/Relu", "r2/Relu__1"]
    nodes = unary_chain(["Relu", "Relu"], ["r1", "r2"], output="out")
    side_inputs = []
    for name in taken:
        nodes.append(helper.make_node("Sigmoid", ["x"], [f"{name}:0"], name=name))
        side_inputs.append(f"{name}:0")
    nodes.append(helper.make_node("Abs", ["x"], ["r2/Mul__2:0"], name="abs"))
    side_inputs += ["r2/Mul__2:0", "r2/mul_input", "r2/mul_input__1"]
    nodes.append(helper.make_node("Sum", side_inputs, ["side"], name="sum"))
    branch_nodes = [
        helper.make_node("Neg", ["x"], ["r2/Relu__2:0"], name="r2/Relu__2"),
        helper.make_node("Neg", ["r2/Relu__2:0"], ["branch_out"], name="r2/Mul__2"),
    ]
    nodes.append(
        helper.make_node(
            "If",
            ["cond"],
            ["z"],
            name="if",
            then_branch=_branch("then", branch_nodes, "branch_out"),
            else_branch=_branch("else", [helper.make_node("Abs", ["x"], ["r2/mul_input__2"])], "r2/mul_input__2"),
        )
    )
    inits = {"r2/mul_input": np.full((2, 3), 2.0, F32), "r2/mul_input__1": np.full((2, 3), 3.0, F32)}
    proto = make_model(nodes, [("x", F32, [2, 3]), ("cond", np.bool_, [])], io("out", "side", "z"), inits)
    existing = {n.name for n in _all_nodes(proto.graph)} | {o for n in _all_nodes(proto.graph) for o in n.output}
    existing |= set(inits)

    out, report = fuser.optimize(proto, rules=[relu_relu_scaled])
    assert report.counts == {"relu-relu-scaled": 1}
    created = report.rewrites[0].created
    assert len(created) == 2 and not set(created) & existing
    new_nodes = [n for n in out.graph.node if n.name in created]
    new_tensors = [o for n in new_nodes for o in n.output if o != "out"]
    new_tensors += [t.name for t in out.graph.initializer if t.name not in inits]
    assert len(new_tensors) == 2 and not set(new_tensors) & existing
    check_valid(out)
    all_outputs = [o for n in _all_nodes(out.graph) for o in n.output] + [t.name for t in out.graph.initializer]
    assert len(all_outputs) == len(set(all_outputs))
    for cond in (True, False):
        feeds = {"x": RNG.standard_normal((2, 3)).astype(F32), "cond": np.array(cond)}
        assert_same_outputs(proto, out, feeds)


def test_an_inserted_identity_gets_a_fresh_name():
    nodes = unary_chain(["Neg", "Neg"], ["n1", "n2"])
    nodes.append(helper.make_node("Abs", ["x"], ["z"], name="y/identity"))
    proto = make_model(nodes, io("x"), io("y", "z"))
    out, report = fuser.optimize(proto, rules=[neg_neg])
    names = [n.name for n in out.graph.node]
    assert len(names) == len(set(names)) == 2
    assert report.rewrites[0].created == ["y/identity__1"]
    check_valid(out)
    assert_same_outputs(proto, out, feeds_for(proto))


# ------------------------------------------------------------------ subgraphs


def _branch(name, nodes, output):
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(output, TensorProto.FLOAT, [2, 3])])


def _if_model(then_nodes, then_out, else_nodes, else_out, outer_nodes=(), outputs=("y",)):
    node = helper.make_node(
        "If",
        ["cond"],
        ["y"],
        name="if",
        then_branch=_branch("then", then_nodes, then_out),
        else_branch=_branch("else", else_nodes, else_out),
    )
    return make_model(list(outer_nodes) + [node], [("x", F32, [2, 3]), ("cond", np.bool_, [])], io(*outputs))


def _assert_same_for_both_branches(before, after):
    for cond in (True, False):
        feeds = {"x": RNG.standard_normal((2, 3)).astype(F32), "cond": np.array(cond)}
        assert_same_outputs(before, after, feeds)


def test_patterns_inside_if_branches_are_rewritten():
    then_nodes = [
        helper.make_node("Relu", ["x"], ["ta"], name="then_r1"),
        helper.make_node("Relu", ["ta"], ["then_out"], name="then_r2"),
    ]
    else_nodes = [
        helper.make_node("Neg", ["x"], ["ea"], name="else_neg"),
        helper.make_node("Relu", ["ea"], ["eb"], name="else_r1"),
        helper.make_node("Relu", ["eb"], ["else_out"], name="else_r2"),
    ]
    proto = _if_model(then_nodes, "then_out", else_nodes, "else_out")
    out, report = fuser.optimize(proto, rules=[relu_relu])
    assert report.counts == {"relu-relu": 2}
    assert sorted(r.scope for r in report.rewrites) == ["main/if.else_branch", "main/if.then_branch"]
    if_node = out.graph.node[0]
    branches = {a.name: a.g for a in if_node.attribute}
    assert [n.op_type for n in branches["then_branch"].node] == ["Relu"]
    assert list(branches["then_branch"].node[0].input) == ["x"]
    assert [n.op_type for n in branches["else_branch"].node] == ["Neg", "Relu"]
    assert [o.name for o in branches["then_branch"].output] == ["then_out"]
    assert [o.name for o in branches["else_branch"].output] == ["else_out"]
    check_valid(out)
    _assert_same_for_both_branches(proto, out)


def test_branch_output_replaced_by_an_outer_tensor_gets_an_identity():
    then_nodes = [
        helper.make_node("Neg", ["x"], ["ta"], name="then_n1"),
        helper.make_node("Neg", ["ta"], ["then_out"], name="then_n2"),
    ]
    else_nodes = [helper.make_node("Abs", ["x"], ["else_out"], name="else_abs")]
    proto = _if_model(then_nodes, "then_out", else_nodes, "else_out")
    out, report = fuser.optimize(proto, rules=[neg_neg])
    assert report.counts == {"neg-neg": 1}
    then_branch = next(a.g for a in out.graph.node[0].attribute if a.name == "then_branch")
    assert [(n.op_type, list(n.input), list(n.output)) for n in then_branch.node] == [("Identity", ["x"], ["then_out"])]
    check_valid(out)
    _assert_same_for_both_branches(proto, out)


def test_an_interior_tensor_read_inside_a_subgraph_blocks_the_outer_rewrite():
    outer = unary_chain(["Relu", "Relu"], ["r1", "r2"], output="z")  # x -> r1 -> t0 -> r2 -> z
    then_nodes = [helper.make_node("Neg", ["t0"], ["then_out"], name="then_neg")]
    else_nodes = [helper.make_node("Abs", ["t0"], ["else_out"], name="else_abs")]
    proto = _if_model(then_nodes, "then_out", else_nodes, "else_out", outer, outputs=("y", "z"))
    out, report = fuser.optimize(proto, rules=[relu_relu], trace=True)
    assert report.rewrites == []
    assert [(d.node, d.scope, d.reason) for d in report.engine.declined] == [
        ("r2", "main", "'t0' (output of r1) is used outside the match")
    ]
    assert out.SerializeToString(deterministic=True) == proto.SerializeToString(deterministic=True)


def test_a_root_output_read_inside_a_subgraph_keeps_its_name():
    outer = unary_chain(["Neg", "Neg"], ["n1", "n2"], output="t")  # x -> n1 -> t0 -> n2 -> t
    then_nodes = [helper.make_node("Relu", ["t"], ["then_out"], name="then_relu")]
    else_nodes = [helper.make_node("Abs", ["t"], ["else_out"], name="else_abs")]
    proto = _if_model(then_nodes, "then_out", else_nodes, "else_out", outer)
    out, report = fuser.optimize(proto, rules=[neg_neg])
    assert report.counts == {"neg-neg": 1}
    identity = next(n for n in out.graph.node if n.op_type == "Identity")
    assert list(identity.input) == ["x"] and list(identity.output) == ["t"]
    assert [n.op_type for n in out.graph.node] == ["Identity", "If"]
    check_valid(out)
    _assert_same_for_both_branches(proto, out)


def test_numerics_helper_sanity():
    # the comparison helpers used above do detect a difference
    a = make_model(unary_chain(["Relu"]), io("x"), io("y"))
    b = make_model(unary_chain(["Neg"]), io("x"), io("y"))
    feeds = {"x": np.array([[1, -2, 3], [-4, 5, -6]], F32)}
    assert not np.array_equal(run(a, feeds)[0], run(b, feeds)[0])
    with pytest.raises(AssertionError):
        assert_same_outputs(a, b, feeds)


def test_check_mode_lists_only_what_optimize_applies():
    """A replacement that optimize declines in its final checks (here: the same node again) is
    no opportunity either, so `fuser check` on an optimized model finds nothing to do."""

    @rule("clip-again", pattern=op.Clip(var("x"), name="clip"))
    def clip_again(m: Match, b: Builder):
        """Clip(x) => Clip(x)."""
        return b.Clip(m["x"])

    proto = make_model([helper.make_node("Clip", ["x"], ["y"], name="clip")], [("x", F32, [4])], [("y", F32, [4])])
    assert fuser.find_opportunities(proto, rules=[clip_again]).opportunities == []
    _, report = fuser.optimize(proto, rules=[clip_again], check=False)
    assert report.counts == {}


# -------------------------------------------------- patterns needing op types the graph lacks


@rule("abs-to-sigmoid", pattern=op.Abs(var("x"), name="abs"))
def abs_to_sigmoid(m: Match, b: Builder):
    """Abs => Sigmoid (a test rule: it creates the op type another rule needs)."""
    return b.Sigmoid(m["x"])


@rule("neg-of-sigmoid", pattern=op.Neg(op.Sigmoid(var("x"), name="sigmoid"), name="neg"))
def neg_of_sigmoid(m: Match, b: Builder):
    """Neg(Sigmoid(x)) => Exp(x) (a test rule: its pattern needs a Sigmoid below its root)."""
    return b.Exp(m["x"])


def chain_model(nodes: list[onnx.NodeProto], inputs: list[str], outputs: list[str]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_pattern_is_tried_again_once_a_rewrite_creates_the_op_type_it_needs():
    # The first Neg is visited while the graph has no Sigmoid; the Abs rewrite then creates one
    # below the second Neg, which must still be matched.
    model = chain_model(
        [
            helper.make_node("Neg", ["a"], ["na"], name="early"),
            helper.make_node("Abs", ["x"], ["t"], name="abs"),
            helper.make_node("Neg", ["t"], ["y"], name="late"),
        ],
        ["a", "x"],
        ["na", "y"],
    )
    loaded = Model(model)
    result = Engine(loaded, [abs_to_sigmoid, neg_of_sigmoid]).run()
    assert [r.rule for r in result.rewrites] == ["abs-to-sigmoid", "neg-of-sigmoid"]
    assert op_types(loaded.to_proto()) == ["Neg", "Exp"]


def test_a_needed_op_type_counts_in_either_spelling_of_the_default_domain():
    model = chain_model(
        [helper.make_node("Sigmoid", ["x"], ["s"], domain="ai.onnx"), helper.make_node("Neg", ["s"], ["y"])],
        ["x"],
        ["y"],
    )
    assert [r.rule for r in Engine(Model(model), [neg_of_sigmoid]).run().rewrites] == ["neg-of-sigmoid"]
    without = chain_model([helper.make_node("Relu", ["x"], ["s"]), helper.make_node("Neg", ["s"], ["y"])], ["x"], ["y"])
    assert Engine(Model(without), [neg_of_sigmoid]).run().rewrites == []
    assert neg_of_sigmoid.needs == (((("Sigmoid",), ""),),)


# ------------------------------------------------ revisiting nodes behind the current one


@rule("sub-of-neg", pattern=op.Sub(var("h"), op.Neg(var("s"), name="neg"), name="sub"))
def sub_of_neg(m: Match, b: Builder):
    """Sub(h, Neg(s)) => Add(h, s)."""
    return b.Add(m["h"], m["s"])


def layers_reading_one_tensor(layers: int) -> onnx.ModelProto:
    """Each layer: Sub(h, Neg(s)), which sub-of-neg rewrites to an Add reading s, then Sub(., s),
    which it declines; s is read by every layer, as a mask or a rotary cache is."""
    nodes = [helper.make_node("Relu", ["x"], ["s"])]
    for i in range(layers):
        nodes += [
            helper.make_node("Neg", ["s"], [f"n{i}"]),
            helper.make_node("Sub", [f"h{i}", f"n{i}"], [f"a{i}"]),
            helper.make_node("Sub", [f"a{i}", "s"], [f"h{i + 1}"]),
        ]
    return chain_model(nodes, ["x", "h0"], [f"h{layers}"])


def visits(model: onnx.ModelProto, rules) -> tuple[int, int]:
    """(nodes visited, rewrites) of one engine run."""
    seen = []
    result = Engine(Model(model), rules, progress=lambda stage, done, total: seen.append(done)).run()
    return seen[-1], len(result.rewrites)


def test_a_tensor_every_layer_reads_does_not_make_each_rewrite_revisit_every_layer():
    # Each rewrite re-queues the readers of s, in every layer: the earlier ones are visited once
    # more when the queue drains, not once per later layer (which grows with the square of depth).
    few, rewrites_few = visits(layers_reading_one_tensor(10), [sub_of_neg])
    many, rewrites_many = visits(layers_reading_one_tensor(80), [sub_of_neg])
    assert (rewrites_few, rewrites_many) == (10, 80)
    assert many <= 10 * few


def test_the_rewrite_progress_never_reads_complete_while_nodes_wait_behind():
    # The progress reports every 1,000 visits; nodes waiting behind are still to come.
    reports = []
    model = Model(layers_reading_one_tensor(1000))
    Engine(model, [sub_of_neg], progress=lambda stage, done, total: reports.append((done, total))).run()
    *running, (done, total) = reports
    assert done == total
    assert any(seen < done for seen, _ in running)
    assert all(planned > seen for seen, planned in running if seen < done)


@rule("sigmoid-of-sole-reader", pattern=op.Sigmoid(var("s"), name="sigmoid"))
def sigmoid_of_sole_reader(m: Match, b: Builder):
    """Sigmoid(s) => Tanh(s) when nothing else reads s (a test rule: it depends on the readers)."""
    m.require(len(m.graph.op_consumers(m["s"])) == 1, "s has other readers")
    return b.Tanh(m["s"])


@rule("neg-of-relu", pattern=op.Neg(op.Relu(var("x"), name="relu"), name="neg"), shared_interior=True)
def neg_of_relu(m: Match, b: Builder):
    """Neg(Relu(x)) => Neg(x), keeping the Relu for its other readers (a test rule)."""
    return b.Neg(m["x"])


def test_a_node_behind_is_still_revisited_when_a_later_rewrite_changes_what_it_reads():
    # The Sigmoid comes first and declines (the Neg also reads s); the Neg's rewrite then leaves
    # it the only reader, and it must be visited again.
    model = chain_model(
        [
            helper.make_node("Relu", ["x"], ["s"], name="relu"),
            helper.make_node("Sigmoid", ["s"], ["early"], name="sigmoid"),
            helper.make_node("Neg", ["s"], ["late"], name="neg"),
        ],
        ["x"],
        ["early", "late"],
    )
    loaded = Model(model)
    result = Engine(loaded, [sigmoid_of_sole_reader, neg_of_relu]).run()
    assert [r.rule for r in result.rewrites] == ["neg-of-relu", "sigmoid-of-sole-reader"]
    assert sorted(op_types(loaded.to_proto())) == ["Neg", "Relu", "Tanh"]


@rule("relu-of-relu", pattern=op.Relu(op.Relu(var("x"), name="inner"), name="outer"))
def relu_of_relu(m: Match, b: Builder):
    """Relu(Relu(x)) => Relu(x) (a test rule; the inner Relu must have no other reader)."""
    return b.Relu(m["x"])


@rule("merge-twin-relu", pattern=op.Relu(var("v"), name="relu"))
def merge_twin_relu(m: Match, b: Builder):
    """A Relu reading what an earlier Relu reads => the earlier one's output (a test rule)."""
    graph, node = m.graph, m.node("relu")
    twins = [
        other
        for other in graph.op_consumers(m["v"])
        if graph.node(other).op_type == "Relu" and graph.sort_key(other) < graph.sort_key(node.id)
    ]
    m.require(bool(twins), "no earlier twin")
    return graph.node(twins[0]).outputs[0]


def test_a_rewrite_that_stops_reading_a_tensor_revisits_its_last_reader():
    # relu_a declines at first (s has two readers); merging relu_b into it leaves relu_a the
    # only reader of s, though nothing the merge builds reads s or sits below relu_a.
    model = chain_model(
        [
            helper.make_node("Relu", ["x"], ["s"], name="inner"),
            helper.make_node("Relu", ["s"], ["a"], name="relu_a"),
            helper.make_node("Relu", ["s"], ["b"], name="relu_b"),
            helper.make_node("Neg", ["a"], ["na"], name="neg_a"),
            helper.make_node("Exp", ["b"], ["eb"], name="exp_b"),
        ],
        ["x"],
        ["na", "eb"],
    )
    loaded = Model(model)
    result = Engine(loaded, [merge_twin_relu, relu_of_relu]).run()
    assert [r.rule for r in result.rewrites] == ["merge-twin-relu", "relu-of-relu"]
    optimized = loaded.to_proto()
    assert sorted(op_types(optimized)) == ["Exp", "Neg", "Relu"]
    assert_same_outputs(model, optimized, feeds_for(model))
    again = Model(optimized)
    assert not Engine(again, [merge_twin_relu, relu_of_relu]).run().rewrites


def _reshape_below_a_folded_shape(reader: onnx.NodeProto) -> onnx.ModelProto:
    """Reshape(Reshape(x)) whose inner output `t` has a second reader, `reader` (t -> d), read
    only by a Shape that shape-fold turns into a constant: d then has no reader left."""
    nodes = [
        helper.make_node("Reshape", ["x", "s1"], ["t"], name="r1"),
        helper.make_node("Reshape", ["t", "s2"], ["u"], name="r2"),
        reader,
        helper.make_node("Shape", ["d"], ["sh"], name="shape"),
        helper.make_node("Reshape", ["y", "sh"], ["v"], name="r3"),
    ]
    return make_model(
        nodes,
        [("x", np.float32, [2, 3]), ("y", np.float32, [3, 2])],
        [("u", np.float32, [2, 3]), ("v", np.float32, [6])],
        {"s1": np.array([6], np.int64), "s2": np.array([2, 3], np.int64)},
        extra_opsets={"ai.onnx.ml": 3},
    )


@pytest.mark.parametrize(
    "reader",
    [
        # Removed at once with the Shape that was its only reader (a computable node left unused).
        helper.make_node("Neg", ["t"], ["d"], name="reader"),
        # Not computable here (another domain): left to the dead-code sweep after the pass.
        helper.make_node("Binarizer", ["t"], ["d"], name="reader", domain="ai.onnx.ml"),
    ],
    ids=["removed-with-its-reader", "removed-by-a-sweep"],
)
@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
def test_a_tensor_left_with_one_reader_lets_it_fuse_in_the_same_pass(reader, target):
    model = _reshape_below_a_folded_shape(reader)
    optimized, report = fuser.optimize(model, target=target)
    assert "reshape-chain" in report.counts
    assert report.verdict.passed
    assert not fuser.optimize(optimized, target=target, check=False)[1].rewrites
    feeds = {"x": RNG.standard_normal((2, 3)).astype(F32), "y": RNG.standard_normal((3, 2)).astype(F32)}
    assert_same_outputs(model, optimized, feeds)


def test_a_node_ahead_touched_again_is_looked_below_again():
    # Positions need not be topological (the Relu is listed after its readers): each Neg's
    # rewrite touches the Relu, ahead of it; only after the second does the Sigmoid read s alone.
    model = chain_model(
        [
            helper.make_node("Neg", ["s"], ["n1"], name="neg1"),
            helper.make_node("Sigmoid", ["s"], ["y"], name="sigmoid"),
            helper.make_node("Neg", ["s"], ["n2"], name="neg2"),
            helper.make_node("Relu", ["x"], ["s"], name="relu"),
        ],
        ["x"],
        ["y", "n1", "n2"],
    )
    loaded = Model(model)
    result = Engine(loaded, [sigmoid_of_sole_reader, neg_of_relu]).run()
    assert [r.rule for r in result.rewrites] == ["neg-of-relu", "neg-of-relu", "sigmoid-of-sole-reader"]
    assert "Tanh" in op_types(loaded.to_proto())


# ------------------------------------------------ rules that name the nodes worth trying

tried_at: list[str] = []


def negs_of_initializers(graph) -> list[int]:
    return [n.id for n in graph.nodes() if n.op_type == "Neg" and graph.initializer(n.inputs[0]) is not None]


@rule("neg-of-initializer", pattern=op.Neg(var("w"), name="neg"), candidates=negs_of_initializers)
def neg_of_initializer(m: Match, b: Builder):
    """Neg(w) => -w for an initializer w (a test rule that names the nodes worth trying)."""
    tried_at.append(m.node("neg").name)
    m.require(m.graph.initializer(m["w"]) is not None, "not an initializer")
    return b.constant(-m.value("w"))


@rule("sigmoid-as-tanh", pattern=op.Sigmoid(var("x"), name="sigmoid"), phase=1)
def sigmoid_as_tanh(m: Match, b: Builder):
    """Sigmoid(x) => Tanh(x), in a later phase (a test rule)."""
    return b.Tanh(m["x"])


def negs_model(nodes: list[onnx.NodeProto], outputs: list[str]) -> onnx.ModelProto:
    model = chain_model(nodes, ["x"], outputs)
    model.graph.initializer.append(numpy_helper.from_array(np.array([1.0, -2.0], F32), "w"))
    return model


@rule("double-neg", pattern=op.Neg(op.Neg(var("x"), name="inner"), name="outer"), exact=True)
def double_neg(m: Match, b: Builder):
    """Neg(Neg(x)) => x (a test rule rooted at every Neg, naming no candidates)."""
    return b.Identity(m["x"])


@pytest.mark.parametrize("others", [[], [double_neg]], ids=["alone", "beside-a-rule-rooted-at-every-neg"])
def test_a_pass_tries_a_rule_only_at_the_nodes_it_names(others):
    # With another rule rooted at Neg, both Negs are visited; the rule is still tried at one.
    tried_at.clear()
    model = negs_model(
        [helper.make_node("Neg", ["x"], ["a"], name="of_input"), helper.make_node("Neg", ["w"], ["b"], name="of_w")],
        ["a", "b"],
    )
    result = Engine(Model(model), [neg_of_initializer, *others]).run()
    assert tried_at == ["of_w"]
    assert [r.matched for r in result.rewrites] == [["of_w"]]


def test_a_node_a_rewrite_touches_is_tried_in_the_same_pass_whatever_the_rule_named():
    # The outer Neg reads an initializer only once the inner one is folded: the rule did not name
    # it, and it must be folded before the later phase runs.
    tried_at.clear()
    model = negs_model(
        [
            helper.make_node("Neg", ["w"], ["a"], name="inner"),
            helper.make_node("Neg", ["a"], ["b"], name="outer"),
            helper.make_node("Sigmoid", ["x"], ["y"], name="sigmoid"),
        ],
        ["b", "y"],
    )
    result = Engine(Model(model), [neg_of_initializer, sigmoid_as_tanh]).run()
    assert [r.rule for r in result.rewrites] == ["neg-of-initializer", "neg-of-initializer", "sigmoid-as-tanh"]
    assert tried_at == ["inner", "outer"]


@rule("identity-away", pattern=op.Identity(var("x"), name="id"), phase=1, exact=True)
def identity_away(m: Match, b: Builder):
    """Identity(x) => x, in a later phase (a test rule)."""
    return m["x"]


def test_a_pass_below_an_earlier_phases_changes_tries_the_rule_at_the_nodes_it_names_then():
    # The later phase leaves both Negs reading what the Identities read; the pass over them
    # names the one reading an initializer, and tries the rule there only.
    tried_at.clear()
    model = negs_model(
        [
            helper.make_node("Identity", ["w"], ["a"], name="id_w"),
            helper.make_node("Identity", ["x"], ["x2"], name="id_x"),
            helper.make_node("Neg", ["a"], ["b"], name="of_w"),
            helper.make_node("Neg", ["x2"], ["c"], name="of_x"),
        ],
        ["b", "c"],
    )
    result = Engine(Model(model), [neg_of_initializer, identity_away]).run()
    assert [r.rule for r in result.rewrites] == ["identity-away", "identity-away", "neg-of-initializer"]
    assert tried_at == ["of_w"]


def visits_of(model: onnx.ModelProto, rules: list) -> int:
    """How many node visits a run of `rules` over `model` makes, as its progress reports them."""
    reported = []
    Engine(Model(model), rules, progress=lambda stage, done, total: reported.append((stage, done))).run()
    return [done for stage, done in reported if stage == "rewrite"][-1]


def test_a_pass_below_an_earlier_phases_changes_skips_the_nodes_no_rule_names():
    # Many Negs below the later phase's Identities: the rule that names candidates is the only
    # one rooted at Neg, so the pass over them visits the one it names, not every Neg.
    def fanned(count: int) -> onnx.ModelProto:
        nodes = [helper.make_node("Identity", ["w"], ["a"], name="id_w")]
        nodes += [helper.make_node("Neg", ["a"], ["b"], name="of_w")]
        for i in range(count):
            nodes += [helper.make_node("Identity", ["x"], [f"x{i}"], name=f"id{i}")]
            nodes += [helper.make_node("Neg", [f"x{i}"], [f"y{i}"], name=f"neg{i}")]
        return negs_model(nodes, ["b"] + [f"y{i}" for i in range(count)])

    rules = [neg_of_initializer, identity_away]
    tried_at.clear()
    visits = [visits_of(fanned(count), rules) for count in (8, 40)]
    assert tried_at == ["of_w", "of_w"]
    assert visits[1] - visits[0] == 40 - 8  # the later phase visits each Identity; then only the named Neg
    with_a_rule_naming_none = visits_of(fanned(40), [*rules, double_neg])
    assert with_a_rule_naming_none >= visits[1] + 40  # another rule rooted at Neg: each Neg is visited


def test_a_pass_below_an_earlier_phases_changes_still_tries_the_rules_naming_none():
    # Neg(Identity(Neg(x))) is a double negation only once the later phase drops the Identity:
    # the pass below that change names of_w for one rule, and must try the other at every Neg.
    nodes = [
        helper.make_node("Identity", ["w"], ["a"], name="id_w"),
        helper.make_node("Neg", ["a"], ["b"], name="of_w"),
        helper.make_node("Neg", ["x"], ["n1"], name="inner"),
        helper.make_node("Identity", ["n1"], ["n2"], name="id_n"),
        helper.make_node("Neg", ["n2"], ["y"], name="outer"),
    ]
    result = Engine(Model(negs_model(nodes, ["b", "y"])), [neg_of_initializer, identity_away, double_neg]).run()
    assert [(r.rule, r.matched) for r in result.rewrites] == [
        ("identity-away", ["id_w"]),
        ("identity-away", ["id_n"]),
        ("neg-of-initializer", ["of_w"]),
        ("double-neg", ["outer", "inner"]),
    ]


def test_candidates_must_be_a_function_of_a_pattern_rule():
    with pytest.raises(PatternError, match="candidates must be a function"):
        rule("bad-candidates", pattern=op.Neg(var("x")), description="a test rule", candidates=[1, 2])(
            lambda m, b: None
        )


def test_a_crash_in_candidates_is_the_rules_error():
    def crashing(graph):
        raise KeyError("boom")

    crashing_rule = rule(
        "crashing-candidates", pattern=op.Neg(var("x")), description="a test rule", candidates=crashing
    )(lambda m, b: b.Abs(m["x"]))
    model = negs_model([helper.make_node("Neg", ["x"], ["a"])], ["a"])
    with pytest.raises(RuleError, match="crashing-candidates.*its candidates raised KeyError"):
        Engine(Model(model), [crashing_rule]).run()


# ------------------------------------------------- how far below a change the engine looks


def relu_chain(length: int) -> Model:
    nodes = [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"], name=f"relu{i}") for i in range(length)]
    return Model(make_model(nodes, [("t0", F32, [2])], [(f"t{length}", F32, [2])]))


def test_op_types_version_changes_only_when_an_op_type_appears_or_goes():
    graph = relu_chain(3).graph
    version = graph.op_types_version
    graph.add_node(helper.make_node("Relu", ["t3"], ["u"]), key=(10,))
    assert graph.op_types_version == version  # Relu was there already
    sigmoid = graph.add_node(helper.make_node("Sigmoid", ["t3"], ["v"]), key=(11,))
    assert graph.op_types_version == version + 1
    graph.remove_node(graph.nodes_of_type("Relu")[0])
    assert graph.op_types_version == version + 1  # Relu is still there
    graph.remove_node(sigmoid)
    assert graph.op_types_version == version + 2


@rule("relu-anywhere", pattern=op.Relu(var("x"), name="relu"), phase=0)
def relu_anywhere(m: Match, b: Builder):
    """A rule that never rewrites: Relu, declined."""
    raise Decline("test rule")


@rule("relu-over-sigmoid", pattern=op.Relu(op.Relu(op.Sigmoid(var("x")), name="inner"), name="outer"), phase=0)
def relu_over_sigmoid(m: Match, b: Builder):
    """A rule that never rewrites: Relu(Relu(Sigmoid)), declined."""
    raise Decline("test rule")


def test_a_change_is_followed_down_as_deep_as_a_pattern_that_can_match_there():
    """Below a change, a node is looked at again only within reach of a pattern rooted at it;
    a pattern needing an op type the graph lacks reaches nowhere until a node of that type comes."""
    model = relu_chain(6)
    graph = model.graph
    engine = Engine(model, [relu_anywhere, relu_over_sigmoid])
    engine._enter_phase(0)
    first = graph.producer("t1")
    below = lambda: sorted(graph.node(n).name for n in engine._downstream(graph, {first}))
    assert below() == ["relu0", "relu1"]  # relu-anywhere's depth 1: a Relu reading the change
    graph.add_node(helper.make_node("Sigmoid", ["t6"], ["s"], name="sigmoid"), key=(10,))
    assert below() == ["relu0", "relu1", "relu2", "relu3"]  # relu-over-sigmoid can match now: depth 3


@rule("relu-walking-up", pattern=op.Relu(var("x"), name="relu"), phase=0, walks=4)
def relu_walking_up(m: Match, b: Builder):
    """A rule that never rewrites, but reads four nodes deep above its Relu, as attention does."""
    raise Decline("test rule")


def test_a_rule_that_reads_beyond_its_pattern_is_looked_at_again_as_deep_as_it_walks():
    model = relu_chain(6)
    graph = model.graph
    engine = Engine(model, [relu_anywhere, relu_walking_up])
    engine._enter_phase(0)
    below = engine._downstream(graph, {graph.producer("t1")})
    assert sorted(graph.node(n).name for n in below) == ["relu0", "relu1", "relu2", "relu3", "relu4"]


def test_walks_must_be_a_depth():
    with pytest.raises(PatternError, match="walks must be a depth"):

        @rule("bad-walks", pattern=op.Relu(var("x")), walks=-1)
        def bad_walks(m: Match, b: Builder):
            """Never built."""


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 50)), max_size=60), st.integers(0, 30))
def test_the_visit_queue_pops_in_the_order_of_one_heap(operations, initial):
    """Positions pushed before a pass settles are read as a sorted run, later ones from a
    heap; whatever the mix, nodes come out smallest position first, as from a single heap."""
    queue, heap = _VisitQueue(), []
    for node_id in range(initial):
        queue.push(((initial - node_id) % 7,), node_id)
        heapq.heappush(heap, (((initial - node_id) % 7,), node_id))
    queue.settle()
    node_ids = iter(range(initial, 10_000))
    for is_pop, position in operations:
        if is_pop:
            assert len(queue) == len(heap)
            if heap:
                assert queue.pop() == heapq.heappop(heap)
        else:
            node_id = next(node_ids)
            queue.push((position,), node_id)
            heapq.heappush(heap, ((position,), node_id))
    assert [queue.pop() for _ in range(len(queue))] == [heapq.heappop(heap) for _ in range(len(heap))]


_scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(width=32),  # with -0.0, infinities and NaN
    st.sampled_from([0, 0.0, -0.0, 1, 1.0, True, False, struct.pack("<d", 0.0), struct.pack("<d", 1.0)]),
    st.text(max_size=4),
    st.binary(max_size=8),  # a float's bits may be these bytes
)
_attribute_values = st.one_of(
    _scalars, st.lists(st.one_of(st.integers(-5, 5), st.floats(width=32)), min_size=1, max_size=4)
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_attribute_values, min_size=2, max_size=6))
def test_builder_attributes_encode_as_make_attribute_does_whatever_was_built_before(values):
    # Values that compare equal (1, 1.0, True; 0.0, -0.0), or a float and the bytes of its bits,
    # encode differently and must not share a cached encoding.
    from fuser.rule import _attribute

    for value in values:
        built = _attribute("a", value).SerializeToString()
        assert built == helper.make_attribute("a", value).SerializeToString(), value


def test_builder_attribute_cache_holds_only_small_values():
    from fuser.rule import ATTRIBUTE_CACHE_LENGTH, _attribute, _encoded_attributes

    long_list, long_text = list(range(ATTRIBUTE_CACHE_LENGTH + 1)), "x" * (ATTRIBUTE_CACHE_LENGTH + 1)
    for value in (long_list, long_text, long_list[:-1]):
        assert _attribute("cached_or_not", value) == helper.make_attribute("cached_or_not", value)
    held = [key[1] for key in _encoded_attributes if key[0] == "cached_or_not"]
    assert held == [(list, tuple((int, i) for i in long_list[:-1]))]


def test_builder_doc_string_and_overload_are_the_nodes_fields_not_attributes():
    graph = Model(chain_model([helper.make_node("Relu", ["x"], ["y"])], ["x"], ["y"])).graph
    builder = Builder(graph, "anchor")
    builder.op("Relu", "x", doc_string="why", overload="", alpha=None)
    builder.op("Custom", "x", domain="custom.domain", overload="variant", mode=2)
    relu, custom = builder.nodes
    assert (relu.doc_string, list(relu.attribute)) == ("why", [])
    assert custom.overload == "variant" and [a.name for a in custom.attribute] == ["mode"]
