"""Two engine features the transformer rules use: a rule's `pattern` may be a tuple of
alternative patterns (several spellings of one computation), and `Builder.replaces(interior,
tensor)` lets a replacement stand in for an interior node's output that is used outside the
match (the residual sum of skip-layer-norm).

Rules here are written with the public API; numerics are compared in onnxruntime with graph
optimizations disabled, bit for bit (the rewrites only respell the same arithmetic).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

import fuser
from fuser import Builder, Match, const, op, rule, var
from fuser.errors import RuleError
from fuser.pattern import PatternError
from tests.helpers import assert_declined, assert_rewritten, make_model, nodes_of, op_types

F32 = np.float32
SHAPE = ["batch", 4]
x = var("x")


@rule(
    "abs-of-square",
    pattern=(
        op.Abs(op.Mul(x, x, name="square"), name="abs"),
        op.Abs(op.Pow(x, const("two"), name="square"), name="abs"),
    ),
)
def abs_of_square(m: Match, b: Builder):
    """Abs(x * x) or Abs(x ^ 2)  =>  x * x (a square is never negative)."""
    if m.has("two"):
        m.require(float(m.value("two")) == 2.0, "the exponent is not 2")
    return b.Mul(m["x"], m["x"])


def sum_relu_rule(stand_in: bool = True, decline: str | None = None, bogus: str | None = None):
    """Relu(Add(a, b))  =>  Relu(Sum(a, b)); with stand_in, the Sum stands in for the Add."""

    def build(m: Match, b: Builder):
        if decline:
            m.require(False, decline)
        total = b.Sum(m["a"], m["b"])
        if stand_in:
            b.replaces(m["sum"], total)
        if bogus:
            b.replaces(bogus, total)
        return b.Relu(total)

    return rule(
        "sum-relu",
        pattern=op.Relu(op.Add(var("a"), var("b"), name="sum"), name="relu"),
        description="Relu(Add(a, b)) => Relu(Sum(a, b)).",
    )(build)


def feeds(seed=0):
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((3, 4)).astype(F32), "b": rng.standard_normal((3, 4)).astype(F32)}


def residual_model(sum_is_output=False, outside_consumer=True):
    """s = a + b; y = Relu(s); z = Neg(s) (outside the match); s may be a graph output."""
    nodes = [
        helper.make_node("Add", ["a", "b"], ["s"], name="sum"),
        helper.make_node("Relu", ["s"], ["y"], name="relu"),
    ]
    outputs = [("y", F32, SHAPE)]
    if outside_consumer:
        nodes.append(helper.make_node("Neg", ["s"], ["z"], name="neg"))
        outputs.append(("z", F32, SHAPE))
    if sum_is_output:
        outputs.append(("s", F32, SHAPE))
    return make_model(nodes, [("a", F32, SHAPE), ("b", F32, SHAPE)], outputs)


# ------------------------------------------------------------------------ alternatives


def test_alternatives_are_listed_and_validated():
    assert len(abs_of_square.alternatives) == 2
    assert abs_of_square.roots == [("Abs", "")]
    assert abs_of_square.depth == 2
    with pytest.raises(PatternError, match="empty list of patterns"):
        rule("no-patterns", pattern=(), description="d")(lambda m, b: None)
    with pytest.raises(PatternError, match="two different nodes are named"):
        rule(
            "bad-alternative",
            pattern=(op.Relu(x), op.Relu(op.Abs(x, name="n"), name="n")),
            description="d",
        )(lambda m, b: None)


def test_a_rule_with_two_alternatives_matches_both():
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["sq1"], name="mul"),
        helper.make_node("Abs", ["sq1"], ["y1"], name="abs1"),
        helper.make_node("Pow", ["x", "two"], ["sq2"], name="pow"),
        helper.make_node("Abs", ["sq2"], ["y2"], name="abs2"),
    ]
    model = make_model(
        nodes, [("x", F32, SHAPE)], [("y1", F32, SHAPE), ("y2", F32, SHAPE)], {"two": np.array(2.0, F32)}
    )
    after, report = assert_rewritten(
        model, [abs_of_square], counts={"abs-of-square": 2}, expected_ops=["Mul", "Mul"], feeds={"x": feeds()["a"]}
    )
    assert sorted(tuple(r.matched) for r in report.rewrites) == [("abs1", "mul"), ("abs2", "pow")]
    assert after.graph.initializer == []


def test_an_alternative_declines_with_its_own_reason():
    nodes = [helper.make_node("Pow", ["x", "three"], ["sq"], name="pow"), helper.make_node("Abs", ["sq"], ["y"])]
    model = make_model(nodes, [("x", F32, SHAPE)], [("y", F32, SHAPE)], {"three": np.array(3.0, F32)})
    assert_declined(model, abs_of_square, "the exponent is not 2")


def test_alternatives_with_different_roots():
    @rule("negated-square", pattern=(op.Neg(op.Mul(x, x, name="sq"), name="root"), op.Abs(x, name="root")))
    def negated(m: Match, b: Builder):
        """Neg(x * x) => -(x^2) via Pow; Abs(x) => Max(x, -x)."""
        if m.node("root").op_type == "Abs":
            return b.Max(m["x"], b.Neg(m["x"]))
        return b.Neg(b.Pow(m["x"], np.array(2.0, F32)))

    assert negated.roots == [("Neg", ""), ("Abs", "")]
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["sq"], name="mul"),
        helper.make_node("Neg", ["sq"], ["y1"], name="neg"),
        helper.make_node("Abs", ["x"], ["y2"], name="abs"),
    ]
    model = make_model(nodes, [("x", F32, SHAPE)], [("y1", F32, SHAPE), ("y2", F32, SHAPE)])
    assert_rewritten(
        model,
        [negated],
        counts={"negated-square": 2},
        expected_ops=["Pow", "Neg", "Neg", "Max"],
        feeds={"x": feeds()["a"]},
        rtol=1e-6,
        atol=1e-6,
    )


# -------------------------------------------------------------------------- stand-ins


def test_stand_in_removes_the_interior_node_and_outside_consumers_read_the_new_tensor():
    model = residual_model()
    after, report = assert_rewritten(
        model, [sum_relu_rule()], counts={"sum-relu": 1}, expected_ops=["Sum", "Relu", "Neg"], feeds=feeds()
    )
    assert "Add" not in op_types(after)
    (total,) = nodes_of(after, "Sum")
    assert list(nodes_of(after, "Neg")[0].input) == [total.output[0]]
    assert list(nodes_of(after, "Relu")[0].input) == [total.output[0]]
    assert report.rewrites[0].matched == ["relu", "sum"]


def test_stand_in_keeps_a_graph_output_name():
    model = residual_model(sum_is_output=True, outside_consumer=False)
    after, _ = assert_rewritten(
        model, [sum_relu_rule()], counts={"sum-relu": 1}, expected_ops=["Sum", "Relu"], feeds=feeds()
    )
    assert [o.name for o in after.graph.output] == ["y", "s"]
    assert nodes_of(after, "Sum")[0].output[0] == "s"


def test_stand_in_for_graph_output_with_outside_consumer():
    model = residual_model(sum_is_output=True)
    after, _ = assert_rewritten(
        model, [sum_relu_rule()], counts={"sum-relu": 1}, expected_ops=["Sum", "Relu", "Neg"], feeds=feeds()
    )
    produced = {o for n in after.graph.node for o in n.output}
    assert "s" in produced and list(nodes_of(after, "Neg")[0].input) == ["s"]


def test_without_a_stand_in_an_escaping_interior_declines():
    assert_declined(residual_model(), sum_relu_rule(stand_in=False), "'s' (output of sum) is used outside the match")


def test_when_the_rule_declines_the_interior_reason_is_reported():
    """The interior's escape is the first reason: the rule's own decline comes after it."""
    _, report = assert_declined(
        residual_model(),
        sum_relu_rule(decline="the rule's own reason"),
        "'s' (output of sum) is used outside the match",
    )
    assert all("the rule's own reason" not in d.reason for d in report.engine.declined)
    # with nothing escaping, the rule's own reason is what is reported
    assert_declined(
        residual_model(outside_consumer=False), sum_relu_rule(decline="the rule's own reason"), "the rule's own reason"
    )


@pytest.mark.parametrize("bogus", ["a", "y"], ids=["graph-input", "root-output"])
def test_stand_in_for_a_tensor_no_removed_interior_computes_is_a_rule_error(bogus):
    with pytest.raises(RuleError, match="which no removed interior node computes"):
        fuser.optimize(residual_model(), rules=[sum_relu_rule(bogus=bogus)])


def test_stand_in_when_nothing_escapes_is_harmless():
    """Standing in for an interior output nobody else reads changes nothing."""
    model = residual_model(outside_consumer=False)
    assert_rewritten(model, [sum_relu_rule()], counts={"sum-relu": 1}, expected_ops=["Sum", "Relu"], feeds=feeds())
