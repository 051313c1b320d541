"""What pipelines rely on: the shipped report schema, the pre-commit hook, the distribution's names."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import distribution
from importlib.resources import files
from pathlib import Path

import jsonschema
import pytest

import fuser
from fuser.report import REPORT_SCHEMA, schema_text
from tests.helpers import in_process_cli

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"


@pytest.fixture
def cli(monkeypatch, capfd):
    return in_process_cli(monkeypatch, capfd)


def test_the_shipped_schema_file_is_the_reports_schema():
    shipped = files("fuser").joinpath("report.schema.json").read_text()
    assert shipped == schema_text(), "fuser/report.schema.json is stale: regenerate it with `python -m fuser.report`"
    jsonschema.Draft202012Validator.check_schema(json.loads(shipped))


def test_schema_command_prints_it(cli, tmp_path):
    result = cli(tmp_path, "schema")
    assert result.returncode == 0 and json.loads(result.stdout) == REPORT_SCHEMA


def test_a_report_fails_the_schema_when_it_breaks_it(cli, tmp_path):
    shutil.copy(MODELS / "mlp.onnx", tmp_path / "mlp.onnx")
    result = cli(tmp_path, "check", "mlp.onnx", "--format", "json")
    report = json.loads(result.stdout)
    jsonschema.validate(report, REPORT_SCHEMA)
    report["verdict"] = "maybe"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(report, REPORT_SCHEMA)


def test_the_pre_commit_hook_gates_models(tmp_path):
    hooks = (ROOT / ".pre-commit-hooks.yaml").read_text()
    assert re.search(r"^- id: fuser-check$", hooks, re.M) and re.search(r"^  files: \\\.onnx\$$", hooks, re.M)
    entry = shlex.split(re.search(r"^  entry: (.+)$", hooks, re.M).group(1))
    assert entry[0] == "python"
    command = [sys.executable, *entry[1:]]
    shutil.copy(MODELS / "mlp.onnx", tmp_path / "mlp.onnx")
    fused = subprocess.run([sys.executable, "-m", "fuser.cli", "optimize", "mlp.onnx"], cwd=tmp_path, timeout=300)
    assert fused.returncode == 0

    def hook(*args):
        return subprocess.run([*command, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)

    work_left = hook("mlp.fused.onnx", "mlp.onnx")
    assert work_left.returncode == 1 and "mlp.onnx: matmul-add-gemm" in work_left.stderr
    assert hook("mlp.fused.onnx").returncode == 0
    assert hook("--target", "onnxruntime", "mlp.fused.onnx").returncode == 1  # Gemm + Relu -> FusedGemm
    assert hook("missing.onnx").returncode == 2


def test_the_distribution_is_onnx_fuser_with_both_commands():
    meta = distribution("onnx-fuser")
    assert meta.version == fuser.__version__
    scripts = {e.name: e.value for e in meta.entry_points if e.group == "console_scripts"}
    assert scripts["fuser"] == scripts["onnx-fuser"] == "fuser.cli:program"


def test_markdown_reports_for_a_job_summary(cli, tmp_path):
    shutil.copy(MODELS / "mlp.onnx", tmp_path / "mlp.onnx")
    found = cli(tmp_path, "check", "mlp.onnx", "--format", "markdown")
    assert found.returncode == 1
    assert found.stdout.startswith("### fuser check: work-found\n")
    assert "| `matmul-add-gemm` | main | fc1.add, fc1.matmul |" in found.stdout
    optimized = cli(tmp_path, "optimize", "mlp.onnx", "--format", "markdown")
    assert optimized.returncode == 0, optimized.stderr
    text = optimized.stdout
    assert text.startswith("### fuser optimize: optimized\n") and "| `matmul-add-gemm` | 2 |" in text
    assert "Numerics check: **passed**" in text and "| `logits` | ok |" in text
    assert "wrote" not in optimized.stderr  # the Markdown replaces the text summary
    compared = cli(tmp_path, "compare", "mlp.onnx", "mlp.fused.onnx", "--format", "markdown")
    assert compared.returncode == 0 and "### fuser compare: match" in compared.stdout
