"""[tool.fuser] in the nearest pyproject.toml: settings a pipeline keeps in its repository.

The working directory decides which pyproject.toml is found, so every test runs fuser in
its own tmp_path. A few tests start a real `python -m fuser.cli` process; the rest call
fuser.cli.main in this process (after chdir), which is the same code path and much faster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.helpers import fuser_cli, in_process_cli, make_model

MODELS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "models")

RULE_FILE = '''\
from fuser import op, rule, var


@rule("double-relu", pattern=op.Relu(op.Relu(var("x"), name="inner"), name="outer"), exact=True)
def double_relu(m, b):
    """Relu(Relu(x))  =>  Relu(x)."""
    return b.Relu(m["x"])
'''


@pytest.fixture
def cli(monkeypatch, capfd):
    """`fuser ...` in this process, run from `cwd`: exit code, stdout, stderr."""
    return in_process_cli(monkeypatch, capfd)


def write_pyproject(folder, body: str, header: str = "[tool.fuser]\n"):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "pyproject.toml"
    path.write_text('[project]\nname = "pipeline"\n\n' + header + textwrap.dedent(body))
    return path


def copy_resnet(folder):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "resnet_small.onnx"
    shutil.copy(os.path.join(MODELS, "resnet_small.onnx"), path)
    return path


def ops(path) -> list[tuple[str, str]]:
    return [(n.domain, n.op_type) for n in onnx.load(str(path)).graph.node]


# --------------------------------------------------------------------------- settings take effect


def test_target_from_pyproject_and_the_command_line_overrides_it(tmp_path):
    write_pyproject(tmp_path, 'target = "onnxruntime"\n')
    copy_resnet(tmp_path)
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "fuser.cli", "optimize", "resnet_small.onnx", "-o", out, *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for out, extra in (("ort.onnx", []), ("portable.onnx", ["--target", "onnx"]))
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr
    fused = ops(tmp_path / "ort.onnx")
    # FusedConv, or on a machine with NCHWc kernels the blocked Conv that replaces it
    assert ("com.microsoft", "FusedConv") in fused or ("com.microsoft.nchwc", "Conv") in fused
    portable = ops(tmp_path / "portable.onnx")
    assert {domain for domain, _ in portable} == {""}
    assert ("", "BatchNormalization") not in portable and ("", "Conv") in portable


def test_disable_keeps_batch_normalization(cli, tmp_path):
    write_pyproject(tmp_path, 'disable = ["conv-bn-fold"]\n')
    copy_resnet(tmp_path)
    result = cli(tmp_path, "optimize", "resnet_small.onnx", "-o", "out.onnx")
    assert result.returncode == 0, result.stderr
    assert "conv-bn-fold" not in result.stderr
    assert ("", "BatchNormalization") in ops(tmp_path / "out.onnx")
    # the check command reads it too
    check = cli(tmp_path, "check", "resnet_small.onnx", "--format", "json")
    assert "conv-bn-fold" not in {o["rule"] for o in json.loads(check.stdout)["opportunities"]}


def test_enable_and_disable_from_the_command_line_replace_the_pyproject_list(cli, tmp_path):
    write_pyproject(tmp_path, 'disable = ["conv-bn-fold"]\n')
    copy_resnet(tmp_path)
    result = cli(tmp_path, "optimize", "resnet_small.onnx", "-o", "out.onnx", "--disable", "matmul-add-gemm")
    assert result.returncode == 0, result.stderr
    assert ("", "BatchNormalization") not in ops(tmp_path / "out.onnx")
    assert ("", "Gemm") not in ops(tmp_path / "out.onnx")


def relu_relu_model(path):
    model = make_model(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Relu", ["r"], ["y"])],
        [("x", np.float32, ["batch", 8])],
        [("y", np.float32, ["batch", 8])],
    )
    onnx.save(model, str(path))


@pytest.mark.parametrize("where", ["my_rules.py", "tools/my_rules.py"])
def test_rule_files_are_relative_to_the_pyproject(cli, tmp_path, where):
    write_pyproject(tmp_path, f'rules = ["{where}"]\n')
    (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / where).write_text(RULE_FILE)
    work = tmp_path / "work" / "deeper"  # no pyproject.toml here: the one above is the nearest
    work.mkdir(parents=True)
    listed = cli(work, "rules", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    rules = {r["name"]: r for r in json.loads(listed.stdout)}
    assert "double-relu" in rules and rules["double-relu"]["exact"] is True
    assert "my_rules.py" in rules["double-relu"]["source"]
    assert "conv-bn-fold" in rules  # the built-in rules are still there
    text = cli(work, "rules")
    assert text.returncode == 0 and any(line.startswith("double-relu") for line in text.stdout.splitlines())

    relu_relu_model(work / "relu.onnx")
    optimized = cli(work, "optimize", "relu.onnx", "-o", "out.onnx", "--format", "json")
    assert optimized.returncode == 0, optimized.stderr
    assert json.loads(optimized.stdout)["rule_counts"] == {"double-relu": 1}
    assert ops(work / "out.onnx") == [("", "Relu")]
    explained = cli(work, "explain", "relu.onnx", "--rule", "double-relu", "--format", "json")
    assert explained.returncode == 0, explained.stderr
    [rule] = json.loads(explained.stdout)["rules"]
    assert rule["rule"] == "double-relu" and rule["applied"] == 1


def test_explain_reads_the_target_and_the_disabled_rules(cli, tmp_path):
    write_pyproject(tmp_path, 'target = "onnxruntime"\ndisable = ["conv-bn-fold"]\n')
    copy_resnet(tmp_path)
    result = cli(tmp_path, "explain", "resnet_small.onnx", "--format", "json")
    assert result.returncode == 0, result.stderr
    explained = json.loads(result.stdout)
    named = {r["rule"] for r in explained["rules"]}
    assert explained["target"] == "onnxruntime" and "fused-conv" in named and "conv-bn-fold" not in named


CHECK_SETTINGS = """\
    dims = { batch = 2 }
    input-shapes = { image = [3, 3, 32, 32] }
    input-ranges = { image = [-1.0, 1.0] }
    check-runs = 2
    seed = 7
    atol = 1e-4
    rtol = 1e-3
    on-mismatch = "drop"
