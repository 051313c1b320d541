"""The NCHWc rules at both block sizes, 8 and 16, on any machine.

onnxruntime runs its com.microsoft.nchwc operators only at the block size of the machine it
runs on. fuser/nchwc.py writes them as standard operators for a given block size; these tests
first check that lowering against onnxruntime's own kernels at this machine's block size, then
optimize with `nchwc_block=8` and `nchwc_block=16` and compare each result, lowered, with the
original in onnxruntime (graph optimizations off). tests/rules/test_nchwc.py covers the rules
in detail at this machine's block size.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.rules._nchwc import conv_activations
from onnx import helper, numpy_helper

import fuser
from fuser.context import machine_nchwc_block
from fuser.errors import UsageError
from fuser.nchwc import NCHWC, lower
from tests.helpers import make_model, run

BLOCKS = (8, 16)
TOL = {"rtol": 1e-4, "atol": 1e-4}


def _weight(rng, *shape) -> np.ndarray:
    return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)


def image_model() -> onnx.ModelProto:
    """An image convolution (3 channels, read as NCHW), a residual Add, a depthwise convolution,
    MaxPool and a Clip activation."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["a"]),
        helper.make_node("Relu", ["a"], ["r2"]),
        helper.make_node("Conv", ["r2", "w3"], ["c3"], pads=[1, 1, 1, 1], group=24),
        helper.make_node("MaxPool", ["c3"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p", "w4", "b4"], ["c4"]),
        helper.make_node("Clip", ["c4", "low", "high"], ["y"]),
    ]
    inits = {
        "w1": _weight(rng, 24, 3, 3, 3),
        "b1": _weight(rng, 24, 1)[:, 0],
        "w2": _weight(rng, 24, 24, 3, 3),
        "b2": _weight(rng, 24, 1)[:, 0],
        "w3": _weight(rng, 24, 1, 3, 3),
        "w4": _weight(rng, 40, 24, 1, 1),
        "b4": _weight(rng, 40, 1)[:, 0],
        "low": np.array(0, np.float32),
        "high": np.array(0.5, np.float32),
    }
    return make_model(nodes, [("x", np.float32, ["batch", 3, 16, 16])], [("y", np.float32, ["batch", 40, 8, 8])], inits)


def feature_model() -> onnx.ModelProto:
    """A grouped convolution, LeakyRelu, HardSigmoid and Tanh activations, AveragePool, a
    BatchNormalization of its own, a channel Concat and the global pools."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], group=2),
        helper.make_node("LeakyRelu", ["c1"], ["l1"], alpha=0.1),
        helper.make_node("Conv", ["l1", "w2", "b2"], ["c2"]),
        helper.make_node("HardSigmoid", ["c2"], ["h2"], alpha=0.2, beta=0.5),
        helper.make_node("AveragePool", ["h2"], ["p"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["p", "scale", "shift", "mean", "var"], ["bn"]),
        helper.make_node("Conv", ["bn", "w3", "b3"], ["c3"], pads=[1, 1, 1, 1]),
        helper.make_node("Tanh", ["c3"], ["t3"]),
        helper.make_node("Concat", ["t3", "l1"], ["cat"], axis=1),
        helper.make_node("GlobalAveragePool", ["cat"], ["y"]),
        helper.make_node("GlobalMaxPool", ["cat"], ["z"]),
    ]
    inits = {
        "w1": _weight(rng, 32, 16, 3, 3),
        "w2": _weight(rng, 32, 32, 1, 1),
        "b2": _weight(rng, 32, 1)[:, 0],
        "scale": rng.uniform(0.5, 1.5, 32).astype(np.float32),
        "shift": rng.normal(0, 0.5, 32).astype(np.float32),
        "mean": rng.normal(0, 0.5, 32).astype(np.float32),
        "var": rng.uniform(0.5, 1.5, 32).astype(np.float32),
        "w3": _weight(rng, 32, 32, 3, 3),
        "b3": _weight(rng, 32, 1)[:, 0],
    }
    outputs = [("y", np.float32, [1, 64, 1, 1]), ("z", np.float32, [1, 64, 1, 1])]
    return make_model(nodes, [("x", np.float32, [1, 32, 12, 12])], outputs, inits)


def carried_model() -> onnx.ModelProto:
    """A ConvNeXt-like block (depthwise Conv, Transposes around a LayerNormalization over
    channels) and standard operators on blocked tensors: HardSwish, Tanh, a Sub of the two."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[3, 3, 3, 3], group=24),
        helper.make_node("Transpose", ["c1"], ["nhwc"], perm=[0, 2, 3, 1]),
        helper.make_node("LayerNormalization", ["nhwc", "gamma", "beta"], ["normed"], axis=-1),
        helper.make_node("Transpose", ["normed"], ["nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["nchw", "w2", "b2"], ["c2"]),
        helper.make_node("HardSwish", ["c2"], ["h2"]),
        helper.make_node("Tanh", ["h2"], ["t2"]),
        helper.make_node("Sub", ["h2", "t2"], ["d2"]),
        helper.make_node("Conv", ["d2", "w3"], ["y"], pads=[1, 1, 1, 1]),
    ]
    inits = {
        "w1": _weight(rng, 24, 1, 7, 7),
        "b1": _weight(rng, 24, 1)[:, 0],
        "gamma": rng.uniform(0.5, 1.5, 24).astype(np.float32),
        "beta": rng.normal(0, 0.5, 24).astype(np.float32),
        "w2": _weight(rng, 20, 24, 1, 1),
        "b2": _weight(rng, 20, 1)[:, 0],
        "w3": _weight(rng, 24, 20, 3, 3),
    }
    return make_model(nodes, [("x", np.float32, [1, 24, 9, 9])], [("y", np.float32, [1, 24, 9, 9])], inits)


def token_model() -> onnx.ModelProto:
    """SegFormer's way between two convolutions: flatten(2).transpose(1, 2), a LayerNormalization
    over channels, transpose(1, 2).reshape(N, C, H, W)."""
    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["c1", "flat"], ["f"]),
        helper.make_node("Transpose", ["f"], ["tokens"], perm=[0, 2, 1]),
        helper.make_node("LayerNormalization", ["tokens", "gamma", "beta"], ["normed"], axis=-1),
        helper.make_node("Transpose", ["normed"], ["back"], perm=[0, 2, 1]),
        helper.make_node("Reshape", ["back", "image"], ["map"]),
        helper.make_node("Conv", ["map", "w2"], ["y"], pads=[1, 1, 1, 1]),
    ]
    inits = {
        "w1": _weight(rng, 20, 16, 3, 3),
        "b1": _weight(rng, 20, 1)[:, 0],
        "flat": np.array([2, 20, -1], np.int64),
        "gamma": rng.uniform(0.5, 1.5, 20).astype(np.float32),
        "beta": rng.normal(0, 0.5, 20).astype(np.float32),
        "image": np.array([2, 20, 5, 7], np.int64),
        "w2": _weight(rng, 24, 20, 3, 3),
    }
    return make_model(nodes, [("x", np.float32, [2, 16, 5, 7])], [("y", np.float32, [2, 24, 5, 7])], inits)


