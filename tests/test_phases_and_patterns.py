"""Rule phases, optional op inputs in patterns, Builder.once and rule-name patterns in --disable.

Rules are written with the public API only (plus Engine/Model where a test looks at what the
engine records); numerics are compared in onnxruntime with graph optimizations disabled.
"""

from __future__ import annotations

import fnmatch

import numpy as np
import onnx
import pytest
from fuser.rules.conv_bn_fold import conv_bn_fold
from onnx import TensorProto, helper

import fuser
from fuser import Builder, Match, const, op, rule, var
from fuser.engine import Engine
from fuser.errors import UsageError
from fuser.model import Model
from fuser.pattern import PatternError
from fuser.registry import all_rules
from tests.helpers import assert_same_outputs, fuser_cli, make_model, nodes_of, op_types

F32 = np.float32
FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def check_valid(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)


# ====================================================================== rule phases
#
# A phase-0 rule fuses Relu(Conv(x, w)) into Clip(Conv(x, w), 0) (standing for an activation
# fusion); a later-phase rule rooted at Conv gives a bias-less Conv a zero bias (standing for a
# layout change that hides the Conv from the fusion's pattern: Relu(Conv(x, w)) needs exactly
# two Conv inputs). Without phases the Conv comes first in position order, gets its bias, and
# the fusion never sees its pattern.


@rule("conv-relu-clip", pattern=op.Relu(op.Conv(var("x"), const("w"), name="conv"), name="relu"))
def conv_relu_clip(m: Match, b: Builder):
    """Relu(Conv(x, w)) => Clip(Conv(x, w), 0)."""
    return b.Clip(b.Conv(m["x"], m["w"], **m.attrs("conv")), np.array(0, F32))


def _zero_bias(m: Match, b: Builder):
    channels = m.value("w").shape[0]
    return b.Conv(m["x"], m["w"], np.zeros(channels, F32), **m.attrs("conv"))


def zero_bias_rule(phase: int, name: str = "conv-zero-bias"):
    """Conv(x, w) => Conv(x, w, 0), in `phase`."""
    return rule(
        name,
        pattern=op.Conv(var("x"), const("w"), name="conv"),
        phase=phase,
        description="Conv(x, w) => Conv(x, w, 0).",
    )(_zero_bias)


def clip_rule(phase: int):
    return rule("conv-relu-clip", pattern=conv_relu_clip.pattern, phase=phase, description=conv_relu_clip.description)(
        conv_relu_clip.build
    )


def conv_blocks_model(side_first: bool = False):
    """x -> conv1 -> relu1 -> conv2 -> relu2 -> y, and x -> conv3 -> z (no Relu).

    side_first: conv3 comes first in the node list (and in position order)."""
    rng = np.random.default_rng(0)
    inits = {
        "w1": (rng.standard_normal((4, 3, 3, 3)) / 5).astype(F32),
        "w2": (rng.standard_normal((4, 4, 1, 1)) / 2).astype(F32),
        "w3": (rng.standard_normal((2, 3, 1, 1)) / 2).astype(F32),
    }
    blocks = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2"),
        helper.make_node("Relu", ["c2"], ["y"], name="relu2"),
    ]
    side = [helper.make_node("Conv", ["x", "w3"], ["z"], name="conv3")]
    nodes = side + blocks if side_first else blocks + side
    model = make_model(
        nodes,
        [("x", F32, [1, 3, 5, 5])],
        [("y", F32, [1, 4, 5, 5]), ("z", F32, [1, 2, 5, 5])],
        inits,
        opset=13,
    )
    return model, {"x": rng.standard_normal((1, 3, 5, 5)).astype(F32)}


@pytest.mark.parametrize("phases", [(0, 1), (2, 10), (-1, 0)], ids=["0-1", "2-10", "minus1-0"])
@pytest.mark.parametrize("side_first", [False, True], ids=["side-last", "side-first"])
@pytest.mark.parametrize("fusion_first", [True, False], ids=["rules=[fuse,bias]", "rules=[bias,fuse]"])
def test_lower_phase_reaches_its_fixed_point_first(phases, side_first, fusion_first):
    early, late = phases
    fuse, bias = clip_rule(early), zero_bias_rule(late)
    model, feeds = conv_blocks_model(side_first)
    rules = [fuse, bias] if fusion_first else [bias, fuse]
    after, report = fuser.optimize(model, rules=rules, trace=True)
    # The fusion won everywhere, and the later phase still rewrote every Conv, including the
    # two the fusion created.
    assert report.counts == {"conv-relu-clip": 2, "conv-zero-bias": 3}
    assert sorted(op_types(after)) == ["Clip", "Clip", "Conv", "Conv", "Conv"]
    assert all(len(n.input) == 3 for n in nodes_of(after, "Conv"))
    kinds = [r.rule for r in report.rewrites]
    assert kinds == ["conv-relu-clip"] * 2 + ["conv-zero-bias"] * 3
    late_roots = sorted(r.matched[0] for r in report.rewrites if r.rule == "conv-zero-bias")
    created_by_fusion = sorted(n for r in report.rewrites if r.rule == "conv-relu-clip" for n in r.created)
    assert "conv3" in late_roots
    assert len(set(late_roots) - {"conv3"}) == 2 and set(late_roots) - {"conv3"} <= set(created_by_fusion)
    assert report.verdict.passed
    check_valid(after)
    assert_same_outputs(model, after, feeds, **FP32_TOL)


