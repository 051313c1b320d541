"""Pipelines: several models in one run (each in its own worker process), one report over all,
the worst exit code, progress only on a terminal, and the time of each stage.

Most tests call fuser.cli.main in this process (the workers are real processes either way);
the progress tests start real `python -m fuser.cli` processes, one under a pseudo-terminal.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import pty
import re
import shutil
import subprocess
import sys
import time
from importlib.resources import files
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import external_data_helper, helper, numpy_helper

from fuser import jobs, stops, wire
from fuser import report as report_module
from fuser.report import REPORT_SCHEMA, SCHEMA_VERSION
from tests.helpers import fuser_cli, in_process_cli, model_from_text, run

MODELS = Path(__file__).resolve().parent.parent / "models"
SAMPLES = ("resnet_small.onnx", "mlp.onnx", "classifier_head.onnx")

# A rule file whose rule kills its own process, as the system does to a process that takes too
# much memory: only models with a Sin node are hit.
KILLING_RULES = """\
import os
import signal

from fuser import op, rule, var


@rule("kill-on-sin", pattern=op.Sin(var("x")))
def kill_on_sin(m, b):
    \"\"\"Sin(x) -> the end of this process.\"\"\"
    os.kill(os.getpid(), signal.SIGKILL)
"""

# A wrong rewrite: Cos(x) -> Sin(x) fails the numerics check.
WRONG_RULES = """\
from fuser import op, rule, var


@rule("wrong-cos", pattern=op.Cos(var("x")))
def wrong_cos(m, b):
    \"\"\"Cos(x) -> Sin(x), which is wrong.\"\"\"
    return b.Sin(m["x"])
