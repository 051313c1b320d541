"""onnxruntime's NCHWc operators written with standard ONNX operators, for any block size.

onnxruntime runs its com.microsoft.nchwc operators only with the block size of the machine
it runs on, so a model written for another block (`--nchwc-block 8` on an AVX-512 machine,
say) cannot be run here as it is. To check it anyway, `lower` rewrites every NCHWc operator
into standard operators that compute the same values for a given block size B, and
onnxruntime runs those.

A NCHWc tensor of shape [N, Cp, H, W] holds its values in the memory order
[N, Cp/B, H, W, B]. The lowered model keeps such tensors exactly as they are (same shape,
same memory), so the standard operators that nchwc rules leave between NCHWc operators
(a residual Add, a channel Concat, the block-size guard's Reshape) see what they see on a
machine with block B. Each NCHWc operator unblocks its inputs (Reshape, Transpose), applies
the standard operator, and blocks its output again. Filters, constant in every model fuser
writes, are unblocked here with numpy.

tests/rules/test_nchwc_blocks.py checks the lowering against onnxruntime's own kernels at
this machine's block size, which is what makes the check at the other block size mean
anything.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fuser.errors import UsageError
from fuser.graph import all_graph_protos

NCHWC = "com.microsoft.nchwc"


class LoweringError(UsageError):
    """A NCHWc operator this module cannot write with standard operators, so a model for
    another machine's block cannot be checked here."""

    def __init__(self, message: str):
        super().__init__(f"{message} (--nchwc-block auto writes for this machine, which the check can run)")


def has_nchwc(model: onnx.ModelProto) -> bool:
    return any(node.domain == NCHWC for graph in all_graph_protos(model.graph) for node in graph.node)


def written_block(model: onnx.ModelProto) -> int | None:
    """The NCHWc block size a model fuser wrote is for, read off its block-size guard (a
    constant's ReorderInput reshaped to [B]); None for a model without one."""
    for graph in all_graph_protos(model.graph):
        constants = {t.name: t for t in graph.initializer}
        probes = {
            node.output[0]
            for node in graph.node
            if node.domain == NCHWC and node.op_type == "ReorderInput" and node.input[0] in constants
        }
        for node in graph.node:
            if node.op_type == "Reshape" and node.domain in ("", "ai.onnx") and node.input[0] in probes:
                shape = constants.get(node.input[1])
                if shape is not None and numpy_helper.to_array(shape).size == 1:
                    return int(numpy_helper.to_array(shape).reshape(()))
    return None


def lower(model: onnx.ModelProto, block: int) -> onnx.ModelProto:
    """A copy of `model` whose com.microsoft.nchwc operators, read as written for block size
    `block`, are replaced by standard ONNX operators computing the same values."""
    if not has_nchwc(model):
        return model
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    if opset < 8:
        raise LoweringError(f"NCHWc operators can be checked at another block size only from opset 8 (this is {opset})")
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    graphs = list(all_graph_protos(lowered.graph))
    constants = {t.name: t for g in graphs for t in g.initializer}
    names = {n for g in graphs for node in g.node for n in (node.name, *node.input, *node.output)} | set(constants)
    for graph in graphs:
        _Lowering(graph, block, constants, names, opset).run()
    return lowered


