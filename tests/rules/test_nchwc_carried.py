"""Tests for the rules that carry operators other than convolutions and pools into the NCHWc
layout: nchwc-elementwise, nchwc-binary, nchwc-channels-last-output/-input and
nchwc-tokens-output/-input, and for how region_cost looks through carried activations.

Each positive test checks which operators end up on blocked tensors, that the reorders
between them are gone, that fuser's own check passed, and then runs the original and the
result in onnxruntime (graph optimizations off) and compares every output (see
tests/rules/test_nchwc.py for the helpers). Channel counts that are not a multiple of the
block put the padding channels through the carried operators too.
"""

from __future__ import annotations

import numpy as np
import pytest

from fuser.rules._nchwc import CARRIED_UNARY, conv_activations
from tests.helpers import attrs_of, op_types
from tests.rules.test_nchwc import (
    B,
    HALF,
    Net,
    declines,
    nchwc_nodes,
    optimize_and_compare,
    plain_reorder_inputs,
    standard_nodes,
)

MS = "com.microsoft"


def blocked_tensors(model) -> set[str]:
    """Tensors in the blocked layout: written by a NCHWc operator other than ReorderOutput, or
    by a standard operator reading one."""
    blocked = set()
    for node in model.graph.node:
        writes_blocked = node.op_type != "ReorderOutput" if node.domain == "com.microsoft.nchwc" else False
        if writes_blocked or (node.domain != "com.microsoft.nchwc" and any(i in blocked for i in node.input)):
            blocked.update(node.output)
    return blocked


def runs_blocked(model, op_type: str) -> list:
    """The standard-layout operators of type `op_type` that read blocked tensors."""
    blocked = blocked_tensors(model)
    return [
        n
        for n in model.graph.node
        if n.op_type == op_type and n.domain != "com.microsoft.nchwc" and all(i in blocked for i in n.input[:1])
    ]


def reorder_counts(model) -> tuple[int, int]:
    return len(plain_reorder_inputs(model)), len(nchwc_nodes(model, "ReorderOutput"))


# --------------------------------------------------------------------------- nchwc-elementwise


UNARY = [
    ("QuickGelu", MS, {"alpha": 1.702}),
    ("Gelu", MS, {}),
    ("FastGelu", MS, {}),
    ("Gelu", "", {}),
    ("Gelu", "", {"approximate": "tanh"}),
    ("Erf", "", {}),
    ("Elu", "", {"alpha": 0.5}),
    ("Softsign", "", {}),
    ("Mish", "", {}),
]


@pytest.mark.parametrize("channels", [2 * B, HALF], ids=["aligned", "padded"])
@pytest.mark.parametrize("op_type,domain,attrs", UNARY, ids=[f"{d or 'onnx'}-{t}-{len(a)}" for t, d, a in UNARY])
def test_activation_between_convolutions_runs_blocked(op_type, domain, attrs, channels):
    """Conv -> activation no NCHWc Conv applies -> Conv: the activation reads the blocked tensor,
    and the only reorders left are the input's and the output's."""
    net = Net(21)
    hidden = net.conv("x", 2 * B, channels)
    net.nodes.append(_node(op_type, [hidden], "act_out", domain, attrs))
    net.conv("act_out", channels, 2 * B, output="y")
    model = _model(net, [("x", [1, 2 * B, 9, 9])], ["y"], opset=20)
    after, report = optimize_and_compare(model)
    assert report.counts.get("nchwc-elementwise") == 1
    assert [n.domain for n in runs_blocked(after, op_type)] == [domain]
    assert reorder_counts(after) == (1, 1)


CHAIN = [("Abs", {}), ("Neg", {}), ("Selu", {}), ("Celu", {"alpha": 2.0}), ("Relu", {}), ("LeakyRelu", {"alpha": 0.1})]
CHAIN += [("Tanh", {}), ("Clip", {}), ("HardSwish", {})]