"""


@pytest.fixture
def cli(monkeypatch, capfd):
    return in_process_cli(monkeypatch, capfd)


@pytest.fixture
def zoo(tmp_path) -> Path:
    folder = tmp_path / "zoo"
    folder.mkdir()
    for name in SAMPLES:
        shutil.copy(MODELS / name, folder / name)
    return folder


def unary_model(op_type: str) -> onnx.ModelProto:
    return model_from_text(f"agraph (float[2, 3] x) => (float[2, 3] y) {{ y = {op_type}(x) }}")


def validated(path: Path) -> dict:
    report = json.loads(path.read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    return report


def by_input(report: dict) -> dict[str, dict]:
    return {Path(m["input"]["path"]).name: m for m in report["models"]}


def test_a_folder_of_models_goes_into_an_output_folder_with_one_report(cli, zoo, tmp_path):
    before = {name: (zoo / name).read_bytes() for name in SAMPLES}
    out = tmp_path / "out" / "nested"
    result = cli(tmp_path, "optimize", zoo, "-o", out, "-j", "2", "--report", tmp_path / "r.json")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(SAMPLES)
    assert {name: (zoo / name).read_bytes() for name in SAMPLES} == before
    for name in SAMPLES:
        onnx.checker.check_model(onnx.load(out / name), full_check=True)
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "fuser: 3 models, 2 at a time"
    assert sum(line.startswith(str(zoo)) for line in lines) == 3
    assert lines[-1].startswith("3 models: 3 written, 0 failed (exit 0); 2 at a time")
    report = validated(tmp_path / "r.json")
    assert report["schema_version"] == SCHEMA_VERSION and report["exit_code"] == 0 and report["verdict"] == "optimized"
    assert report["jobs"] == 2 and len(report["models"]) == 3
    for name, model in by_input(report).items():
        assert model["output"]["path"] == str(out / name)
        assert model["numerics"]["passed"]
        assert {"load", "rewrite", "check", "write"} <= set(model["timings"])


def test_the_outputs_compute_what_the_inputs_do(cli, zoo, tmp_path):
    result = cli(tmp_path, "optimize", zoo / "mlp.onnx", zoo / "classifier_head.onnx", "-o", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    for name in ("mlp.onnx", "classifier_head.onnx"):
        original, optimized = onnx.load(zoo / name), onnx.load(tmp_path / "out" / name)
        spec = original.graph.input[0]
        shape = [d.dim_value or 1 for d in spec.type.tensor_type.shape.dim]
        feeds = {spec.name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
        np.testing.assert_allclose(run(optimized, feeds)[0], run(original, feeds)[0], rtol=1e-4, atol=1e-5)


def test_without_o_each_output_goes_beside_its_input_and_a_second_run_skips_them(cli, zoo, tmp_path):
    assert cli(tmp_path, "optimize", zoo).returncode == 0
    fused = sorted(p.name for p in zoo.glob("*.fused.onnx"))
    assert fused == sorted(name.replace(".onnx", ".fused.onnx") for name in SAMPLES)
    again = cli(tmp_path, "optimize", zoo, "--force")  # the folder's *.fused.onnx are outputs, not inputs
    assert again.returncode == 0, again.stderr
    assert not list(zoo.glob("*.fused.fused.onnx"))


def test_one_model_goes_into_a_folder_that_exists_or_that_ends_in_a_slash(cli, zoo, tmp_path):
    (tmp_path / "existing").mkdir()
    (tmp_path / "afile").write_text("not a folder")
    for output in ("existing", "new/"):
        result = cli(tmp_path, "optimize", zoo / "mlp.onnx", "-o", output)
        assert result.returncode == 0, result.stderr
        assert sorted(p.name for p in (tmp_path / output).iterdir()) == ["mlp.onnx"]
    assert cli(tmp_path, "optimize", zoo / "mlp.onnx", "-o", "existing").returncode == 2  # not replaced unforced
    assert "-o names no file or folder" in cli(tmp_path, "optimize", zoo / "mlp.onnx", "-o", "").stderr
    refused = cli(tmp_path, "optimize", zoo / "mlp.onnx", "-o", "afile/")
    assert refused.returncode == 2 and "-o ending in a slash names a folder, and afile/ is a file" in refused.stderr
    assert (tmp_path / "afile").read_text() == "not a folder"


def test_a_folder_of_one_model_is_counted_as_one(cli, zoo, tmp_path):
    (tmp_path / "one").mkdir()
    shutil.copy(zoo / "mlp.onnx", tmp_path / "one" / "mlp.onnx")
    result = cli(tmp_path, "optimize", "one", "-o", "out")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == "fuser: 1 model, 1 at a time" and lines[-1].startswith("1 model: 1 written, 0 failed")


def test_a_folder_stands_for_its_models_not_its_hidden_files(cli, zoo, tmp_path):
    (zoo / "._mlp.onnx").write_bytes(b"\x00\x05\x16\x07 an archive's resource fork")
    result = cli(tmp_path, "optimize", zoo, "-o", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(SAMPLES)


def test_a_quoted_glob_is_expanded(cli, zoo, tmp_path):
    result = cli(tmp_path, "optimize", str(zoo / "[mc]*.onnx"), "-o", tmp_path / "out", "--report", tmp_path / "r.json")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["classifier_head.onnx", "mlp.onnx"]
    assert len(validated(tmp_path / "r.json")["models"]) == 2


def test_a_corrupt_file_fails_alone(cli, zoo, tmp_path):
    (zoo / "broken.onnx").write_bytes(b"this is not a model\n")
    result = cli(tmp_path, "optimize", zoo, "-o", tmp_path / "out", "--report", tmp_path / "r.json")
    assert result.returncode == 2
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(SAMPLES)
    assert f"FAILED {zoo / 'broken.onnx'} (exit 2): not an ONNX model" in result.stderr
    report = validated(tmp_path / "r.json")
    assert report["exit_code"] == 2 and report["verdict"] == "error" and report["error"] == "1 of 4 models failed"
    assert by_input(report)["broken.onnx"]["exit_code"] == 2
    assert sorted(m["exit_code"] for m in report["models"]) == [0, 0, 0, 2]


def test_a_killed_worker_is_that_models_failure_and_the_worst_code_wins(cli, zoo, tmp_path):
    (tmp_path / "killing_rules.py").write_text(KILLING_RULES)
    onnx.save(unary_model("Sin"), zoo / "sine.onnx")
    (zoo / "broken.onnx").write_bytes(b"")
    result = cli(tmp_path, "optimize", zoo, "-o", tmp_path / "out", "--rules", "killing_rules.py", "--report", "r.json")
    assert result.returncode == 4, result.stderr  # 4 (the crash) is worse than 2 (the corrupt file)
    assert "killed by signal SIGKILL" in result.stderr and "-j" in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(SAMPLES)
    report = validated(tmp_path / "r.json")
    models = by_input(report)
    assert models["sine.onnx"]["exit_code"] == 4 and models["sine.onnx"]["output"] is None
    assert models["sine.onnx"]["seconds"] > 0  # how long the worker ran before it was killed
    assert report["exit_code"] == 4
    assert sorted(m["exit_code"] for m in report["models"]) == [0, 0, 0, 2, 4]


def test_a_mismatch_keeps_its_evidence_and_the_others_are_written(cli, zoo, tmp_path):
    (tmp_path / "wrong_rules.py").write_text(WRONG_RULES)
    onnx.save(unary_model("Cos"), zoo / "cosine.onnx")
    result = cli(tmp_path, "optimize", zoo, "-o", "out", "--rules", "wrong_rules.py", "--report", "r.json")
    assert result.returncode == 3, result.stderr
    assert not (tmp_path / "out" / "cosine.onnx").exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(SAMPLES)
    cosine = by_input(validated(tmp_path / "r.json"))["cosine.onnx"]
    assert cosine["verdict"] == "mismatch" and cosine["blamed"][0]["rule"] == "wrong-cos"
    assert "blame" in cosine["timings"]
    evidence = Path(cosine["evidence"])
    assert (evidence / "original.onnx").exists() and (evidence / "report.json").exists()


def test_existing_outputs_need_force_model_by_model(cli, zoo, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mlp.onnx").write_bytes(b"keep me")
    result = cli(tmp_path, "optimize", zoo, "-o", out)
    assert result.returncode == 2
    assert (out / "mlp.onnx").read_bytes() == b"keep me"
    assert (out / "resnet_small.onnx").exists() and (out / "classifier_head.onnx").exists()
    assert "already exists; pass --force" in result.stderr
    assert cli(tmp_path, "optimize", zoo, "-o", out, "--force").returncode == 0
    assert (out / "mlp.onnx").read_bytes() != b"keep me"


@pytest.mark.parametrize(
    "arrange, message",
    [
        ("o-is-a-file", "-o names a folder"),
        ("o-ends-in-onnx", "not a .onnx file"),
        ("same-name-twice", "same file"),
        ("output-is-an-input", "one of the input models"),
        ("output-data-is-an-inputs-data", "reads its data from"),
        ("empty-folder", "no .onnx files"),
        ("glob-matches-nothing", "no file matches"),
    ],
)
def test_ambiguous_runs_are_refused_before_any_work(cli, zoo, tmp_path, arrange, message):
    args = [zoo]
    if arrange == "o-is-a-file":
        (tmp_path / "file").write_text("x")
        args += ["-o", tmp_path / "file"]
    elif arrange == "o-ends-in-onnx":
        args += ["-o", tmp_path / "all.onnx"]
    elif arrange == "same-name-twice":
        other = tmp_path / "other"
        other.mkdir()
        shutil.copy(zoo / "mlp.onnx", other / "mlp.onnx")
        args = [zoo / "mlp.onnx", other / "mlp.onnx", "-o", tmp_path / "out"]
    elif arrange == "output-is-an-input":
        shutil.copy(zoo / "mlp.onnx", zoo / "mlp.fused.onnx")
        args = [str(zoo / "mlp*.onnx")]  # both mlp.onnx and mlp.fused.onnx: the first would overwrite the second
    elif arrange == "output-data-is-an-inputs-data":
        # mlp's output data file would be the file classifier_head reads its weights from
        head = onnx.load(zoo / "classifier_head.onnx")
        external_data_helper.convert_model_to_external_data(head, location="mlp.fused.onnx.data", size_threshold=0)
        onnx.save(head, zoo / "classifier_head.onnx")
        args = [zoo / "mlp.onnx", zoo / "classifier_head.onnx", "--external-data", "always"]
    elif arrange == "empty-folder":
        (tmp_path / "empty").mkdir()
        args = [tmp_path / "empty"]
    else:
        args = [str(tmp_path / "*.onnx")]
    snapshot = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    result = cli(tmp_path, "optimize", *args, "--force")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == snapshot


def test_one_model_keeps_its_report_format(cli, zoo, tmp_path):
    result = cli(tmp_path, "optimize", zoo / "mlp.onnx", "-o", tmp_path / "mlp.out.onnx", "--report", "r.json")
    assert result.returncode == 0, result.stderr
    report = validated(tmp_path / "r.json")
    assert "models" not in report and report["schema_version"] == SCHEMA_VERSION
    assert list(report["timings"]) == ["load", "rewrite", "check", "write"]
    assert "time: load " in result.stderr and ", write " in result.stderr


def test_the_shipped_schema_is_the_one_in_the_code():
    assert json.loads(files("fuser").joinpath("report.schema.json").read_text()) == REPORT_SCHEMA


def test_json_and_markdown_cover_every_model(cli, zoo, tmp_path):
    result = cli(tmp_path, "optimize", zoo, "-o", "out", "--format", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    jsonschema.validate(report, REPORT_SCHEMA)
    assert len(report["models"]) == 3
    # Each model's wall time is its own, its stages and what lies between them.
    assert all(m["seconds"] >= sum(m["timings"].values()) > 0 for m in report["models"])
    markdown = cli(tmp_path, "optimize", zoo, "-o", "out", "--force", "--format", "markdown")
    assert markdown.returncode == 0
    assert markdown.stdout.startswith("## fuser optimize: 3 models, exit 0")
    for name in SAMPLES:
        assert f"`{zoo / name}`" in markdown.stdout
        [row] = [line for line in markdown.stdout.splitlines() if line.startswith(f"| `{zoo / name}` |")]
        assert float(row.split("|")[-2]) > 0, row


def test_the_markdown_of_a_check_of_several_models_counts_what_each_has_left(cli, zoo, tmp_path):
    assert cli(tmp_path, "optimize", zoo / "mlp.onnx", "-o", tmp_path / "done.onnx").returncode == 0
    models = [zoo / "mlp.onnx", tmp_path / "done.onnx"]
    result = cli(tmp_path, "check", *models, "--format", "markdown", "--report", "r.json")
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[2] == "| model | verdict | exit | opportunities | seconds |"
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[4:6]]
    assert [row[:4] for row in rows] == [
        [f"`{models[0]}`", "work-found", "1", "2"],
        [f"`{models[1]}`", "fully-fused", "0", "0"],
    ]
    assert all(re.fullmatch(r"\d+\.\d\d", row[4]) for row in rows)
    report = validated(tmp_path / "r.json")
    assert all(model["seconds"] > 0 for model in report["models"]) and report["seconds"] > 0


@pytest.mark.parametrize("command", ["optimize", "check"])
def test_a_model_that_cannot_be_read_is_named_in_the_report_of_several(cli, zoo, tmp_path, command):
    missing = tmp_path / "missing.onnx"
    extra = ["-o", "out", "--force"] if command == "optimize" else []
    result = cli(tmp_path, command, zoo / "mlp.onnx", missing, *extra, "--format", "json")
    assert result.returncode == 2, result.stderr
    report = json.loads(result.stdout)
    jsonschema.validate(report, REPORT_SCHEMA)
    entry = report["models"][1]
    assert entry["verdict"] == "error" and entry["input"] == {"path": str(missing), "sha256": None}
    markdown = cli(tmp_path, command, zoo / "mlp.onnx", missing, *extra, "--format", "markdown")
    assert f"| `{missing}` | error | 2 |" in markdown.stdout and f"### `{missing}`: error" in markdown.stdout


def test_markdown_keeps_a_table_whole_whatever_the_names():
    names = ["a|b.onnx", "x`y.onnx", "`z.onnx"]
    done = [report_module.envelope("check", "fully-fused", 0, input={"path": n}, seconds=0.5) for n in names]
    lines = report_module.markdown(report_module.batch_envelope("check", done)).splitlines()
    rows = lines[4:7]
    assert rows == [
        "| `a\\|b.onnx` | fully-fused | 0 | 0 | 0.50 |",
        "| ``x`y.onnx`` | fully-fused | 0 | 0 | 0.50 |",
        "| `` `z.onnx `` | fully-fused | 0 | 0 | 0.50 |",
    ]
    # Each row has its five cells: no pipe in a name splits one (GitHub splits at any unescaped pipe).
    assert all(len(re.split(r"(?<!\\)\|", row)) == 7 for row in rows)


def test_a_model_the_run_was_stopped_before_has_no_time_in_the_markdown_table():
    done = report_module.envelope("optimize", "unchanged", 0, input={"path": "a.onnx"}, seconds=1.25)
    stopped = report_module.envelope("optimize", "error", 130, error="b.onnx: interrupted", input={"path": "b.onnx"})
    lines = report_module.markdown(report_module.batch_envelope("optimize", [done, stopped])).splitlines()
    assert lines[4].startswith("| `a.onnx` | unchanged | 0 |") and lines[4].endswith("| 1.25 |")
    assert lines[5].startswith("| `b.onnx` | error | 130 |") and lines[5].endswith("|  |")


def test_check_takes_several_models_and_the_worst_code_wins(cli, zoo, tmp_path):
    assert cli(tmp_path, "optimize", zoo / "mlp.onnx", "-o", tmp_path / "done.onnx").returncode == 0
    result = cli(tmp_path, "check", zoo / "mlp.onnx", tmp_path / "done.onnx", "--report", "r.json")
    assert result.returncode == 1
    report = validated(tmp_path / "r.json")
    assert [m["verdict"] for m in report["models"]] == ["work-found", "fully-fused"]
    (tmp_path / "broken.onnx").write_bytes(b"")
    worse = cli(tmp_path, "check", zoo / "mlp.onnx", tmp_path / "broken.onnx")
    assert worse.returncode == 2
    assert f"{zoo / 'mlp.onnx'}: " in worse.stderr and "broken.onnx" in worse.stderr


RAISING_RULES = """\
from fuser import op, rule, var


