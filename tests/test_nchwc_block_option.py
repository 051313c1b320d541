"""`--nchwc-block auto|8|16`: resolved once per run, recorded in every report format, and
settable in `[tool.fuser]` (fuser/context.py). The rules' numerics at both block sizes are
in tests/rules/test_nchwc_blocks.py."""

from __future__ import annotations

import json

import jsonschema
import onnx
import pytest

from fuser.context import machine_nchwc_block, resolve_nchwc_block
from fuser.nchwc import written_block
from fuser.report import REPORT_SCHEMA
from tests.helpers import in_process_cli
from tests.rules.test_nchwc_blocks import image_model


@pytest.fixture
def cli(monkeypatch, capfd):
    return in_process_cli(monkeypatch, capfd)


@pytest.fixture
def folder(tmp_path):
    onnx.save(image_model(), tmp_path / "m.onnx")
    return tmp_path


def test_auto_is_this_machines_block_and_numbers_are_taken_as_given():
    assert resolve_nchwc_block("auto") == resolve_nchwc_block(None) == machine_nchwc_block()
    assert machine_nchwc_block() in (0, 8, 16)
    assert [resolve_nchwc_block(v) for v in (8, "8", 16, "16")] == [8, 8, 16, 16]


@pytest.mark.parametrize("block", ["8", "16"])
def test_every_report_format_records_the_block(cli, folder, block):
    optimized = cli(
        folder, "optimize", "m.onnx", "--target", "onnxruntime", "--nchwc-block", block, "--report", "r.json"
    )
    assert optimized.returncode == 0, optimized.stderr
    assert f"NCHWc block: {block}\n" in optimized.stderr  # the summary, for people
    report = json.loads((folder / "r.json").read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    assert report["nchwc_block"] == int(block) and report["numerics"]["passed"]
    markdown = cli(
        folder, "optimize", "m.onnx", "-o", "md.onnx", "--target", "onnxruntime", "--nchwc-block", block,
        "--format", "markdown",
    )  # fmt: skip
    assert markdown.returncode == 0 and f"NCHWc block: {block}\n" in markdown.stdout
    checked = cli(folder, "check", "m.onnx", "--target", "onnxruntime", "--nchwc-block", block, "--format", "json")
    assert checked.returncode == 1
    report = json.loads(checked.stdout)
    jsonschema.validate(report, REPORT_SCHEMA)
    assert report["nchwc_block"] == int(block)


def test_the_default_is_auto(cli, folder):
    checked = cli(folder, "check", "m.onnx", "--target", "onnxruntime", "--format", "json")
    assert json.loads(checked.stdout)["nchwc_block"] == machine_nchwc_block()


def test_a_block_size_onnxruntime_has_not_is_a_usage_error(cli, folder):
    refused = cli(folder, "optimize", "m.onnx", "--target", "onnxruntime", "--nchwc-block", "32")
    assert refused.returncode == 2 and "--nchwc-block" in refused.stderr
    assert not (folder / "m.fused.onnx").exists()


def test_the_config_file_sets_the_block_and_the_flag_overrides_it(cli, folder):
    (folder / "pyproject.toml").write_text('[tool.fuser]\ntarget = "onnxruntime"\nnchwc-block = 8\n')
    from_config = cli(folder, "check", "m.onnx", "--format", "json")
    assert json.loads(from_config.stdout)["nchwc_block"] == 8
    overridden = cli(folder, "check", "m.onnx", "--nchwc-block", "16", "--format", "json")
    assert json.loads(overridden.stdout)["nchwc_block"] == 16
    (folder / "pyproject.toml").write_text('[tool.fuser]\nnchwc-block = "auto"\n')
    auto = cli(folder, "check", "m.onnx", "--target", "onnxruntime", "--format", "json")
    assert json.loads(auto.stdout)["nchwc_block"] == machine_nchwc_block()


@pytest.mark.parametrize("wrong", ["12", '"avx2"', "true"])
def test_a_wrong_block_in_the_config_file_is_named(cli, folder, wrong):
    (folder / "pyproject.toml").write_text(f"[tool.fuser]\nnchwc-block = {wrong}\n")
    refused = cli(folder, "check", "m.onnx", "--target", "onnxruntime")
    assert refused.returncode == 2 and "nchwc-block" in refused.stderr


@pytest.mark.parametrize("block", [8, 16])
def test_compare_runs_a_model_written_for_any_block(cli, folder, block):
    """`fuser compare` reads the block off the model's guard; one written for another machine's
    block (which onnxruntime here refuses to run) is compared with its NCHWc operators lowered,
    and the output says so."""
    optimized = cli(folder, "optimize", "m.onnx", "-o", "b.onnx", "--target", "onnxruntime", "--nchwc-block", str(block))
    assert optimized.returncode == 0, optimized.stderr
    assert written_block(onnx.load(folder / "b.onnx")) == block and written_block(onnx.load(folder / "m.onnx")) is None
    for first, second in (("m.onnx", "b.onnx"), ("b.onnx", "m.onnx")):
        compared = cli(folder, "compare", first, second, "--report", f"{first}.json")
        assert compared.returncode == 0, compared.stderr
        report = json.loads((folder / f"{first}.json").read_text())
        jsonschema.validate(report, REPORT_SCHEMA)
        foreign = block != machine_nchwc_block()
        note = f"b.onnx is written for NCHWc block {block}, this machine's is {machine_nchwc_block() or 'none'}"
        assert (note in compared.stderr) == foreign
        assert [n.startswith(note) for n in report["notes"]] == ([True] if foreign else [])