def gate_model() -> onnx.ModelProto:
    """Squeeze-and-excitation as the dynamo exporter writes it (ReduceMean over H and W, then a
    gate of shape [1, C, 1, 1] times the feature map), and a stored per-channel scale of 20
    channels, which the blocks pad."""
    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("ReduceMean", ["r1"], ["pooled"], axes=[2, 3], keepdims=1),
        helper.make_node("Conv", ["pooled", "w_squeeze", "b_squeeze"], ["squeezed"]),
        helper.make_node("Relu", ["squeezed"], ["excited"]),
        helper.make_node("Conv", ["excited", "w_expand", "b_expand"], ["logits"]),
        helper.make_node("Sigmoid", ["logits"], ["gate"]),
        helper.make_node("Mul", ["gate", "r1"], ["gated"]),
        helper.make_node("Conv", ["gated", "w2", "b2"], ["c2"]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("Mul", ["r2", "scale"], ["scaled"]),
        helper.make_node("Conv", ["scaled", "w3"], ["y"], pads=[1, 1, 1, 1]),
    ]
    inits = {
        "w1": _weight(rng, 32, 16, 3, 3),
        "b1": _weight(rng, 32, 1)[:, 0],
        "w_squeeze": _weight(rng, 4, 32, 1, 1),
        "b_squeeze": _weight(rng, 4, 1)[:, 0],
        "w_expand": _weight(rng, 32, 4, 1, 1),
        "b_expand": _weight(rng, 32, 1)[:, 0],
        "w2": _weight(rng, 20, 32, 1, 1),
        "b2": _weight(rng, 20, 1)[:, 0],
        "scale": rng.uniform(0.5, 1.5, (1, 20, 1, 1)).astype(np.float32),
        "w3": _weight(rng, 24, 20, 3, 3),
    }
    return make_model(nodes, [("x", np.float32, [1, 16, 6, 6])], [("y", np.float32, [1, 24, 6, 6])], inits)


