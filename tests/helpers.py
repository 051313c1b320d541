"""The helpers the test files share.

Building and running models, looking into them and the two sides of a rule test
(`assert_rewritten`, `assert_declined`) come from the public `fuser.testing` module, so rule
authors test their rules the way fuser tests its own. Here are the suite's own additions: the
model-zoo files of the onnx wheel (`backend_models`, `light_model`, `randomize_constants`),
reference results (`np_log_softmax`; `reference_run`, the ONNX reference evaluator) and running
the `fuser` command line (`fuser_cli`, `in_process_cli`).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import numpy as np
import onnx
from onnx import helper, numpy_helper

# The helpers rule authors use too live in fuser.testing; the project's tests use the same ones.
from fuser.testing import (  # noqa: F401 - re-exported for the test files
    IR_VERSION,
    assert_declined,
    assert_rewritten,
    assert_same_outputs,
    attrs_of,
    initializer,
    initializer_value,
    make_model,
    model_from_text,
    nodes_of,
    op_types,
    opsets_of,
    ort_session,
    run,
)

ONNX_DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")


# The model-zoo architectures shipped (with placeholder weights) in onnx's backend test data.
LIGHT_MODELS = [
    "resnet50",
    "densenet121",
    "inception_v1",
    "inception_v2",
    "shufflenet",
    "squeezenet",
    "vgg19",
    "bvlc_alexnet",
    "zfnet512",
]


def backend_models(kind: str = "*") -> list[str]:
    """Every model.onnx (and light_*.onnx) shipped in the installed onnx wheel."""
    return sorted(glob.glob(os.path.join(ONNX_DATA, kind, "**", "*.onnx"), recursive=True))


def light_model(name: str) -> str:
    return os.path.join(ONNX_DATA, "light", f"light_{name}.onnx")


def reference_run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """Run `model` in the ONNX reference evaluator (onnx.reference): for what onnxruntime has
    no CPU kernel for, such as float64 Conv."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, feeds)


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
            value = (
                rng.uniform(0.5, 1.5, shape)
                if is_variance
                else rng.normal(0, 0.5, shape) / max(1, np.prod(shape[1:]) ** 0.5)
            )
            model.graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), node.output[0]))
            if model.ir_version < 4:
                model.graph.input.append(helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, shape))
        else:
            kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return model


# ------------------------------------------------------------------------ numpy references


def np_log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Single-axis log-softmax in float64 (opset >= 13 semantics)."""
    x = x.astype(np.float64)
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


# ------------------------------------------------------------------------ command line


def fuser_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """`python -m fuser.cli ARGS...` in a real process started in `cwd`; text output captured."""
    return subprocess.run(
        [sys.executable, "-m", "fuser.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def in_process_cli(monkeypatch, capfd):
    """For a `cli` fixture: `invoke(cwd, *args)` runs `fuser ARGS...` through fuser.cli.main in
    this process (the same code path as the command, much faster than a subprocess), from
    `cwd`, and returns a CompletedProcess with the exit code, stdout and stderr."""
    import pytest

    from fuser.cli import main

    def invoke(cwd, *args):
        monkeypatch.chdir(cwd)
        capfd.readouterr()
        with pytest.raises(SystemExit) as done:
            main([str(a) for a in args])
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(args, done.value.code, out, err)

    return invoke