@rule("boom-on-relu", pattern=op.Relu(var("x")))
def boom_on_relu(m, b):
    \"\"\"Relu(x) -> an error.\"\"\"
    raise RuntimeError("boom")
"""


def test_check_of_several_models_names_the_model_a_rule_failed_on(cli, zoo, tmp_path):
    (tmp_path / "raising_rules.py").write_text(RAISING_RULES)
    result = cli(tmp_path, "check", zoo / "classifier_head.onnx", zoo / "mlp.onnx", "--rules", "raising_rules.py")
    assert result.returncode == 4
    assert f"fuser: error: {zoo / 'mlp.onnx'}: rule 'boom-on-relu' failed: RuntimeError: boom" in result.stderr
    alone = cli(tmp_path, "check", zoo / "mlp.onnx", "--rules", "raising_rules.py")  # one model: as before
    assert alone.returncode == 4 and "fuser: error: rule 'boom-on-relu' failed" in alone.stderr


# SIGTERM lands while a finalizer runs: its SystemExit cannot unwind from there.
SIGTERM_IN_A_FINALIZER = """\
import os
import signal
import time

from fuser import stops

stops.end_on_sigterm()


class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass


thing = Finalized()
del thing
time.sleep(5)
print("carried on")
"""


# A second SIGTERM comes as the first unwinds (sent to fuser's process group, then by fuser).
SIGTERM_TWICE = """\
import os
import signal

from fuser import stops

stops.end_on_sigterm()
try:
    os.kill(os.getpid(), signal.SIGTERM)
finally:
    os.kill(os.getpid(), signal.SIGTERM)
    for step in range(1000):
        pass
    print("cleaned up")
"""


def python_script(script: str) -> tuple[int, str, str]:
    """Run `script` in a Python process of its own, with this checkout's fuser: its exit status and output."""
    ended = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(MODELS.parent)},
        timeout=60,
    )
    return ended.returncode, ended.stdout, ended.stderr


def test_a_second_sigterm_lets_the_cleanup_of_the_first_run_to_its_end():
    assert python_script(SIGTERM_TWICE) == (128 + 15, "cleaned up\n", "")


def test_a_worker_ends_quietly_on_sigterm_even_where_it_lands_in_a_finalizer():
    assert python_script(SIGTERM_IN_A_FINALIZER) == (128 + 15, "", "")  # no traceback, not carried on


def planned(sources, **options) -> list[jobs.OptimizeJob]:
    return [jobs.OptimizeJob(source, source.with_suffix(".out.onnx"), **options) for source in sources]