MODELS = {
    "image": image_model,
    "features": feature_model,
    "carried": carried_model,
    "tokens": token_model,
    "gate": gate_model,
}
# The NCHWc forms each model must reach at both block sizes: every operator the lowering covers.
EXPECTED_NCHWC = {
    "image": {"ReorderInput", "ReorderOutput", "Conv"},
    "features": {"ReorderInput", "ReorderOutput", "Conv", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"},
    "carried": {"ReorderInput", "ReorderOutput", "Conv"},
    "tokens": {"ReorderInput", "ReorderOutput", "Conv"},
    "gate": {"ReorderInput", "ReorderOutput", "Conv", "GlobalAveragePool"},
}
# Standard operators each model must run on blocked tensors, and its channels-last reorders.
# HardSwish goes into its convolution where this onnxruntime's NCHWc Conv applies it.
CARRIED_HARD_SWISH = set() if "HardSwish" in conv_activations() else {"HardSwish"}
EXPECTED_CARRIED = {
    "image": set(),
    "features": {"Concat"},
    "carried": {"Tanh", "Sub"} | CARRIED_HARD_SWISH,
    "tokens": set(),
    "gate": set(),
}
EXPECTED_CHANNELS_LAST = {"image": 0, "features": 0, "carried": 2, "tokens": 2, "gate": 0}


def _feeds(model: onnx.ModelProto, seed: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value or 2 for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _nchwc_ops(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in model.graph.node if n.domain == NCHWC}


def _carried_ops(model: onnx.ModelProto) -> set[str]:
    """Standard operators that read a tensor a NCHWc operator (other than ReorderOutput) wrote."""
    blocked, carried = set(), set()
    for node in model.graph.node:
        if node.domain == NCHWC:
            if node.op_type != "ReorderOutput":
                blocked.update(node.output)
        elif any(i in blocked for i in node.input):
            blocked.update(node.output)
            carried.add(node.op_type)
    return carried - {"Reshape", "Gather", "Add"}  # the block-size guard's


def _channels_last(model: onnx.ModelProto) -> int:
    return sum(
        1 for n in model.graph.node if n.domain == NCHWC and any(a.name == "channels_last" and a.i for a in n.attribute)
    )


def _assert_close(actual: list, expected: list, **tol) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype
        np.testing.assert_allclose(a, e, **tol)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_lowering_matches_onnxruntimes_kernels_at_this_machines_block(name):
    """What makes the check at the other block size mean anything: at this machine's block,
    the lowered model computes what onnxruntime's NCHWc kernels compute."""
    block = machine_nchwc_block()
    if block == 0:
        pytest.skip("onnxruntime on this machine has no NCHWc kernels to compare the lowering with")
    after, report = fuser.optimize(MODELS[name](), target="onnxruntime", nchwc_block="auto")
    assert report.context.nchwc_block == block
    assert _nchwc_ops(after) >= EXPECTED_NCHWC[name]
    lowered = lower(after, block)
    assert not _nchwc_ops(lowered)
    feeds = _feeds(after)
    _assert_close(run(lowered, feeds), run(after, feeds), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_block_size_on_any_machine(name, block):
    model = MODELS[name]()
    after, report = fuser.optimize(model, target="onnxruntime", nchwc_block=block)
    assert report.context.nchwc_block == block and report.to_dict()["nchwc_block"] == block
    assert report.verdict is not None and report.verdict.passed  # fuser's own check, lowered when foreign
    assert _nchwc_ops(after) >= EXPECTED_NCHWC[name]
    assert _carried_ops(after) == EXPECTED_CARRIED[name]
    assert _channels_last(after) == EXPECTED_CHANNELS_LAST[name]
    initializers = {t.name: numpy_helper.to_array(t) for t in after.graph.initializer}
    convs = [n for n in after.graph.node if n.domain == NCHWC and n.op_type == "Conv"]
    filters = [initializers[n.input[1]] for n in convs if n.input[1] in initializers]
    assert filters and all(f.shape[0] % block == 0 for f in filters)
    # Only nchwc-gate computes a filter at run time.
    assert all(n.input[1] in initializers for n in convs) == ("nchwc-gate" not in report.counts)
    guard_shapes = [
        initializers[n.input[1]].tolist() for n in after.graph.node if n.op_type == "Reshape" and n.domain == ""
    ]
    assert [block] in guard_shapes
    feeds = _feeds(model)
    expected = run(model, feeds)
    _assert_close(run(lower(after, block), feeds), expected, **TOL)
    if block == machine_nchwc_block():
        _assert_close(run(after, feeds), expected, **TOL)
    else:
        assert any(f"written for NCHWc block {block}" in note for note in report.notes)


def test_the_guard_refuses_a_model_lowered_for_the_other_block():
    """A model written for one block size, read as written for the other, must not run: the
    guard's Reshape of the reordered probe to [B] fails, in the lowering as on a real machine."""
    model = image_model()
    after, _ = fuser.optimize(model, target="onnxruntime", nchwc_block=8, check=False)
    with pytest.raises(Exception, match="(?i)reshape"):
        run(lower(after, 16), _feeds(model))


def test_the_block_can_be_written_as_text():
    _, report = fuser.optimize(image_model(), target="onnxruntime", nchwc_block="8", check=False)
    assert report.context.nchwc_block == 8


@pytest.mark.parametrize("wrong", ["4", 12, "avx", True])
def test_other_block_sizes_are_usage_errors(wrong):
    with pytest.raises(UsageError, match="must be one of auto, 8, 16"):
        fuser.optimize(image_model(), target="onnxruntime", nchwc_block=wrong, check=False)


def test_measure_refuses_a_block_this_machine_cannot_run():
    foreign = next(b for b in BLOCKS if b != machine_nchwc_block())
    with pytest.raises(UsageError, match=f"cannot time a model written for --nchwc-block {foreign}"):
        fuser.optimize(image_model(), target="onnxruntime", nchwc_block=foreign, measure="off")


def test_an_operator_the_lowering_does_not_know_is_a_clear_error():
    """The check of a model for another machine's block cannot run what it cannot lower."""
    model = make_model(
        [helper.make_node("Softmax", ["x"], ["y"], domain=NCHWC)],
        [("x", np.float32, [1, 8, 2, 2])],
        [("y", np.float32, [1, 8, 2, 2])],
        extra_opsets={NCHWC: 1},
        check=False,
    )
    with pytest.raises(UsageError, match="cannot check NCHWc operator 'Softmax' at another block size") as caught:
        lower(model, 8)
    assert "--nchwc-block auto" in str(caught.value)


def neck(mode: str) -> onnx.ModelProto:
    """A detector's neck: a convolution, a Resize by 2, a convolution (nchwc-upsample)."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Resize", ["c", "", "scales"], ["r"], mode=mode),
        helper.make_node("Conv", ["r", "w2"], ["y"]),
    ]
    inits = {"w1": _weight(rng, 16, 16, 3, 3), "w2": _weight(rng, 16, 16, 1, 1)}
    inits["scales"] = np.array([1, 1, 2, 2], np.float32)
    return make_model(nodes, [("x", np.float32, [1, 16, 5, 6])], [("y", np.float32, [1, 16, 10, 12])], inits, 17)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_an_upsample_is_checked_at_either_block(mode, block):
    """The check of a model for another block lowered no NCHWc Upsample: a neck written for an AVX2
    machine (block 8) was refused on an AVX-512 one, and the other way round."""
    model = neck(mode)
    after, report = fuser.optimize(model, target="onnxruntime", nchwc_block=block)
    assert report.counts.get("nchwc-upsample") == 1 and report.verdict.passed
    feeds = _feeds(model)
    _assert_close(run(lower(after, block), feeds), run(model, feeds), **TOL)
    if block == machine_nchwc_block():  # the lowering computes what the kernel does
        _assert_close(run(lower(after, block), feeds), run(after, feeds), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", BLOCKS)
def test_a_hard_swish_activation_is_lowered_below_opset_14(block):
    """Opset 13 has no HardSwish: x * HardSigmoid(x, 1/6, 1/2), as the model wrote it, fused into
    the NCHWc Conv, was lowered to a HardSwish node the check could not run."""
    if "HardSwish" not in conv_activations():
        pytest.skip("this onnxruntime's NCHWc Conv applies no HardSwish")
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("HardSigmoid", ["c"], ["gate"], alpha=1 / 6, beta=0.5),
        helper.make_node("Mul", ["c", "gate"], ["y"]),
    ]
    model = make_model(
        nodes,
        [("x", np.float32, [1, 16, 6, 6])],
        [("y", np.float32, [1, 16, 6, 6])],
        {"w": _weight(rng, 16, 16, 3, 3)},
        13,
    )
    after, report = fuser.optimize(model, target="onnxruntime", nchwc_block=block)
    activations = [a.s for n in after.graph.node if n.domain == NCHWC for a in n.attribute if a.name == "activation"]
    assert activations == [b"HardSwish"] and report.verdict.passed
    lowered = lower(after, block)
    assert "HardSwish" not in {n.op_type for n in lowered.graph.node}
    feeds = _feeds(model)
    _assert_close(run(lowered, feeds), run(model, feeds), **TOL)


def test_a_computed_filter_other_than_a_gate_is_a_clear_error():
    """Only nchwc-gate computes a filter at run time, a depthwise 1x1 one; the lowering cannot
    know the blocked order of another."""
    model = make_model(
        [helper.make_node("Conv", ["x", "w"], ["y"], domain=NCHWC, kernel_shape=[1, 1])],
        [("x", np.float32, [1, 8, 2, 2]), ("w", np.float32, [8, 8, 1, 1])],
        [("y", np.float32, [1, 8, 2, 2])],
        extra_opsets={NCHWC: 1},
        check=False,
    )
    with pytest.raises(UsageError, match="computed, and not a depthwise 1x1 one"):
        lower(model, 8)
