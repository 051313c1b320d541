"""Building small models and running them in onnxruntime (graph optimizations off) for tests.

Also the helpers the test files share: looking into models (`nodes_of`, `attrs_of`,
`initializer`, `initializer_value`, `opsets_of`), the two sides of a rule test
(`assert_rewritten`: the rule fired as expected; `assert_declined`: it did not), reference
results (`np_log_softmax`; `reference_run`, the ONNX reference evaluator) and running the
`fuser` command line (`fuser_cli`, `in_process_cli`).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

import fuser

ONNX_DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
IR_VERSION = 8


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


def make_model(
    nodes, inputs, outputs, initializers=(), opset=17, extra_opsets=None, ir_version=IR_VERSION, *, check=True
):
    """inputs/outputs: (name, numpy dtype, shape) tuples; initializers: {name: array}.

    The model is run through the full ONNX checker; check=False skips it, for deliberately
    invalid models (mismatched dtypes, unknown shapes the full check wants, ...).
    """

    def info(name, dtype, shape):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape)

    inits = initializers.items() if isinstance(initializers, dict) else initializers
    graph = helper.make_graph(
        list(nodes),
        "test",
        [info(*i) for i in inputs],
        [info(*o) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in inits],
    )
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="fuser-tests")
    model.ir_version = ir_version
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def ort_session(model: onnx.ModelProto) -> ort.InferenceSession:
    """An onnxruntime CPU session for `model` with every graph optimization disabled."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort_session(model).run(None, feeds)


def reference_run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """Run `model` in the ONNX reference evaluator (onnx.reference): for what onnxruntime has
    no CPU kernel for, such as float64 Conv."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, feeds)


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


# --------------------------------------------------------------------- looking into models


def nodes_of(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    """The main graph's nodes of one op type, in graph order."""
    return [n for n in model.graph.node if n.op_type == op_type]


def attrs_of(node: onnx.NodeProto) -> dict:
    """A node's attributes as {name: Python value}; a string attribute comes back as str."""
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}


def opsets_of(model: onnx.ModelProto) -> dict[str, int]:
    """The model's opset imports as {domain: version} ("" is the default ONNX domain)."""
    return {o.domain: o.version for o in model.opset_import}


def initializer(model: onnx.ModelProto, name: str) -> onnx.TensorProto:
    """The main graph's initializer called `name`; fails unless there is exactly one."""
    found = [t for t in model.graph.initializer if t.name == name]
    assert len(found) == 1, f"expected exactly one initializer '{name}', found {len(found)}"
    return found[0]


def initializer_value(model: onnx.ModelProto, name: str) -> np.ndarray:
    """The value of the main graph's initializer `name` (exactly one must exist) as an array."""
    return numpy_helper.to_array(initializer(model, name))


# ------------------------------------------------------------------------ numpy references


def np_log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Single-axis log-softmax in float64 (opset >= 13 semantics)."""
    x = x.astype(np.float64)
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


# ------------------------------------------------------------------------- rule tests


def assert_rewritten(
    model,
    rules,
    *,
    counts,
    expected_ops,
    check=True,
    feeds=None,
    rtol=0.0,
    atol=0.0,
    all_outputs_ok=False,
    **optimize_kwargs,
):
    """Optimize `model` with exactly `rules` and check that the rewrite happened as expected.

    Checks: report.counts == counts (per-rule rewrite counts); the optimized op sequence is
    `expected_ops`; the optimized model passes the full ONNX checker; the graph interface is
    unchanged (input and output names, in order); with check=True fuser's numerics check ran
    and passed (with all_outputs_ok=True every output's status is also "ok", i.e. none merely
    "stabilized"). Given `feeds`, the outputs of both models in onnxruntime must also agree
    within rtol/atol (0/0: bit-identical; see assert_same_outputs).
    optimize_kwargs go to fuser.optimize (target=..., trace=...). Returns (after, report).
    """
    after, report = fuser.optimize(model, rules=list(rules), check=check, **optimize_kwargs)
    assert report.counts == counts, [d.reason for d in report.engine.declined]
    assert op_types(after) == list(expected_ops)
    onnx.checker.check_model(after, full_check=True)
    assert [i.name for i in after.graph.input] == [i.name for i in model.graph.input]
    assert [o.name for o in after.graph.output] == [o.name for o in model.graph.output]
    if check:
        assert report.verdict is not None and report.verdict.passed
        if all_outputs_ok:
            assert all(o.status == "ok" for o in report.verdict.outputs), report.verdict.outputs
    if feeds is not None:
        assert_same_outputs(model, after, feeds, rtol=rtol, atol=atol)
    return after, report


def assert_declined(model, rule, reason, *, node=None, scope=None, rules=None, check=True, **optimize_kwargs):
    """Optimize `model` with `rule` (or with `rules`, which should include it) and check that
    nothing was rewritten: no counts, no rewrites, the op sequence unchanged.

    reason: a substring that at least one of `rule`'s declines must contain; None when the
    pattern itself must not match, so that `rule` declines nothing either. With a reason,
    `node` / `scope` (when given) are the node name / graph scope every one of `rule`'s
    declines must be at. optimize_kwargs go to fuser.optimize (target=...); the optimization
    is traced so that declines are recorded. Returns (after, report).
    """
    after, report = fuser.optimize(model, rules=list(rules or [rule]), trace=True, check=check, **optimize_kwargs)
    assert report.counts == {}
    assert report.rewrites == []
    assert op_types(after) == op_types(model)
    declined = [d for d in report.engine.declined if d.rule == rule.name]
    if reason is None:
        assert declined == []
    else:
        assert declined, "expected the rule to decline the match"
        if node is not None:
            assert all(d.node == node for d in declined), [d.node for d in declined]
        if scope is not None:
            assert all(d.scope == scope for d in declined), [d.scope for d in declined]
        assert any(reason in d.reason for d in declined), [d.reason for d in declined]
    return after, report


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