def test_default_jobs_fit_cores_and_memory(zoo):
    sources = planned(sorted(zoo.iterdir()))
    assert jobs.default_jobs(sources) == max(1, min(jobs.available_cores(), 3))
    assert jobs.available_memory() > 0
    peaks = sorted((jobs.estimated_peak(source) for source in sources), reverse=True)
    assert jobs.default_jobs(sources, cores=8, memory=sum(peaks)) == 3
    assert jobs.default_jobs(sources, cores=8, memory=peaks[0] + peaks[1]) == 2  # the two largest fit
    assert jobs.default_jobs(sources, cores=8, memory=peaks[0] // 2) == 1  # at least one, however short
    assert jobs.default_jobs(sources, cores=2, memory=sum(peaks)) == 2


def system_files(root: Path, files: dict[str, str]) -> str:
    """A system's /proc and /sys files under `root`, as available_memory and available_cores read them."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(root)


GIB = 1 << 30
MEMINFO = f"MemTotal: {32 * GIB // 1024} kB\nMemAvailable: {20 * GIB // 1024} kB\n"


def test_memory_is_what_the_tightest_cgroup_limit_leaves_less_the_files_the_kernel_drops_first(tmp_path):
    nested_v2 = {
        "proc/meminfo": MEMINFO,
        "proc/self/cgroup": "0::/ci.slice/job\n",
        "sys/fs/cgroup/ci.slice/memory.max": f"{4 * GIB}\n",  # the slice's limit holds for the job inside it
        "sys/fs/cgroup/ci.slice/memory.current": f"{3 * GIB}\n",
        "sys/fs/cgroup/ci.slice/memory.stat": f"anon {2 * GIB}\ninactive_file {GIB}\n",
        "sys/fs/cgroup/ci.slice/job/memory.max": "max\n",
        "sys/fs/cgroup/ci.slice/job/memory.current": f"{GIB}\n",
    }
    assert jobs.available_memory(system_files(tmp_path / "v2", nested_v2)) == 2 * GIB
    container_v1 = {  # its own cgroup mounted where the hierarchy's root would be
        "proc/meminfo": MEMINFO,
        "proc/self/cgroup": "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{2 * GIB}\n",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{3 * GIB // 2}\n",
        "sys/fs/cgroup/memory/memory.stat": f"cache {GIB}\ninactive_file 7\ntotal_inactive_file {GIB // 2}\n",
    }
    assert jobs.available_memory(system_files(tmp_path / "v1", container_v1)) == GIB
    outside_v2 = {  # a cgroup namespace's view of a cgroup outside it: its own limit is at the root
        "proc/meminfo": MEMINFO,
        "proc/self/cgroup": "0::/../ci.slice\n",
        "sys/fs/cgroup/memory.max": f"{3 * GIB}\n",
        "sys/fs/cgroup/memory.current": f"{GIB}\n",
        "sys/fs/cgroup/ci.slice/memory.max": "1\n",  # not this process's: never read
        "sys/fs/cgroup/ci.slice/memory.current": "0\n",
    }
    assert jobs.available_memory(system_files(tmp_path / "outside", outside_v2)) == 2 * GIB
    unlimited_v1 = {**container_v1, "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"}
    assert jobs.available_memory(system_files(tmp_path / "unlimited", unlimited_v1)) == 20 * GIB
    assert jobs.available_memory(system_files(tmp_path / "bare", {"proc/meminfo": MEMINFO})) == 20 * GIB
    garbled = {
        **nested_v2,
        "proc/self/cgroup": "garbage\n0::/ci.slice/job\n",
        "sys/fs/cgroup/ci.slice/memory.max": "a lot\n",
    }
    assert jobs.available_memory(system_files(tmp_path / "garbled", garbled)) == 20 * GIB


def test_cores_are_the_affinity_or_fewer_under_a_cgroup_quota(tmp_path):
    container_v1 = {
        "proc/self/cgroup": "5:cpu,cpuacct:/docker/abc\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "50000\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    }
    assert jobs.available_cores(system_files(tmp_path / "v1", container_v1)) == 1
    linked = {  # listed as "cpu,cpuacct", mounted as "cpu"
        "proc/self/cgroup": "5:cpu,cpuacct:/docker/abc\n",
        "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "50000\n",
        "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
    }
    assert jobs.available_cores(system_files(tmp_path / "linked", linked)) == 1
    unlimited = {**container_v1, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n"}
    assert jobs.available_cores(system_files(tmp_path / "unlimited", unlimited)) == jobs.available_cores(str(tmp_path))
    nested_v2 = {
        "proc/self/cgroup": "0::/a/b\n",
        "sys/fs/cgroup/a/cpu.max": "50000 100000\n",
        "sys/fs/cgroup/a/b/cpu.max": "max 100000\n",
    }
    assert jobs.available_cores(system_files(tmp_path / "v2", nested_v2)) == 1


def test_the_check_memory_warning_weighs_nodes_and_weights_against_what_is_available():
    need = jobs.check_memory_need(1_000_000, 400_000_000)
    assert need == 1_000_000 * jobs.CHECK_BYTES_PER_NODE + int(400_000_000 * jobs.CHECK_BYTES_PER_WEIGHT_BYTE)
    assert jobs.check_memory_warning(Path("m.onnx"), 1_000_000, 400_000_000, need) is None  # it fits
    assert jobs.check_memory_warning(Path("m.onnx"), 1_000_000, 400_000_000, None) is None  # unknown: no guess
    warning = jobs.check_memory_warning(Path("m.onnx"), 1_000_000, 400_000_000, need - 1)
    assert warning.startswith("fuser: warning: m.onnx: the check of its 1,000,000 nodes needs about 5.9 GB more")
    assert "and 5.9 GB is available" in warning and "--no-check" in warning and "fuser compare" in warning
    after = jobs.check_memory_warning(Path("m.onnx"), 1_000_000, 400_000_000, need - 1, after_writing=True)
    assert "needs about 5.9 GB more beside the rewrite" in after and "once the result is written" in after
    assert "--no-check" in after


def test_a_check_that_may_not_fit_in_memory_is_warned_of_before_the_work(cli, zoo, tmp_path, monkeypatch):
    monkeypatch.setattr(jobs, "available_memory", lambda: 1000)  # no check fits
    out = tmp_path / "out.onnx"
    result = cli(tmp_path, "optimize", zoo / "mlp.onnx", "-o", out, "--report", tmp_path / "r.json")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"fuser: warning: {zoo / 'mlp.onnx'}: the check of its ")
    assert "B is available" in lines[0] and "--no-check" in lines[0]
    assert any(line.startswith("numerics check: passed") for line in lines)  # warned of, not left out
    assert validated(tmp_path / "r.json")["numerics"]["passed"] and out.exists()
    quiet = cli(tmp_path, "optimize", zoo / "mlp.onnx", "-o", out, "--force", "-q")
    assert quiet.returncode == 0 and "warning" not in quiet.stderr
    unchecked = cli(tmp_path, "optimize", zoo / "mlp.onnx", "-o", out, "--force", "--no-check")
    assert unchecked.returncode == 0 and "needs about" not in unchecked.stderr
    monkeypatch.setattr(jobs, "available_memory", lambda: 1 << 40)
    roomy = cli(tmp_path, "optimize", zoo / "mlp.onnx", "-o", out, "--force")
    assert roomy.returncode == 0 and "warning" not in roomy.stderr


@pytest.mark.parametrize("external_data", ["never", "always"])
def test_short_of_memory_the_check_runs_once_the_result_is_written_and_its_graph_let_go(
    cli, zoo, tmp_path, monkeypatch, external_data
):
    source = zoo / "resnet_small.onnx"
    beside = tmp_path / "beside" / "m.onnx"
    usual = cli(tmp_path, "optimize", source, "-o", beside, "--external-data", external_data)
    assert usual.returncode == 0 and "warning" not in usual.stderr, usual.stderr
    monkeypatch.setattr(jobs, "available_memory", lambda: 1000)
    out = tmp_path / "after" / "m.onnx"
    after = cli(tmp_path, "optimize", source, "-o", out, "--external-data", external_data, "--report", "r.json")
    assert after.returncode == 0, after.stderr
    assert (
        "beside the rewrite and 1000 B is available: it runs once the result is written" in after.stderr.splitlines()[0]
    )
    report = validated(tmp_path / "r.json")
    assert report["numerics"]["passed"] and {"load", "rewrite", "check", "write"} <= set(report["timings"])
    assert report["output"]["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    # The files the check beside the rewrite writes, and nothing else left beside them.
    names = ["m.onnx", "m.onnx.data"] if external_data == "always" else ["m.onnx"]
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(p.name for p in beside.parent.iterdir()) == names
    assert all((out.parent / name).read_bytes() == (beside.parent / name).read_bytes() for name in names)
    assert cli(tmp_path, "compare", source, out).returncode == 0


def test_a_difference_the_check_after_writing_finds_is_found_again_and_blamed(cli, tmp_path, monkeypatch):
    (tmp_path / "wrong_rules.py").write_text(WRONG_RULES)
    onnx.save(unary_model("Cos"), tmp_path / "cosine.onnx")
    monkeypatch.setattr(jobs, "available_memory", lambda: 1000)
    check_written = jobs._check_written

    def slow_check_written(*args, **kwargs):  # the first attempt's check, long enough to tell apart
        time.sleep(0.5)
        return check_written(*args, **kwargs)

    monkeypatch.setattr(jobs, "_check_written", slow_check_written)
    result = cli(
        tmp_path, "optimize", "cosine.onnx", "-o", "out.onnx", "--rules", "wrong_rules.py", "--report", "r.json"
    )
    assert result.returncode == 3, result.stderr
    lines = result.stderr.splitlines()
    assert "optimizing again with the check beside the rewrite" in lines[1]
    assert sum("needs about" in line for line in lines) == 1  # warned once
    assert "caused by 1 rewrite(s): wrong-cos" in result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verdict"] == "mismatch" and report["blamed"]
    # The times are both attempts': the first one's check after writing is counted too.
    assert {"load", "rewrite", "check", "blame", "write"} <= set(report["timings"])
    assert report["timings"]["check"] >= 0.5
    assert report["seconds"] >= sum(report["timings"].values())
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("fuser-evidence")) == [
        "cosine.onnx",
        "r.json",
        "wrong_rules.py",
    ]  # nothing written, no staging folder left


def test_among_several_models_a_line_says_what_the_check_dropped(cli, zoo, tmp_path):
    (tmp_path / "wrong_rules.py").write_text(WRONG_RULES)
    onnx.save(unary_model("Cos"), zoo / "cosine.onnx")
    result = cli(
        tmp_path, "optimize", zoo / "cosine.onnx", zoo / "mlp.onnx", "-o", "out", "--rules", "wrong_rules.py",
        "--on-mismatch", "drop",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith(str(zoo / "cosine.onnx"))]
    assert "0 rewrites, check passed after dropping 1 rewrite(s)" in line
    [other] = [line for line in result.stderr.splitlines() if line.startswith(str(zoo / "mlp.onnx"))]
    assert "check passed," in other


def test_the_summary_of_a_model_whose_every_rewrite_was_dropped_says_so(cli, tmp_path):
    (tmp_path / "wrong_rules.py").write_text(WRONG_RULES)
    onnx.save(unary_model("Cos"), tmp_path / "cosine.onnx")
    result = cli(tmp_path, "optimize", "cosine.onnx", "--rules", "wrong_rules.py", "--on-mismatch", "drop")
    assert result.returncode == 0, result.stderr
    assert "none left: the check dropped every rewrite (1)" in result.stderr
    assert "nothing to fuse" not in result.stderr


def test_a_check_the_model_needs_as_changed_before_the_rewrite_stays_beside_it(cli, zoo, tmp_path, monkeypatch):
    monkeypatch.setattr(jobs, "available_memory", lambda: 1000)
    result = cli(tmp_path, "optimize", zoo / "mlp.onnx", "-o", "out.onnx", "--opset", "18")  # an upgrade
    assert result.returncode == 0, result.stderr
    assert "needs about" in result.stderr and "the system may stop fuser" in result.stderr
    assert "once the result is written" not in result.stderr


def test_each_worker_warns_of_a_check_that_may_not_fit_as_it_starts(zoo, tmp_path):
    """The workers are processes of their own: every interpreter of the run, the fork server's
    and the workers' included, is told of 1000 bytes available by a sitecustomize module. A
    worker the system then kills has warned first."""
    (tmp_path / "sitecustomize.py").write_text("import fuser.jobs\nfuser.jobs.available_memory = lambda: 1000\n")
    (tmp_path / "killing_rules.py").write_text(KILLING_RULES)
    onnx.save(unary_model("Sin"), zoo / "sine.onnx")
    models = [zoo / "mlp.onnx", zoo / "resnet_small.onnx", zoo / "sine.onnx"]
    command = [sys.executable, "-m", "fuser.cli", "optimize", *models, "-j", "2", "--rules", "killing_rules.py"]
    result = subprocess.run(
        [*map(str, command), "-o", str(tmp_path / "out")],
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(MODELS.parent)])},
        timeout=300,
    )
    assert result.returncode == 4, result.stderr
    lines = result.stderr.splitlines()
    warned = [line.split(": ")[2] for line in lines if line.startswith("fuser: warning: ") and "needs about" in line]
    assert sorted(warned) == sorted(map(str, models))
    killed = next(i for i, line in enumerate(lines) if "killed by signal SIGKILL" in line)
    warned_of_sine = next(i for i, line in enumerate(lines) if line.startswith(f"fuser: warning: {zoo / 'sine.onnx'}"))
    assert "--no-check" in lines[killed] and warned_of_sine < killed
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["mlp.onnx", "resnet_small.onnx"]
    assert lines[-1].startswith("3 models: 2 written, 1 failed (exit 4)")


@pytest.mark.parametrize("collector_on", [True, False])
def test_a_job_runs_without_the_cyclic_collector_and_gives_it_back_as_it_was(zoo, tmp_path, collector_on):
    """A graph's objects are freed by reference counting, so a job spares the collector's scans
    of them; after it, succeeded or failed, the collector is on or off as it was."""
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    was_on = gc.isenabled()
    (gc.enable if collector_on else gc.disable)()
    gc.callbacks.append(count)
    try:
        during = []  # collections so far, at each stage's progress: the job's own
        written = jobs.optimize_file(
            jobs.OptimizeJob(zoo / SAMPLES[0], tmp_path / "out.onnx"),
            progress=lambda *stage: during.append(len(collections)),
        )
        assert written.error is None and written.code == 0
        assert len(during) > 4 and set(during) == {0}
        assert gc.isenabled() == collector_on
        broken = tmp_path / "broken.onnx"
        broken.write_bytes(b"not a model")
        failed = jobs.optimize_file(jobs.OptimizeJob(broken, tmp_path / "broken.out.onnx"))
        assert failed.error is not None
        assert gc.isenabled() == collector_on
    finally:
        gc.callbacks.remove(count)
        (gc.enable if was_on else gc.disable)()


def mlp_stack(blocks: int, width: int = 8) -> onnx.ModelProto:
    nodes, weights, previous = [], [], "x"
    for index in range(blocks):
        weights += [
            numpy_helper.from_array(np.ones((width, width), np.float32), f"w{index}"),
            numpy_helper.from_array(np.ones(width, np.float32), f"b{index}"),
        ]
        nodes += [
            helper.make_node("MatMul", [previous, f"w{index}"], [f"m{index}"]),
            helper.make_node("Add", [f"m{index}", f"b{index}"], [f"a{index}"]),
            helper.make_node("Relu", [f"a{index}"], [f"r{index}"]),
        ]
        previous = f"r{index}"
    graph = helper.make_graph(
        nodes,
        "stack",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info(previous, onnx.TensorProto.FLOAT, [1, width])],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_peak_estimate_grows_with_what_the_model_holds(tmp_path):
    onnx.save(mlp_stack(10), tmp_path / "small.onnx")
    onnx.save(mlp_stack(1000), tmp_path / "many_nodes.onnx")
    small, many = planned([tmp_path / "small.onnx", tmp_path / "many_nodes.onnx"])
    assert jobs.estimated_peak(many) > jobs.estimated_peak(small) + 2900 * jobs.PEAKS[True].per_node
    unchecked = planned([tmp_path / "many_nodes.onnx"], check=False)[0]
    assert jobs.estimated_peak(unchecked) < jobs.estimated_peak(many)

    filters = np.ones((64, 64, 3, 3), np.float32)
    conv = model_from_text(
        "agraph (float[1, 64, 8, 8] x) => (float[1, 64, 6, 6] y) { y = Conv(x, w) }", initializers={"w": filters}
    )
    onnx.save(conv, tmp_path / "conv.onnx")
    on_onnx, on_ort = (planned([tmp_path / "conv.onnx"], target=target)[0] for target in ("onnx", "onnxruntime"))
    census, whole = jobs.model_census(tmp_path / "conv.onnx")
    assert (census.nodes, census.filter_bytes, whole) == (1, conv.graph.initializer[0].ByteSize(), False)
    assert jobs.estimated_peak(on_ort) - jobs.estimated_peak(on_onnx) == int(
        (jobs.PEAKS[True].per_filter_byte_nchwc - jobs.PEAKS[True].per_filter_byte)
        * conv.graph.initializer[0].ByteSize()
    )
    conv.ir_version = 3  # every weight is a graph input too: read whole
    conv.graph.input.append(helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [64, 64, 3, 3]))
    onnx.save(conv, tmp_path / "conv_ir3.onnx")
    assert jobs.model_census(tmp_path / "conv_ir3.onnx")[1] is True
    assert jobs.estimated_peak(planned([tmp_path / "conv_ir3.onnx"])[0]) > jobs.estimated_peak(on_onnx)


def test_census_counts_subgraphs_tensor_attributes_and_weights_made_at_run_time():
    big = numpy_helper.from_array(np.arange(1000, dtype=np.float32), "value")
    branch = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=big), helper.make_node("Add", ["x", "c"], ["y"])],
        "branch",
        [],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1000])],
    )
    shape = numpy_helper.from_array(np.array([16, 1024], np.int64), "shape")
    fill = numpy_helper.from_array(np.zeros(1, np.float16))
    graph = helper.make_graph(
        [
            helper.make_node("If", ["flag"], ["y"], then_branch=branch, else_branch=branch),
            helper.make_node("ConstantOfShape", ["shape"], ["zeros"], value=fill),
        ],
        "g",
        [
            helper.make_tensor_value_info("flag", onnx.TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1000]),
        ],
        [
            helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1000]),
            helper.make_tensor_value_info("zeros", onnx.TensorProto.FLOAT16, [16, 1024]),
        ],
        [shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    census = wire.census(memoryview(model.SerializeToString()))
    assert census.nodes == 6 and census.ir_version == model.ir_version
    assert census.weight_bytes == 2 * big.ByteSize() + shape.ByteSize() + fill.ByteSize()
    assert census.computed_bytes == 16 * 1024 * 2  # float16
    assert wire.census(memoryview(b"\x0a\xff")) is None  # a length past the end


@settings(max_examples=30, deadline=None)
@given(blocks=st.integers(1, 40), width=st.sampled_from([1, 8, 200]))
def test_census_agrees_with_the_parsed_model(blocks, width):
    model = mlp_stack(blocks, width)
    census = wire.census(memoryview(model.SerializeToString()))
    assert census.nodes == len(model.graph.node)
    assert census.weight_bytes == sum(t.ByteSize() for t in model.graph.initializer)
    assert census.filter_bytes == census.computed_bytes == 0


def test_census_looks_into_small_nodes_and_external_tensors_with_long_names(tmp_path):
    branch = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Abs", ["n"], ["y"])],
        "branch",
        [],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
    )
    node = helper.make_node("If", ["flag"], ["y"], then_branch=branch, else_branch=branch)
    assert node.ByteSize() < 200
    name = "w" * 1100  # its TensorProto is longer than the small ones parsed outright
    weights = numpy_helper.from_array(np.ones((16, 16, 2, 2), np.float32), name)
    graph = helper.make_graph(
        [node, helper.make_node("Conv", ["x4", name], ["c"])],
        "g",
        [
            helper.make_tensor_value_info("flag", onnx.TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("x4", onnx.TensorProto.FLOAT, [1, 16, 4, 4]),
        ],
        [
            helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, [1, 16, 3, 3]),
        ],
        [weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.bin", size_threshold=0)
    census, whole = jobs.model_census(tmp_path / "m.onnx")
    assert census.nodes == 6 and not whole
    assert (census.weight_bytes, census.filter_bytes, census.held_bytes) == (16 * 16 * 4 * 4, 16 * 16 * 4 * 4, 0)
    assert census.locations == {"m.bin"} and census.unsized == set()

    written = onnx.load(tmp_path / "m.onnx", load_external_data=False)
    for entry in list(written.graph.initializer[0].external_data):
        if entry.key in ("offset", "length"):
            written.graph.initializer[0].external_data.remove(entry)
    onnx.save(written, tmp_path / "unsized.onnx")
    census, _ = jobs.model_census(tmp_path / "unsized.onnx")
    assert census.unsized == {"m.bin"} and census.weight_bytes == 0
    unsized, sized = planned([tmp_path / "unsized.onnx", tmp_path / "m.onnx"])
    assert jobs.estimated_peak(unsized) >= jobs.estimated_peak(sized) - jobs.PEAKS[True].per_filter_byte * 4096 - 1


def nested_ifs(depth: int) -> onnx.ModelProto:
    leaf = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "b", [], [helper.make_tensor_value_info("y", 1, [1])]
    )
    body = leaf
    for _ in range(depth):
        body = helper.make_graph(
            [helper.make_node("If", ["flag"], ["y"], then_branch=body, else_branch=leaf)],
            "b",
            [],
            [helper.make_tensor_value_info("y", 1, [1])],
        )
    model = helper.make_model(body, opset_imports=[helper.make_opsetid("", 17)])
    model.graph.input.extend([helper.make_tensor_value_info("flag", 9, []), helper.make_tensor_value_info("x", 1, [1])])
    return model


def nested_graphs(depth: int, padding: int = 0) -> bytes:
    """A ModelProto's bytes whose graph nests `depth` graphs, each in a node's attribute (and a
    `padding`-byte node name): protobuf's helpers refuse to build one that deep."""

    def length_delimited(number: int, value: bytes) -> bytes:
        return wire.field_key(number) + wire.encode_varint(len(value)) + value

    graph = b""
    for _ in range(depth):
        node = length_delimited(3, b"n" * padding) + length_delimited(5, length_delimited(6, graph))
        graph = length_delimited(1, node)
    return length_delimited(7, graph)


def test_census_refuses_what_protobuf_would():
    assert wire.census(memoryview(nested_ifs(5).SerializeToString())).nodes == 5 + 5 + 1  # Ifs, Identities
    assert wire.census(memoryview(nested_graphs(20))).nodes == 20
    assert wire.census(memoryview(nested_graphs(150))) is None  # deeper than protobuf reads
    assert wire.census(memoryview(nested_graphs(150, padding=2000))) is None  # nodes too long to parse outright
    assert wire.census(memoryview(bytes(1 << 20))) is None  # zeros: field number 0 does not exist


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=400), cut=st.integers(0, 10_000))
def test_census_of_any_bytes_is_a_census_or_none(data, cut):
    valid = mlp_stack(3).SerializeToString()
    for candidate in (data, valid[:cut], valid[:cut] + data, data + valid):
        assert wire.census(memoryview(candidate)) is None or isinstance(wire.census(memoryview(candidate)), wire.Census)