@pytest.mark.parametrize("fusion_first", [True, False], ids=["rules=[fuse,bias]", "rules=[bias,fuse]"])
def test_without_phases_the_conv_rule_hides_the_fusion(fusion_first):
    """The control: with both rules in phase 0 the Conv, first in position order, is rewritten
    first and Relu(Conv(x, w)) never matches. This is what phases are for."""
    fuse, bias = clip_rule(0), zero_bias_rule(0)
    model, feeds = conv_blocks_model()
    after, report = fuser.optimize(model, rules=[fuse, bias] if fusion_first else [bias, fuse])
    assert report.counts == {"conv-zero-bias": 3}
    assert op_types(after).count("Relu") == 2
    assert_same_outputs(model, after, feeds, **FP32_TOL)


def test_phases_run_per_scope_inside_if_branches():
    """Each branch is a scope of its own: its phase 0 runs before its phase 1 too."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((2, 3, 1, 1)) / 2).astype(F32)

    def branch(name):
        nodes = [
            helper.make_node("Conv", ["x", f"{name}_w"], [f"{name}_c"], name=f"{name}_conv"),
            helper.make_node("Relu", [f"{name}_c"], [f"{name}_out"], name=f"{name}_relu"),
        ]
        return helper.make_graph(
            nodes,
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [1, 2, 4, 4])],
            [onnx.numpy_helper.from_array(w * (2 if name == "else" else 1), f"{name}_w")],
        )

    node = helper.make_node("If", ["cond"], ["y"], name="if", then_branch=branch("then"), else_branch=branch("else"))
    model = make_model([node], [("x", F32, [1, 3, 4, 4]), ("cond", np.bool_, [])], [("y", F32, [1, 2, 4, 4])])
    after, report = fuser.optimize(model, rules=[zero_bias_rule(1), clip_rule(0)], runs=2)
    assert report.counts == {"conv-relu-clip": 2, "conv-zero-bias": 2}
    for scope in ("main/if.then_branch", "main/if.else_branch"):
        assert [r.rule for r in report.rewrites if r.scope == scope] == ["conv-relu-clip", "conv-zero-bias"]
    check_valid(after)
    for cond in (True, False):
        feeds = {"x": rng.standard_normal((1, 3, 4, 4)).astype(F32), "cond": np.array(cond)}
        assert_same_outputs(model, after, feeds, **FP32_TOL)


def test_check_mode_with_phases_does_not_crash():
    """find_opportunities runs every phase without applying anything: the phase-0 fusions are
    reported, and the model is left as it is."""
    model, _ = conv_blocks_model()
    before = model.SerializeToString(deterministic=True)
    result = fuser.find_opportunities(model, rules=[zero_bias_rule(1), clip_rule(0)])
    found = [(o.rule, o.nodes) for o in result.opportunities]
    assert ("conv-relu-clip", ["relu1", "conv1"]) in found
    assert ("conv-relu-clip", ["relu2", "conv2"]) in found
    assert {rule_name for rule_name, _ in found} <= {"conv-relu-clip", "conv-zero-bias"}
    assert result.rewrites == []
    assert model.SerializeToString(deterministic=True) == before


def test_check_mode_with_builtin_phased_rules_does_not_crash():
    """The built-in onnxruntime target has phase-1 (NCHWc) rules."""
    model, _ = conv_blocks_model()
    result = fuser.find_opportunities(model, target="onnxruntime")
    assert any(o.rule == "fused-conv" for o in result.opportunities)


def test_rule_phase_defaults_to_zero():
    assert conv_relu_clip.phase == 0
    assert zero_bias_rule(3).phase == 3


# ================================================================ optional op inputs


SEEN: list[dict] = []


@rule(
    "concat-of-relus",
    pattern=op.Concat(
        op.Relu(var("a"), name="r0"),
        op.Relu(var("b"), name="r1"),
        op.Relu(var("c"), name="r2", optional=True),
        name="concat",
    ),
    exact=True,
)
def concat_of_relus(m: Match, b: Builder):
    """Concat(Relu(a), Relu(b)[, Relu(c)]) => Relu(Concat(a, b[, c]))."""
    seen = {"r2": m.has("r2"), "c": m.has("c"), "r0": m.has("r0")}
    if not m.has("r2"):
        try:
            m["c"]
        except KeyError:
            seen["c-unbound"] = True
    SEEN.append(seen)
    inputs = [m["a"], m["b"]] + ([m["c"]] if m.has("r2") else [])
    return b.Relu(b.Concat(*inputs, axis=m.attr("concat", "axis")))


def concat_model(producers: list[str]):
    """Concat(axis=1) of one tensor per entry: "Relu"/"Sigmoid" of its own input, or "input"
    (a graph input read directly)."""
    nodes, parts, inputs = [], [], []
    for index, kind in enumerate(producers):
        name = f"i{index}"
        inputs.append((name, F32, [2, 3]))
        if kind == "input":
            parts.append(name)
        else:
            nodes.append(helper.make_node(kind, [name], [f"p{index}"], name=f"{kind.lower()}{index}"))
            parts.append(f"p{index}")
    nodes.append(helper.make_node("Concat", parts, ["y"], name="concat", axis=1))
    model = make_model(nodes, inputs, [("y", F32, [2, 3 * len(producers)])])
    rng = np.random.default_rng(len(producers))
    feeds = {name: rng.standard_normal(shape).astype(F32) for name, _, shape in inputs}
    return model, feeds


@pytest.mark.parametrize("count", [2, 3])
def test_optional_op_input_absent_or_present_matches(count):
    SEEN.clear()
    model, feeds = concat_model(["Relu"] * count)
    after, report = fuser.optimize(model, rules=[concat_of_relus])
    assert report.counts == {"concat-of-relus": 1}
    assert op_types(after) == ["Concat", "Relu"]
    (concat,) = nodes_of(after, "Concat")
    assert list(concat.input) == [f"i{i}" for i in range(count)]
    expected_matched = ["concat", "relu0", "relu1"] + (["relu2"] if count == 3 else [])
    assert report.rewrites[0].matched == expected_matched
    if count == 3:
        assert SEEN == [{"r2": True, "c": True, "r0": True}]
    else:
        assert SEEN == [{"r2": False, "c": False, "r0": True, "c-unbound": True}]
    check_valid(after)
    assert_same_outputs(model, after, feeds)


@pytest.mark.parametrize(
    "producers",
    [
        ["Relu"] * 4,
        ["Relu", "Relu", "Sigmoid"],
        ["Relu", "Relu", "input"],
        ["Relu", "Sigmoid"],
        ["Relu"],
        ["Sigmoid", "Relu", "Relu"],
    ],
    ids=["4-relus", "3rd-sigmoid", "3rd-graph-input", "2nd-sigmoid", "1-relu", "1st-sigmoid"],
)
def test_optional_op_input_present_must_match(producers):
    SEEN.clear()
    model, _ = concat_model(producers)
    assert fuser.find_opportunities(model, rules=[concat_of_relus]).opportunities == []
    after, report = fuser.optimize(model, rules=[concat_of_relus], trace=True)
    assert report.rewrites == [] and report.engine.declined == []
    assert SEEN == []
    assert after.SerializeToString(deterministic=True) == model.SerializeToString(deterministic=True)


def test_present_optional_op_is_interior_and_checked_like_any_other():
    """A bound optional node whose output has another reader blocks the rewrite."""
    model, _ = concat_model(["Relu"] * 3)
    model.graph.node.append(helper.make_node("Neg", ["p2"], ["n"], name="neg"))
    model.graph.output.append(helper.make_tensor_value_info("n", TensorProto.FLOAT, [2, 3]))
    check_valid(model)
    _, report = fuser.optimize(model, rules=[concat_of_relus], trace=True)
    assert report.rewrites == []
    assert [d.reason for d in report.engine.declined] == ["'p2' (output of relu2) is used outside the match"]


@rule(
    "concat-same-relu",
    pattern=op.Concat(op.Relu(var("a"), name="r0"), op.Relu(var("a"), name="r1", optional=True), name="concat"),
    exact=True,
)
def concat_same_relu(m: Match, b: Builder):
    """Concat(Relu(a)[, Relu(a)]) => Relu(Concat(a[, a]))."""
    inputs = [m["a"], m["a"]] if m.has("r1") else [m["a"]]
    return b.Relu(b.Concat(*inputs, axis=m.attr("concat", "axis")))


@pytest.mark.parametrize(
    "second, matches", [(None, True), ("x", True), ("other", False)], ids=["absent", "same-var", "other-var"]
)
def test_present_optional_op_binds_vars_consistently(second, matches):
    nodes = [helper.make_node("Relu", ["x"], ["p0"], name="relu0")]
    parts = ["p0"]
    if second is not None:
        nodes.append(helper.make_node("Relu", [second], ["p1"], name="relu1"))
        parts.append("p1")
    nodes.append(helper.make_node("Concat", parts, ["y"], name="concat", axis=0))
    model = make_model(nodes, [("x", F32, [2, 3]), ("other", F32, [2, 3])], [("y", F32, [2 * len(parts), 3])])
    after, report = fuser.optimize(model, rules=[concat_same_relu])
    assert report.counts == ({"concat-same-relu": 1} if matches else {})
    if matches:
        rng = np.random.default_rng(5)
        feeds = {n: rng.standard_normal((2, 3)).astype(F32) for n in ("x", "other")}
        assert_same_outputs(model, after, feeds)


@rule(
    "concat-nested-optional",
    pattern=op.Concat(
        op.Relu(var("a"), name="r0"), op.Relu(op.Neg(var("c"), name="neg"), name="r1", optional=True), name="concat"
    ),
    exact=True,
)
def concat_nested_optional(m: Match, b: Builder):
    """Concat(Relu(a)[, Relu(Neg(c))]) => Relu(Concat(a[, Neg(c)]))."""
    inputs = [m["a"]] + ([b.Neg(m["c"])] if m.has("r1") else [])
    return b.Relu(b.Concat(*inputs, axis=0))


@pytest.mark.parametrize("inner, matches", [("Neg", True), ("Abs", False)])
def test_present_optional_op_must_match_its_whole_subtree(inner, matches):
    nodes = [
        helper.make_node("Relu", ["x"], ["p0"], name="relu0"),
        helper.make_node(inner, ["x"], ["q"], name="inner"),
        helper.make_node("Relu", ["q"], ["p1"], name="relu1"),
        helper.make_node("Concat", ["p0", "p1"], ["y"], name="concat", axis=0),
    ]
    model = make_model(nodes, [("x", F32, [2, 3])], [("y", F32, [4, 3])])
    after, report = fuser.optimize(model, rules=[concat_nested_optional])
    assert report.counts == ({"concat-nested-optional": 1} if matches else {})
    assert_same_outputs(model, after, {"x": np.random.default_rng(2).standard_normal((2, 3)).astype(F32)})


@pytest.mark.parametrize(
    "build",
    [
        lambda: op.Concat(op.Relu(var("a"), optional=True), op.Relu(var("b"), name="r1")),
        lambda: op.Concat(op.Relu(var("a"), optional=True), var("b")),
        lambda: op.Concat(op.Relu(var("a")), var("b", optional=True), op.Sigmoid(var("c"))),
        lambda: op.Concat(var("a"), op.Relu(var("b"), optional=True), const("c")),
    ],
    ids=["op-after-op", "var-after-op", "op-after-var", "const-after-op"],
)
def test_required_input_after_an_optional_one_is_a_pattern_error(build):
    with pytest.raises(PatternError, match="a required input follows an optional one"):
        build()


def test_trailing_optional_inputs_are_accepted():
    pattern = op.Concat(
        op.Relu(var("a")), op.Relu(var("b"), name="r1", optional=True), op.Relu(var("c"), name="r2", optional=True)
    )
    assert [getattr(i, "optional", False) for i in pattern.inputs] == [False, True, True]


# ====================================================================== Builder.once


def _one_node(b: Builder) -> str:
    return b.Identity(b.constant(np.ones((), F32), "one"))


def _one_initializer(b: Builder) -> str:
    return b.constant(np.ones((), F32), "one")


def sigmoid_rule(make=_one_node, name="sigmoid-expanded", decline_at=(), wrong_at=()):
    """Sigmoid(x) => one / (one + Exp(-x)) with `one` shared by every rewrite of the graph.

    decline_at: node names declined (m.require) after the shared tensor was asked for;
    wrong_at: node names given a wrong replacement (Exp(x)), for the numerics check to catch."""

    def build(m: Match, b: Builder):
        one = b.once("one", make)
        m.require(m.root.name not in decline_at, "declined after asking for the shared tensor")
        x = m["x"] if m.root.name in wrong_at else b.Neg(m["x"])
        return b.Div(one, b.Add(one, b.Exp(x)))

    return rule(name, pattern=op.Sigmoid(var("x"), name="sig"), description="Sigmoid expanded.")(build)


def sigmoid_model():
    """x -> s1 -> s2 -> y1 and x -> s3 -> y2: three Sigmoids."""
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["t"], name="s1"),
        helper.make_node("Sigmoid", ["t"], ["y1"], name="s2"),
        helper.make_node("Sigmoid", ["x"], ["y2"], name="s3"),
    ]
    model = make_model(nodes, [("x", F32, [2, 5])], [("y1", F32, [2, 5]), ("y2", F32, [2, 5])])
    return model, {"x": np.random.default_rng(4).standard_normal((2, 5)).astype(F32) * 3}


def shared_inputs(model: onnx.ModelProto) -> set[str]:
    """The tensors the Div nodes divide (the shared one)."""
    return {n.input[0] for n in nodes_of(model, "Div")}


def new_initializers(before: onnx.ModelProto, after: onnx.ModelProto) -> list[str]:
    return sorted({t.name for t in after.graph.initializer} - {t.name for t in before.graph.initializer})


@pytest.mark.parametrize("make", [_one_node, _one_initializer], ids=["node", "initializer"])
def test_once_builds_the_shared_tensor_once(make):
    model, feeds = sigmoid_model()
    after, report = fuser.optimize(model, rules=[sigmoid_rule(make)])
    assert report.counts == {"sigmoid-expanded": 3}
    assert op_types(after).count("Identity") == (1 if make is _one_node else 0)
    assert len(new_initializers(model, after)) == 1
    (one,) = shared_inputs(after)
    assert all(one in n.input for n in nodes_of(after, "Add"))
    # Only the first rewrite created it.
    first, *later = report.rewrites
    if make is _one_node:
        identity = nodes_of(after, "Identity")[0].name
        assert identity in first.created and all(identity not in r.created for r in later)
    assert report.verdict.passed
    check_valid(after)
    assert_same_outputs(model, after, feeds, rtol=1e-6, atol=1e-6)


def test_once_after_a_rule_decline_no_dangling_name():
    """The first Sigmoid asks for the shared tensor and then declines: nothing of it is kept or
    recorded, and the next rewrite creates it."""
    model, feeds = sigmoid_model()
    declining = sigmoid_rule(decline_at=("s1",))
    after, report = fuser.optimize(model, rules=[declining], trace=True)
    assert report.counts == {"sigmoid-expanded": 2}
    assert {d.node for d in report.engine.declined} == {"s1"}
    assert op_types(after).count("Identity") == 1 and op_types(after).count("Sigmoid") == 1
    assert len(new_initializers(model, after)) == 1
    assert len(shared_inputs(after)) == 1
    check_valid(after)
    assert_same_outputs(model, after, feeds, rtol=1e-6, atol=1e-6)

    loaded = Model(model)
    Engine(loaded, [declining]).run()
    (name,) = loaded.graph.shared.values()
    assert loaded.graph.defines(name)
    assert name in shared_inputs(loaded.to_proto())


def test_once_after_every_match_declines_nothing_recorded():
    model, _ = sigmoid_model()
    loaded = Model(model)
    Engine(loaded, [sigmoid_rule(decline_at=("s1", "s2", "s3"))]).run()
    assert loaded.graph.shared == {}
    assert op_types(loaded.to_proto()) == ["Sigmoid"] * 3


def test_once_in_check_mode_records_nothing():
    model, _ = sigmoid_model()
    loaded = Model(model)
    result = Engine(loaded, [sigmoid_rule()]).run(apply=False)
    assert len(result.opportunities) == 3
    assert loaded.graph.shared == {}


@rule("identity-via-once", pattern=op.Identity(var("x"), name="id"), exact=True)
def identity_via_once(m: Match, b: Builder):
    """Identity(x) => the shared Identity(x): the same node again, which the engine declines."""
    return b.once(f"copy-of-{m['x']}", lambda builder: builder.Identity(m["x"]))


def test_once_after_an_engine_decline_nothing_recorded():
    """The engine declines a replacement identical to the match after the rule built it."""
    nodes = [
        helper.make_node("Identity", ["x"], ["t"], name="id1"),
        helper.make_node("Relu", ["t"], ["y"], name="relu"),
    ]
    model = make_model(nodes, [("x", F32, [2, 3])], [("y", F32, [2, 3])])
    loaded = Model(model)
    result = Engine(loaded, [identity_via_once], trace=True).run()
    assert result.rewrites == []
    assert [d.reason for d in result.declined] == ["the replacement is identical to the match"]
    assert loaded.graph.shared == {}


@rule("softmax-axis-last", pattern=op.Softmax(var("x"), name="sm"), exact=True)
def softmax_axis_last(m: Match, b: Builder):
    """Softmax(x, axis=a) => Softmax(x, axis=-1) under the same node name and output: it differs
    from the match in its attribute alone."""
    root = m.node("sm")
    m.require(m.attr("sm", "axis", -1) != -1, "already on the last axis")
    b.nodes.append(helper.make_node("Softmax", [m["x"]], list(root.outputs), name=root.name, axis=-1))
    return root.outputs[0]


@rule("relu-neg-rebuilt", pattern=op.Relu(op.Neg(var("x"), name="neg"), name="relu"), exact=True)
def relu_neg_rebuilt(m: Match, b: Builder):
    """Relu(Neg(x)) => the same two nodes, listed the other way round."""
    for name in ("relu", "neg"):
        b.nodes.append(onnx.NodeProto())
        b.nodes[-1].CopyFrom(m.node(name).proto)
    return m.node("relu").outputs[0]


def test_a_replacement_differing_only_in_an_attribute_is_applied():
    """Same op, inputs and outputs, another attribute value: a rewrite, not the match again."""
    nodes = [helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=1)]
    model = make_model(nodes, [("x", F32, [2, 3])], [("y", F32, [2, 3])])
    result = Engine(Model(model), [softmax_axis_last], trace=True).run()
    assert [r.rule for r in result.rewrites] == ["softmax-axis-last"]


def test_the_matched_nodes_rebuilt_in_another_order_are_declined():
    """The same nodes, listed in another order, are the match again."""
    nodes = [
        helper.make_node("Neg", ["x"], ["t"], name="neg"),
        helper.make_node("Relu", ["t"], ["y"], name="relu"),
    ]
    model = make_model(nodes, [("x", F32, [2, 3])], [("y", F32, [2, 3])])
    result = Engine(Model(model), [relu_neg_rebuilt], trace=True).run()
    assert result.rewrites == []
    assert [d.reason for d in result.declined] == ["the replacement is identical to the match"]


def test_once_after_a_dropped_rewrite_the_next_one_creates_it():
    """The rewrite that created the shared tensor fails the numerics check and is dropped; the
    re-run declines it, and the next rewrite creates the shared tensor instead."""
    model, feeds = sigmoid_model()
    after, report = fuser.optimize(model, rules=[sigmoid_rule(wrong_at=("s1",))], on_mismatch="drop")
    assert [r.matched for r in report.dropped] == [["s1"]]
    assert report.counts == {"sigmoid-expanded": 2}
    assert report.verdict.passed
    assert op_types(after).count("Identity") == 1 and op_types(after).count("Sigmoid") == 1
    assert len(shared_inputs(after)) == 1
    check_valid(after)
    assert_same_outputs(model, after, feeds, rtol=1e-6, atol=1e-6)


@rule("shared-ones", pattern=op.ConstantOfShape(const("shape"), name="cos"))
def shared_ones(m: Match, b: Builder):
    """ConstantOfShape(shape) => one Expand(1, shape) shared by every rewrite (a CSE)."""
    shape = tuple(int(d) for d in m.value("shape"))
    value = m.attr("cos", "value")
    m.require(value is not None and onnx.numpy_helper.to_array(value).tolist() == [1.0], "the value is not a float 1")
    return b.once(f"ones{shape}", lambda builder: builder.Expand(np.ones((), F32), m["shape"]))


def test_once_tensor_returned_as_the_replacement_is_shared():
    ones = onnx.numpy_helper.from_array(np.ones(1, F32), "v")
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["o1"], name="cs1", value=ones),
        helper.make_node("ConstantOfShape", ["shape"], ["o2"], name="cs2", value=ones),
        helper.make_node("Add", ["x", "o1"], ["a"], name="add"),
        helper.make_node("Mul", ["a", "o2"], ["y"], name="mul"),
    ]
    model = make_model(nodes, [("x", F32, [2, 3])], [("y", F32, [2, 3])], {"shape": np.array([2, 3], np.int64)})
    loaded = Model(model)
    Engine(loaded, [shared_ones]).run()
    assert all(loaded.graph.defines(name) for name in loaded.graph.shared.values()), loaded.graph.shared
    after, report = fuser.optimize(model, rules=[shared_ones])
    assert report.counts == {"shared-ones": 2}
    assert op_types(after).count("Expand") == 1
    assert_same_outputs(model, after, {"x": np.random.default_rng(3).standard_normal((2, 3)).astype(F32)})


def test_once_is_per_graph():
    """An If branch is a graph of its own: it builds its own shared tensor, in the branch."""

    def branch(name):
        node = helper.make_node("Sigmoid", ["x"], [f"{name}_out"], name=f"{name}_sig")
        return helper.make_graph(
            [node], name, [], [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [2, 5])]
        )

    nodes = [
        helper.make_node("Sigmoid", ["x"], ["t"], name="s1"),
        helper.make_node("Sigmoid", ["t"], ["y1"], name="s2"),
        helper.make_node("If", ["cond"], ["y2"], name="if", then_branch=branch("then"), else_branch=branch("else")),
    ]
    model = make_model(nodes, [("x", F32, [2, 5]), ("cond", np.bool_, [])], [("y1", F32, [2, 5]), ("y2", F32, [2, 5])])
    after, report = fuser.optimize(model, rules=[sigmoid_rule()], runs=2)
    assert report.counts == {"sigmoid-expanded": 4}
    assert op_types(after).count("Identity") == 1
    (if_node,) = nodes_of(after, "If")
    for attribute in if_node.attribute:
        branch_ops = [n.op_type for n in attribute.g.node]
        assert branch_ops.count("Identity") == 1 and "Sigmoid" not in branch_ops
    check_valid(after)
    rng = np.random.default_rng(6)
    for cond in (True, False):
        feeds = {"x": rng.standard_normal((2, 5)).astype(F32), "cond": np.array(cond)}
        assert_same_outputs(model, after, feeds, rtol=1e-6, atol=1e-6)


# ============================================================ --disable with patterns


NCHWC_NAMES = [r.name for r in all_rules() if fnmatch.fnmatchcase(r.name, "nchwc-*")]


def conv_relu_model():
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"], name="relu"),
    ]
    inits = {
        "w": (rng.standard_normal((16, 16, 3, 3)) / 12).astype(F32),
        "b": rng.standard_normal(16).astype(F32),
    }
    model = make_model(nodes, [("x", F32, [1, 16, 6, 6])], [("y", F32, [1, 16, 6, 6])], inits)
    return model, {"x": rng.standard_normal((1, 16, 6, 6)).astype(F32)}


def domains(model: onnx.ModelProto) -> set[str]:
    return {n.domain for n in model.graph.node}


def test_there_are_nchwc_rules_to_disable():
    assert len(NCHWC_NAMES) >= 2


def test_disable_pattern_turns_off_every_matching_rule():
    model, feeds = conv_relu_model()
    after, report = fuser.optimize(model, target="onnxruntime", disable=["nchwc-*"])
    assert not [name for name in report.rules if name.startswith("nchwc-")]
    assert "fused-conv" in report.rules and "conv-bn-fold" in report.rules
    assert op_types(after) == ["FusedConv"]
    assert "com.microsoft.nchwc" not in domains(after)
    assert report.verdict.passed
    assert_same_outputs(model, after, feeds, **FP32_TOL)


def test_without_the_pattern_the_nchwc_rules_are_chosen():
    model, _ = conv_relu_model()
    _, report = fuser.optimize(model, target="onnxruntime", check=False)
    assert set(NCHWC_NAMES) <= set(report.rules)


@pytest.mark.parametrize(
    "disable, gone",
    [
        (["fused-conv*"], {"fused-conv", "fused-conv-residual"}),
        (["fused-conv"], {"fused-conv"}),
        (["fused-[cg]*"], {"fused-conv", "fused-conv-residual", "fused-gemm"}),
        (["log-s?ftmax", "log-sum-exp"], {"log-softmax", "log-sum-exp"}),
        (["*"], None),
    ],
    ids=["star", "exact", "class", "question-mark", "everything"],
)
def test_disable_pattern_forms(disable, gone):
    model, _ = conv_relu_model()
    everything = {r.name for r in all_rules() if r.enabled_by_default}
    _, report = fuser.optimize(model, target="onnxruntime", disable=disable, check=False)
    if gone is None:
        assert report.rules == [] and report.rewrites == []
    else:
        assert set(report.rules) == everything - gone


def test_disable_pattern_may_name_rules_of_another_target():
    """nchwc-* are onnxruntime rules; disabling them for target onnx is not an error."""
    model, _ = conv_relu_model()
    after, report = fuser.optimize(model, target="onnx", disable=["nchwc-*"])
    assert op_types(after) == ["Conv", "Relu"] and report.rewrites == []


@pytest.mark.parametrize("disable", [["nope-*"], ["nchwc-*", "nope-*"], ["NCHWC-*"], ["nope"]])
def test_disable_pattern_matching_nothing_is_a_usage_error(disable):
    model, _ = conv_relu_model()
    bad = disable[-1]
    with pytest.raises(UsageError, match=f"unknown rule '{bad.replace('*', '[*]')}'"):
        fuser.optimize(model, target="onnxruntime", disable=disable)


def test_disable_pattern_against_explicit_rules():
    """With rules=[...] the pattern is matched against those rules only."""
    model, _ = conv_relu_model()
    _, report = fuser.optimize(model, rules=[conv_bn_fold], disable=["conv-*"])
    assert report.rules == []
    with pytest.raises(UsageError, match="unknown rule 'nchwc-[*]'"):
        fuser.optimize(model, rules=[conv_bn_fold], disable=["nchwc-*"])


def test_enable_accepts_a_pattern_too():
    off = rule("off-by-default-one", pattern=op.Neg(var("x")), enabled=False, description="Neg.")(lambda m, b: m["x"])
    other = rule("off-by-default-two", pattern=op.Abs(var("x")), enabled=False, description="Abs.")(lambda m, b: m["x"])
    model, _ = conv_relu_model()
    _, report = fuser.optimize(model, rules=[off, other], enable=["off-by-default-*"], check=False)
    assert report.rules == ["off-by-default-one", "off-by-default-two"]


def test_cli_disable_pattern(tmp_path):
    model, _ = conv_relu_model()
    path, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(model, path)
    result = fuser_cli("optimize", path, "--target", "onnxruntime", "--disable", "nchwc-*", "-o", out, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    optimized = onnx.load(out)
    check_valid(optimized)
    assert op_types(optimized) == ["FusedConv"]
    assert "com.microsoft.nchwc" not in domains(optimized)
    assert "nchwc" not in result.stderr


def test_cli_disable_pattern_matching_nothing(tmp_path):
    model, _ = conv_relu_model()
    path, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(model, path)
    result = fuser_cli("optimize", path, "--target", "onnxruntime", "--disable", "nope-*", "-o", out, cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown rule 'nope-*'" in lines[0], result.stderr
    assert not out.exists()
    check = fuser_cli("check", path, "--target", "onnxruntime", "--disable", "nope-*", cwd=tmp_path)
    assert check.returncode == 2 and "unknown rule 'nope-*'" in check.stderr


def conv_bn_model():
    rng = np.random.default_rng(8)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "s", "t", "mean", "var"], ["y"], name="bn"),
    ]
    inits = {
        "w": (rng.standard_normal((4, 3, 1, 1)) / 2).astype(F32),
        "s": rng.uniform(0.5, 1.5, 4).astype(F32),
        "t": rng.standard_normal(4).astype(F32),
        "mean": rng.standard_normal(4).astype(F32),
        "var": rng.uniform(0.5, 1.5, 4).astype(F32),
    }
    return make_model(nodes, [("x", F32, [1, 3, 4, 4])], [("y", F32, [1, 4, 4, 4])], inits)


def test_cli_configured_disable_pattern_applies(tmp_path):
    onnx.save(conv_bn_model(), tmp_path / "m.onnx")
    (tmp_path / "pyproject.toml").write_text('[tool.fuser]\ndisable = ["conv-*"]\n')
    result = fuser_cli("optimize", "m.onnx", "-o", "out.onnx", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert op_types(onnx.load(tmp_path / "out.onnx")) == ["Conv", "BatchNormalization"]


def test_cli_enable_wins_over_a_configured_disable_pattern(tmp_path):
    """README: 'A rule named by --enable wins over a disable in [tool.fuser]'."""
    model = conv_bn_model()
    onnx.save(model, tmp_path / "m.onnx")
    (tmp_path / "pyproject.toml").write_text('[tool.fuser]\ndisable = ["conv-*"]\n')
    result = fuser_cli("optimize", "m.onnx", "--enable", "conv-bn-fold", "-o", "out.onnx", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert op_types(onnx.load(tmp_path / "out.onnx")) == ["Conv"]


# --------------------------------------------------------------------------- rule notes


@rule("double-relu", pattern=op.Relu(op.Relu(var("x"), name="inner")), note="double-relu was here")
def _double_relu(m: Match, b: Builder):
    """Relu(Relu(x)) => Relu(x)."""
    return b.Relu(m["x"])


@rule("wrong-neg", pattern=op.Neg(var("x")), note=lambda: "wrong-neg was here")
def _wrong_neg(m: Match, b: Builder):
    """Neg(x) => Identity(x), deliberately wrong."""
    return b.Identity(m["x"])


def test_rule_notes_follow_the_rewrites_that_stay():
    """A rule's note (a string or a function) reaches the report when the rule rewrote
    something; after on_mismatch="drop" removes a rule's only rewrite, its note goes too."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Neg", ["b"], ["y"]),
    ]
    model = make_model(nodes, [("x", F32, [2, 3])], [("y", F32, [2, 3])])
    _, report = fuser.optimize(model, rules=[_double_relu, _wrong_neg], check=False)
    assert report.notes == ["double-relu was here", "wrong-neg was here"]
    _, report = fuser.optimize(model, rules=[_double_relu, _wrong_neg], on_mismatch="drop")
    assert report.counts == {"double-relu": 1}
    assert report.notes == ["double-relu was here"]
