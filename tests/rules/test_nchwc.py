"""Tests for the onnxruntime-target NCHWc layout rules (rules/_nchwc.py, rules/nchwc_*.py):
nchwc-conv, nchwc-fused-conv, nchwc-reorder-cancel, nchwc-activation, nchwc-pool,
nchwc-pool-input, nchwc-concat, nchwc-upsample and nchwc-batchnorm.

Every positive test builds a small model with seeded random weights, optimizes it with all
built-in rules for `target="onnxruntime"`, checks the structure of the result (which ops in
which domain, report.counts), that fuser's own numerics check passed and that the graph
interface is unchanged, and then runs the original and the optimized model once more in
onnxruntime (CPU, graph optimizations off, see tests/helpers.py) on seeded random inputs and
compares every output within TOL. Negative tests check, with trace=True, that the rule
declined for the stated reason (or that its pattern never matched) and that no NCHWc op was
emitted.

The block size B is this machine's (`fuser.context.machine_nchwc_block()`, what
`--nchwc-block auto` resolves to: 16 with AVX-512, 8 with AVX2); channel counts are written
in terms of B, so that "not a multiple of the block" holds on every machine. Without NCHWc
kernels (B == 0) the whole file is skipped; tests/rules/test_nchwc_blocks.py covers both
block sizes on any machine.

Runtime facts this file relies on (onnxruntime 1.32, CPUExecutionProvider):
* com.microsoft.nchwc ops (ReorderInput, ReorderOutput, Conv, MaxPool, AveragePool,
  GlobalAveragePool, ...) run with graph optimizations disabled.
* onnxruntime has no float64 Conv kernel: float64 models are not run.
* Its own NchwcTransformer (ORT_ENABLE_ALL) leaves AveragePool with ceil_mode=1 and
  count_include_pad=1 in the standard layout: the NCHWc kernel divides the windows that
  ceil_mode adds past the padded input by the full kernel size, the standard kernel by the part
  of the window inside the padded input; the pooling rules decline that case too (see
  test_average_pool_ceil_mode_count_include_pad).
"""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import fuser
from fuser.context import machine_nchwc_block
from fuser.rules._nchwc import padded
from tests.helpers import (
    LIGHT_MODELS,
    assert_same_outputs,
    attrs_of,
    light_model,
    make_model,
    nodes_of,
    op_types,
    opsets_of,
    randomize_constants,
    run,
)

B = machine_nchwc_block()
if B == 0:
    pytest.skip("onnxruntime on this machine has no NCHWc kernels", allow_module_level=True)

NCHWC = "com.microsoft.nchwc"
TOL = {"rtol": 1e-4, "atol": 1e-4}
LIGHT_TOL = {"rtol": 1e-3, "atol": 1e-4}
HALF = B + B // 2  # a channel count that is not a multiple of the block (24 for B = 16)


# --------------------------------------------------------------------------- builders


class Net:
    """A model under construction: named nodes, seeded random weights as initializers."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, np.ndarray] = {}
        self.count = 0

    def name(self, kind: str) -> str:
        self.count += 1
        return f"{kind.lower()}{self.count}"

    def const(self, name: str, value) -> str:
        self.inits[name] = np.asarray(value)
        return name

    def add(self, op_type: str, *inputs: str, output: str | None = None, outputs=None, name=None, **attrs) -> str:
        name = name or self.name(op_type)
        outs = outputs or [output or f"{name}_out"]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, **attrs))
        return outs[0]

    def conv(
        self,
        x: str,
        c_in: int,
        c_out: int,
        *,
        kernel: int = 3,
        group: int = 1,
        bias: bool = True,
        dims: int = 2,
        dtype=np.float32,
        output: str | None = None,
        name: str | None = None,
        **attrs,
    ) -> str:
        """Conv with a [c_out, c_in/group, k, ...] filter and (by default) 'same' padding."""
        name = name or self.name("conv")
        fan_in = c_in // group * kernel**dims
        w = self.rng.standard_normal((c_out, c_in // group) + (kernel,) * dims) / np.sqrt(fan_in)
        inputs = [x, self.const(f"{name}_w", w.astype(dtype))]
        if bias:
            inputs.append(self.const(f"{name}_b", self.rng.normal(0, 0.5, c_out).astype(dtype)))
        if "pads" not in attrs and "auto_pad" not in attrs:
            attrs["pads"] = [kernel // 2] * (2 * dims)
        return self.add("Conv", *inputs, output=output, name=name, group=group, **attrs)

    def batchnorm(self, x: str, channels: int, output: str | None = None, **attrs) -> str:
        name = self.name("bn")
        params = [
            self.const(f"{name}_scale", self.rng.uniform(0.5, 1.5, channels).astype(np.float32)),
            self.const(f"{name}_shift", self.rng.normal(0, 0.5, channels).astype(np.float32)),
            self.const(f"{name}_mean", self.rng.normal(0, 0.5, channels).astype(np.float32)),
            self.const(f"{name}_var", self.rng.uniform(0.5, 1.5, channels).astype(np.float32)),
        ]
        return self.add("BatchNormalization", x, *params, output=output, name=name, **attrs)

    def model(self, inputs, outputs, opset: int = 17, check: bool = True) -> onnx.ModelProto:
        """inputs: (name, shape) of float32 graph inputs or (name, dtype, shape); outputs: names
        (float32, rank 4, shape left to inference) or (name, dtype, shape) tuples."""
        ins = [i if len(i) == 3 else (i[0], np.float32, i[1]) for i in inputs]
        outs = [o if isinstance(o, tuple) else (o, np.float32, [None] * 4) for o in outputs]
        return make_model(self.nodes, ins, outs, self.inits, opset=opset, check=check)


def random_feeds(model: onnx.ModelProto, seed: int = 1) -> dict:
    """Standard-normal inputs of each graph input's declared shape and dtype."""
    rng = np.random.default_rng(seed)
    initialized = {t.name for t in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in initialized:
            continue
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


# ------------------------------------------------------------------ looking into results


def nchwc_nodes(model: onnx.ModelProto, op_type: str | None = None) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == NCHWC and op_type in (None, n.op_type)]


def standard_nodes(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain in ("", "ai.onnx") and n.op_type == op_type]


def producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output}