def test_peak_estimate_of_what_is_not_a_model_file(tmp_path):
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "garbage.onnx").write_bytes(b"\xff" * 100)
    os.mkfifo(tmp_path / "pipe.onnx")  # never opened: opening a pipe waits for a writer
    sizes = {"empty.onnx": 0, "garbage.onnx": 100, "pipe.onnx": 0, "missing.onnx": 0}
    for name, size in sizes.items():
        assert jobs.model_census(tmp_path / name) is None
        job = planned([tmp_path / name])[0]
        assert jobs.estimated_peak(job) == jobs.PEAKS[True].base + int(
            jobs.PEAKS[True].per_weight_byte_read_whole * size
        )
    sources = planned([tmp_path / "pipe.onnx", tmp_path / "missing.onnx", tmp_path / "garbage.onnx"])
    assert jobs.default_jobs(sources, cores=2, memory=2 * jobs.PEAKS[True].base + 250) == 2
    assert jobs.default_jobs(sources, cores=2, memory=2 * jobs.PEAKS[True].base + 249) == 1


def test_census_finds_external_data_and_what_loading_holds_in_memory(tmp_path):
    large = np.ones((256, 128), np.float32)  # 128 KiB: over IN_PLACE_BYTES
    model = model_from_text(
        "agraph (float[1, 256] x) => (float[1, 128] y, float[1, 128] z) { y = MatMul(x, w)  z = MatMul(x, v) }",
        initializers={"w": large, "v": large},
    )
    as_floats = helper.make_tensor("v", onnx.TensorProto.FLOAT, [256, 128], large.ravel().tolist())
    model.graph.initializer[1].CopyFrom(as_floats)  # float_data: parsed into memory, not read in place
    census = wire.census(memoryview(model.SerializeToString()))
    raw, floats = (t.ByteSize() for t in model.graph.initializer)
    assert (census.weight_bytes, census.held_bytes) == (raw + floats, floats)

    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(large, "v"))
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.weights", size_threshold=0)
    census, whole = jobs.model_census(tmp_path / "m.onnx")
    assert (census.weight_bytes, census.held_bytes, whole) == (2 * large.nbytes, 0, False)
    assert (census.locations, census.unsized) == ({"m.weights"}, set())