class _Lowering:
    def __init__(self, graph: onnx.GraphProto, block: int, constants: dict, names: set[str], opset: int):
        self.graph = graph
        self.block = block
        self.opset = opset  # the default domain's: the standard operators written are of it
        self.constants = constants
        self.names = names
        self.counter = itertools.count()
        self.nodes: list[onnx.NodeProto] = []
        self.prefix = ""

    def run(self) -> None:
        original = list(self.graph.node)
        del self.graph.node[:]
        for node in original:
            if node.domain != NCHWC:
                self.nodes.append(node)
                continue
            self.prefix = node.name or node.output[0]
            lower_op = getattr(self, f"_{node.op_type}", None)
            if lower_op is None:
                raise LoweringError(f"cannot check NCHWc operator '{node.op_type}' at another block size")
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute[:]}
            lower_op(node, attrs)
        self.graph.node.extend(self.nodes)

    # ------------------------------------------------------------- building

    def _fresh(self, hint: str) -> str:
        while True:
            name = f"{self.prefix}/lowered/{hint}_{next(self.counter)}"
            if name not in self.names:
                self.names.add(name)
                return name

    def _op(self, op_type: str, *inputs: str, output: str | None = None, **attrs) -> str:
        output = output or self._fresh(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], name=self._fresh(op_type), **attrs))
        return output

    def _constant(self, value: np.ndarray, hint: str = "const") -> str:
        name = self._fresh(hint)
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def _dims(self, tensor: str) -> tuple[str, str, str]:
        """[N], [C] and [H, W] of a 4-D tensor, as int64 tensors."""
        shape = self._op("Shape", tensor)
        return tuple(self._op("Gather", shape, self._constant(np.array(i, np.int64))) for i in ([0], [1], [2, 3]))

    def _unblocked(self, tensor: str) -> str:
        """[N, Cp, H, W] held as [N, Cp/B, H, W, B]  ->  the same values in NCHW order."""
        n, _, hw = self._dims(tensor)
        split = self._op("Concat", n, self._constant(np.array([-1], np.int64)), hw, self._block_dim(), axis=0)
        blocks = self._op("Transpose", self._op("Reshape", tensor, split), perm=[0, 1, 4, 2, 3])
        return self._op("Reshape", blocks, self._op("Shape", tensor))

    def _blocked(self, tensor: str, output: str | None = None) -> str:
        """NCHW values with Cp a multiple of B  ->  held as [N, Cp/B, H, W, B] in shape [N, Cp, H, W]."""
        n, _, hw = self._dims(tensor)
        split = self._op("Concat", n, self._constant(np.array([-1], np.int64)), self._block_dim(), hw, axis=0)
        blocks = self._op("Transpose", self._op("Reshape", tensor, split), perm=[0, 1, 3, 4, 2])
        return self._op("Reshape", blocks, self._op("Shape", tensor), output=output)

    def _block_dim(self) -> str:
        return self._constant(np.array([self.block], np.int64), "block")

    def _filter(self, name: str) -> np.ndarray:
        tensor = self.constants.get(name)
        if tensor is None:
            raise LoweringError(f"the NCHWc filter '{name}' is not an initializer")
        return numpy_helper.to_array(tensor)

    # ----------------------------------------------------------- operators

    def _ReorderInput(self, node: onnx.NodeProto, attrs: dict) -> None:
        x = node.input[0]
        if attrs.get("channels_last", 0):
            x = self._op("Transpose", x, perm=[0, 3, 1, 2])
        n, c, hw = self._dims(x)
        block = self._block_dim()
        # Zero channels up to the next multiple of the block.
        one = self._constant(np.array([1], np.int64))
        rounded = self._op("Mul", self._op("Div", self._op("Sub", self._op("Add", c, block), one), block), block)
        extra = self._op("Concat", n, self._op("Sub", rounded, c), hw, axis=0)
        zeros = self._op("Expand", self._constant(np.zeros((1, 1, 1, 1), np.float32)), extra)
        self._blocked(self._op("Concat", x, zeros, axis=1), output=node.output[0])

    def _ReorderOutput(self, node: onnx.NodeProto, attrs: dict) -> None:
        channels = self._constant(np.arange(int(attrs["channels"]), dtype=np.int64), "channels")
        if not attrs.get("channels_last", 0):
            self._op("Gather", self._unblocked(node.input[0]), channels, output=node.output[0], axis=1)
            return
        plain = self._op("Gather", self._unblocked(node.input[0]), channels, axis=1)
        self._op("Transpose", plain, output=node.output[0], perm=[0, 2, 3, 1])

    def _Conv(self, node: onnx.NodeProto, attrs: dict) -> None:
        group = int(attrs.get("group", 1))
        block = self.block
        if node.input[1] in self.constants:
            weight = self._filter(node.input[1])
            out_channels, in_channels = weight.shape[:2]
            # As onnxruntime's kernels tell them apart: depthwise and few-input-channel filters
            # are blocked by output channel only ([O/B, I, H, W, Bo]), and the latter read NCHW.
            depthwise = group > 1 and in_channels == 1
            nchw_input = group == 1 and in_channels < block
            if depthwise or nchw_input:
                plain = weight.reshape(out_channels // block, in_channels, *weight.shape[2:], block)
                plain = plain.transpose(0, 4, 1, 2, 3)
            else:
                plain = weight.reshape(out_channels // block, in_channels // block, *weight.shape[2:], block, block)
                plain = plain.transpose(0, 5, 1, 4, 2, 3)
            w = self._constant(np.ascontiguousarray(plain).reshape(weight.shape), "filter")
        else:
            w, nchw_input = self._computed_filter(node, attrs), False
        x = node.input[0] if nchw_input else self._unblocked(node.input[0])
        inputs = [x, w] + ([node.input[2]] if len(node.input) > 2 and node.input[2] else [])
        conv_attrs = {k: v for k, v in attrs.items() if k not in ("activation", "activation_params")}
        y = self._op("Conv", *inputs, **conv_attrs)
        if len(node.input) > 3 and node.input[3]:
            y = self._op("Add", y, self._unblocked(node.input[3]))
        y = self._activation(y, attrs.get("activation"), list(attrs.get("activation_params", [])))
        self._blocked(y, output=node.output[0])

    def _computed_filter(self, node: onnx.NodeProto, attrs: dict) -> str:
        """A filter computed at run time (nchwc-gate's): a depthwise 1x1 one, [Cp, 1, 1, 1],
        whose blocked order ([Cp/B, 1, 1, 1, B]) is its plain order."""
        kernel = [int(k) for k in attrs.get("kernel_shape", [])]
        if int(attrs.get("group", 1)) == 1 or kernel != [1, 1]:
            raise LoweringError(f"the NCHWc filter '{node.input[1]}' is computed, and not a depthwise 1x1 one")
        return node.input[1]

    def _activation(self, y: str, kind: str | bytes | None, params: list[float]) -> str:
        kind = kind.decode() if isinstance(kind, bytes) else kind
        if not kind:
            return y
        if kind == "HardSwish" and self.opset < 14:  # no HardSwish yet: x * HardSigmoid(x, 1/6, 1/2)
            return self._op("Mul", y, self._op("HardSigmoid", y, alpha=1 / 6, beta=0.5))
        if kind in ("Relu", "Sigmoid", "Tanh", "HardSwish"):
            return self._op(kind, y)
        if kind == "LeakyRelu":
            return self._op(kind, y, alpha=params[0] if params else 0.01)
        if kind == "HardSigmoid":
            alpha, beta = params if params else (0.2, 0.5)
            return self._op(kind, y, alpha=alpha, beta=beta)
        if kind == "Clip":
            low, high = (self._constant(np.array(v, np.float32), "clip") for v in params)
            return self._op("Min", self._op("Max", y, low), high)
        raise LoweringError(f"cannot check a NCHWc Conv with activation '{kind}' at another block size")

    def _Upsample(self, node: onnx.NodeProto, attrs: dict) -> None:
        """By whole factors on H and W: nearest repeats each pixel (o // factor), linear
        interpolates with the coordinate mode given (rules/nchwc_upsample.py)."""
        factors = np.array(attrs["scales"], np.float32)  # all four axes
        plain = self._unblocked(node.input[0])
        if self.opset >= 11:
            linear = attrs.get("mode", b"nearest") in ("linear", b"linear")
            coordinates = attrs.get("coordinate_transformation_mode", "asymmetric") if linear else "asymmetric"
            coordinates = coordinates.decode() if isinstance(coordinates, bytes) else coordinates
            resized = self._op(
                "Resize",
                plain,
                "",
                self._constant(factors, "scales"),
                mode="linear" if linear else "nearest",
                coordinate_transformation_mode=coordinates,
                **({} if linear else {"nearest_mode": "floor"}),
            )
        elif self.opset == 9:  # asymmetric coordinates, floor rounding: what the rule took
            mode = attrs.get("mode", b"nearest")
            resized = self._op("Upsample", plain, self._constant(factors, "scales"), mode=mode)
        else:
            raise LoweringError(f"cannot check a NCHWc Upsample at another block size at opset {self.opset}")
        self._blocked(resized, output=node.output[0])

    def _pool(self, node: onnx.NodeProto, attrs: dict) -> None:
        pooled = self._op(node.op_type, self._unblocked(node.input[0]), **attrs)
        self._blocked(pooled, output=node.output[0])

    _MaxPool = _AveragePool = _GlobalMaxPool = _GlobalAveragePool = _pool