"""


def test_check_settings_are_accepted_and_used(cli, tmp_path):
    write_pyproject(tmp_path, CHECK_SETTINGS)
    copy_resnet(tmp_path)
    result = cli(tmp_path, "optimize", "resnet_small.onnx", "-o", "out.onnx", "--format", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["numerics"]["passed"] is True
    [output] = report["numerics"]["outputs"]
    assert output["shape"] == [3, 10]  # input-shapes beats dims
    assert (output["atol"], output["rtol"]) == (1e-4, 1e-3)
    assert (tmp_path / "out.onnx").exists()

    flags = cli(
        tmp_path,
        "optimize",
        "resnet_small.onnx",
        "-o",
        "flags.onnx",
        "--format",
        "json",
        "--atol",
        "0.5",
        "--input-shape",
        "image:1,3,32,32",
    )
    assert flags.returncode == 0, flags.stderr
    [output] = json.loads(flags.stdout)["numerics"]["outputs"]
    assert output["atol"] == 0.5 and output["rtol"] == 1e-3 and output["shape"] == [1, 10]


def test_compare_reads_dims_and_tolerances(cli, tmp_path):
    write_pyproject(tmp_path, "dims = { batch = 2 }\nrtol = 0.01\nseed = 3\ncheck-runs = 2\n")
    copy_resnet(tmp_path)
    result = cli(tmp_path, "compare", "resnet_small.onnx", "resnet_small.onnx", "--format", "json")
    assert result.returncode == 0, result.stderr
    [output] = json.loads(result.stdout)["numerics"]["outputs"]
    assert output["shape"] == [2, 10] and output["rtol"] == 0.01


# --------------------------------------------------------------------------- bad settings


def test_unknown_key_exits_2_naming_the_key_and_the_file_in_a_real_process(tmp_path):
    path = write_pyproject(tmp_path, 'target = "onnx"\nno-such-setting = 3\n')
    copy_resnet(tmp_path)
    result = fuser_cli("optimize", "resnet_small.onnx", "-o", "out.onnx", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "no-such-setting" in lines[0] and str(path) in lines[0]
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize(
    "body, named",
    [
        ('seed = "x"\n', "seed"),
        ("seed = 1.5\n", "seed"),
        ("seed = true\n", "seed"),
        ("check-runs = 2.0\n", "check-runs"),
        ('atol = "1e-3"\n', "atol"),
        ('target = ["onnxruntime"]\n', "target"),
        ('disable = "conv-bn-fold"\n', "disable"),
        ('rules = "my_rules.py"\n', "rules"),
        ("dims = 4\n", "dims"),
        ('input-shapes = ["image"]\n', "input-shapes"),
        ("on-mismatch = 1\n", "on-mismatch"),
    ],
)
def test_wrong_type_exits_2(cli, tmp_path, body, named):
    path = write_pyproject(tmp_path, body)
    copy_resnet(tmp_path)
    result = cli(tmp_path, "optimize", "resnet_small.onnx", "-o", "out.onnx")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and str(path) in lines[0], result.stderr
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize(
    "body",
    [
        "input-ranges = { image = [0] }\n",  # not a [LO, HI] pair
        "input-ranges = { image = 5 }\n",
        "input-shapes = { image = 5 }\n",  # not a list of dimensions
        "rules = [1]\n",  # not a path
    ],
    ids=["range-pair", "range-number", "shape-number", "rule-number"],
)
def test_wrong_type_inside_a_table_or_list_exits_2(cli, tmp_path, body):
    """Values inside dims / input-shapes / input-ranges / rules are checked too: a wrong one is
    exit 2 with a one-line message naming the file, never a traceback (exit 1 or 4)."""
    path = write_pyproject(tmp_path, body)
    copy_resnet(tmp_path)
    try:
        result = cli(tmp_path, "optimize", "resnet_small.onnx", "-o", "out.onnx")
    except Exception as error:  # noqa: BLE001 - escaping main() is the bug this test shows
        pytest.fail(f"{type(error).__name__} escaped fuser.cli.main: {error}")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0], result.stderr


@pytest.mark.parametrize(
    "body, message",
    [
        ("check-runs = 0\n", "pyproject.toml: [tool.fuser] check-runs must be 1 or more, not 0"),
        ('on-mismatch = "ignore"\n', "pyproject.toml: [tool.fuser] on-mismatch must be one of fail, drop"),
        ('target = "tpu"\n', "pyproject.toml: [tool.fuser] target must be one of onnx, onnxruntime, not 'tpu'"),
        ('external-data = "sometimes"\n', "pyproject.toml: [tool.fuser] external-data must be one of auto"),
        ('disable = ["no-such-rule"]\n', "no-such-rule"),
        ('rules = ["missing_rules.py"]\n', "missing_rules.py"),
        ('dims = { batch = "many" }\n', "batch"),
        ("seed = -1\n", "pyproject.toml: [tool.fuser] seed must be 0 or more, not -1"),
        ("atol = -0.1\n", "pyproject.toml: [tool.fuser] atol must be a finite number, 0 or more"),
        ("rtol = nan\n", "pyproject.toml: [tool.fuser] rtol must be a finite number"),
        ("input-shapes = { image = [-1, 3, 32, 32] }\n", "[tool.fuser] input-shapes must be shapes of sizes 0 or more"),
        ("input-ranges = { image = [5, 1] }\n", "[tool.fuser] input-ranges must be [low, high] pairs"),
    ],
)
def test_invalid_values_exit_2(cli, tmp_path, body, message):
    write_pyproject(tmp_path, body)
    copy_resnet(tmp_path)
    result = cli(tmp_path, "optimize", "resnet_small.onnx", "-o", "out.onnx")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize(
    "text",
    [
        '[tool.fuser]\ntarget = "onnxruntime\n',  # unterminated string
        "[tool.fuser\n",
        "[tool.fuser]\nseed = 1\nseed = 2\n",  # duplicate key
    ],
)
def test_invalid_toml_exits_2(cli, tmp_path, text):
    path = tmp_path / "pyproject.toml"
    path.write_text(text)
    copy_resnet(tmp_path)
    result = cli(tmp_path, "optimize", "resnet_small.onnx", "-o", "out.onnx")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0], result.stderr
    assert not (tmp_path / "out.onnx").exists()


def test_a_broken_pyproject_stops_every_command(cli, tmp_path):
    write_pyproject(tmp_path, "no-such-setting = 3\n")
    copy_resnet(tmp_path)
    for args in (("rules",), ("check", "resnet_small.onnx"), ("compare", "resnet_small.onnx", "resnet_small.onnx")):
        result = cli(tmp_path, *args)
        assert result.returncode == 2 and "no-such-setting" in result.stderr, (args, result.stderr)


def test_a_pyproject_without_tool_fuser_changes_nothing(cli, tmp_path):
    write_pyproject(tmp_path, "", header="[tool.other]\nkey = 1\n")
    copy_resnet(tmp_path)
    result = cli(tmp_path, "optimize", "resnet_small.onnx", "-o", "out.onnx")
    assert result.returncode == 0, result.stderr
    assert {domain for domain, _ in ops(tmp_path / "out.onnx")} == {""}


# --------------------------------------------------------------------------- which pyproject.toml


def test_the_nearest_pyproject_wins(cli, tmp_path):
    write_pyproject(tmp_path, 'target = "onnxruntime"\nno-such-setting = 1\n')  # would fail if it were read
    inner = tmp_path / "packages" / "vision"
    write_pyproject(inner, 'disable = ["conv-bn-fold"]\n')
    deeper = inner / "models"
    copy_resnet(deeper)
    for cwd in (inner, deeper):
        out = cwd / "out.onnx"
        result = cli(cwd, "optimize", deeper / "resnet_small.onnx", "-o", out)
        assert result.returncode == 0, result.stderr
        fused = ops(out)
        assert ("", "BatchNormalization") in fused  # the inner file's disable applies
        assert {domain for domain, _ in fused} == {""}  # the outer file's target does not
    outer = cli(tmp_path, "rules")
    assert outer.returncode == 2 and "no-such-setting" in outer.stderr


def test_configured_names_apply_to_the_models_that_have_them(cli, tmp_path):
    """[tool.fuser] serves every model of a project: a dim or input another model lacks is not an
    error for this one; the same names typed on the command line are."""
    write_pyproject(tmp_path, "dims = { sequence = 8 }\ninput-ranges = { token_ids = [0, 5] }\n")
    copy_resnet(tmp_path)
    configured = cli(tmp_path, "optimize", "resnet_small.onnx", "-o", "out.onnx")
    assert configured.returncode == 0, configured.stderr
    typed = cli(tmp_path, "optimize", "resnet_small.onnx", "-o", "typed.onnx", "--dim", "sequence=8")
    assert typed.returncode == 2 and "no symbolic dimension sequence" in typed.stderr
    assert not (tmp_path / "typed.onnx").exists()


def test_external_data_from_pyproject(cli, tmp_path):
    write_pyproject(tmp_path, 'external-data = "always"\n')
    copy_resnet(tmp_path)
    result = cli(tmp_path, "optimize", "resnet_small.onnx", "-o", "out.onnx")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out.onnx.data").is_file()
    inline = cli(tmp_path, "optimize", "resnet_small.onnx", "-o", "inline.onnx", "--external-data", "never")
    assert inline.returncode == 0 and not (tmp_path / "inline.onnx.data").exists()
    write_pyproject(tmp_path, 'external-data = "sometimes"\n')
    bad = cli(tmp_path, "optimize", "resnet_small.onnx", "-o", "bad.onnx")
    assert bad.returncode == 2 and "sometimes" in bad.stderr
