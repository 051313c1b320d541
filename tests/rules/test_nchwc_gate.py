"""Tests for nchwc-gate (a per-channel gate on a blocked feature map becomes a NCHWc depthwise
Conv whose filter is the gate) and for nchwc-pool's spatial ReduceMean/ReduceMax.

Squeeze-and-excitation blocks as torchvision's MobileNetV3 and EfficientNet write them: a
convolution's result x, a gate Sigmoid(Conv(Relu(Conv(GlobalAveragePool(x))))) of shape
[1, C, 1, 1], and Mul(x, gate) (or Mul(gate, x)) feeding the next convolution. Each positive
test checks the structure, that fuser's own check passed, and runs the original and the result
in onnxruntime with its optimizations off (tests/rules/test_nchwc.py's helpers).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from fuser.rules._nchwc import padded
from tests.rules.test_nchwc import (
    B,
    HALF,
    Net,
    declines,
    guards,
    nchwc_nodes,
    optimize_and_compare,
    random_feeds,
    run,
    standard_nodes,
)


def se_block(channels: int = 2 * B, *, gate_first: bool = False, batch: int = 1, size: int = 6, opset: int = 17):
    """conv -> x; gate = Sigmoid(conv(Relu(conv(GlobalAveragePool(x))))); conv(x * gate) -> y."""
    net = Net(41)
    x = net.add("Relu", net.conv("x", 2 * B, channels))
    squeezed = net.add("Relu", net.conv(net.add("GlobalAveragePool", x), channels, 4, kernel=1))
    gate = net.add("Sigmoid", net.conv(squeezed, 4, channels, kernel=1))
    product = net.add("Mul", *((gate, x) if gate_first else (x, gate)), name="gate_mul")
    net.conv(product, channels, 2 * B, kernel=1, output="y")
    return net.model([("x", [batch, 2 * B, size, size])], ["y"], opset=opset)


def gate_convs(model) -> list:
    """NCHWc Convs whose filter is computed at run time (not an initializer)."""
    stored = {t.name for t in model.graph.initializer}
    return [n for n in nchwc_nodes(model, "Conv") if n.input[1] not in stored]


@pytest.mark.parametrize("channels", [2 * B, HALF], ids=["aligned", "padded"])
@pytest.mark.parametrize("gate_first", [False, True], ids=["x-gate", "gate-x"])
def test_gate_becomes_a_depthwise_convolution(channels, gate_first):
    after, report = optimize_and_compare(se_block(channels, gate_first=gate_first))
    assert report.counts["nchwc-gate"] == 1
    assert standard_nodes(after, "Mul") == []
    (conv,) = gate_convs(after)
    attrs = {a.name: a for a in conv.attribute}
    assert attrs["group"].i == padded(channels, B) and list(attrs["kernel_shape"].ints) == [1, 1]
    # The gated map goes to the next convolution without leaving the blocked layout.
    consumers = [n for n in nchwc_nodes(after, "Conv") if conv.output[0] in n.input]
    assert len(consumers) == 1
    if channels % B:
        assert len(standard_nodes(after, "Concat")) == 1  # the gate padded with zeros
    else:
        assert standard_nodes(after, "Concat") == []


def test_constant_per_channel_scale():
    """A stored per-channel scale (a layer scale) is a gate too. (Right after the convolution
    conv-mul-scale would take it into the filter.)"""
    net = Net(42)
    x = net.add("Relu", net.conv("x", 2 * B, 2 * B))
    scale = net.const("scale", net.rng.uniform(0.5, 1.5, (1, 2 * B, 1, 1)).astype(np.float32))
    net.conv(net.add("Mul", x, scale), 2 * B, 2 * B, output="y")
    after, report = optimize_and_compare(net.model([("x", [1, 2 * B, 5, 5])], ["y"]))
    assert report.counts["nchwc-gate"] == 1
    assert standard_nodes(after, "Mul") == []


def test_a_gate_with_no_convolution_plants_the_guard():
    """The gate's depthwise Conv groups the channels padded to this machine's block. A graph
    whose only block-dependent rewrite it is (pooled plain inputs, no convolution) gets the
    guard from it: on a machine with another block the model refuses to run."""
    net = Net(43)
    pooled = net.add("MaxPool", "x", kernel_shape=[2, 2])
    gate = net.add("Sigmoid", net.add("GlobalAveragePool", pooled))
    net.add("MaxPool", net.add("Mul", pooled, gate), kernel_shape=[2, 2], output="y")
    model = net.model([("x", [1, HALF, 8, 8])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts["nchwc-gate"] == 1
    assert "nchwc-conv" not in report.counts and "nchwc-concat" not in report.counts
    (guard,) = guards(after)
    assert len(gate_convs(after)) == 1
    feeds = random_feeds(model)
    run(after, feeds)
    (shape,) = [t for t in after.graph.initializer if t.name == guard.input[1]]
    shape.CopyFrom(numpy_helper.from_array(np.array([B // 2], np.int64), shape.name))
    with pytest.raises(Exception, match="(?i)reshape|shape"):
        run(after, feeds)


def test_gated_map_read_elsewhere_too():
    """The feature map is also a graph output: its plain form stays for it, the gate still runs
    blocked."""
    net = Net(43)
    x = net.conv("x", 2 * B, 2 * B, output="features")
    gate = net.add("Sigmoid", net.conv(net.add("GlobalAveragePool", x), 2 * B, 2 * B, kernel=1))
    net.conv(net.add("Mul", x, gate), 2 * B, 2 * B, output="y")
    after, report = optimize_and_compare(net.model([("x", [1, 2 * B, 5, 5])], ["features", "y"]))
    assert report.counts["nchwc-gate"] == 1
    assert len(gate_convs(after)) == 1


def test_batch_of_two_stays_plain():
    """Each image has its own gate; one filter cannot serve both."""
    after, report = optimize_and_compare(se_block(batch=2), trace=True)
    assert "nchwc-gate" not in report.counts
    assert len(standard_nodes(after, "Mul")) == 1
    assert any("a batch of 2" in r for r in declines(report, "nchwc-gate"))


@pytest.mark.parametrize(
    "gate_shape,reason",
    [([2 * B, 1, 5], "not one value per channel"), ([1, 2 * B, 5, 1], "not one value per channel")],
    ids=["per-row-3d", "per-row"],
)
def test_other_broadcasts_stay_plain(gate_shape, reason):
    net = Net(44)
    x = net.conv("x", 2 * B, 2 * B)
    scale = net.const("scale", net.rng.uniform(0.5, 1.5, gate_shape).astype(np.float32))
    net.conv(net.add("Mul", x, scale), 2 * B, 2 * B, output="y")
    after, report = optimize_and_compare(net.model([("x", [1, 2 * B, 5, 5])], ["y"]), trace=True)
    assert "nchwc-gate" not in report.counts
    assert len(standard_nodes(after, "Mul")) == 1
    assert any(reason in r for r in declines(report, "nchwc-gate"))


def test_product_larger_than_the_map_stays_plain():
    """A blocked [1, C, 1, 1] result times a plain [1, C, H, W] input: the product is not the
    blocked map's shape."""
    net = Net(45)
    pooled = net.add("GlobalAveragePool", net.conv("x", 2 * B, 2 * B))
    net.add("Mul", pooled, "x", output="y")
    after, report = optimize_and_compare(net.model([("x", [1, 2 * B, 5, 5])], ["y"]), trace=True)
    assert "nchwc-gate" not in report.counts
    assert len(standard_nodes(after, "Mul")) == 1
    assert any("larger than the feature map" in r for r in declines(report, "nchwc-gate"))


