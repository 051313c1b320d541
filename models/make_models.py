"""Build the sample ONNX models that ship with fuser.

This script deterministically generates three small float32 models and writes
them next to itself:

* ``resnet_small.onnx`` -- a tiny ResNet-style CNN (Conv/BatchNormalization/Relu
  stem, three residual blocks including a stride-2 block with a projection
  shortcut and a grouped conv, then GlobalAveragePool -> Flatten -> MatMul ->
  Add). Exercises Conv+BN(+Relu) and MatMul+Add fusions.
* ``mlp.onnx`` -- a 784 -> 256 -> 10 multilayer perceptron built from
  MatMul/Add/Relu. Exercises MatMul+Add (Gemm) fusion.
* ``classifier_head.onnx`` -- a linear head whose logits feed Log(Softmax),
  a hand-decomposed softmax (Exp -> ReduceSum -> Div) and Log of another
  hand-decomposed softmax. Exercises softmax / log-softmax fusions.

Only ``onnx`` and ``numpy`` are used. Weights come from a seeded
``numpy.random.default_rng`` and models are serialized with
``deterministic=True``, so running the script twice yields byte-identical files.

Run it from the repository root with::

    python models/make_models.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8  # onnxruntime cannot load the newest IR versions onnx defaults to
PRODUCER_NAME = "fuser-samples"
SEED = 0
MODELS_DIR = Path(__file__).resolve().parent


class GraphBuilder:
    """Collects nodes and initializers for one graph, enforcing unique names."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set()

    def _claim(self, name: str) -> str:
        if name in self._names:
            raise ValueError(f"duplicate name: {name}")
        self._names.add(name)
        return name

    def initializer(self, name: str, array: np.ndarray) -> str:
        """Register ``array`` as an initializer called ``name``; return the name."""
        self.initializers.append(numpy_helper.from_array(array, self._claim(name)))
        return name

    def node(self, op_type: str, name: str, inputs: list[str], output: str, **attrs) -> str:
        """Add a single-output node; return the name of its output tensor."""
        self.nodes.append(helper.make_node(op_type, inputs, [self._claim(output)], name=self._claim(name), **attrs))
        return output

    # ----------------------------------------------------------- random params
    def normal(self, shape, std: float, mean: float = 0.0) -> np.ndarray:
        return self.rng.normal(mean, std, size=shape).astype(np.float32)

    def uniform(self, shape, low: float, high: float) -> np.ndarray:
        return self.rng.uniform(low, high, size=shape).astype(np.float32)

    def he_normal(self, shape, fan_in: int) -> np.ndarray:
        return self.normal(shape, std=float(np.sqrt(2.0 / fan_in)))

    # ---------------------------------------------------------- common layers
    def conv(
        self,
        prefix: str,
        x: str,
        in_ch: int,
        out_ch: int,
        kernel: int,
        stride: int = 1,
        group: int = 1,
        bias: bool = False,
    ) -> str:
        pad = kernel // 2
        fan_in = (in_ch // group) * kernel * kernel
        weight = self.initializer(
            f"{prefix}.weight",
            self.he_normal((out_ch, in_ch // group, kernel, kernel), fan_in),
        )
        inputs = [x, weight]
        if bias:
            inputs.append(self.initializer(f"{prefix}.bias", self.normal((out_ch,), 0.1)))
        return self.node(
            "Conv",
            prefix,
            inputs,
            f"{prefix}.out",
            kernel_shape=[kernel, kernel],
            strides=[stride, stride],
            pads=[pad, pad, pad, pad],
            dilations=[1, 1],
            group=group,
        )

    def batchnorm(self, prefix: str, x: str, channels: int) -> str:
        c = (channels,)
        inputs = [
            x,
            self.initializer(f"{prefix}.scale", self.uniform(c, 0.5, 1.5)),
            self.initializer(f"{prefix}.bias", self.normal(c, 0.1)),
            self.initializer(f"{prefix}.mean", self.normal(c, 0.1)),
            self.initializer(f"{prefix}.var", self.uniform(c, 0.5, 1.5)),
        ]
        return self.node("BatchNormalization", prefix, inputs, f"{prefix}.out", epsilon=1e-5)

    def relu(self, name: str, x: str) -> str:
        return self.node("Relu", name, [x], f"{name}.out")

    def linear(self, prefix: str, x: str, in_f: int, out_f: int, output: str | None = None) -> str:
        """MatMul(x, W) -> Add(b); ``output`` optionally names the result."""
        weight = self.initializer(f"{prefix}.weight", self.he_normal((in_f, out_f), in_f))
        bias = self.initializer(f"{prefix}.bias", self.normal((out_f,), 0.1))
        y = self.node("MatMul", f"{prefix}.matmul", [x, weight], f"{prefix}.matmul.out")
        return self.node("Add", f"{prefix}.add", [y, bias], output or f"{prefix}.out")

    def decomposed_softmax(self, prefix: str, x: str, output: str | None = None) -> str:
        """Softmax over the last axis spelled out as Exp -> ReduceSum -> Div."""
        axes = self.initializer(f"{prefix}.axes", np.array([-1], dtype=np.int64))
        e = self.node("Exp", f"{prefix}.exp", [x], f"{prefix}.exp.out")
        s = self.node("ReduceSum", f"{prefix}.reducesum", [e, axes], f"{prefix}.reducesum.out", keepdims=1)
        return self.node("Div", f"{prefix}.div", [e, s], output or f"{prefix}.out")

    # ------------------------------------------------------------------ output
    def make_model(
        self,
        graph_name: str,
        inputs: list[onnx.ValueInfoProto],
        outputs: list[onnx.ValueInfoProto],
        doc: str,
    ) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, graph_name, inputs, outputs, initializer=self.initializers, doc_string=doc
        )
        model = helper.make_model(
            graph,
            producer_name=PRODUCER_NAME,
            opset_imports=[helper.make_opsetid("", OPSET)],
        )
        model.ir_version = IR_VERSION
        return model


def float_tensor(name: str, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


# --------------------------------------------------------------------- models
def residual_block(
    b: GraphBuilder,
    prefix: str,
    x: str,
    in_ch: int,
    out_ch: int,
    stride: int = 1,
    group2: int = 1,
) -> str:
    """Conv-BN-Relu-Conv-BN, add the (optionally projected) shortcut, Relu."""
    y = b.conv(f"{prefix}.conv1", x, in_ch, out_ch, 3, stride=stride)
    y = b.batchnorm(f"{prefix}.bn1", y, out_ch)
    y = b.relu(f"{prefix}.relu1", y)
    y = b.conv(f"{prefix}.conv2", y, out_ch, out_ch, 3, group=group2)
    y = b.batchnorm(f"{prefix}.bn2", y, out_ch)
    shortcut = x
    if stride != 1 or in_ch != out_ch:
        shortcut = b.conv(f"{prefix}.downsample.conv", x, in_ch, out_ch, 1, stride=stride)
        shortcut = b.batchnorm(f"{prefix}.downsample.bn", shortcut, out_ch)
    y = b.node("Add", f"{prefix}.add", [y, shortcut], f"{prefix}.add.out")
    return b.relu(f"{prefix}.relu2", y)


def build_resnet_small(rng: np.random.Generator) -> onnx.ModelProto:
    b = GraphBuilder(rng)
    x = b.conv("stem.conv", "image", 3, 16, 3, bias=True)
    x = b.batchnorm("stem.bn", x, 16)
    x = b.relu("stem.relu", x)
    x = residual_block(b, "block1", x, 16, 16)
    x = residual_block(b, "block2", x, 16, 32, stride=2)
    x = residual_block(b, "block3", x, 32, 32, group2=4)
    x = b.node("GlobalAveragePool", "head.pool", [x], "head.pool.out")
    x = b.node("Flatten", "head.flatten", [x], "head.flatten.out", axis=1)
    b.linear("head.fc", x, 32, 10, output="logits")
    return b.make_model(
        "resnet_small",
        [float_tensor("image", ["batch", 3, 32, 32])],
        [float_tensor("logits", ["batch", 10])],
        "Small ResNet-style CNN: stem + 3 residual blocks + linear head.",
    )


def build_mlp(rng: np.random.Generator) -> onnx.ModelProto:
    b = GraphBuilder(rng)
    h = b.linear("fc1", "x", 784, 256)
    h = b.relu("relu1", h)
    b.linear("fc2", h, 256, 10, output="logits")
    return b.make_model(
        "mlp",
        [float_tensor("x", [64, 784])],
        [float_tensor("logits", [64, 10])],
        "Two-layer MLP 784 -> 256 -> 10 built from MatMul/Add/Relu.",
    )


def build_classifier_head(rng: np.random.Generator) -> onnx.ModelProto:
    b = GraphBuilder(rng)
    logits = b.linear("fc", "features", 128, 10, output="logits")
    # (a) Log(Softmax) -> LogSoftmax candidate.
    sm = b.node("Softmax", "softmax", [logits], "softmax.out", axis=-1)
    b.node("Log", "log", [sm], "log_probs")
    # (b) Hand-decomposed softmax -> Softmax candidate.
    b.decomposed_softmax("softmax_a", logits, output="probs")
    # (c) Log of another decomposed softmax -> LogSoftmax candidate.
    sm_b = b.decomposed_softmax("softmax_b", logits)
    b.node("Log", "softmax_b.log", [sm_b], "log_probs_decomposed")
    return b.make_model(
        "classifier_head",
        [float_tensor("features", ["batch", 128])],
        [
            float_tensor("logits", ["batch", 10]),
            float_tensor("log_probs", ["batch", 10]),
            float_tensor("probs", ["batch", 10]),
            float_tensor("log_probs_decomposed", ["batch", 10]),
        ],
        "Linear classifier head with Log(Softmax) and hand-decomposed softmax patterns.",
    )


BUILDERS = {
    "resnet_small.onnx": build_resnet_small,
    "mlp.onnx": build_mlp,
    "classifier_head.onnx": build_classifier_head,
}


def build_all(out_dir: Path = MODELS_DIR) -> list[Path]:
    """Build every sample model, check it and write it into ``out_dir``."""
    paths = []
    for filename, build in BUILDERS.items():
        # One generator per model so each file is independent of the others.
        model = build(np.random.default_rng(SEED))
        onnx.checker.check_model(model, full_check=True)
        path = out_dir / filename
        path.write_bytes(model.SerializeToString(deterministic=True))
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in build_all():
        print(f"wrote {p} ({p.stat().st_size} bytes)")