@pytest.mark.parametrize("op_type,attrs", CHAIN, ids=[t for t, _ in CHAIN])
def test_chain_of_activations_runs_blocked(op_type, attrs):
    """A convolution that already applies an activation, then two more element-wise operators."""
    net = Net(22)
    first = net.add("Relu", net.conv("x", 2 * B, HALF))
    bounds = [net.const("low", np.float32(-0.5)), net.const("high", np.float32(0.5))] if op_type == "Clip" else []
    second = net.add(op_type, first, *bounds, **attrs)
    net.add("Sigmoid", second, output="y")
    model = net.model([("x", [1, 2 * B, 6, 6])], ["y"], opset=17)
    after, report = optimize_and_compare(model)
    assert report.counts.get("nchwc-elementwise") == 2
    assert len(runs_blocked(after, op_type)) == 1 and len(runs_blocked(after, "Sigmoid")) == 1
    (to_plain,) = nchwc_nodes(after, "ReorderOutput")
    assert list(to_plain.output) == ["y"] and attrs_of(to_plain)["channels"] == HALF


def test_every_carried_operator_is_run_blocked_here():
    """What nchwc-elementwise may carry is what the tests above and below run blocked
    (HardSigmoid in test_hard_swish_written_out_runs_blocked)."""
    tested = {(d, t) for t, d, _ in UNARY} | {("", t) for t, _ in CHAIN} | {("", "Sigmoid"), ("", "HardSigmoid")}
    assert {(d, t) for d, names in CARRIED_UNARY.items() for t in names} == tested


@pytest.mark.skipif("HardSwish" not in conv_activations(), reason="this onnxruntime's NCHWc Conv has no HardSwish")
def test_hard_swish_goes_into_the_convolution_where_onnxruntime_applies_it():
    """MobileNetV3's activation: onnxruntime's CPU runs a lone HardSwish as a HardSigmoid and a
    Mul, so where its NCHWc Conv can apply it, the convolution does."""
    net = Net(33)
    net.add("HardSwish", net.conv("x", 2 * B, HALF), output="h")
    net.conv("h", HALF, 2 * B, output="y")
    model = net.model([("x", [1, 2 * B, 7, 7])], ["y"], opset=14)
    after, report = optimize_and_compare(model)
    assert report.counts.get("nchwc-activation") == 1 and "nchwc-elementwise" not in report.counts
    assert "HardSwish" not in op_types(after)
    assert [attrs_of(c).get("activation") for c in nchwc_nodes(after, "Conv")] == ["HardSwish", None]


def test_shared_reorder_stays_for_its_plain_reader():
    """Conv -> {QuickGelu -> Conv, Exp}: QuickGelu moves into the layout; Exp, which could make
    the padding infinite, stays on the plain tensor, whose ReorderOutput stays for it."""
    net = Net(24)
    hidden = net.conv("x", 2 * B, 2 * B)
    net.nodes.append(_node("QuickGelu", [hidden], "gelu", MS, {}))
    net.conv("gelu", 2 * B, 2 * B, output="y")
    net.add("Exp", hidden, output="e")
    model = _model(net, [("x", [1, 2 * B, 6, 6])], ["y", "e"], opset=17)
    after, report = optimize_and_compare(model, trace=True)
    assert report.counts.get("nchwc-elementwise") == 1
    assert len(runs_blocked(after, "QuickGelu")) == 1 and runs_blocked(after, "Exp") == []
    assert reorder_counts(after) == (1, 2)


def test_fast_gelu_with_a_bias_stays_plain():
    """FastGelu's bias runs along the last axis, which the blocked layout reorders."""
    net = Net(25)
    hidden = net.conv("x", 2 * B, 2 * B)
    net.const("bias", net.rng.normal(size=6).astype(np.float32))
    net.nodes.append(_node("FastGelu", [hidden, "bias"], "gelu", MS, {}))
    net.conv("gelu", 2 * B, 2 * B, output="y")
    model = _model(net, [("x", [1, 2 * B, 6, 6])], ["y"], opset=17)
    after, report = optimize_and_compare(model, trace=True)
    assert "nchwc-elementwise" not in report.counts
    assert runs_blocked(after, "FastGelu") == []
    assert any("inputs besides the tensor" in r for r in declines(report, "nchwc-elementwise"))


# ------------------------------------------------------------------------------ nchwc-binary