def test_one_pixel_map_is_left_to_the_element_wise_rules():
    """At 1x1 the map and the gate have one shape: nchwc-binary multiplies them blocked."""
    after, report = optimize_and_compare(se_block(size=1))
    assert "nchwc-gate" not in report.counts
    assert report.counts["nchwc-binary"] == 1


# ------------------------------------------------------------- nchwc-pool: ReduceMean over H, W


def reduce_block(op_type: str, axes, keepdims: int = 1, opset: int = 17, size=5):
    """conv -> ReduceMean/ReduceMax(axes) -> conv, the axes an attribute (opset < 18) or input."""
    net = Net(46)
    x = net.conv("x", 2 * B, 2 * B)
    if opset >= 18:
        reduced = net.add(op_type, x, net.const("axes", np.array(axes, np.int64)), keepdims=keepdims)
    else:
        reduced = net.add(op_type, x, axes=axes, keepdims=keepdims)
    spatial = keepdims and sorted(a % 4 for a in axes) == [2, 3]
    if spatial:
        net.conv(reduced, 2 * B, 2 * B, kernel=1, output="y")
    else:
        net.add("Identity", reduced, output="y")
    outputs = ["y"] if spatial else [("y", np.float32, [None] * (4 if keepdims else 4 - len(axes)))]
    return net.model([("x", [1, 2 * B, size, size])], outputs, opset=opset)


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("op_type,pool", [("ReduceMean", "GlobalAveragePool"), ("ReduceMax", "GlobalMaxPool")])
@pytest.mark.parametrize("axes", [[2, 3], [-1, -2]], ids=["2,3", "-1,-2"])
def test_spatial_reduction_becomes_global_pooling(opset, op_type, pool, axes):
    after, report = optimize_and_compare(reduce_block(op_type, axes, opset=opset))
    assert report.counts["nchwc-pool"] == 1
    assert len(nchwc_nodes(after, pool)) == 1
    assert standard_nodes(after, op_type) == []


def test_a_mean_over_many_pixels_stays_a_reduce_mean():
    # 64x64 pixels: the blocked pooling's float32 sum would round more coarsely than ReduceMean's.
    after, report = optimize_and_compare(reduce_block("ReduceMean", [2, 3], size=64), trace=True)
    assert nchwc_nodes(after, "GlobalAveragePool") == []
    assert len(standard_nodes(after, "ReduceMean")) == 1
    assert any("averages 4096 pixels, more than 3136" in r for r in declines(report, "nchwc-pool"))


def test_a_mean_over_56_by_56_pixels_is_pooled_blocked():
    after, report = optimize_and_compare(reduce_block("ReduceMean", [2, 3], size=56))
    assert report.counts["nchwc-pool"] == 1
    assert len(nchwc_nodes(after, "GlobalAveragePool")) == 1


def test_a_max_over_many_pixels_is_pooled_blocked():
    # A maximum rounds nothing: any size goes.
    after, report = optimize_and_compare(reduce_block("ReduceMax", [2, 3], size=64))
    assert report.counts["nchwc-pool"] == 1
    assert len(nchwc_nodes(after, "GlobalMaxPool")) == 1


@pytest.mark.parametrize(
    "axes,keepdims,reason",
    [([1, 2], 1, "not H and W"), ([3], 1, "not H and W"), ([2, 3], 0, "drops the spatial axes")],
    ids=["channels", "width", "no-keepdims"],
)
def test_other_reductions_stay(axes, keepdims, reason):
    after, report = optimize_and_compare(reduce_block("ReduceMean", axes, keepdims), trace=True)
    assert nchwc_nodes(after, "GlobalAveragePool") == []
    assert len(standard_nodes(after, "ReduceMean")) == 1
    assert any(reason in r for r in declines(report, "nchwc-pool"))
