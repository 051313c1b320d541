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