@pytest.mark.parametrize("op_type", ["Mul", "Sub", "Max", "Min", "Sum"])
def test_two_blocked_tensors_of_one_shape_combine_blocked(op_type):
    """binary(a, Tanh(a)) of a convolution's result, then a convolution: one reorder in, one
    out; the operator reads both blocked tensors."""
    net = Net(26)
    hidden = net.conv("x", 2 * B, HALF)
    net.add(op_type, hidden, net.add("Tanh", hidden), output="gated")
    net.conv("gated", HALF, 2 * B, output="y")
    model = net.model([("x", [1, 2 * B, 7, 7])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts.get("nchwc-binary") == 1
    (combined,) = runs_blocked(after, op_type)
    assert set(combined.input) <= blocked_tensors(after)
    assert reorder_counts(after) == (1, 1)


def test_hard_swish_written_out_runs_blocked():
    """x * HardSigmoid(x) with HardSigmoid's default slope (not HardSwish's): both carried."""
    net = Net(27)
    hidden = net.conv("x", 2 * B, 2 * B)
    net.add("Mul", hidden, net.add("HardSigmoid", hidden), output="y")
    model = net.model([("x", [1, 2 * B, 5, 5])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts.get("nchwc-binary") == 1 and report.counts.get("nchwc-elementwise") == 1
    assert reorder_counts(after) == (1, 1)


def _paddle_hard_swish(net: Net, x: str) -> str:
    """(x * Clip(x + 3, 0, 6)) / 6, as PaddlePaddle exports hardswish at opsets 11 to 13."""
    three, low, high, six = (
        net.const(n, np.array(v, np.float32)) for n, v in (("three", 3), ("lo", 0), ("hi", 6), ("six", 6))
    )
    clipped = net.add("Clip", net.add("Add", x, three), low, high)
    return net.add("Div", net.add("Mul", x, clipped), six)


@pytest.mark.skipif("HardSwish" not in conv_activations(), reason="this onnxruntime's NCHWc Conv has no HardSwish")
def test_hard_swish_before_opset_14_goes_into_the_convolution():
    """PP-LCNet and PicoDet at opset 13: hardswish-clip-regroup writes x * HardSigmoid(x), which
    nchwc-activation applies as the convolution's HardSwish, with no reorder in between."""
    net = Net(37)
    hidden = _paddle_hard_swish(net, net.conv("x", 2 * B, 2 * B))
    net.conv(hidden, 2 * B, 2 * B, output="y")
    model = net.model([("x", [1, 2 * B, 6, 6])], ["y"], opset=13)
    after, report = optimize_and_compare(model)
    assert report.counts.get("hardswish-clip-regroup") == 1 and report.counts.get("nchwc-activation") == 1
    assert "nchwc-elementwise" not in report.counts and "nchwc-binary" not in report.counts
    assert [attrs_of(c).get("activation") for c in nchwc_nodes(after, "Conv")] == ["HardSwish", None]
    assert {"HardSigmoid", "Mul"}.isdisjoint(op_types(after))
    assert reorder_counts(after) == (1, 1)


def test_hard_swish_of_a_result_read_elsewhere_runs_blocked():
    """The convolution's result is also a graph output: it cannot apply HardSwish itself, so the
    HardSigmoid and the Mul are carried into the layout instead."""
    net = Net(38)
    hidden = net.conv("x", 2 * B, 2 * B, output="features")
    net.conv(_paddle_hard_swish(net, hidden), 2 * B, 2 * B, output="y")
    model = net.model([("x", [1, 2 * B, 6, 6])], ["features", "y"], opset=13)
    after, report = optimize_and_compare(model)
    assert "nchwc-activation" not in report.counts
    assert report.counts.get("nchwc-elementwise") == 1 and report.counts.get("nchwc-binary") == 1
    assert [attrs_of(c).get("activation") for c in nchwc_nodes(after, "Conv")] == [None, None]


def test_hard_swish_of_a_convolution_a_concat_also_reads_runs_blocked():
    """The blocked result also feeds a Concat in the layout: the convolution cannot apply
    HardSwish for one of its readers only, so the HardSigmoid and the Mul run blocked."""
    net = Net(39)
    features = net.conv("x", 2 * B, 2 * B)
    joined = net.add("Concat", features, net.conv("x", 2 * B, 2 * B), axis=1)
    net.conv(joined, 4 * B, B, output="y")
    net.conv(_paddle_hard_swish(net, features), 2 * B, B, output="z")
    model = net.model([("x", [1, 2 * B, 6, 6])], ["y", "z"], opset=13)
    after, report = optimize_and_compare(model)
    assert report.counts.get("nchwc-concat") == 1
    assert len(runs_blocked(after, "HardSigmoid")) + report.counts.get("nchwc-activation", 0) == 1


def test_broadcast_scale_is_not_an_element_wise_binary():
    """A squeeze-and-excitation gate: [1, C, H, W] times [1, C, 1, 1]. Read against the blocked
    tensor, the small one would meet the wrong channels, so nchwc-binary leaves it (nchwc-gate
    makes it a depthwise convolution, tests/rules/test_nchwc_gate.py)."""
    net = Net(28)
    features = net.conv("x", 2 * B, 2 * B)
    gate = net.add("Sigmoid", net.conv(net.add("GlobalAveragePool", features), 2 * B, 2 * B, kernel=1))
    net.add("Mul", features, gate, output="y")
    model = net.model([("x", [1, 2 * B, 6, 6])], ["y"])
    after, report = optimize_and_compare(model, trace=True)
    assert "nchwc-binary" not in report.counts and report.counts["nchwc-gate"] == 1
    assert runs_blocked(after, "Mul") == []
    assert any("one known shape" in r for r in declines(report, "nchwc-binary"))


def test_binary_of_different_channel_counts_stays_plain():
    """One channel broadcast against 2B: the blocked tensors differ in shape, so the Sub stays
    plain."""
    net = Net(29)
    a = net.conv("x", 2 * B, 1)
    b = net.conv("x", 2 * B, 2 * B)
    net.add("Sub", b, a, output="y")
    model = net.model([("x", [1, 2 * B, 5, 5])], ["y"])
    after, report = optimize_and_compare(model, trace=True)
    assert "nchwc-binary" not in report.counts
    assert any("different channel counts" in r for r in declines(report, "nchwc-binary"))


# ------------------------------------------------------------------------- channels last


def convnext_block(perm_out=(0, 2, 3, 1), perm_in=(0, 3, 1, 2)) -> tuple:
    """Depthwise Conv -> Transpose to NHWC -> LayerNormalization -> Transpose back -> Conv."""
    net = Net(30)
    dw = net.conv("x", 2 * B, 2 * B, kernel=7, group=2 * B)
    nhwc = net.add("Transpose", dw, perm=list(perm_out))
    last = 2 * B if list(perm_out) == [0, 2, 3, 1] else 8
    net.const("gamma", net.rng.uniform(0.5, 1.5, last).astype(np.float32))
    net.const("beta", net.rng.normal(0, 0.5, last).astype(np.float32))
    normed = net.add("LayerNormalization", nhwc, "gamma", "beta", axis=-1)
    back = net.add("Transpose", normed, perm=list(perm_in))
    net.conv(back, 2 * B, 2 * B, kernel=1, output="y")
    return net.model([("x", [1, 2 * B, 8, 8])], ["y"])


def test_transposes_around_a_blocked_tensor_become_channels_last_reorders():
    after, report = optimize_and_compare(convnext_block())
    assert report.counts.get("nchwc-channels-last-output") == 1
    assert report.counts.get("nchwc-channels-last-input") == 1
    assert standard_nodes(after, "Transpose") == []
    last = [n for n in nchwc_nodes(after) if attrs_of(n).get("channels_last") == 1]
    assert sorted(n.op_type for n in last) == ["ReorderInput", "ReorderOutput"]


def test_other_transposes_stay():
    """[0, 1, 3, 2] swaps height and width: not what a channels-last reorder does."""
    model = convnext_block(perm_out=(0, 1, 3, 2), perm_in=(0, 1, 3, 2))
    after, report = optimize_and_compare(model, trace=True)
    assert "nchwc-channels-last-output" not in report.counts and "nchwc-channels-last-input" not in report.counts
    assert len(standard_nodes(after, "Transpose")) == 2
    assert any("not NCHW to NHWC" in r for r in declines(report, "nchwc-channels-last-output"))
    assert any("not NHWC to NCHW" in r for r in declines(report, "nchwc-channels-last-input"))


# ------------------------------------------------------------------------------ tokens


def token_block(channels: int = 2 * B, batch: int = 1, perm=(0, 2, 1), flatten=None) -> tuple:
    """Conv -> x.flatten(2).transpose(1, 2) -> LayerNormalization over channels ->
    .transpose(1, 2).reshape(N, C, H, W) -> Conv: SegFormer's way between its convolutions."""
    net = Net(32)
    conv = net.conv("x", 2 * B, channels)
    shape = net.const("flat", np.array(flatten or [batch, channels, -1], np.int64))
    tokens = net.add("Transpose", net.add("Reshape", conv, shape), perm=list(perm))
    features = flatten[1] if flatten else channels
    net.const("gamma", net.rng.uniform(0.5, 1.5, features).astype(np.float32))
    normed = net.add("LayerNormalization", tokens, "gamma", axis=-1)
    back = net.add("Transpose", normed, perm=list(perm))
    image = net.add("Reshape", back, net.const("image", np.array([batch, channels, 6, 6], np.int64)))
    net.conv(image, channels, 2 * B, output="y")
    return net.model([("x", [batch, 2 * B, 6, 6])], ["y"])


@pytest.mark.parametrize("channels,batch", [(2 * B, 1), (HALF, 2)], ids=["aligned", "padded-batch-2"])
def test_tokens_between_convolutions_use_channels_last_reorders(channels, batch):
    after, report = optimize_and_compare(token_block(channels, batch))
    assert report.counts.get("nchwc-tokens-output") == 1 and report.counts.get("nchwc-tokens-input") == 1
    assert standard_nodes(after, "Transpose") == []
    last = [n for n in nchwc_nodes(after) if attrs_of(n).get("channels_last") == 1]
    assert sorted(n.op_type for n in last) == ["ReorderInput", "ReorderOutput"]


def test_a_flatten_that_mixes_channels_into_tokens_stays():
    """[N, C, H, W] -> [N, 3C, H*W/3]: not one token per pixel, either way."""
    model = token_block(flatten=[1, 2 * B * 3, -1])
    after, report = optimize_and_compare(model, trace=True)
    assert "nchwc-tokens-output" not in report.counts and "nchwc-tokens-input" not in report.counts
    assert len(standard_nodes(after, "Transpose")) == 2
    assert any("does not keep batch and channels" in r for r in declines(report, "nchwc-tokens-output"))
    assert any("does not keep batch and channels" in r for r in declines(report, "nchwc-tokens-input"))


# --------------------------------------------------------------------------- region cost


def test_small_conv_behind_an_activation_stays_nchw():
    """A 1x1 convolution of 2 channels whose only neighbours are an activation and plain
    operators beyond it: the activation runs in whatever layout it gets, so the convolution is
    as lone as without it, and its reorders would not pay."""
    net = Net(31)
    small = net.conv(net.add("Neg", "x"), 2, 4, kernel=1)
    net.add("Neg", net.add("Sigmoid", small), output="y")
    net.add("Neg", small, output="z")  # a second reader: the Sigmoid stays a node of its own
    model = net.model([("x", [1, 2, 8, 8])], ["y", "z"])
    after, report = optimize_and_compare(model, trace=True)
    assert nchwc_nodes(after) == []
    assert any("against 2 tensor(s)" in r for r in declines(report, "nchwc-conv"))


# ------------------------------------------------------------------------------- builders


def _node(op_type: str, inputs: list[str], output: str, domain: str, attrs: dict):
    from onnx import helper

    return helper.make_node(op_type, inputs, [output], name=f"{op_type}_{output}", domain=domain, **attrs)


def _model(net: Net, inputs, outputs, opset: int):
    from tests.helpers import make_model

    ins = [(name, np.float32, shape) for name, shape in inputs]
    outs = [(name, np.float32, [None] * 4) for name in outputs]
    return make_model(net.nodes, ins, outs, net.inits, opset=opset, extra_opsets={MS: 1}, check=False)