def test_census_of_subgraphs_constants_functions_and_absurd_sizes():
    large = numpy_helper.from_array(np.ones(20000, np.float32), "w")  # 80 KB, in a subgraph: parsed
    body = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "body",
        [],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [20000])],
        [large],
    )
    shape = numpy_helper.from_array(np.array([1024, 256], np.int64))
    absurd = numpy_helper.from_array(np.array([1 << 40, 1 << 40], np.int64), "absurd")
    graph = helper.make_graph(
        [
            helper.make_node("If", ["flag"], ["y"], then_branch=body, else_branch=body),
            helper.make_node("Constant", [], ["shape"], value=shape),
            helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),  # no value: float32 zeros
            helper.make_node("ConstantOfShape", ["absurd"], ["huge"]),
            helper.make_node("Twice", ["x"], ["t"], domain="local"),
        ],
        "g",
        [
            helper.make_tensor_value_info("flag", onnx.TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [20000]),
        ],
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in ("y", "zeros", "huge", "t")],
        [absurd],
    )
    twice = helper.make_function(
        "local", "Twice", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])], [helper.make_opsetid("", 17)]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], functions=[twice])
    census = wire.census(memoryview(model.SerializeToString()))
    assert census.nodes == 5 + 2 + 1  # the graph's, both branches', the function's
    assert census.held_bytes == census.weight_bytes == 2 * large.ByteSize() + shape.ByteSize() + absurd.ByteSize()
    assert census.computed_bytes == 1024 * 256 * 4  # the absurd shape counts for nothing

    external = numpy_helper.from_array(np.zeros(4, np.float32), "e")
    external_data_helper.set_external_data(external, "e.bin", length=10**400)
    external.ClearField("raw_data")
    model.graph.initializer.append(external)
    census = wire.census(memoryview(model.SerializeToString()))
    assert census.unsized == {"e.bin"}


def test_peak_estimate_with_the_latency_measurement_is_the_checks(tmp_path):
    onnx.save(mlp_stack(100), tmp_path / "m.onnx")
    unchecked, measured = (
        planned([tmp_path / "m.onnx"], check=False, measure=measure)[0] for measure in (None, "onnxruntime")
    )
    assert jobs.estimated_peak(measured) == jobs.estimated_peak(planned([tmp_path / "m.onnx"])[0])
    assert jobs.estimated_peak(unchecked) < jobs.estimated_peak(measured)


# ------------------------------------------------------------------------ progress


def chain(nodes: int) -> onnx.ModelProto:
    """Relu and Identity by turns: enough nodes that the rewrite stage reports progress (every 1000
    visits), and Identity nodes to remove, so that the check runs."""
    text = "\n".join(f"r{i + 1} = {'Relu' if i % 2 else 'Identity'}(r{i})" for i in range(nodes))
    return model_from_text(f"agraph (float[4] r0) => (float[4] r{nodes}) {{\n{text}\n}}")


def run_in_terminal(args: list, cwd: Path, ci: str | None = None) -> tuple[int, str]:
    """Run `python -m fuser.cli ARGS` with stderr on a pseudo-terminal; its exit code and what it
    drew. CI is set to `ci`, or unset (the suite itself may run in CI)."""
    main, secondary = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    process = subprocess.Popen(
        [sys.executable, "-m", "fuser.cli", *map(str, args)],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=secondary,
    )
    os.close(secondary)
    drawn = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the terminal closes when the process ends
            break
        if not chunk:
            break
        drawn += chunk
    os.close(main)
    return process.wait(timeout=300), drawn.decode(errors="replace")


def test_progress_bars_on_a_terminal_and_not_with_q(tmp_path):
    onnx.save(chain(2500), tmp_path / "chain.onnx")
    code, drawn = run_in_terminal(["optimize", "chain.onnx"], tmp_path)
    assert code == 0, drawn
    assert "fuser: loading..." in drawn
    assert re.search(r"fuser: loading .*\] +2500/2500 +[\d,.]+ nodes/s", drawn)
    assert re.search(r"fuser: rewriting .*\] +[1-9]\d*000/\d+ +[\d,.]+ nodes/s", drawn)
    assert "fuser: checking numerics" in drawn and "2/2" in drawn and "model runs/s" in drawn
    assert "time: load " in drawn
    code, drawn = run_in_terminal(["optimize", "chain.onnx", "-q", "--force"], tmp_path)
    assert code == 0 and drawn == ""


@pytest.mark.parametrize(("ci", "drawn_bars"), [("true", False), ("1", False), ("false", True), ("0", True)])
def test_a_ci_runner_s_terminal_gets_no_bars(tmp_path, ci, drawn_bars):
    """Some CI runners hand the job a pseudo-terminal; their logs would keep every redraw."""
    onnx.save(chain(2500), tmp_path / "chain.onnx")
    code, drawn = run_in_terminal(["optimize", "chain.onnx"], tmp_path, ci=ci)
    assert code == 0, drawn
    assert ("nodes/s" in drawn) == drawn_bars
    assert "time: load " in drawn  # the summary is printed either way


def test_check_shows_where_it_is_on_a_terminal_and_not_with_q(tmp_path):
    onnx.save(chain(2500), tmp_path / "chain.onnx")
    onnx.save(chain(2400), tmp_path / "short.onnx")
    code, drawn = run_in_terminal(["check", "chain.onnx", "short.onnx"], tmp_path)
    assert code == 1, drawn
    assert re.search(r"fuser: loading .*\] +2500/2500 +[\d,.]+ nodes/s", drawn)
    assert re.search(r"fuser: looking for fusions .*\] +1250/1250 +[\d,.]+ nodes/s", drawn)  # its Identity nodes
    assert "rewriting" not in drawn
    # Each model's lines come below its bars, not drawn over by them.
    assert re.search(r"nodes/s\S*\r?\nchain\.onnx: identity-elimination", drawn), drawn
    assert re.search(r"nodes/s\S*\r?\nshort\.onnx: identity-elimination", drawn), drawn
    code, drawn = run_in_terminal(["check", "chain.onnx", "-q"], tmp_path)
    assert code == 1 and drawn == ""


def test_the_progress_hook_hears_the_load_and_the_match_of_a_check():
    import fuser

    heard = []
    found = fuser.find_opportunities(chain(2500), progress=lambda *told: heard.append(told))
    assert found.opportunity_counts() == {"identity-elimination": len(found.opportunities)} and found.counts() == {}
    assert list(dict.fromkeys(stage for stage, _, _ in heard)) == ["load", "match"]
    matched = [(done, total) for stage, done, total in heard if stage == "match"]
    assert matched[0] == (1000, matched[0][1]) and matched[-1][0] == matched[-1][1] >= 1000  # the Identity nodes


