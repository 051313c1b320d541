"""The command line as a user meets it: exit codes, one-line errors, nothing overwritten."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jsonschema
import onnx
import pytest

from fuser.report import REPORT_SCHEMA, file_entry, file_entry_soon

MODELS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "models")
MODELS_PATH = Path(MODELS)


def fuser_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "fuser.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


@pytest.fixture
def resnet(tmp_path):
    path = tmp_path / "resnet_small.onnx"
    shutil.copy(os.path.join(MODELS, "resnet_small.onnx"), path)
    return path


def test_optimize_writes_beside_the_input_and_never_touches_it(resnet):
    before = resnet.read_bytes()
    result = fuser_cli("optimize", str(resnet))
    assert result.returncode == 0, result.stderr
    out = resnet.with_name("resnet_small.fused.onnx")
    assert out.exists()
    assert resnet.read_bytes() == before
    assert "conv-bn-fold" in result.stderr and "nodes: 30 -> 21" in result.stderr
    assert result.stdout == ""
    optimized = onnx.load(str(out))
    onnx.checker.check_model(optimized, full_check=True)
    assert "BatchNormalization" not in {n.op_type for n in optimized.graph.node}


def test_existing_output_needs_force(resnet):
    out = resnet.with_name("resnet_small.fused.onnx")
    out.write_bytes(b"keep me")
    result = fuser_cli("optimize", str(resnet))
    assert result.returncode == 2
    assert "--force" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert out.read_bytes() == b"keep me"
    explicit = fuser_cli("optimize", str(resnet), "-o", str(out))
    assert explicit.returncode == 2 and out.read_bytes() == b"keep me"
    assert fuser_cli("optimize", str(resnet), "--force").returncode == 0
    assert out.read_bytes() != b"keep me"


def test_the_input_can_never_be_the_output(resnet):
    before = resnet.read_bytes()
    result = fuser_cli("optimize", str(resnet), "-o", str(resnet), "--force")
    assert result.returncode == 2 and "input" in result.stderr
    assert resnet.read_bytes() == before


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.onnx", None, "no such file"),
        ("empty.onnx", b"", "empty"),
        ("random.onnx", bytes(range(256)) * 8, "not an ONNX model"),
        ("text.onnx", b"this is a text file, not a model\n", "not an ONNX model"),
    ],
)
def test_unusable_input_exits_2_with_one_line_and_writes_nothing(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    result = fuser_cli("optimize", str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ([name] if content is not None else [])


def test_invalid_model_exits_2(tmp_path):
    model = onnx.load(os.path.join(MODELS, "resnet_small.onnx"))
    model.graph.node[0].input[0] = "no_such_tensor"
    path = tmp_path / "invalid.onnx"
    path.write_bytes(model.SerializeToString())
    result = fuser_cli("optimize", str(path))
    assert result.returncode == 2
    assert "invalid ONNX model" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["invalid.onnx"]


def test_debug_shows_the_traceback(tmp_path):
    result = fuser_cli("--debug", "optimize", str(tmp_path / "missing.onnx"))
    assert result.returncode == 2 and "Traceback" in result.stderr


def test_bad_usage_exits_2():
    assert fuser_cli("optimize").returncode == 2
    assert fuser_cli("no-such-command").returncode == 2
    assert fuser_cli("optimize", "x.onnx", "--target", "tpu").returncode == 2


def test_unknown_rule_name_is_bad_usage(resnet):
    result = fuser_cli("optimize", str(resnet), "--disable", "no-such-rule")
    assert result.returncode == 2 and "no-such-rule" in result.stderr


def test_version_and_rules():
    version = fuser_cli("--version")
    assert version.returncode == 0 and "fuser" in version.stdout
    listed = fuser_cli("rules", "--format", "json")
    assert listed.returncode == 0
    rules = {r["name"]: r for r in json.loads(listed.stdout)}
    assert rules["conv-bn-fold"]["target"] == "onnx" and rules["conv-bn-fold"]["default"] is True


def test_help_documents_exit_codes():
    result = fuser_cli("optimize", "--help")
    assert result.returncode == 0 and "Exit codes" in result.stdout and "numerics check failed" in result.stdout


def test_check_mode_exit_codes_and_never_writes(resnet, tmp_path):
    before = sorted(p.name for p in tmp_path.iterdir())
    found = fuser_cli("check", str(resnet))
    assert found.returncode == 1 and "conv-bn-fold" in found.stderr
    assert fuser_cli("check", str(resnet), "--exit-zero").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert fuser_cli("optimize", str(resnet)).returncode == 0
    clean = fuser_cli("check", str(resnet.with_name("resnet_small.fused.onnx")))
    assert clean.returncode == 0, clean.stderr


def test_json_report_matches_its_schema(resnet, tmp_path):
    report_path = tmp_path / "report.json"
    result = fuser_cli("optimize", str(resnet), "--report", str(report_path), "--format", "json")
    assert result.returncode == 0, result.stderr
    on_disk = json.loads(report_path.read_text())
    assert json.loads(result.stdout) == on_disk
    jsonschema.validate(on_disk, REPORT_SCHEMA)
    assert on_disk["rule_counts"] == {"conv-bn-fold": 8, "matmul-add-gemm": 1}
    assert on_disk["numerics"]["passed"] is True
    assert len(on_disk["rewrites"]) == 9 and on_disk["nodes_before"] == 30 and on_disk["nodes_after"] == 21
    lines = report_path.read_text().splitlines()
    assert sum(line.startswith('    {"index": ') for line in lines) == 9  # the log's entries, one a line
    assert any(line.startswith('  "rules": ["') for line in lines)  # a list of plain values: one line


def test_reports_name_the_input_and_output_by_their_digests(resnet, tmp_path):
    report_path = tmp_path / "report.json"
    output = tmp_path / "out.onnx"
    result = fuser_cli("optimize", str(resnet), "-o", str(output), "--report", str(report_path))
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    assert report["input"] == {"path": str(resnet), "sha256": hashlib.sha256(resnet.read_bytes()).hexdigest()}
    assert report["output"] == {"path": str(output), "sha256": hashlib.sha256(output.read_bytes()).hexdigest()}
    # A file that is no model is still named in the error report, by what it holds.
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    failed = fuser_cli("optimize", str(garbage), "--report", str(report_path))
    assert failed.returncode == 2
    report = json.loads(report_path.read_text())
    assert report["input"]["sha256"] == hashlib.sha256(b"not a model").hexdigest() and report["output"] is None


def test_a_run_with_its_output_closed_ends_as_it_would_otherwise(tmp_path):
    # `fuser ... >&-`: Python starts without sys.stdout, and the end has nothing to flush there.
    model = MODELS_PATH / "mlp.onnx"
    command = [sys.executable, "-m", "fuser", "optimize", str(model), "-o", str(tmp_path / "out.onnx"), "-q"]
    result = subprocess.run(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.close(1)
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert (tmp_path / "out.onnx").is_file()


def test_an_interrupted_compare_replaces_an_earlier_report(tmp_path, monkeypatch, capsys):
    # Ctrl-C during the comparison: the report at the path says so, rather than an earlier run's.
    from fuser import cli, verify
    from fuser import report as report_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(verify.Checker, "check", interrupted)
    report_path = tmp_path / "r.json"
    report_path.write_text(report_module.dumps(report_module.envelope("compare", "match", 0)))
    model = str(MODELS_PATH / "mlp.onnx")
    assert cli.run(["compare", model, model, "--report", str(report_path)]) == 130
    report = json.loads(report_path.read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    assert (report["command"], report["verdict"], report["exit_code"]) == ("compare", "error", 130)
    assert report["input"]["path"] == report["output"]["path"] == model
    assert capsys.readouterr().err.strip() == "fuser: interrupted"


def test_digests_are_worked_out_only_for_a_json_report(tmp_path, monkeypatch, capsys):
    # Reading and hashing a 500 MB model takes 0.5 s: only a JSON report shows the digests.
    from fuser import cli
    from fuser import model as model_module
    from fuser import report as report_module

    hashed = []
    real = report_module.file_entry
    monkeypatch.setattr(report_module, "file_entry", lambda path: hashed.append(Path(path).name) or real(path))

    class Digesting(model_module._DigestingFile):  # the output's digest, worked out as it is written
        def hexdigest(self):
            hashed.append("while writing")
            return super().hexdigest()

    monkeypatch.setattr(model_module, "_DigestingFile", Digesting)
    model = MODELS_PATH / "mlp.onnx"
    assert cli.run(["optimize", str(model), "-o", str(tmp_path / "a.onnx"), "-q"]) == 0
    assert cli.run(["optimize", str(model), "-o", str(tmp_path / "b.onnx"), "--format", "markdown"]) == 0
    assert cli.run(["check", str(model), "--exit-zero", "--format", "markdown"]) == 0
    assert hashed == []
    shown = capsys.readouterr().out
    assert str(model) in shown and str(tmp_path / "b.onnx") in shown  # Markdown still names the files
    assert cli.run(["optimize", str(model), "-o", str(tmp_path / "c.onnx"), "--format", "json"]) == 0
    assert sorted(hashed) == ["mlp.onnx", "while writing"]
    report = json.loads(capsys.readouterr().out)
    assert report["output"]["sha256"] == hashlib.sha256((tmp_path / "c.onnx").read_bytes()).hexdigest()
    assert cli.run(["check", str(model), "--report", str(tmp_path / "r.json")]) == 1
    assert sorted(hashed) == ["mlp.onnx", "mlp.onnx", "while writing"]


def test_check_reads_a_pipe_once(tmp_path):
    # The report names a pipe without reading it again: that would wait for a writer for ever.
    data = (MODELS_PATH / "mlp.onnx").read_bytes()
    pipe = tmp_path / "pipe.onnx"
    os.mkfifo(pipe)
    writer = threading.Thread(target=pipe.write_bytes, args=(data,))
    writer.start()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "fuser.cli", "check", str(pipe), "--format", "json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        writer.join()
    assert result.returncode == 1, result.stderr  # matmul-add-gemm is left to do
    assert json.loads(result.stdout)["input"] == {"path": str(pipe), "sha256": None}  # read once, by the load


def test_a_file_that_cannot_be_read_has_no_entry(tmp_path):
    assert file_entry_soon(tmp_path / "missing.onnx")() is None
    assert file_entry_soon(tmp_path)() is None  # a folder
    model = tmp_path / "m.onnx"
    model.write_bytes(b"abc")
    assert (
        file_entry_soon(model)()
        == file_entry(model)
        == {"path": str(model), "sha256": hashlib.sha256(b"abc").hexdigest()}
    )


def test_error_report_matches_its_schema(tmp_path):
    report_path = tmp_path / "report.json"
    result = fuser_cli("optimize", str(tmp_path / "missing.onnx"), "--report", str(report_path))
    assert result.returncode == 2
    report = json.loads(report_path.read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    assert report["verdict"] == "error" and report["exit_code"] == 2


def test_the_command_leaves_the_home_folder_alone(resnet, tmp_path):
    # onnxruntime 1.29 and later otherwise keep a telemetry device id and event queue there,
    # and warn on stderr where they cannot write it.
    home = tmp_path / "home"
    home.mkdir()
    environment = {k: v for k, v in os.environ.items() if k not in ("ORT_DISABLE_TELEMETRY", "XDG_CACHE_HOME")}
    result = subprocess.run(
        [sys.executable, "-m", "fuser.cli", "optimize", str(resnet), "-o", str(tmp_path / "out.onnx")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**environment, "HOME": str(home)},
    )
    assert result.returncode == 0, result.stderr
    assert "numerics check: passed" in result.stderr and "telemetry" not in result.stderr
    assert list(home.rglob("*")) == []


def test_a_profiler_attached_to_the_command_still_gets_its_data(resnet, tmp_path):
    # Run as the program, fuser ends the process without freeing its model; not under a profiler
    # (or a coverage tool), which writes what it found only as the interpreter ends.
    profile = tmp_path / "fuser.prof"
    result = subprocess.run(
        [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "fuser.cli", "optimize", str(resnet), "-q"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert profile.stat().st_size > 0
    assert resnet.with_name("resnet_small.fused.onnx").exists()


def test_a_reader_that_goes_away_early_ends_the_run_quietly(resnet):
    # `fuser optimize m.onnx --format json | true`: the report meets a closed pipe.
    with subprocess.Popen(
        [sys.executable, "-m", "fuser.cli", "optimize", str(resnet), "--format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as child:
        child.stdout.close()  # before the report is written
        error = child.stderr.read().decode()
        code = child.wait(timeout=300)
    assert code == 0 and "Traceback" not in error and "Exception ignored" not in error
    assert resnet.with_name("resnet_small.fused.onnx").exists()


def test_main_called_by_other_code_ends_by_raising_system_exit(resnet, monkeypatch):
    # Only the `fuser` program ends its process at once; main(), called with sys.argv's arguments
    # by a wrapper or a test, hands the exit code back as SystemExit.
    from fuser.cli import main

    monkeypatch.setattr(sys, "argv", ["fuser", "optimize", str(resnet), "-q", "--no-check"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 0
    assert resnet.with_name("resnet_small.fused.onnx").exists()
