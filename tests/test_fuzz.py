"""A bounded, seeded mutation fuzzer: a broken model is the input's fault, never a crash.

Each mutant is a valid sample model from models/ with one field changed: an initializer's
dtype or dims, an attribute's value or type, an op type, a node input's name, or the opset.
`fuser optimize` on it must exit 0-3 with at most one line of error and no traceback (never
exit 4, which blames fuser or a rule), and whatever it writes must be a valid model.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import onnx
import pytest
from onnx import AttributeProto, TensorProto

from tests.helpers import in_process_cli

MODELS = Path(__file__).resolve().parents[1] / "models"
SEEDS = ("resnet_small.onnx", "mlp.onnx", "classifier_head.onnx")
MUTANTS = 96
DTYPES = [TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.INT64, TensorProto.INT8, TensorProto.BOOL, 0, 99]
OP_TYPES = ["Relu", "Add", "Conv", "MatMul", "Gemm", "BatchNormalization", "Softmax", "ReduceSum", "Exp", "NoSuchOp"]
OPSETS = [1, 7, 11, 13, 21, 99]


def mutate_initializer_dtype(model: onnx.ModelProto, rng: random.Random) -> str:
    tensor = rng.choice(list(model.graph.initializer))
    tensor.data_type = rng.choice([d for d in DTYPES if d != tensor.data_type])
    return f"initializer {tensor.name} dtype -> {tensor.data_type}"


def mutate_initializer_dims(model: onnx.ModelProto, rng: random.Random) -> str:
    tensor = rng.choice(list(model.graph.initializer))
    dims = list(tensor.dims)
    choice = rng.randrange(4)
    if choice == 0 and dims:
        dims.pop(rng.randrange(len(dims)))
    elif choice == 1:
        dims.insert(rng.randrange(len(dims) + 1), rng.choice([1, 2, 3]))
    elif choice == 2 and dims:
        dims[rng.randrange(len(dims))] = rng.choice([0, 1, 3, 7, -1])
    else:
        dims = dims[::-1]
    del tensor.dims[:]
    tensor.dims.extend(dims)
    return f"initializer {tensor.name} dims -> {dims}"


def mutate_attribute(model: onnx.ModelProto, rng: random.Random) -> str:
    nodes = [n for n in model.graph.node if n.attribute]
    if not nodes:
        return mutate_op_type(model, rng)
    node = rng.choice(nodes)
    attribute = rng.choice(list(node.attribute))
    if attribute.type == AttributeProto.INTS and rng.random() < 0.5:  # float axes, pads, strides
        values = [float(v) + 0.5 for v in attribute.ints]
        del attribute.ints[:]
        attribute.type = AttributeProto.FLOATS
        attribute.floats.extend(values)
    elif attribute.type == AttributeProto.INTS:
        attribute.ints.append(rng.choice([-5, 0, 9]))
    elif attribute.type == AttributeProto.INT:
        attribute.i = rng.choice([-3, 0, 2, 1000])
    elif attribute.type == AttributeProto.FLOAT:
        attribute.f = rng.choice([-1.0, 0.0, float("nan"), 1e30])
    else:
        attribute.type = AttributeProto.STRING
        attribute.s = b"nonsense"
    return f"attribute {node.name}.{attribute.name}"


def mutate_op_type(model: onnx.ModelProto, rng: random.Random) -> str:
    node = rng.choice(list(model.graph.node))
    node.op_type = rng.choice([t for t in OP_TYPES if t != node.op_type])
    return f"node {node.name} op -> {node.op_type}"


def mutate_input_name(model: onnx.ModelProto, rng: random.Random) -> str:
    node = rng.choice([n for n in model.graph.node if n.input])
    slot = rng.randrange(len(node.input))
    names = [t.name for t in model.graph.initializer] + [i.name for i in model.graph.input] + ["missing", ""]
    node.input[slot] = rng.choice(names)
    return f"node {node.name} input {slot} -> {node.input[slot]!r}"


def mutate_opset(model: onnx.ModelProto, rng: random.Random) -> str:
    model.opset_import[0].version = rng.choice([v for v in OPSETS if v != model.opset_import[0].version])
    return f"opset -> {model.opset_import[0].version}"


MUTATIONS = [
    mutate_initializer_dtype,
    mutate_initializer_dims,
    mutate_attribute,
    mutate_op_type,
    mutate_input_name,
    mutate_opset,
]


def mutants():
    rng = random.Random(20261123)
    originals = {name: onnx.load(MODELS / name) for name in SEEDS}
    for index in range(MUTANTS):
        seed = SEEDS[index % len(SEEDS)]
        model = onnx.ModelProto()
        model.CopyFrom(originals[seed])
        mutation = MUTATIONS[index % len(MUTATIONS)]
        yield index, seed, mutation(model, rng), model


@pytest.fixture
def cli(monkeypatch, capfd):
    return in_process_cli(monkeypatch, capfd)


def test_mutated_models_never_crash_fuser(cli, tmp_path):
    failures = []
    codes = []
    for index, seed, description, model in mutants():
        folder = tmp_path / str(index)
        folder.mkdir()
        onnx.save(model, folder / "m.onnx")
        before = (folder / "m.onnx").read_bytes()
        target = "onnxruntime" if index % 2 else "onnx"
        result = cli(folder, "optimize", "m.onnx", "--target", target)
        codes.append(result.returncode)
        problem = None
        if result.returncode not in (0, 1, 2, 3) or "Traceback" in result.stderr or "internal error" in result.stderr:
            problem = result.stderr.strip()[-300:]
        elif result.returncode != 0 and result.stderr.strip().count("\n") != 0:
            problem = f"more than one line: {result.stderr.strip()[:300]}"
        elif result.returncode == 0:
            try:
                onnx.checker.check_model(str(folder / "m.fused.onnx"), full_check=True)
            except Exception as error:  # noqa: BLE001 - any checker failure is the finding
                problem = f"wrote an invalid model: {error}"
        elif (folder / "m.fused.onnx").exists():
            problem = "wrote a model although it failed"
        if (folder / "m.onnx").read_bytes() != before:
            problem = "modified the input"
        if problem:
            failures.append(f"#{index} {seed}: {description} (exit {result.returncode}): {problem}")
        shutil.rmtree(folder)
    assert not failures, "\n".join(failures)
    assert codes.count(2) > len(codes) // 3 and 0 in codes  # the mutants are mostly, not all, broken