def test_a_bars_rate_counts_from_its_first_count():
    from fuser.cli import TerminalProgress

    now = [0.0]
    progress = TerminalProgress(clock=lambda: now[0])
    progress("load", 0, None)  # the file is parsed: no count yet
    now[0] = 30.0
    progress("load", 0, 1000)  # its nodes are read into the graph from here on
    now[0] = 31.0
    progress("load", 1000, 1000)
    assert progress.bar.current_item == "1,000.0 nodes/s"  # not 1000 nodes over 31 s
    progress("rewrite", 0, None)  # the passes before the first visit
    now[0] = 40.0
    progress("rewrite", 1000, 3000)  # counts come every thousand: the first with a thousand done
    assert progress.bar.current_item == ""  # a rate needs a second count
    now[0] = 42.0
    progress("rewrite", 3000, 3000)
    assert progress.bar.current_item == "1,000.0 nodes/s"  # not 3000 nodes over the stage's 11 s
    progress.close()


def test_the_loading_bar_rate_leaves_out_the_wait_before_the_nodes_are_read(tmp_path, monkeypatch):
    """Loading a model parses it (and, short of memory, waits for onnx's check of it) before its
    nodes are read into the graph; the bar's rate counts only the nodes' reading."""
    from fuser.cli import TerminalProgress
    from fuser.model import Model

    onnx.save(chain(2500), tmp_path / "chain.onnx")
    now = [0.0]
    progress = TerminalProgress(clock=lambda: now[0])
    progress("load", 0, None)
    rates = []

    def tick(stage, done, total):
        now[0] += 1000.0 if not rates else 1.0  # a long wait, then a second per call
        progress(stage, done, total)
        rates.append(progress.bar.current_item)

    Model.load(tmp_path / "chain.onnx", progress=tick)
    assert rates[-1] == f"{(2500 - 1000) / (len(rates) - 1):,.1f} nodes/s", rates
    progress.close()


def test_no_progress_in_a_log(tmp_path):
    onnx.save(chain(2500), tmp_path / "chain.onnx")
    result = fuser_cli("optimize", "chain.onnx", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr and "..." not in result.stderr and "nodes/s" not in result.stderr
    assert "time: load " in result.stderr


def test_the_progress_hook_hears_every_stage_in_order():
    import fuser

    heard = []
    _, report = fuser.optimize(chain(2500), progress=lambda stage, done, total: heard.append((stage, done, total)))
    stages = list(dict.fromkeys(stage for stage, _, _ in heard))
    assert stages == ["load", "rewrite", "check"]
    rewrite = [(done, total) for stage, done, total in heard if stage == "rewrite" and total is not None]
    assert rewrite[0] == (1000, rewrite[0][1]) and rewrite[-1][0] == rewrite[-1][1] >= 2500
    assert len(rewrite) < 20  # every 1000 nodes, not every node
    assert [(d, t) for s, d, t in heard if s == "check" and t is not None] == [(0, 2), (1, 2), (2, 2)]
    assert [(d, t) for s, d, t in heard if s == "load"] == [(0, None), (1000, 2500), (2000, 2500), (2500, 2500)]
    assert list(report.to_dict()["timings"]) == ["load", "rewrite", "check", "write"]


def test_the_check_counts_the_padded_mask_set_in_its_progress():
    import fuser

    from tests.test_cli_real_models import bert_like

    heard = []
    fuser.optimize(bert_like(vocabulary=30), progress=lambda stage, done, total: heard.append((stage, done, total)))
    assert [(d, t) for s, d, t in heard if s == "check" and t is not None] == [(0, 2), (2, 4), (3, 4), (4, 4)]


@pytest.mark.parametrize("external_data", ["never", "always"])
def test_writing_counts_the_tensors_it_writes(tmp_path, external_data):
    from fuser.model import write_model

    weights = [numpy_helper.from_array(np.full((64, 64), i, np.float32), f"w{i}") for i in range(250)]
    nodes = [helper.make_node("Add", [f"t{i}", f"w{i}"], [f"t{i + 1}"]) for i in range(250)]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("t0", 1, [64, 64])],
        [helper.make_tensor_value_info("t250", 1, [64, 64])],
        weights,
    )
    heard = []
    written = write_model(
        helper.make_model(graph), tmp_path / "m.onnx", None, external_data, lambda *call: heard.append(call)
    )
    total = 250 if external_data == "never" else 500  # kept outside: the data, then its pointer
    assert heard[-1] == ("write", total, total) and all(t == total for _, _, t in heard)
    assert len(written) == (1 if external_data == "never" else 2)


def test_each_worker_writes_for_the_nchwc_block_asked(cli, zoo, tmp_path):
    args = ["--target", "onnxruntime", "--nchwc-block", "16", "--report", "r.json"]
    result = cli(tmp_path, "optimize", zoo / "mlp.onnx", zoo / "resnet_small.onnx", "-o", "out", *args)
    assert result.returncode == 0, result.stderr
    assert [m["nchwc_block"] for m in validated(tmp_path / "r.json")["models"]] == [16, 16]


# A rule that records its worker's pid, then takes its time: the run is interrupted meanwhile.
SLOW_RULES = """\
import os
import time
from pathlib import Path

from fuser import op, rule, var


@rule("slow-sin", pattern=op.Sin(var("x")))
def slow_sin(m, b):
    \"\"\"Sin(x) -> a long wait.\"\"\"
    Path(f"worker-{os.getpid()}.pid").write_text("")
    time.sleep(600)  # far longer than the test waits: Ctrl-C must end it, never the clock
"""


def _interrupted(tmp_path, names, command, started, quick=(), stop=None, group=True):
    """Run `command` in `tmp_path` on models of `names` under SLOW_RULES, send it Ctrl-C once
    `started` of them are being worked on, and give (exit status, stderr, the pids of the
    worker processes that worked on them, besides the command's own); its stdout is left in
    stdout.txt. The models of `quick`,
    among `names`, hold nothing the slow rule matches. `stop`: another signal to send, to the
    command alone unless `group`."""
    import signal
    import time

    (tmp_path / "slow_rules.py").write_text(SLOW_RULES)
    for name in names:
        onnx.save(unary_model("Cos" if name in quick else "Sin"), tmp_path / f"{name}.onnx")
    stdout = (tmp_path / "stdout.txt").open("w")  # what the run prints there, for the test to read
    process = subprocess.Popen(
        [sys.executable, "-m", *command, "--rules", "slow_rules.py"],
        cwd=tmp_path,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # A suite started in the background inherits SIGINT ignored, and Python then never turns
        # it into KeyboardInterrupt: give the run the disposition a terminal gives it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("worker-*.pid"))) < started and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = [int(p.stem.split("-")[1]) for p in tmp_path.glob("worker-*.pid")]
    assert len(workers) == started
    if group:
        os.killpg(process.pid, stop or signal.SIGINT)  # what Ctrl-C sends: to the whole process group
    else:
        os.kill(process.pid, stop)
    _, stderr = process.communicate(timeout=60)
    stdout.close()
    return process.returncode, stderr, [pid for pid in workers if pid != process.pid]


def test_ctrl_c_stops_the_pre_commit_hook_at_the_model_it_checks(tmp_path):
    import signal

    command = ["fuser.precommit", "a.onnx", "b.onnx"]
    status, stderr, _ = _interrupted(tmp_path, ("a", "b"), command, started=1)
    # The hook ends: b.onnx is not checked after a's was interrupted, and nothing says "error".
    assert status == -signal.SIGINT and stderr.strip().splitlines() == ["fuser: interrupted"]
    assert len(list(tmp_path.glob("worker-*.pid"))) == 1


@pytest.mark.parametrize("names", [("a",), ("a", "b")], ids=["one-model", "two-workers"])
@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_ends_every_worker_writes_nothing_and_ends_by_that_signal(tmp_path, names, stop):
    import signal

    (tmp_path / "out").mkdir()
    output = "out" if len(names) > 1 else "out/a.onnx"
    (tmp_path / "r.json").write_text(_earlier_report())  # at the same path
    command = ["fuser.cli", "optimize", *[f"{name}.onnx" for name in names], "-o", output, "--report", "r.json"]
    # Ctrl-C reaches the whole process group; a CI job's timeout or `kill` sends SIGTERM to fuser
    # alone, whose workers must not go on without it and write their models after it ended.
    number = getattr(signal, stop)
    status, stderr, workers = _interrupted(tmp_path, names, command, len(names), stop=number, group=stop == "SIGINT")
    # Ended by that signal itself, as a program it stopped ends: a shell stops its loop too and
    # reports 130 (143); the usage code, 2, would blame the command line.
    said = "fuser: interrupted" if stop == "SIGINT" else "fuser: terminated"
    assert status == -number and stderr.strip().splitlines()[-1] == said
    assert list((tmp_path / "out").iterdir()) == []
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # The report says the run was interrupted, in place of the earlier run's.
    report = validated(tmp_path / "r.json")
    assert (report["verdict"], report["exit_code"]) == ("error", 130)
    entries = report["models"] if len(names) > 1 else [report]
    assert [(m["verdict"], m["exit_code"]) for m in entries] == [("error", 130)] * len(names)
    assert [m["input"]["path"] for m in entries] == [f"{name}.onnx" for name in names]
    digests = [hashlib.sha256((tmp_path / f"{name}.onnx").read_bytes()).hexdigest() for name in names]
    assert [m["input"]["sha256"] for m in entries] == digests


def test_an_interrupted_run_reports_the_models_done_before_it(tmp_path):
    import signal

    command = ["fuser.cli", "optimize", "a.onnx", "b.onnx", "-o", "out", "-j", "1", "--report", "r.json"]
    status, _, _ = _interrupted(tmp_path, ("a", "b"), command, started=1, quick=("a",))
    assert status == -signal.SIGINT
    report = validated(tmp_path / "r.json")
    first, second = report["models"]
    # a.onnx was written before the interruption, with its digests; b.onnx was not.
    assert (first["verdict"], first["exit_code"]) == ("unchanged", 0)
    assert first["output"]["sha256"] == hashlib.sha256((tmp_path / "out" / "a.onnx").read_bytes()).hexdigest()
    assert (second["verdict"], second["exit_code"], second["input"]["path"]) == ("error", 130, "b.onnx")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.onnx"]
    assert (report["verdict"], report["exit_code"]) == ("error", 130)
    assert report["error"] == "interrupted before it was done: 1 of 2 models not done"


# Every interpreter started with it on its path is slow to make its summary, once its output is in place.
SLOW_AFTER_WRITING = """\
import os
import time
from pathlib import Path

import fuser.report


def slow_summary(*args, **kwargs):
    Path(f"worker-{os.getpid()}.pid").write_text("")
    time.sleep(600)


fuser.report.summary_lines = slow_summary
"""


@pytest.mark.parametrize("names", [("a",), ("a", "b")], ids=["one-model", "workers"])
def test_a_stop_once_the_output_is_written_is_reported_with_the_output(tmp_path, monkeypatch, names):
    import signal

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_AFTER_WRITING)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), str(MODELS.parent)]))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.onnx").write_bytes(b"an earlier output")  # replaced: --force
    output = "out/a.onnx" if len(names) == 1 else "out"
    command = ["fuser.cli", "optimize", *[f"{n}.onnx" for n in names], "-o", output, "-j", "1", "--force"]
    status, _, _ = _interrupted(tmp_path, names, [*command, "--report", "r.json"], started=1, quick=names)
    assert status == -signal.SIGINT
    report = validated(tmp_path / "r.json")
    first = report["models"][0] if len(names) > 1 else report
    written = tmp_path / "out" / "a.onnx"
    assert (first["verdict"], first["exit_code"]) == ("error", 130)
    assert first["error"] == "a.onnx: interrupted once out/a.onnx was written, before its report was done"
    assert first["output"]["sha256"] == hashlib.sha256(written.read_bytes()).hexdigest()
    assert onnx.load(written).graph.node[0].op_type == "Cos"  # the whole model, not the earlier file
    if len(names) > 1:
        second = report["models"][1]
        assert second["error"] == "b.onnx: interrupted before it was done" and second.get("output") is None
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.onnx"]


