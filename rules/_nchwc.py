"""onnxruntime's NCHWc layout: the blocked tensor format of its fastest CPU kernels.

A tensor in NCHWc form keeps the shape [N, Cp, H, W] but stores [N, Cp/B, H, W, B]:
channels are padded with zeros to Cp, a multiple of the block size B, and every run
of B channels is interleaved so that one SIMD register holds one pixel of B channels.
B is chosen by onnxruntime's MLAS library for the CPU it runs on (16 with AVX-512, 8
with AVX2), so a model holding NCHWc weights is only correct where B is the same. The
rules take B from the run (`m.context.nchwc_block`: `--nchwc-block`, by default this
machine's) and plant a guard that makes the model fail to run, loudly, on a machine
whose B differs.

The padding channels of a NCHWc tensor hold finite junk (an activation of zero, say);
every NCHWc consumer ignores them and ReorderOutput drops them.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from fuser import Builder, Match, op

NCHWC = "com.microsoft.nchwc"
nchwc = op.domain(NCHWC)
EMITS = {NCHWC: 1}
GUARD_KEY = "nchwc-block-size-guard"


def machine_note() -> str:
    return (
        "the model uses onnxruntime's NCHWc layout for one block size (nchwc_block in the report, "
        "--nchwc-block): onnxruntime refuses to run it on a machine with another block size; "
        "use --disable 'nchwc-*' for a model meant for other machines or GPU providers"
    )


def require_block_size(m: Match) -> int:
    """The block size the model is written for (the run's --nchwc-block); declines without one."""
    size = m.context.nchwc_block
    m.require(size > 1, "onnxruntime on this machine has no NCHWc kernels")
    return size


def padded(channels: int, block: int) -> int:
    return -(-channels // block) * block


def pad_channels(array: np.ndarray, block: int) -> np.ndarray:
    """Zero-pad axis 0 to a multiple of `block`."""
    out = np.zeros((padded(array.shape[0], block),) + array.shape[1:], array.dtype)
    out[: array.shape[0]] = array
    return out


def blocked_filter(weight: np.ndarray, block: int, blocked_input: bool) -> np.ndarray:
    """An OIHW filter in the layout NCHWc Conv reads, as an [Op, I, H, W] tensor.

    blocked_input: the input is NCHWc too, so input channels are padded and blocked as
    well (memory order [O/B, I/B, H, W, Bi, Bo]); otherwise only outputs are
    ([O/B, I, H, W, Bo]). Padded filter entries are zero, so the input's padding
    channels, whatever they hold, add nothing.
    """
    w = pad_channels(weight, block)
    if blocked_input:
        w = pad_channels(w.transpose(1, 0, 2, 3), block).transpose(1, 0, 2, 3)
    out_channels, in_channels, height, width = w.shape
    if blocked_input:
        blocks = w.reshape(out_channels // block, block, in_channels // block, block, height, width)
        ordered = blocks.transpose(0, 2, 4, 5, 3, 1)
    else:
        ordered = w.reshape(out_channels // block, block, in_channels, height, width).transpose(0, 2, 3, 4, 1)
    return np.ascontiguousarray(ordered).reshape(w.shape)


def require_reorderable(m: Match, channels: int, what: str = "channels") -> None:
    """Decline unless onnxruntime's ReorderInput can take `channels`: its MLAS reorder of a
    plain tensor handles multiples of 4 only (a model with 3 would be written and fail to run)."""
    m.require(channels % 4 == 0, f"{channels} {what} are not a multiple of 4 (ReorderInput)")


def channel_count(m: Match, tensor: str) -> int:
    """The channel count of a 4-D NCHW tensor; declines if unknown."""
    shape = m.shape_of(tensor)
    m.require(shape is not None and len(shape) == 4, "the input is not known to be 4-D")
    m.require(isinstance(shape[1], int), "the channel count is not fixed")
    return shape[1]


def guarded_bias(b: Builder, bias: np.ndarray | None, block: int, out_channels: int) -> str | np.ndarray | None:
    """The padded bias, plus (in the first NCHWc rewrite of a graph) a zero that only a
    machine with block size `block` can compute: elsewhere the model fails to run
    instead of computing wrong values."""
    guard = _new_guard(b, block)
    if guard is None:
        return bias
    if bias is None:
        bias = np.zeros(padded(out_channels, block), np.float32)
    return b.Add(bias, guard)


def guarded(b: Builder, tensor: str, block: int) -> str:
    """`tensor`, plus the block-size guard's zero if this is the graph's first rewrite that
    depends on the block size (see guarded_bias)."""
    guard = _new_guard(b, block)
    return tensor if guard is None else b.Add(tensor, guard)


def _new_guard(b: Builder, block: int) -> str | None:
    """The guard's zero when this rewrite creates it; None when the graph already has it."""
    created = []

    def make(builder: Builder) -> str:
        created.append(True)
        probe = builder.op("ReorderInput", np.zeros((1, 4, 1, 1), np.float32), domain=NCHWC)
        same_block = builder.Reshape(probe, np.array([block], np.int64))
        return builder.Gather(same_block, np.array(0, np.int64))

    guard = b.once(GUARD_KEY, make)
    return guard if created else None


# Activations every onnxruntime with NCHWc kernels applies in its NCHWc Conv, and those only
# newer ones do (asked of the one installed here: a model written here is for this machine).
CONV_ACTIVATIONS = frozenset({"Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "Clip"})
NEWER_CONV_ACTIVATIONS = ("HardSwish",)


@functools.cache
def conv_activations() -> frozenset[str]:
    """The activations the installed onnxruntime's NCHWc Conv applies as it writes its output."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    supported = set(CONV_ACTIVATIONS)
    for kind in NEWER_CONV_ACTIVATIONS:
        graph = helper.make_graph(
            [
                helper.make_node("ReorderInput", ["x"], ["blocked"], domain=NCHWC),
                helper.make_node("Conv", ["blocked", "w"], ["y"], domain=NCHWC, activation=kind),
            ],
            "probe",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 2, 2])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            [numpy_helper.from_array(np.zeros((16, 16, 1, 1), np.float32), "w")],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(NCHWC, 1)])
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 4
        try:
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - an activation this onnxruntime does not know is an answer
            continue
        supported.add(kind)
    return frozenset(supported)


def reorder_output(b: Builder, blocked: str, channels: int) -> str:
    return b.op("ReorderOutput", blocked, domain=NCHWC, channels=int(channels))


def is_float32(m: Match, tensor: str) -> None:
    dtype = m.dtype_of(tensor)
    m.require(dtype == np.dtype(np.float32), "NCHWc kernels take float32, this tensor is %s", dtype)


def channels_of(m: Match, reorder_output_node: str) -> int:
    """The logical channel count a matched ReorderOutput restores (NCHW order only)."""
    m.require(m.attr(reorder_output_node, "channels_last", 0) == 0, "the reorder writes channels-last data")
    return int(m.attr(reorder_output_node, "channels", 0))


# Element-wise operators of one input that run on a blocked tensor as they are
# (nchwc-elementwise carries them into the layout), by domain. Each keeps finite padding
# channels finite, which NCHWc consumers rely on: a zero filter entry times an infinity is NaN,
# in a real channel. So no Exp, Log, Div, Sqrt, Pow or Softplus here.
CARRIED_UNARY = {
    "": frozenset(
        {"Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Clip", "Gelu", "Erf", "Abs", "Neg"}
        | {"Elu", "Selu", "Celu", "Softsign", "Mish"}
    ),
    "com.microsoft": frozenset({"QuickGelu", "Gelu", "FastGelu"}),
}


def is_carried_unary(info) -> bool:
    """An element-wise operator of one input that can run on a blocked tensor as it is."""
    if info.op_type not in CARRIED_UNARY.get(info.domain, ()):
        return False
    inputs = [name for name in info.inputs if name]
    # Clip's bounds are scalars; FastGelu's bias runs along the last axis, which blocking reorders.
    return len(inputs) == 1 or info.op_type == "Clip"


# Operators a NCHWc region can hold besides the carried element-wise ones: convolutions, and
# what the nchwc-* rules carry into the blocked layout next to them (pools, Concat,
# BatchNormalization, a residual Add).
_REGION_OPS = {
    "Conv",
    "FusedConv",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "GlobalMaxPool",
    "Concat",
    "BatchNormalization",
    "Add",
    "ReorderInput",
    "ReorderOutput",
}
# The blocked kernels save a fraction of each multiply-add, a reorder costs a copy of a tensor.
# Taking the tensors around a convolution to be of similar size, a lone convolution pays when it
# does at least this many multiply-adds per output element for each tensor it must reorder.
MACS_PER_REORDER = 4


def _source(graph, tensor: str) -> str:
    """Where `tensor` comes from, looking up through carried element-wise operators."""
    while (producer := graph.producer(tensor)) is not None and is_carried_unary(graph.node(producer)):
        tensor = graph.node(producer).inputs[0]
    return tensor


def _reached(graph, tensor: str) -> list[str]:
    """`tensor` and what carried element-wise operators compute from it, down every path."""
    reached, pending = [], [tensor]
    while pending:
        name = pending.pop()
        reached.append(name)
        for consumer in graph.op_consumers(name):
            info = graph.node(consumer)
            if is_carried_unary(info):
                pending.extend(o for o in info.outputs if o)
    return reached


def read_by_region(graph, tensor: str) -> bool:
    """Whether an operator a NCHWc region can hold reads `tensor` (or what carried element-wise
    operators compute from it): there, a result computed blocked saves a reorder."""
    return any(
        graph.node(c).op_type in _REGION_OPS for name in _reached(graph, tensor) for c in graph.op_consumers(name)
    )


def region_cost(m: Match, start: int) -> tuple[int, int] | None:
    """(multiply-adds per output element, tensors reordered) for a convolution none of whose
    neighbours can stay blocked; None when a neighbour can (the region is then taken to pay).

    Carried element-wise operators (an activation, say) are looked through: they run in
    whichever layout their input has, so it is their other neighbours that decide. Such a
    convolution alone pays a reorder for each tensor it reads or writes, except an image's few
    channels, which NCHWc convolutions read straight from NCHW. Only the weights and the
    graph's structure enter the estimate, never inferred shapes (shape inference does not know
    com.microsoft operators), and a lone convolution stays lone whatever happens to other
    convolutions: the decision is the same in any visiting order and again on the result.
    """
    graph = m.graph
    info = graph.node(start)
    weight = graph.constant_value(info.inputs[1]) if len(info.inputs) > 1 else None
    if weight is None or weight.ndim < 2:
        return None
    # As nchwc-conv decides it, from the filter: few input channels are read straight from NCHW.
    unblocked_input = int(info.attr("group", 1) or 1) == 1 and weight.shape[1] < m.context.nchwc_block
    crossings = 0
    for slot, name in enumerate(info.inputs):
        if not name or (slot == 0 and unblocked_input):
            continue
        source = _source(graph, name)
        producer = graph.producer(source)
        if producer is None:
            crossings += not graph.is_constant(source)  # a graph input
        elif graph.node(producer).op_type in _REGION_OPS:
            return None
        else:
            crossings += 1
    for name in info.outputs:
        if not name:
            continue
        for tensor in _reached(graph, name):
            readers = [graph.node(c) for c in graph.op_consumers(tensor)]
            if any(r.op_type in _REGION_OPS for r in readers):
                return None
            # One reorder serves every plain reader of a tensor.
            crossings += graph.is_graph_output(tensor) or any(not is_carried_unary(r) for r in readers)
    return math.prod(weight.shape[1:]), crossings


def require_region_pays(m: Match, node: str) -> None:
    """Declines a convolution whose region reorders more than its convolutions can repay."""
    cost = region_cost(m, m.node(node).id)
    if cost is not None:
        m.require(cost[0] >= MACS_PER_REORDER * cost[1], region_message(*cost))


def region_message(work: int, crossings: int) -> str:
    return (
        f"no neighbour can stay blocked, and it does {work} multiply-adds per output element against "
        f"{crossings} tensor(s) to reorder (fewer than {MACS_PER_REORDER} each): the blocked layout would not "
        "pay, so it stays NCHW"
    )