def guards(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The block-size guards: Reshape nodes that read a ReorderInput of a constant."""
    constants = {t.name for t in model.graph.initializer}
    made_by = producers(model)
    found = []
    for node in nodes_of(model, "Reshape"):
        source = made_by.get(node.input[0])
        is_reorder = source is not None and source.domain == NCHWC and source.op_type == "ReorderInput"
        if is_reorder and source.input[0] in constants:
            found.append(node)
    return found


def plain_reorder_inputs(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """ReorderInput nodes other than the guard's (which reads a constant)."""
    constants = {t.name for t in model.graph.initializer}
    return [n for n in nchwc_nodes(model, "ReorderInput") if n.input[0] not in constants]


def initializer_array(model: onnx.ModelProto, name: str) -> np.ndarray:
    (tensor,) = [t for t in model.graph.initializer if t.name == name]
    return numpy_helper.to_array(tensor)


def declines(report, rule: str) -> list[str]:
    return [d.reason for d in report.engine.declined if d.rule == rule]


# ----------------------------------------------------------------------- optimizing


def assert_checked(report) -> None:
    """fuser's numerics check ran and passed; it runs only when something was rewritten."""
    if report.rewrites:
        assert report.verdict is not None and report.verdict.passed
    else:
        assert report.verdict is None


def optimize_and_compare(model: onnx.ModelProto, feeds: dict | None = None, *, tol=TOL, **kwargs):
    """All built-in rules for onnxruntime; fuser's check passed; interface unchanged; the
    result passes the ONNX checker and agrees with the original in onnxruntime within `tol`."""
    after, report = fuser.optimize(model, target="onnxruntime", **kwargs)
    assert_checked(report)
    assert [i.name for i in after.graph.input] == [i.name for i in model.graph.input]
    assert [o.name for o in after.graph.output] == [o.name for o in model.graph.output]
    onnx.checker.check_model(after)
    assert_same_outputs(model, after, feeds if feeds is not None else random_feeds(model), **tol)
    return after, report


def assert_no_nchwc(model: onnx.ModelProto) -> None:
    assert nchwc_nodes(model) == []
    assert NCHWC not in opsets_of(model)


def the_nchwc_conv(model: onnx.ModelProto) -> onnx.NodeProto:
    (conv,) = nchwc_nodes(model, "Conv")
    return conv


# ------------------------------------------------------------------- single convolutions


def test_image_conv_relu_becomes_one_nchwc_conv_with_relu():
    """Conv 3 -> 2B channels (an image: fewer input channels than the block, read straight from
    NCHW, no ReorderInput on x) + Relu: one NCHWc Conv applying Relu, its output reordered back
    under the original output name; the model imports com.microsoft.nchwc version 1."""
    net = Net()
    net.add("Relu", net.conv("x", 3, 2 * B, name="conv"), output="y", name="relu")
    model = net.model([("x", [1, 3, 12, 12])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts == {"fused-conv": 1, "nchwc-fused-conv": 1}
    conv = the_nchwc_conv(after)
    assert conv.input[0] == "x"
    assert plain_reorder_inputs(after) == []
    assert attrs_of(conv)["activation"] == "Relu"
    assert standard_nodes(after, "Conv") == [] and nodes_of(after, "FusedConv") == [] and "Relu" not in op_types(after)
    (to_plain,) = nchwc_nodes(after, "ReorderOutput")
    assert list(to_plain.input) == [conv.output[0]] and list(to_plain.output) == ["y"]
    assert attrs_of(to_plain)["channels"] == 2 * B
    assert opsets_of(after)[NCHWC] == 1
    assert [o.name for o in after.graph.output] == ["y"]
    # The filter is padded to the block in its output channels only (NCHW input path).
    assert initializer_array(after, conv.input[1]).shape == (2 * B, 3, 3, 3)


def test_conv_chain_reorders_cancel():
    """Conv(2B -> 2B) + Relu -> Conv(2B -> 2B): the ReorderOutput/ReorderInput pair between the
    two convolutions cancels, the second reads the first's blocked output directly, and one
    ReorderOutput remains, at the end."""
    net = Net(1)
    hidden = net.add("Relu", net.conv("x", 2 * B, 2 * B))
    net.conv(hidden, 2 * B, 2 * B, output="y")
    model = net.model([("x", [1, 2 * B, 9, 9])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts == {"fused-conv": 1, "nchwc-fused-conv": 1, "nchwc-conv": 1, "nchwc-reorder-cancel": 1}
    first, second = nchwc_nodes(after, "Conv")
    assert second.input[0] == first.output[0]
    assert len(nchwc_nodes(after, "ReorderOutput")) == 1
    assert [n.input[0] for n in plain_reorder_inputs(after)] == ["x"]
    assert attrs_of(first)["activation"] == "Relu" and "activation" not in attrs_of(second)


@pytest.mark.parametrize(
    "c_in,c_out,kernel",
    [(HALF, 2 * B, 5), (5 * B // 2, 3 * B, 3)],
    ids=["24-to-32-5x5", "40-to-48-3x3"],
)
def test_input_channels_not_a_multiple_of_the_block(c_in, c_out, kernel):
    """More input channels than the block but not a multiple of it: the input is reordered
    (padded with zero channels) and the filter's input channels are padded with zeros."""
    net = Net(2)
    net.conv("x", c_in, c_out, kernel=kernel, output="y")
    model = net.model([("x", [2, c_in, 11, 11])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts == {"nchwc-conv": 1}
    conv = the_nchwc_conv(after)
    assert initializer_array(after, conv.input[1]).shape == (padded(c_out, B), padded(c_in, B), kernel, kernel)
    assert [n.input[0] for n in plain_reorder_inputs(after)] == ["x"]
    assert standard_nodes(after, "Conv") == []


def test_output_channels_not_a_multiple_of_the_block():
    """2B -> 20 channels (B=16): the filter and bias are padded to the block; ReorderOutput
    drops the padding (channels=20)."""
    c_out = B + B // 4
    net = Net(3)
    net.conv("x", 2 * B, c_out, output="y")
    model = net.model([("x", [1, 2 * B, 8, 8])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts == {"nchwc-conv": 1}
    conv = the_nchwc_conv(after)
    assert initializer_array(after, conv.input[1]).shape == (padded(c_out, B), 2 * B, 3, 3)
    (to_plain,) = nchwc_nodes(after, "ReorderOutput")
    assert attrs_of(to_plain)["channels"] == c_out
    assert run(after, random_feeds(model))[0].shape == (1, c_out, 8, 8)


def test_padded_output_feeds_next_conv_directly():
    """Conv(2B -> HALF) + Sigmoid -> Conv(HALF -> 2B): the reorders cancel, so the second conv
    reads the first's padding channels, which hold Sigmoid(0) = 0.5, not zero; its zero-padded
    filter must make them irrelevant. HALF, not B + B // 4: a blocked input needs a multiple of
    4 channels, which B + B // 4 is only for B = 16."""
    c_mid = HALF
    net = Net(4)
    hidden = net.add("Sigmoid", net.conv("x", 2 * B, c_mid))
    net.conv(hidden, c_mid, 2 * B, output="y")
    model = net.model([("x", [1, 2 * B, 8, 8])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts.get("nchwc-reorder-cancel") == 1
    first, second = nchwc_nodes(after, "Conv")
    assert second.input[0] == first.output[0]
    assert attrs_of(first)["activation"] == "Sigmoid"


@pytest.mark.parametrize(
    "channels,c_out,group,attrs",
    [
        (2 * B, 2 * B, 2 * B, {}),
        (HALF, HALF, HALF, {}),
        (4 * B, 4 * B, 2, {}),
        (4 * B, 4 * B, 2, {"strides": [2, 2]}),
    ],
    ids=["depthwise", "depthwise-padded", "grouped-2", "grouped-2-strided"],
)
def test_depthwise_and_grouped_conv(channels, c_out, group, attrs):
    """Depthwise (group == channels) and grouped convolutions whose channels per group are
    multiples of the block: converted; a depthwise one of any channel count (a multiple of 4)
    is padded to the block, with one zero filter and one group per padding channel."""
    net = Net(5)
    net.conv("x", channels, c_out, group=group, output="y", **attrs)
    model = net.model([("x", [1, channels, 10, 10])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts == {"nchwc-conv": 1}
    conv = the_nchwc_conv(after)
    assert attrs_of(conv)["group"] == (padded(group, B) if group == channels else group)
    assert standard_nodes(after, "Conv") == []


@pytest.mark.parametrize(
    "attrs",
    [
        {"strides": [2, 1], "pads": [1, 0, 2, 1], "dilations": [1, 2]},
        {"auto_pad": "SAME_UPPER", "strides": [2, 2]},
        {"auto_pad": "VALID"},
        {"pads": [0, 0, 0, 0], "kernel_shape": [3, 3]},
    ],
    ids=["strided-dilated-asymmetric", "same-upper", "valid", "kernel-shape"],
)
@pytest.mark.parametrize("c_in", [3, 2 * B], ids=["nchw-input", "blocked-input"])
def test_conv_attributes_preserved(attrs, c_in):
    """Strides, dilations, asymmetric pads, auto_pad and kernel_shape carry over to the NCHWc
    Conv, on both the NCHW and the blocked input path."""
    net = Net(6)
    net.conv("x", c_in, 2 * B, output="y", **attrs)
    model = net.model([("x", [1, c_in, 11, 13])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts == {"nchwc-conv": 1}
    before = attrs_of(nodes_of(model, "Conv")[0])
    assert attrs_of(the_nchwc_conv(after)) == before


def test_convs_without_bias():
    """Two convs without bias: the guarded one gets a bias (zeros + the guard), the other none."""
    net = Net(7)
    hidden = net.conv("x", 2 * B, 2 * B, bias=False)
    net.conv(hidden, 2 * B, B, bias=False, output="y")
    model = net.model([("x", [1, 2 * B, 6, 6])], ["y"])
    after, _ = optimize_and_compare(model)
    made_by = producers(after)
    biases = sorted(
        made_by[c.input[2]].op_type if len(c.input) > 2 and c.input[2] else "" for c in nchwc_nodes(after, "Conv")
    )
    assert biases == ["", "Add"]


# --------------------------------------------------------------------------- residuals


def test_residual_block_becomes_nchwc_conv_with_sum_input():
    """r = Relu(Conv0(x)); y = Relu(Conv1(r) + r): FusedConv with Z becomes a NCHWc Conv with a
    4th (Sum) input and activation Relu; the Sum input is the first conv's blocked output."""
    net = Net(8)
    r = net.add("Relu", net.conv("x", 2 * B, 2 * B))
    net.add("Relu", net.add("Add", net.conv(r, 2 * B, 2 * B), r), output="y")
    model = net.model([("x", [1, 2 * B, 8, 8])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts["fused-conv-residual"] == 1 and report.counts["nchwc-fused-conv"] == 2
    first, second = nchwc_nodes(after, "Conv")
    assert len(second.input) == 4 and second.input[0] == second.input[3] == first.output[0]
    assert attrs_of(second)["activation"] == "Relu"
    assert len(nchwc_nodes(after, "ReorderOutput")) == 1
    assert len(standard_nodes(after, "Add")) == 1  # the guard's; the residual Add is gone


def test_fused_conv_with_z_from_the_input_model():
    """A FusedConv with Z already in the model (its output's batch dimension symbolic, Z's
    fixed) becomes a NCHWc Conv with a Sum input, like one fuser made."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((2 * B, 2 * B, 3, 3)) * 0.1).astype(np.float32)
    bias = rng.standard_normal(2 * B).astype(np.float32)
    node = helper.make_node(
        "FusedConv", ["x", "w", "b", "z"], ["y"], domain="com.microsoft", activation="Relu", pads=[1, 1, 1, 1]
    )
    model = make_model(
        [node],
        [("x", np.float32, [1, 2 * B, 8, 8]), ("z", np.float32, [1, 2 * B, 8, 8])],
        [("y", np.float32, ["N", 2 * B, 8, 8])],
        {"w": w, "b": bias},
        extra_opsets={"com.microsoft": 1},
        check=False,
    )
    after, report = optimize_and_compare(model)
    assert report.counts["nchwc-fused-conv"] == 1
    (conv,) = nchwc_nodes(after, "Conv")
    assert len(conv.input) == 4 and attrs_of(conv)["activation"] == "Relu"


def test_residual_conv_without_bias():
    """The residual conv has no bias and is not the guarded conv: the NCHWc Conv gets an empty
    bias input and the Sum as its 4th input (not shifted into the bias slot)."""
    net = Net(8)
    r = net.add("Relu", net.conv("x", 2 * B, 2 * B))
    net.add("Relu", net.add("Add", net.conv(r, 2 * B, 2 * B, bias=False), r), output="y")
    model = net.model([("x", [1, 2 * B, 8, 8])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts["fused-conv-residual"] == 1
    first, second = nchwc_nodes(after, "Conv")
    assert list(second.input[2:]) == ["", first.output[0]]


def test_residual_from_graph_input():
    """y = Relu(Conv(x) + z), z a graph input: the Sum input is ReorderInput(z)."""
    net = Net(9)
    net.add("Relu", net.add("Add", net.conv("x", 2 * B, 2 * B), "z"), output="y")
    model = net.model([("x", [2, 2 * B, 7, 7]), ("z", [2, 2 * B, 7, 7])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts == {"fused-conv-residual": 1, "nchwc-fused-conv": 1}
    conv = the_nchwc_conv(after)
    assert len(conv.input) == 4 and producers(after)[conv.input[3]].op_type == "ReorderInput"
    assert attrs_of(conv)["activation"] == "Relu"


def test_conv_add_without_activation_becomes_the_sum_input():
    """Conv -> Add(residual), no activation (a linear bottleneck): the residual is the NCHWc
    Conv's Sum input and the Add is gone; only the guard's Add remains."""
    net = Net(10)
    net.add("Add", net.conv("x", 2 * B, 2 * B), "z", output="y")
    model = net.model([("x", [1, 2 * B, 7, 7]), ("z", [1, 2 * B, 7, 7])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts == {"nchwc-conv": 1, "nchwc-conv-add": 1}
    assert len(standard_nodes(after, "Add")) == 1
    assert len(the_nchwc_conv(after).input) == 4


def test_residual_chain_stays_blocked_across_adds():
    """Two linear-bottleneck blocks: every reorder between them cancels."""
    net = Net(11)
    first = net.conv("x", 2 * B, 2 * B)
    block = net.add("Add", net.conv(first, 2 * B, 2 * B), first)
    net.add("Add", net.conv(block, 2 * B, 2 * B), block, output="y")
    model = net.model([("x", [1, 2 * B, 7, 7])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts["nchwc-conv-add"] == 2
    assert len(nchwc_nodes(after, "ReorderInput")) == 2  # x's, and the guard's probe
    assert len(nchwc_nodes(after, "ReorderOutput")) == 1


def test_add_after_an_activation_is_not_a_sum():
    net = Net(12)
    net.add("Add", net.add("Relu", net.conv("x", 2 * B, 2 * B)), "z", output="y")
    model = net.model([("x", [1, 2 * B, 7, 7]), ("z", [1, 2 * B, 7, 7])], ["y"])
    after, report = optimize_and_compare(model, trace=True)
    assert "nchwc-conv-add" not in report.counts
    assert any("activation before the Add" in r for r in declines(report, "nchwc-conv-add"))


def test_broadcast_addend_is_not_a_sum():
    net = Net(13)
    net.add("Add", net.conv("x", 2 * B, 2 * B), "z", output="y")
    model = net.model([("x", [1, 2 * B, 7, 7]), ("z", [1, 2 * B, 1, 1])], ["y"])
    after, report = optimize_and_compare(model, trace=True)
    assert "nchwc-conv-add" not in report.counts
    assert any("does not have the convolution's shape" in r for r in declines(report, "nchwc-conv-add"))


def test_small_conv_between_plain_operators_stays_nchw():
    """A 1x1 convolution of 2 channels between two plain operators: its output's reorder would
    cost more than its 2 multiply-adds per element save, so it stays NCHW, and the report says why."""
    net = Net(14)
    net.add("Neg", net.conv(net.add("Neg", "x"), 2, 4, kernel=1), output="y")
    model = net.model([("x", [1, 2, 8, 8])], ["y"])
    after, report = optimize_and_compare(model, trace=True)
    assert_no_nchwc(after)
    assert any("would not pay" in r for r in declines(report, "nchwc-conv"))
    (advice,) = [a for a in report.engine.advice if a.rule == "nchwc-region"]
    assert "stays NCHW" in advice.message and "would not pay" in advice.message


# ------------------------------------------------------------------------- activations


@pytest.mark.parametrize(
    "act,act_attrs,clip,kind,params",
    [
        ("LeakyRelu", {"alpha": 0.2}, None, "LeakyRelu", [0.2]),
        ("Sigmoid", {}, None, "Sigmoid", None),
        ("Tanh", {}, None, "Tanh", None),
        ("Clip", {}, (0.0, 6.0), "Clip", [0.0, 6.0]),
        ("HardSigmoid", {}, None, "HardSigmoid", [0.2, 0.5]),
        ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}, None, "HardSigmoid", [0.3, 0.4]),
    ],
    ids=["leaky-0.2", "sigmoid", "tanh", "clip-0-6", "hardsigmoid", "hardsigmoid-0.3-0.4"],
)
def test_activation_becomes_nchwc_conv_activation(act, act_attrs, clip, kind, params):
    """Each activation FusedConv supports ends up in the NCHWc Conv, with its parameters."""
    net = Net(11)
    inputs = [net.conv("x", 2 * B, 2 * B)]
    if clip is not None:
        inputs += [net.const("lo", np.float32(clip[0])), net.const("hi", np.float32(clip[1]))]
    net.add(act, *inputs, output="y", **act_attrs)
    model = net.model([("x", [1, 2 * B, 8, 8])], ["y"], opset=13)
    after, report = optimize_and_compare(model)
    assert report.counts == {"fused-conv": 1, "nchwc-fused-conv": 1}
    attrs = attrs_of(the_nchwc_conv(after))
    assert attrs["activation"] == kind
    if params is None:
        assert "activation_params" not in attrs
    else:
        np.testing.assert_array_equal(np.float32(attrs["activation_params"]), np.float32(params))
    assert act not in op_types(after)


# ----------------------------------------------------------------------------- pooling


POOLS = [
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
    ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("AveragePool", {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1}),
    ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1}),
    ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER", "count_include_pad": 1}),
    ("MaxPool", {"kernel_shape": [2, 3], "strides": [1, 2], "auto_pad": "VALID"}),
    ("GlobalAveragePool", {}),
    ("GlobalMaxPool", {}),
]
POOL_IDS = [
    "max-pads",
    "max-ceil",
    "avg-include-pad",
    "avg-exclude-pad",
    "avg-ceil",
    "max-ceil-pads",
    "avg-ceil-pads-exclude-pad",
    "avg-same-upper-include-pad",
    "max-valid",
    "global-avg",
    "global-max",
]


@pytest.mark.parametrize("pool,attrs", POOLS, ids=POOL_IDS)
def test_pool_after_conv(pool, attrs):
    """A pool after a NCHWc conv runs in the blocked layout too (nchwc-pool), attributes kept."""
    net = Net(12)
    net.add(pool, net.add("Relu", net.conv("x", 2 * B, 2 * B)), output="y", name="pool", **attrs)
    model = net.model([("x", [1, 2 * B, 10, 11])], ["y"])  # H = 10: ceil_mode adds a window
    after, report = optimize_and_compare(model)
    assert report.counts == {"fused-conv": 1, "nchwc-fused-conv": 1, "nchwc-pool": 1}
    (blocked,) = nchwc_nodes(after, pool)
    assert blocked.input[0] == the_nchwc_conv(after).output[0]
    assert attrs_of(blocked) == attrs
    assert standard_nodes(after, pool) == []
    (to_plain,) = nchwc_nodes(after, "ReorderOutput")
    assert to_plain.input[0] == blocked.output[0] and list(to_plain.output) == ["y"]


@pytest.mark.parametrize("pool,attrs", POOLS[:-2], ids=POOL_IDS[:-2])
def test_pool_of_graph_input(pool, attrs):
    """MaxPool/AveragePool of a plain 2B-channel graph input that a convolution reads moves into
    NCHWc (nchwc-pool-input): the convolution's reorder in cancels against the pool's out."""
    net = Net(13)
    net.conv(net.add(pool, "x", **attrs), 2 * B, 2 * B, kernel=1, output="y")
    model = net.model([("x", [1, 2 * B, 10, 11])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts["nchwc-pool-input"] == 1 and report.counts["nchwc-reorder-cancel"] == 1
    # Two ReorderInputs: the pool's input's, and the block-size guard's probe the convolution plants.
    assert Counter(n.op_type for n in nchwc_nodes(after)) == {"ReorderInput": 2, pool: 1, "Conv": 1, "ReorderOutput": 1}
    assert standard_nodes(after, pool) == [] and len(guards(after)) == 1


@pytest.mark.parametrize("channels", [4, B // 2, B])
def test_a_lone_pool_of_graph_input_stays_plain(channels):
    """Nothing blocked reads it, or (fewer than a block) a convolution after it reads it plain: the
    reorders around a blocked pool cost more than it saves (a lone MaxPool of 4 channels ran 3
    times slower)."""
    net = Net(14)
    pooled = net.add("MaxPool", "x", kernel_shape=[2, 2], **({"output": "y"} if channels == B else {}))
    if channels != B:
        net.conv(pooled, channels, 2 * B, kernel=1, output="y")
    model = net.model([("x", [1, channels, 10, 11])], ["y"])
    reason = "nothing that runs blocked reads the pool" if channels == B else "fewer than the block"
    after, report = fuser.optimize(model, target="onnxruntime", trace=True)
    assert any(reason in r for r in declines(report, "nchwc-pool-input")), declines(report, "nchwc-pool-input")
    assert nchwc_nodes(after, "MaxPool") == [] and len(standard_nodes(after, "MaxPool")) == 1


CEIL_INCLUDE_PAD = {
    "kernel_shape": [3, 3],
    "strides": [2, 2],
    "pads": [1, 1, 1, 1],
    "ceil_mode": 1,
    "count_include_pad": 1,
}


@pytest.mark.parametrize("source", ["after-conv", "graph-input"])
def test_average_pool_ceil_mode_count_include_pad(source):
    """AveragePool with pads, strides, ceil_mode=1 and count_include_pad=1 on a 10x10 input
    (ceil_mode adds a last, overhanging window): the optimized model must compute what the
    original computes, whether the rules convert the pool or not. Run without fuser's own
    check (which would raise NumericsMismatch) to compare directly."""
    net = Net(34)
    x = net.add("Relu", net.conv("x", 2 * B, 2 * B)) if source == "after-conv" else "x"
    net.add("AveragePool", x, output="y", name="pool", **CEIL_INCLUDE_PAD)
    model = net.model([("x", [1, 2 * B, 10, 10])], ["y"])
    after, _ = fuser.optimize(model, target="onnxruntime", check=False)
    assert_same_outputs(model, after, random_feeds(model), **TOL)


def test_wrong_pool_rewrite_is_dropped_cleanly():
    """Whatever the pooling rules do with AveragePool(ceil_mode=1, count_include_pad=1), with
    on_mismatch="drop" the result is correct, the convolutions stay NCHWc and there is still
    exactly one guard."""
    net = Net(35)
    pooled = net.add("AveragePool", "x", **CEIL_INCLUDE_PAD)
    net.conv(net.add("Relu", net.conv(pooled, 2 * B, 2 * B)), 2 * B, 2 * B, output="y")
    model = net.model([("x", [1, 2 * B, 10, 10])], ["y"])
    after, _ = optimize_and_compare(model, on_mismatch="drop")
    assert len(nchwc_nodes(after, "Conv")) == 2
    assert len(guards(after)) == 1


def test_pool_of_graph_input_feeding_conv():
    """MaxPool(x) -> Conv: the pool moves into NCHWc and the reorders to the conv cancel."""
    net = Net(14)
    pooled = net.add("MaxPool", "x", kernel_shape=[2, 2], strides=[2, 2])
    net.conv(pooled, 2 * B, 2 * B, output="y")
    model = net.model([("x", [1, 2 * B, 10, 10])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts == {"nchwc-pool-input": 1, "nchwc-conv": 1, "nchwc-reorder-cancel": 1}
    (pool,) = nchwc_nodes(after, "MaxPool")
    assert the_nchwc_conv(after).input[0] == pool.output[0]


# ------------------------------------------------------------------------------ concat


@pytest.mark.parametrize("parts", [[B, 2 * B], [B, 2 * B, B, 3 * B]], ids=["two", "four"])
def test_concat_of_convs_stays_blocked(parts):
    """Concat(axis=1) of conv outputs whose channels are multiples of the block, feeding a conv:
    the Concat joins the blocked tensors (nchwc-concat), no reorder in between."""
    net = Net(15)
    outs = [net.add("Relu", net.conv("x", 2 * B, c)) for c in parts]
    joined = net.add("Concat", *outs, axis=1, name="concat")
    net.conv(joined, sum(parts), 2 * B, kernel=1, output="y")
    model = net.model([("x", [1, 2 * B, 8, 8])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts["nchwc-concat"] == 1
    assert report.counts["nchwc-fused-conv"] == len(parts) and report.counts["nchwc-conv"] == 1
    (concat,) = nodes_of(after, "Concat")
    convs = nchwc_nodes(after, "Conv")
    assert list(concat.input) == [c.output[0] for c in convs[: len(parts)]]
    assert convs[-1].input[0] == concat.output[0]
    assert len(nchwc_nodes(after, "ReorderOutput")) == 1


def test_concat_of_the_same_conv_twice():
    """Concat(a, a) along channels of one conv output: still correct."""
    net = Net(16)
    a = net.conv("x", 2 * B, B)
    net.conv(net.add("Concat", a, a, axis=1), 2 * B, B, output="y")
    model = net.model([("x", [1, 2 * B, 6, 6])], ["y"])
    optimize_and_compare(model)


@pytest.mark.parametrize("parts", [25, 64, 65])
def test_concat_of_many_parts(parts):
    """The rule joins up to 64 parts (DenseNet-121 joins 25); with 65 it must not drop one
    (it leaves the Concat)."""
    net = Net(17)
    outs = [net.conv("x", B, B, kernel=1) for _ in range(parts)]
    net.add("Concat", *outs, axis=1, output="y")
    model = net.model([("x", [1, B, 5, 5])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts.get("nchwc-concat", 0) == (1 if parts <= 64 else 0)
    (concat,) = nodes_of(after, "Concat")
    assert len(concat.input) == parts
    assert run(after, random_feeds(model))[0].shape == (1, parts * B, 5, 5)


def test_concat_part_that_is_also_a_graph_output():
    """A part of the Concat is also a graph output: the blocked Concat is used and a
    ReorderOutput still writes the graph output."""
    net = Net(36)
    a, b = net.conv("x", B, B, output="a"), net.conv("x", B, B)
    net.conv(net.add("Concat", a, b, axis=1), 2 * B, B, output="y")
    model = net.model([("x", [1, B, 5, 5])], ["a", "y"])
    after, report = optimize_and_compare(model)
    assert report.counts["nchwc-concat"] == 1
    assert {n.output[0] for n in nchwc_nodes(after, "ReorderOutput")} == {"a", "y"}


# ---------------------------------------------------------------------------- upsample


def _resize(net: Net, x: str, spelling: str, factors=(2, 2), channels: int = 2 * B, **attrs) -> str:
    """x resized by `factors` on H and W, spelled as an exporter of that opset writes it."""
    scales = net.const(net.name("scales"), np.array([1, 1, *factors], np.float32))
    if spelling == "upsample-7":
        return net.add("Upsample", x, mode=attrs.pop("mode", "nearest"), scales=[1.0, 1.0, *map(float, factors)])
    if spelling == "upsample-9":
        return net.add("Upsample", x, scales, mode=attrs.pop("mode", "nearest"), **attrs)
    if spelling == "resize-10":
        return net.add("Resize", x, scales, **attrs)
    if spelling == "resize-11":  # an empty roi tensor, as the legacy exporter writes at 11 and 12
        return net.add("Resize", x, net.const(net.name("roi"), np.zeros(0, np.float32)), scales, **attrs)
    if spelling in ("sizes", "sizes-11"):  # at opset 11 and 12, beside an empty roi and empty scales
        sizes = net.const(net.name("sizes"), np.array([1, channels, 6 * factors[0], 7 * factors[1]], np.int64))
        if spelling == "sizes-11":
            empty = net.const(net.name("empty"), np.zeros(0, np.float32))
            return net.add("Resize", x, empty, empty, sizes, **attrs)
        return net.add("Resize", x, "", "", sizes, **attrs)
    return net.add("Resize", x, "", scales, **attrs)


def _neck(spelling: str, opset: int, *, factors=(2, 2), channels: int = 2 * B, **attrs) -> onnx.ModelProto:
    """A detector's neck: conv -> Resize -> Concat with a conv of the larger map -> conv."""
    net = Net(41)
    small = net.add("Relu", net.conv("x", 2 * B, channels, strides=[2, 2]))
    small = net.add("Relu", net.conv(small, channels, channels))
    up = _resize(net, small, spelling, factors, channels, **attrs)
    large = net.add("Relu", net.conv("x", 2 * B, 2 * B))
    if tuple(factors) == (2, 2):
        joined = net.add("Concat", up, large, axis=1)
        net.conv(joined, channels + 2 * B, B, kernel=1, output="y")
    else:
        net.conv(up, channels, B, kernel=1, output="y")
    return net.model([("x", [1, 2 * B, 12, 14])], ["y"], opset=opset)


NEAREST = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
UPSAMPLES = [
    ("resize-13", 17, (2, 2), NEAREST, None),  # both torch exporters' nn.Upsample(mode="nearest")
    ("resize-13", 18, (2, 2), {**NEAREST, "antialias": 0, "keep_aspect_ratio_policy": "stretch"}, None),
    ("resize-11", 11, (2, 2), NEAREST, None),
    ("resize-10", 10, (2, 2), {"mode": "nearest"}, None),
    ("upsample-9", 9, (2, 2), {}, None),
    ("upsample-7", 7, (2, 3), {}, None),
    ("upsample-9", 9, (2, 2), {"mode": "linear"}, "asymmetric"),
    ("resize-10", 10, (3, 2), {"mode": "linear"}, "asymmetric"),
    (
        "resize-13",
        13,
        (3, 2),
        {"coordinate_transformation_mode": "tf_half_pixel_for_nn", "nearest_mode": "floor"},
        None,
    ),
    ("resize-13", 19, (3, 2), {"coordinate_transformation_mode": "half_pixel_symmetric"}, None),
    (
        "resize-13",
        19,
        (3, 2),
        {"mode": "linear", "coordinate_transformation_mode": "half_pixel_symmetric"},
        "half_pixel",
    ),
    ("resize-13", 13, (3, 2), {}, None),  # Resize's defaults: half_pixel, round_prefer_floor
    ("resize-13", 13, (3, 4), {"nearest_mode": "round_prefer_ceil"}, None),
    ("sizes", 13, (2, 2), NEAREST, None),
    ("sizes-11", 11, (3, 2), NEAREST, None),
    ("resize-13", 17, (2, 2), {"mode": "linear", "coordinate_transformation_mode": "half_pixel"}, "half_pixel"),
    ("resize-13", 17, (2, 3), {"mode": "linear", "coordinate_transformation_mode": "align_corners"}, "align_corners"),
    ("resize-13", 17, (2, 2), {"mode": "linear", "coordinate_transformation_mode": "asymmetric"}, "asymmetric"),
    ("resize-13", 17, (3, 1), {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, "half_pixel"),
]


@pytest.mark.parametrize(
    "spelling,opset,factors,attrs,linear",
    UPSAMPLES,
    ids=[f"{u[0]}-{u[1]}-{u[3].get('mode', '')}-{i}" for i, u in enumerate(UPSAMPLES)],
)
def test_upsample_by_whole_factors_stays_blocked(spelling, opset, factors, attrs, linear):
    """A Resize of a NCHWc result by whole factors runs as NCHWc Upsample (nchwc-upsample),
    and the Concat after it joins blocked tensors."""
    after, report = optimize_and_compare(_neck(spelling, opset, factors=factors, **attrs))
    assert report.counts["nchwc-upsample"] == 1
    (upsample,) = nchwc_nodes(after, "Upsample")
    assert attrs_of(upsample)["scales"] == [1, 1, *factors]
    if linear:
        assert attrs_of(upsample)["mode"] == "linear"
        assert attrs_of(upsample)["coordinate_transformation_mode"] == linear
    else:
        assert "mode" not in attrs_of(upsample)
    assert nodes_of(after, "Resize") == [] and nodes_of(after, "Upsample") == [upsample]
    if factors == (2, 2):
        assert report.counts["nchwc-concat"] == 1
    assert len(nchwc_nodes(after, "ReorderOutput")) == 1


def test_upsample_of_channels_not_a_multiple_of_the_block():
    """The padding channels are repeated with the rest and dropped by the last reorder."""
    after, report = optimize_and_compare(_neck("resize-13", 17, factors=(2, 3), channels=HALF, **NEAREST))
    assert report.counts["nchwc-upsample"] == 1
    (upsample,) = nchwc_nodes(after, "Upsample")
    assert upsample.input[0] == nchwc_nodes(after, "Conv")[1].output[0]


UPSAMPLE_DECLINES = [
    ((1.5, 2), NEAREST, "not whole numbers"),
    ((3, 3), {**NEAREST, "nearest_mode": "round_prefer_ceil"}, "does not repeat each pixel"),
    ((2, 2), {**NEAREST, "coordinate_transformation_mode": "half_pixel"}, "does not repeat each pixel"),
    ((2, 2), {"mode": "cubic"}, "cubic interpolation"),
    ((2, 2), {"mode": "linear", "coordinate_transformation_mode": "tf_half_pixel_for_nn"}, "no tf_half_pixel_for_nn"),
]


@pytest.mark.parametrize("factors,attrs,reason", UPSAMPLE_DECLINES, ids=[d[2] for d in UPSAMPLE_DECLINES])
def test_upsample_the_kernel_would_compute_differently_stays_plain(factors, attrs, reason):
    model = _neck("resize-13", 17, factors=factors, **attrs)
    after, report = optimize_and_compare(model, trace=True)
    assert nchwc_nodes(after, "Upsample") == []
    assert any(reason in r for r in declines(report, "nchwc-upsample")), declines(report, "nchwc-upsample")


def test_upsample_to_sizes_that_keep_the_aspect_ratio_stays_plain():
    # not_larger reads sizes [12, 21] of a 6x7 map as a factor of 2 on both axes, not 2 and 3.
    model = _neck("sizes", 18, factors=(2, 3), keep_aspect_ratio_policy="not_larger", **NEAREST)
    after, report = optimize_and_compare(model, trace=True)
    assert nchwc_nodes(after, "Upsample") == []
    assert any("keep_aspect_ratio_policy not_larger" in r for r in declines(report, "nchwc-upsample"))


def test_upsample_of_the_channel_axis_stays_plain():
    net = Net(42)
    scales = net.const("scales", np.array([1, 2, 2, 2], np.float32))
    net.add("Resize", net.add("Relu", net.conv("x", 2 * B, 2 * B)), "", scales, output="y", **NEAREST)
    after, report = optimize_and_compare(net.model([("x", [1, 2 * B, 6, 6])], ["y"], opset=17), trace=True)
    assert nchwc_nodes(after, "Upsample") == []
    assert any("batch or channel axis" in r for r in declines(report, "nchwc-upsample"))


# ------------------------------------------------------------------------- batchnorm


def test_batchnorm_after_concat_becomes_depthwise_nchwc_conv():
    """DenseNet style: Concat -> BatchNormalization -> Relu -> Conv. No conv absorbs the BN;
    it becomes a NCHWc depthwise 1x1 Conv (nchwc-batchnorm) applying the Relu
    (nchwc-activation), all in the blocked layout."""
    net = Net(18)
    a, b = net.conv("x", 2 * B, B), net.conv("x", 2 * B, B)
    normalized = net.batchnorm(net.add("Concat", a, b, axis=1), 2 * B, epsilon=1e-3)
    net.conv(net.add("Relu", normalized), 2 * B, B, kernel=1, output="y")
    model = net.model([("x", [1, 2 * B, 8, 8])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts["nchwc-batchnorm"] == 1 and report.counts["nchwc-activation"] == 1
    assert report.counts["nchwc-concat"] == 1
    assert "BatchNormalization" not in op_types(after) and "Relu" not in op_types(after)
    depthwise = [n for n in nchwc_nodes(after, "Conv") if attrs_of(n).get("group") == 2 * B]
    assert len(depthwise) == 1
    attrs = attrs_of(depthwise[0])
    assert attrs["activation"] == "Relu" and attrs["kernel_shape"] == [1, 1]
    assert len(nchwc_nodes(after, "ReorderOutput")) == 1


def test_batchnorm_with_padded_channels():
    """BatchNormalization of a 20-channel (B=16) conv output that the conv cannot absorb (the
    conv output is also a graph output): a depthwise conv over the padded channels."""
    c = B + B // 4
    net = Net(19)
    conv_out = net.conv("x", 2 * B, c, output="c")
    net.batchnorm(conv_out, c, output="y")
    model = net.model([("x", [1, 2 * B, 6, 6])], ["c", "y"])
    after, report = optimize_and_compare(model)
    assert report.counts.get("nchwc-batchnorm") == 1
    assert "BatchNormalization" not in op_types(after)


# ----------------------------------------------------------------------------- batches


def test_batch_of_three_through_conv_concat_pool():
    """Input [3, C, H, W] through convs, Concat, MaxPool and a final conv."""
    net = Net(20)
    a = net.add("Relu", net.conv("x", 3, B))
    b = net.add("Relu", net.conv("x", 3, 2 * B, kernel=5))
    pooled = net.add("MaxPool", net.add("Concat", a, b, axis=1), kernel_shape=[2, 2], strides=[2, 2])
    net.conv(pooled, 3 * B, B, output="y")
    model = net.model([("x", [3, 3, 16, 16])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts["nchwc-concat"] == 1 and report.counts["nchwc-pool"] == 1
    assert standard_nodes(after, "Conv") == [] and nodes_of(after, "FusedConv") == []
    assert run(after, random_feeds(model))[0].shape == (3, B, 8, 8)


def test_symbolic_batch():
    """Input ['N', 3, H, W] run with a batch of 3 (fuser's own check uses N = 1)."""
    net = Net(37)
    a, b = net.conv("x", 3, B), net.conv("x", 3, B)
    net.add("MaxPool", net.add("Concat", a, b, axis=1), kernel_shape=[2, 2], output="y")
    model = net.model([("x", ["N", 3, 8, 8])], ["y"])
    feeds = {"x": np.random.default_rng(2).standard_normal((3, 3, 8, 8)).astype(np.float32)}
    _, report = optimize_and_compare(model, feeds)
    assert report.counts["nchwc-concat"] == 1 and report.counts["nchwc-pool"] == 1


def test_few_intermediate_channels_take_the_nchw_path():
    """Conv 3 -> B/2 -> Conv B/2 -> 2B: the second conv has fewer input channels than the block
    and reads the first's plain (ReorderOutput) result on the NCHW input path."""
    net = Net(38)
    hidden = net.add("Relu", net.conv("x", 3, B // 2))
    net.conv(hidden, B // 2, 2 * B, output="y")
    model = net.model([("x", [1, 3, 8, 8])], ["y"])
    after, _ = optimize_and_compare(model)
    _, second = nchwc_nodes(after, "Conv")
    assert producers(after)[second.input[0]].op_type == "ReorderOutput"
    assert plain_reorder_inputs(after) == []


# ---------------------------------------------------------------------------- the guard


def several_convs_model() -> onnx.ModelProto:
    net = Net(21)
    hidden = net.add("Relu", net.conv("x", 3, 2 * B))
    hidden = net.add("Relu", net.conv(hidden, 2 * B, 2 * B))
    net.conv(hidden, 2 * B, B, output="y")
    return net.model([("x", [1, 3, 8, 8])], ["y"])


def test_one_guard_per_graph():
    """Three convolutions, one guard: ReorderInput(zeros) -> Reshape([B]) -> Gather(0), added to
    the bias of one NCHWc Conv."""
    model = several_convs_model()
    after, _ = optimize_and_compare(model)
    assert len(nchwc_nodes(after, "Conv")) == 3
    (guard,) = guards(after)
    assert list(initializer_array(after, guard.input[1])) == [B]
    reorder = producers(after)[guard.input[0]]
    np.testing.assert_array_equal(initializer_array(after, reorder.input[0]), np.zeros((1, 4, 1, 1), np.float32))
    (gather,) = [n for n in nodes_of(after, "Gather") if n.input[0] == guard.output[0]]
    assert int(initializer_array(after, gather.input[1])) == 0
    (add,) = [n for n in nodes_of(after, "Add") if gather.output[0] in n.input]
    assert sum(add.output[0] == c.input[2] for c in nchwc_nodes(after, "Conv")) == 1


def test_guard_fails_on_a_different_block_size():
    """Pretend the machine's block is half as wide: Reshape to [B // 2] of the B-channel
    reordered probe cannot run, so onnxruntime refuses the model instead of computing with
    filters blocked for the wrong width."""
    model = several_convs_model()
    after, _ = optimize_and_compare(model)
    feeds = random_feeds(model)
    run(after, feeds)  # the unmodified model runs
    (guard,) = guards(after)
    (shape,) = [t for t in after.graph.initializer if t.name == guard.input[1]]
    shape.CopyFrom(numpy_helper.from_array(np.array([B // 2], np.int64), shape.name))
    with pytest.raises(Exception, match="(?i)reshape|shape"):
        run(after, feeds)


def test_concat_of_pools_alone_is_guarded():
    """Concatenating blocked tensors is exact only where every part is a multiple of this
    machine's block: a graph whose only block-dependent rewrite is such a Concat (of pooled
    inputs, no convolution) gets the guard too, and the machine note."""
    net = Net(40)
    a = net.add("MaxPool", "a", kernel_shape=[2, 2])
    c = net.add("MaxPool", "c", kernel_shape=[2, 2])
    net.add("Concat", a, c, output="y", axis=1)
    model = net.model([("a", [1, B, 6, 6]), ("c", [1, 2 * B, 6, 6])], ["y"])
    after, report = optimize_and_compare(model)
    assert report.counts == {"nchwc-pool-input": 2, "nchwc-concat": 1}
    assert any("block size" in note for note in report.notes)
    (guard,) = guards(after)
    feeds = random_feeds(model)
    (shape,) = [t for t in after.graph.initializer if t.name == guard.input[1]]
    shape.CopyFrom(numpy_helper.from_array(np.array([B // 2], np.int64), shape.name))
    with pytest.raises(Exception, match="(?i)reshape|shape"):
        run(after, feeds)


def test_without_nchwc_kernels_every_rule_declines(monkeypatch):
    """Where onnxruntime has no NCHWc kernels (block size 0, as on ARM builds), every NCHWc
    rule declines with that reason; nothing crashes and the fusions still happen."""
    import fuser.context

    monkeypatch.setattr(fuser.context, "machine_nchwc_block", lambda: 0)
    net = Net(41)
    r = net.add("Relu", net.conv("x", 2 * B, 2 * B))
    pooled = net.add("MaxPool", r, kernel_shape=[2, 2])
    other = net.add("AveragePool", "x", kernel_shape=[2, 2])
    net.add("Concat", pooled, other, output="y", axis=1)
    model = net.model([("x", [1, 2 * B, 8, 8])], ["y"])
    after, report = fuser.optimize(model, target="onnxruntime", trace=True)
    assert_no_nchwc(after)
    assert report.counts == {"fused-conv": 1}
    reasons = {d.reason for d in report.engine.declined if d.rule.startswith("nchwc-")}
    assert reasons == {"onnxruntime on this machine has no NCHWc kernels"}
    assert not any("block size" in note for note in report.notes)


def test_one_guard_in_each_subgraph():
    """Convolutions in the main graph and in both branches of an If: each graph that holds
    NCHWc convolutions gets its own guard (a subgraph's guard is not shared with its parent)."""
    rng = np.random.default_rng(39)

    def weight(name):
        return numpy_helper.from_array((rng.standard_normal((2 * B, 2 * B, 3, 3)) / 12).astype(np.float32), name)

    def branch(name):
        nodes = [
            helper.make_node("Conv", ["h", f"{name}_w"], [f"{name}_c"], pads=[1, 1, 1, 1], name=f"{name}_conv"),
            helper.make_node("Relu", [f"{name}_c"], [f"{name}_r"], name=f"{name}_relu"),
            helper.make_node("Conv", [f"{name}_r", f"{name}_w2"], [f"{name}_y"], pads=[1, 1, 1, 1], name=f"{name}_c2"),
        ]
        out = helper.make_tensor_value_info(f"{name}_y", onnx.TensorProto.FLOAT, [1, 2 * B, 6, 6])
        return helper.make_graph(nodes, name, [], [out], [weight(f"{name}_w"), weight(f"{name}_w2")])

    nodes = [
        helper.make_node("Conv", ["x", "w"], ["h"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("If", ["cond"], ["y"], then_branch=branch("then"), else_branch=branch("else"), name="if"),
    ]
    w = numpy_helper.to_array(weight("w"))
    model = make_model(
        nodes, [("x", np.float32, [1, 2 * B, 6, 6]), ("cond", np.bool_, [])], [("y", np.float32, [None] * 4)], {"w": w}
    )
    x = np.random.default_rng(3).standard_normal((1, 2 * B, 6, 6)).astype(np.float32)
    after, report = optimize_and_compare(model, {"x": x, "cond": np.array(True)})
    assert_same_outputs(model, after, {"x": x, "cond": np.array(False)}, **TOL)
    assert {r.scope for r in report.rewrites if r.rule == "nchwc-fused-conv"} == {
        "main/if.then_branch",
        "main/if.else_branch",
    }
    assert len(guards(after)) == 1
    (if_node,) = nodes_of(after, "If")
    for attr in if_node.attribute:
        body = onnx.ModelProto(graph=attr.g)
        assert len(guards(body)) == 1, attr.name
        assert len(nchwc_nodes(body, "Conv")) == 2


# ------------------------------------------------------------------- whole-model rules


def rich_model() -> onnx.ModelProto:
    """Conv+Relu, a residual block, Concat, BatchNormalization+Relu, MaxPool, GlobalAveragePool."""
    net = Net(22)
    stem = net.add("Relu", net.conv("x", 3, 2 * B))
    block = net.add("Relu", net.add("Add", net.conv(stem, 2 * B, 2 * B), stem))
    joined = net.add("Concat", block, net.add("Relu", net.conv(stem, 2 * B, B)), axis=1)
    normalized = net.add("Relu", net.batchnorm(joined, 3 * B))
    pooled = net.add("MaxPool", normalized, kernel_shape=[2, 2], strides=[2, 2])
    net.add("GlobalAveragePool", net.conv(pooled, 3 * B, 2 * B), output="y")
    return net.model([("x", [2, 3, 12, 12])], ["y"])


def test_rich_model():
    """Every NCHWc rule in one model; only the guard's and the stem's standard ops are left."""
    model = rich_model()
    after, report = optimize_and_compare(model)
    for rule in ("nchwc-fused-conv", "nchwc-conv", "nchwc-concat", "nchwc-batchnorm", "nchwc-activation"):
        assert report.counts.get(rule), rule
    assert report.counts["nchwc-pool"] == 2
    assert len(nchwc_nodes(after, "ReorderOutput")) == 1
    assert set(op_types(after)) - {n.op_type for n in nchwc_nodes(after)} == {"Reshape", "Gather", "Add", "Concat"}


@pytest.mark.parametrize("build", [rich_model, several_convs_model], ids=["rich", "several-convs"])
def test_second_optimization_changes_nothing(build):
    """Optimizing an optimized model again finds nothing to do."""
    once, _ = optimize_and_compare(build())
    twice, report = fuser.optimize(once, target="onnxruntime")
    assert report.rewrites == []
    assert op_types(twice) == op_types(once)


def test_disabling_nchwc_rules_leaves_fused_conv():
    """disable=["nchwc-*"]: FusedConv stays, no com.microsoft.nchwc op or opset."""
    model = rich_model()
    after, report = optimize_and_compare(model, disable=["nchwc-*"])
    assert nodes_of(after, "FusedConv") and all(n.domain == "com.microsoft" for n in nodes_of(after, "FusedConv"))
    assert not any(rule.startswith("nchwc") for rule in report.counts)
    assert_no_nchwc(after)


def test_target_onnx_never_emits_nchwc():
    """The default target emits standard ONNX only, even where NCHWc would apply."""
    model = rich_model()
    after, report = fuser.optimize(model, target="onnx")
    assert report.verdict is None or report.verdict.passed  # None: nothing to rewrite, nothing checked
    assert not any(rule.startswith("nchwc") for rule in report.counts)
    assert_no_nchwc(after)
    assert all(n.domain in ("", "ai.onnx") for n in after.graph.node)


# ------------------------------------------------------------------------- negatives


def assert_not_converted(model, rule: str, reason: str | None, *, check: bool = True):
    """No NCHWc op in the result; `rule` declined with `reason` (a substring), or, with reason
    None, never matched."""
    after, report = fuser.optimize(model, target="onnxruntime", trace=True, check=check)
    assert_no_nchwc(after)
    assert not any(r.startswith("nchwc") for r in report.counts), report.counts
    if reason is None:
        assert declines(report, rule) == []
    else:
        assert any(reason in r for r in declines(report, rule)), declines(report, rule)
    if check:
        assert_checked(report)
    return after, report


def test_float16_pool_of_graph_input_not_converted():
    net = Net(40)
    net.add("MaxPool", "x", output="y", kernel_shape=[2, 2])
    model = net.model([("x", np.float16, [1, 2 * B, 6, 6])], [("y", np.float16, [None] * 4)])
    assert_not_converted(model, "nchwc-pool-input", "NCHWc kernels take float32")


def test_float16_conv_not_converted():
    """NCHWc kernels are float32 only: a float16 Conv+Relu stays a FusedConv."""
    net = Net(23)
    net.add("Relu", net.conv("x", 2 * B, 2 * B, dtype=np.float16), output="y")
    model = net.model([("x", np.float16, [1, 2 * B, 6, 6])], [("y", np.float16, [None] * 4)])
    after, report = assert_not_converted(model, "nchwc-fused-conv", "NCHWc kernels take float32")
    assert report.counts == {"fused-conv": 1}
    assert nodes_of(after, "FusedConv")


def test_float64_conv_not_converted():
    """float64 (no onnxruntime Conv kernel, so not run): not converted."""
    net = Net(24)
    net.conv("x", 2 * B, 2 * B, dtype=np.float64, output="y")
    model = net.model([("x", np.float64, [1, 2 * B, 6, 6])], [("y", np.float64, [None] * 4)])
    after, report = assert_not_converted(model, "nchwc-conv", "this tensor is float64", check=False)
    assert report.rewrites == [] and op_types(after) == ["Conv"]


@pytest.mark.parametrize("dims", [1, 3], ids=["1d", "3d"])
def test_non_2d_conv_not_converted(dims):
    net = Net(25)
    net.conv("x", 2 * B, 2 * B, dims=dims, output="y")
    model = net.model([("x", [1, 2 * B] + [5] * dims)], [("y", np.float32, [None] * (dims + 2))])
    assert_not_converted(model, "nchwc-conv", "NCHWc kernels are 2-D")


@pytest.mark.parametrize(
    "c_in,c_out,group,reason",
    [
        (2 * HALF, 4 * B, 2, "channels per group are not a multiple"),
        (2 * B, 2 * (B + B // 8), 2, "channels per group are not a multiple"),
        (B + 2, B + 2, B + 2, "input channels are not a multiple of 4"),
    ],
    ids=["24-per-group", "output-per-group-not-multiple", "depthwise-18"],
)
def test_grouped_conv_with_unaligned_channels_not_converted(c_in, c_out, group, reason):
    net = Net(26)
    net.conv("x", c_in, c_out, group=group, output="y")
    model = net.model([("x", [1, c_in, 6, 6])], ["y"])
    assert_not_converted(model, "nchwc-conv", reason)


def test_weight_from_graph_input_not_converted():
    """The filter must be reordered ahead of time: a weight fed at run time cannot be."""
    net = Net(27)
    net.add("Conv", "x", "w", net.const("b", np.zeros(2 * B, np.float32)), output="y", pads=[1, 1, 1, 1])
    model = net.model([("x", [1, 2 * B, 6, 6]), ("w", [2 * B, 2 * B, 3, 3])], ["y"])
    assert_not_converted(model, "nchwc-conv", None)


def test_bias_from_graph_input_not_converted():
    """A constant filter but a bias fed at run time: the optional constant bias of the pattern
    does not match it (matching it as "no bias" would drop the bias)."""
    net = Net(28)
    w = net.const("w", np.random.default_rng(0).standard_normal((2 * B, 2 * B, 3, 3)).astype(np.float32) / 12)
    net.add("Conv", "x", w, "b", output="y", pads=[1, 1, 1, 1])
    model = net.model([("x", [1, 2 * B, 6, 6]), ("b", [2 * B])], ["y"])
    assert_not_converted(model, "nchwc-conv", None)


def conv_pool_model(pool_attrs: dict, channels: int = 2 * B, outputs=("y",)) -> onnx.ModelProto:
    net = Net(29)
    net.add("MaxPool", net.conv("x", 3, channels), outputs=list(outputs), name="pool", **pool_attrs)
    declared = [("y", np.float32, [None] * 4)] + [("idx", np.int64, [None] * 4)] * (len(outputs) - 1)
    return net.model([("x", [1, 3, 9, 9])], declared)


def assert_pool_declined(model: onnx.ModelProto, reason: str):
    """The conv before the pool converts; both pooling rules decline the pool."""
    after, report = fuser.optimize(model, target="onnxruntime", trace=True)
    assert report.verdict.passed
    assert report.counts == {"nchwc-conv": 1}
    assert standard_nodes(after, "MaxPool") and not nchwc_nodes(after, "MaxPool")
    reasons = declines(report, "nchwc-pool") + declines(report, "nchwc-pool-input")
    assert reasons and all(reason in r for r in reasons), reasons
    assert_same_outputs(model, after, random_feeds(model), **TOL)


def test_maxpool_with_used_indices_not_converted():
    model = conv_pool_model({"kernel_shape": [2, 2], "strides": [2, 2]}, outputs=("y", "idx"))
    assert_pool_declined(model, "indices output is used")


def test_dilated_maxpool_not_converted():
    model = conv_pool_model({"kernel_shape": [2, 2], "dilations": [2, 2]})
    assert_pool_declined(model, "dilated pooling")


@pytest.mark.parametrize("op_type", ["MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"])
def test_pool_of_unaligned_channels_runs_blocked(op_type):
    """24 channels (B=16): the conv converts (padded) and so does the pool; the padding channels
    are pooled like the others and dropped by the reorder out."""
    net = Net(29)
    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]} if not op_type.startswith("Global") else {}
    pooled = net.add(op_type, net.add("Relu", net.conv("x", 3, HALF)), **attrs)
    net.conv(pooled, HALF, 2 * B, kernel=1, output="y")
    after, report = optimize_and_compare(net.model([("x", [1, 3, 9, 9])], ["y"]))
    assert report.counts["nchwc-pool"] == 1
    assert len(nchwc_nodes(after, op_type)) == 1 and standard_nodes(after, op_type) == []
    assert len(nchwc_nodes(after, "ReorderOutput")) == 1  # the graph output's only


def test_pool_input_of_unaligned_channels_runs_blocked():
    """A pool of a plain input of 24 channels (B=16), before a convolution: ReorderInput pads it."""
    net = Net(30)
    net.conv(net.add("MaxPool", "x", kernel_shape=[2, 2]), HALF, 2 * B, kernel=1, output="y")
    after, report = optimize_and_compare(net.model([("x", [1, HALF, 6, 6])], ["y"]))
    assert report.counts["nchwc-pool-input"] == 1
    assert len(nchwc_nodes(after, "MaxPool")) == 1


@pytest.mark.parametrize("pool", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("channels", [3, 5, 6])
@pytest.mark.parametrize("check", [True, False])
def test_pool_input_of_channels_reorder_input_cannot_take_stays_plain(pool, channels, check):
    """onnxruntime's ReorderInput takes multiples of 4 channels only: a pool of an RGB image was
    written blocked and failed to run (with the check, the whole model was refused)."""
    net = Net(32)
    net.add(pool, "x", kernel_shape=[2, 2], output="y")
    model = net.model([("x", [1, channels, 6, 6])], ["y"])
    after, _ = assert_not_converted(
        model, "nchwc-pool-input", f"{channels} channels are not a multiple of 4 (ReorderInput)", check=check
    )
    x = np.random.default_rng(channels).standard_normal((1, channels, 6, 6), dtype=np.float32)
    np.testing.assert_array_equal(run(after, {"x": x})[0], run(model, {"x": x})[0])


def two_conv_concat(axis: int, c_first: int) -> onnx.ModelProto:
    net = Net(31)
    a, b = net.conv("x", 2 * B, c_first), net.conv("x", 2 * B, 2 * B)
    net.add("Concat", a, b, axis=axis, output="y", name="concat")
    return net.model([("x", [1, 2 * B, 6, 6])], ["y"])


def test_concat_along_height_not_converted():
    """Concat along H: not the blocked channel axis; each conv's output is reordered back."""
    model = two_conv_concat(axis=2, c_first=2 * B)
    after, report = optimize_and_compare(model, trace=True)
    assert "nchwc-concat" not in report.counts and declines(report, "nchwc-concat") == []
    (concat,) = nodes_of(after, "Concat")
    assert all(producers(after)[i].op_type == "ReorderOutput" for i in concat.input)


def test_concat_with_unaligned_part_not_converted():
    """A part of 24 channels (B=16) carries padding: the blocked tensors cannot be joined."""
    model = two_conv_concat(axis=1, c_first=HALF)
    after, report = optimize_and_compare(model, trace=True)
    assert "nchwc-concat" not in report.counts
    assert any("are not multiples of" in r for r in declines(report, "nchwc-concat"))
    (concat,) = nodes_of(after, "Concat")
    assert all(producers(after)[i].op_type == "ReorderOutput" for i in concat.input)


def test_conv_output_that_is_a_graph_output():
    """Conv0's output is a graph output and feeds Conv1: both convert, the reorders between them
    cancel, and a ReorderOutput still produces the graph output under its name."""
    net = Net(32)
    first = net.conv("x", 2 * B, 2 * B, output="stage1")
    net.conv(first, 2 * B, 2 * B, output="y")
    model = net.model([("x", [1, 2 * B, 6, 6])], ["stage1", "y"])
    after, report = optimize_and_compare(model)
    assert report.counts == {"nchwc-conv": 2, "nchwc-reorder-cancel": 1}
    assert [o.name for o in after.graph.output] == ["stage1", "y"]
    assert {n.output[0] for n in nchwc_nodes(after, "ReorderOutput")} == {"stage1", "y"}


def test_conv_relu_where_conv_output_is_a_graph_output():
    """Conv -> Relu, with the conv output also a graph output: no fusion of the Relu may hide it."""
    net = Net(33)
    net.add("Relu", net.conv("x", 2 * B, 2 * B, output="c"), output="y")
    model = net.model([("x", [1, 2 * B, 6, 6])], ["c", "y"])
    after, _ = optimize_and_compare(model)
    assert nchwc_nodes(after, "Conv") and [o.name for o in after.graph.output] == ["c", "y"]


# ---------------------------------------------------------------------- light models

LIGHT = ["resnet50", "squeezenet", "densenet121", "inception_v1", "shufflenet"]
BLOCK_REASONS = ("not a multiple of", "not multiples of")


@functools.cache
def optimized_light(name: str):
    """The randomized light model with its logits (the Softmax input; densenet121 has no Softmax
    and its output is the logits) as a graph output, optimized for onnxruntime with a trace."""
    assert name in LIGHT_MODELS
    model = randomize_constants(onnx.load(light_model(name)))
    softmaxes = nodes_of(model, "Softmax")
    if softmaxes:
        inferred = onnx.shape_inference.infer_shapes(model)
        (logits,) = [v for v in inferred.graph.value_info if v.name == softmaxes[0].input[0]]
        model.graph.output.append(logits)
    after, report = fuser.optimize(model, target="onnxruntime", trace=True)
    return model, after, report


@pytest.mark.parametrize("name", LIGHT)
def test_light_model(name):
    """Every convolution converts to NCHWc except those the trace says were declined for
    block-size reasons; one guard; outputs (logits included) agree with the original."""
    model, after, report = optimized_light(name)
    assert report.verdict is not None and report.verdict.passed
    assert [o.name for o in after.graph.output] == [o.name for o in model.graph.output]
    assert opsets_of(after)[NCHWC] == 1
    assert nchwc_nodes(after, "Conv")
    assert len(guards(after)) == 1
    block_declined = {
        d.node
        for d in report.engine.declined
        if d.rule in ("nchwc-conv", "nchwc-fused-conv") and any(r in d.reason for r in BLOCK_REASONS)
    }
    left = [n.name for n in after.graph.node if n.op_type in ("Conv", "FusedConv") and n.domain != NCHWC]
    assert set(left) <= block_declined, set(left) - block_declined
    if name != "shufflenet":
        assert left == []
    elif 34 % B:  # shufflenet's 1x1 convolutions in 4 groups of 34 channels
        assert left
        assert any("channels per group are not a multiple" in d.reason for d in report.engine.declined)
        # its depthwise 3x3 convolutions of 136 channels are converted, padded to the block (with
        # B = 8 its grouped 1x1 convolutions of 136 channels per group are too: not depthwise)
        depthwise = [
            n
            for n in nchwc_nodes(after, "Conv")
            if attrs_of(n).get("group", 1) > 1 and initializer_array(after, n.input[1]).shape[1] == 1
        ]
        assert depthwise and all(attrs_of(n)["group"] % B == 0 for n in depthwise)
    data = next(i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer})
    shape = [d.dim_value for d in data.type.tensor_type.shape.dim]
    feeds = {data.name: np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
    expected, actual = run(model, feeds), run(after, feeds)
    for e, a in zip(expected, actual):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, e, **LIGHT_TOL)
