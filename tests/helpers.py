"""Building small models and running them in onnxruntime (graph optimizations off) for tests."""

from __future__ import annotations

import glob
import os

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

ONNX_DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
IR_VERSION = 8


def backend_models(kind: str = "*") -> list[str]:
    """Every model.onnx (and light_*.onnx) shipped in the installed onnx wheel."""
    return sorted(glob.glob(os.path.join(ONNX_DATA, kind, "**", "*.onnx"), recursive=True))


def light_model(name: str) -> str:
    return os.path.join(ONNX_DATA, "light", f"light_{name}.onnx")


def make_model(nodes, inputs, outputs, initializers=(), opset=17, extra_opsets=None, ir_version=IR_VERSION):
    """inputs/outputs: (name, numpy dtype, shape) tuples; initializers: {name: array}."""
    def info(name, dtype, shape):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape)

    inits = initializers.items() if isinstance(initializers, dict) else initializers
    graph = helper.make_graph(
        list(nodes), "test", [info(*i) for i in inputs], [info(*o) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in inits],
    )
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="fuser-tests")
    model.ir_version = ir_version
    onnx.checker.check_model(model, full_check=True)
    return model


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_same_outputs(before, after, feeds, rtol=0.0, atol=0.0):
    """Run both models in onnxruntime; rtol=atol=0 means bit-identical."""
    expected = run(before, feeds)
    actual = run(after, feeds)
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        assert e.dtype == a.dtype and e.shape == a.shape
        if rtol == 0 and atol == 0:
            np.testing.assert_array_equal(a, e)
        else:
            np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol)


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def randomize_constants(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """Replace ConstantOfShape-filled weights (all equal values) with random initializers.

    The light model-zoo files carry weights as ConstantOfShape; uniform weights make every
    channel identical and would hide folding errors, so numerics tests randomize them.
    """
    rng = np.random.default_rng(seed)
    model = onnx.ModelProto.FromString(model.SerializeToString())
    shapes = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    variances = {n.input[4] for n in model.graph.node if n.op_type == "BatchNormalization"}
    kept = []
    for node in model.graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in shapes:
            shape = tuple(int(d) for d in shapes[node.input[0]])
            is_variance = node.output[0] in variances
            value = rng.uniform(0.5, 1.5, shape) if is_variance else rng.normal(0, 0.5, shape) / max(1, np.prod(shape[1:]) ** 0.5)
            model.graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), node.output[0]))
            if model.ir_version < 4:
                model.graph.input.append(helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, shape))
        else:
            kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return model