def _earlier_report() -> str:
    from fuser import report

    return report.dumps(report.envelope("optimize", "optimized", 0))


def test_a_killed_run_leaves_no_earlier_report_behind(tmp_path):
    # Killed, a run writes no report: the one an earlier run left at the path is gone from the
    # start. A file there that is no fuser report is left to the report's write.
    import signal

    (tmp_path / "r.json").write_text(_earlier_report())
    (tmp_path / "notes.json").write_text('{"mine": true}')
    for path in ("r.json", "notes.json"):
        command = ["fuser.cli", "optimize", "a.onnx", "-o", "out.onnx", "--force", "--report", path]
        status, _, _ = _interrupted(tmp_path, ("a",), command, started=1, stop=signal.SIGKILL)
        assert status == -signal.SIGKILL
        for pid_file in tmp_path.glob("worker-*.pid"):
            pid_file.unlink()
    assert not (tmp_path / "r.json").exists()
    assert (tmp_path / "notes.json").read_text() == '{"mine": true}'


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="tells a process that ended by /proc")
def test_workers_end_when_fuser_is_killed_and_write_nothing(tmp_path):
    # SIGKILL (a CI job's hard timeout, the out-of-memory killer) gives fuser no chance to end its
    # workers: they must see it gone and end themselves, not run on and write their models after.
    import signal
    import time

    (tmp_path / "out").mkdir()
    command = ["fuser.cli", "optimize", "a.onnx", "b.onnx", "-o", "out", "-j", "2"]
    status, _, workers = _interrupted(tmp_path, ("a", "b"), command, 2, stop=signal.SIGKILL, group=False)
    assert status == -signal.SIGKILL and len(workers) == 2
    deadline = time.monotonic() + 120  # a liveness bound: a worker left running sleeps 600 s
    while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in workers if _running(pid)]
    for pid in left:  # not left behind should the test fail
        os.kill(pid, signal.SIGKILL)
    assert left == []
    assert list((tmp_path / "out").iterdir()) == []


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (an ended one whose parent went with fuser
    may wait, a zombie, for the system to collect it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.parametrize("fmt", ["report", "json", "markdown", "markdown-and-report"])
def test_an_interrupted_check_reports_the_models_it_did_not_finish(tmp_path, fmt):
    import signal

    shown = {
        "report": ["--report", "r.json"],
        "json": ["--format", "json"],
        "markdown": ["--format", "markdown"],
        "markdown-and-report": ["--format", "markdown", "--report", "r.json"],
    }[fmt]
    command = ["fuser.cli", "check", "a.onnx", "b.onnx", "c.onnx", *shown]
    status, _, _ = _interrupted(tmp_path, ("a", "b", "c"), command, started=1, quick=("a",))
    assert status == -signal.SIGINT
    if fmt.startswith("markdown"):  # the models are named
        rows = [line for line in (tmp_path / "stdout.txt").read_text().splitlines() if line.startswith("| `")]
        assert [row.split(" | ")[:3] for row in rows] == [
            ["| `a.onnx`", "fully-fused", "0"],
            ["| `b.onnx`", "error", "130"],
            ["| `c.onnx`", "error", "130"],
        ]
        return
    report = validated(tmp_path / ("r.json" if fmt == "report" else "stdout.txt"))
    assert [(m["verdict"], m["exit_code"]) for m in report["models"]] == [
        ("fully-fused", 0),
        ("error", 130),
        ("error", 130),
    ]


def test_a_stop_that_lands_as_a_worker_starts_still_ends_that_worker(tmp_path, monkeypatch):
    # SIGTERM sent to fuser itself the moment a worker has started, before run_jobs knows of it:
    # held back until it does, the signal stops the run and the worker with it.
    import multiprocessing.process
    import signal

    from fuser import cli

    started = []
    start = multiprocessing.process.BaseProcess.start

    def start_then_terminate(process):
        start(process)
        started.append(process)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start_then_terminate)
    destination = tmp_path / "out.onnx"
    job = jobs.OptimizeJob(source=MODELS / "resnet_small.onnx", destination=destination)
    monkeypatch.setattr(cli, "_stopped_by", cli._stopped_by)  # what the handler sets
    previous = signal.getsignal(signal.SIGTERM)
    cli.stop_on_sigterm()
    try:
        with pytest.raises(KeyboardInterrupt):
            jobs.run_jobs([job], 1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    started[0].join(timeout=60)
    assert started[0].exitcode is not None and started[0].exitcode != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_holding_stops_leaves_a_signal_the_run_ignores_ignored():
    # A run started with Ctrl-C ignored (`nohup`, a background job) must not take it while a
    # worker starts: the fork server started then inherits what the signal's handler is.
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stops.held():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the fork server's signal mask in /proc")
def test_the_fork_server_imports_with_ctrl_c_held_back():
    # Its imports take a second or more; a Ctrl-C to the process group meanwhile printed its
    # traceback below fuser's own "interrupted". Started in a process of its own, so that the
    # fork server is new.
    # The server's command line names it once it has started Python (a busy machine may not have
    # got there yet when it is first looked for).
    script = """
import os, time
from fuser import jobs
jobs._start_fork_server(jobs._process_context())
found = []
for _ in range(600):
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = open(f"/proc/{pid}/status").read()
            command = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if f"PPid:\\t{os.getpid()}\\n" in status and b"forkserver" in command:
            blocked = next(line for line in status.splitlines() if line.startswith("SigBlk:"))
            found.append(int(blocked.split()[1], 16))
    if found:
        break
    time.sleep(0.1)
print(*found)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=MODELS.parent, timeout=300, check=True
    )
    masks = [int(line) for line in result.stdout.split()]
    assert len(masks) == 1 and masks[0] & (1 << (2 - 1))  # SIGINT is signal 2
