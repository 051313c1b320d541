"""The committed sample models are what models/make_models.py builds, and the README's
first command works on them for both targets."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

import fuser
from tests.helpers import LIGHT_MODELS

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ["resnet_small", "mlp", "classifier_head"]


def test_make_models_rebuilds_the_committed_files_byte_for_byte(tmp_path):
    spec = importlib.util.spec_from_file_location("make_models", ROOT / "models" / "make_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written = module.build_all(tmp_path)
    assert sorted(p.name for p in written) == sorted(f"{s}.onnx" for s in SAMPLES)
    for path in written:
        committed = ROOT / "models" / path.name
        assert path.read_bytes() == committed.read_bytes(), f"{path.name} differs from the committed file"
        assert committed.stat().st_size < 1 << 20


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
@pytest.mark.parametrize("sample", SAMPLES)
def test_samples_optimize_and_verify(sample, target):
    optimized, report = fuser.optimize(ROOT / "models" / f"{sample}.onnx", target=target)
    assert report.verdict is not None and report.verdict.passed
    onnx.checker.check_model(optimized, full_check=True)
    ops = {n.op_type for n in optimized.graph.node}
    assert not ops & {"BatchNormalization", "Exp", "ReduceSum", "Div", "Log", "MatMul"}, ops
    if target == "onnxruntime":
        assert "Relu" not in ops, "a Relu after Conv/Gemm was left unfused"
        assert any(o.domain == "com.microsoft" for o in optimized.opset_import) == bool(
            ops & {"FusedConv", "FusedGemm"}
        )
    again, second = fuser.optimize(optimized, target=target)
    assert second.rewrites == [], "a second pass must change nothing"


def test_readme_first_command(tmp_path):
    shutil.copy(ROOT / "models" / "resnet_small.onnx", tmp_path / "resnet_small.onnx")
    readme = (ROOT / "README.md").read_text()
    assert "python -m fuser optimize models/resnet_small.onnx --force" in readme
    command = [sys.executable, "-m", "fuser", "optimize", "models/resnet_small.onnx", "--force"]
    (tmp_path / "models").mkdir()
    shutil.move(tmp_path / "resnet_small.onnx", tmp_path / "models" / "resnet_small.onnx")
    for _ in range(2):  # --force lets it run again over its own previous output
        result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
    assert (tmp_path / "models" / "resnet_small.fused.onnx").exists()


def _unfused(model: onnx.ModelProto, target: str) -> list[str]:
    """Mission patterns still present: Conv->BatchNormalization, 2-D MatMul->Add, Log(Softmax),
    and on the onnxruntime target Conv/Gemm -> activation."""
    producer = {o: n for n in model.graph.node for o in n.output}
    found = []
    for node in model.graph.node:
        source = producer.get(node.input[0]) if node.input else None
        kind = source.op_type if source is not None else None
        if node.op_type == "BatchNormalization" and kind == "Conv":
            found.append(f"{source.name} -> {node.name}")
        if node.op_type == "Log" and kind == "Softmax":
            found.append(f"{source.name} -> {node.name}")
        if (
            target == "onnxruntime"
            and node.op_type in ("Relu", "LeakyRelu", "Sigmoid", "Tanh")
            and kind in ("Conv", "Gemm")
        ):
            found.append(f"{source.name} -> {node.name}")
    return found


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_light_models_leave_no_mission_pattern_unfused(name, target):
    from tests.helpers import light_model

    model = onnx.load(light_model(name))
    optimized, report = fuser.optimize(model, target=target)
    assert report.verdict is None or report.verdict.passed
    onnx.checker.check_model(optimized)
    assert _unfused(optimized, target) == []
    if target == "onnxruntime" and name in ("squeezenet", "inception_v1", "vgg19", "bvlc_alexnet", "zfnet512"):
        assert report.counts.get("fused-conv", 0) > 0
