"""The CLI's promises under awkward use: reports never land on models, errors stay one line,
mismatches on external-data models still exit 3, rewrites inside If bodies are checked wider."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import external_data_helper, helper

import fuser
from fuser.errors import InputError
from tests.helpers import fuser_cli, in_process_cli, make_model

ROOT = Path(__file__).resolve().parents[1]
NEGATING_RULE = '''
from fuser import op, rule, var


@rule("relu-to-neg-wrong", pattern=op.Relu(var("x"), name="relu"))
def relu_to_neg_wrong(m, b):
    """Relu(x) => Neg(x): deliberately wrong."""
    return b.Neg(m["x"])
'''


@pytest.fixture
def cli(monkeypatch, capfd):
    return in_process_cli(monkeypatch, capfd)


@pytest.fixture
def sample(tmp_path):
    shutil.copy(ROOT / "models" / "resnet_small.onnx", tmp_path / "s.onnx")
    return tmp_path / "s.onnx"


@pytest.mark.parametrize("command", ["optimize", "check"])
def test_report_never_overwrites_the_input_model(cli, sample, command):
    before = sample.read_bytes()
    result = cli(sample.parent, command, sample.name, "--report", sample.name)
    assert result.returncode == 2 and "names a model file" in result.stderr
    assert sample.read_bytes() == before


@pytest.mark.parametrize("name", ["other.onnx", "other.onnx.data", "other.ONNX_data"])
def test_report_never_overwrites_a_model_file_the_run_does_not_know_of(cli, sample, name):
    (sample.parent / name).write_bytes(b"someone else's weights")
    result = cli(sample.parent, "optimize", sample.name, "-o", "out.onnx", "--report", name)
    assert result.returncode == 2 and "names a model file" in result.stderr, result.stderr
    assert (sample.parent / name).read_bytes() == b"someone else's weights"
    assert not (sample.parent / "out.onnx").exists()  # refused before the work


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="a folder where no file can be made: Linux's /proc")
def test_a_report_that_cannot_be_made_is_refused_before_the_work(cli, sample):
    result = cli(sample.parent, "optimize", sample.name, "-o", "out.onnx", "--report", "/proc/report.json")
    assert result.returncode == 2 and "--report /proc/report.json: cannot write in /proc" in result.stderr
    assert not (sample.parent / "out.onnx").exists()
    assert not [p for p in sample.parent.iterdir() if p.name.startswith(".fuser")]


def _device(path: Path) -> Path | None:
    """A character device at `path` (/dev/null's numbers), where this user may make one."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (OSError, AttributeError):
        return None
    return path


@pytest.mark.parametrize("kind", ["pipe", "link", "dangling link", "device"])
def test_o_never_replaces_what_is_not_a_regular_file_even_with_force(cli, sample, kind):
    out = sample.parent / "out.onnx"
    (sample.parent / "other.onnx").write_bytes(b"other")
    if kind == "pipe":
        os.mkfifo(out)
    elif kind == "link":
        out.symlink_to("other.onnx")
    elif kind == "dangling link":
        out.symlink_to("nowhere.onnx")
    elif _device(out) is None:
        pytest.skip("this user may not make a device")
    before = out.lstat()
    result = cli(sample.parent, "optimize", sample.name, "-o", out.name, "--force")
    assert result.returncode == 2 and "a model is written only to a regular file" in result.stderr, result.stderr
    after = out.lstat()
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert (sample.parent / "other.onnx").read_bytes() == b"other"


def _optimize_stdin(model: Path, *arguments) -> subprocess.CompletedProcess:
    """`fuser optimize /dev/stdin ARGUMENTS` with `model` on its standard input."""
    with open(model, "rb") as stdin:
        return subprocess.run(
            [sys.executable, "-m", "fuser", "optimize", "/dev/stdin", *map(str, arguments)],
            stdin=stdin,
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
            check=False,
        )


def test_a_model_read_from_a_stream_needs_o(sample):
    result = _optimize_stdin(sample)
    written = Path("/dev/stdin.fused.onnx")
    if written.exists():
        written.unlink()  # what the refusal is there to prevent
    assert result.returncode == 2 and "give the output with -o" in result.stderr, result.stderr
    piped = _optimize_stdin(sample, "-o", sample.parent / "out.onnx", "-q")
    assert piped.returncode == 0 and (sample.parent / "out.onnx").exists(), piped.stderr


def test_report_never_overwrites_the_output_model(cli, sample):
    result = cli(sample.parent, "optimize", sample.name, "-o", "out.onnx", "--report", "out.onnx")
    assert result.returncode == 2
    assert not (sample.parent / "out.onnx").exists()


@pytest.mark.parametrize("read", ["inputs", "rules"])
def test_report_never_overwrites_a_file_the_run_reads(cli, sample, read):
    np.savez(sample.parent / "in.npz", image=np.zeros((1, 3, 32, 32), np.float32))
    (sample.parent / "r.py").write_text(NEGATING_RULE)
    name, option = {"inputs": ("in.npz", "--inputs"), "rules": ("r.py", "--rules")}[read]
    before = (sample.parent / name).read_bytes()
    for command in (["optimize", sample.name, "-o", "out.onnx"], ["check", sample.name]):
        if read == "inputs" and command[0] == "check":
            continue
        result = cli(sample.parent, *command, option, name, "--report", name)
        assert result.returncode == 2 and "names a file this run reads" in result.stderr
        assert (sample.parent / name).read_bytes() == before


def test_report_never_overwrites_the_weights_an_output_is_written_with(cli, sample):
    arguments = ["-o", "out.onnx", "--external-data", "always", "--no-check", "--report", "out.onnx.data"]
    result = cli(sample.parent, "optimize", sample.name, *arguments)
    assert result.returncode == 2 and "keeps its weights in" in result.stderr
    assert not (sample.parent / "out.onnx").exists() and not (sample.parent / "out.onnx.data").exists()


def _with_weights_in(folder: Path, sample: Path, holder: str, location: str = "weights.bin") -> None:
    """ext.onnx: the sample with its weights in `location`, held by its initializers, by a
    Constant node, or by initializers in a file with a field onnx does not know (which the
    model's own readers step over)."""
    model = onnx.load(sample)
    if holder == "constant":
        weight = next(t for t in model.graph.initializer if t.name == "block2.conv2.weight")
        model.graph.initializer.remove(weight)
        model.graph.node.insert(0, helper.make_node("Constant", [], [weight.name], value=weight, name="cst"))
        external_data_helper.set_external_data(model.graph.node[0].attribute[0].t, location=location)
        external_data_helper.write_external_data_tensors(model, str(folder))
        onnx.save(model, folder / "ext.onnx")
        return
    onnx.save(model, folder / "ext.onnx", save_as_external_data=True, location=location, size_threshold=0)
    if holder == "unknown field":
        group = bytes([0x9B, 0x06, 0x9C, 0x06])  # an empty group, field 99: start and end tags
        (folder / "ext.onnx").write_bytes((folder / "ext.onnx").read_bytes() + group)


@pytest.mark.parametrize("holder", ["initializers", "constant", "unknown field"])
@pytest.mark.parametrize("command", ["optimize", "check", "compare"])
def test_report_never_overwrites_the_external_data_an_input_reads(cli, sample, command, holder):
    folder = sample.parent
    _with_weights_in(folder, sample, holder)
    before = (folder / "weights.bin").read_bytes()
    arguments = {
        "optimize": ["optimize", "ext.onnx", "-o", "out.onnx"],
        "check": ["check", "ext.onnx", sample.name],
        "compare": ["compare", sample.name, "ext.onnx"],
    }[command]
    result = cli(folder, *arguments, "--report", "weights.bin")
    assert result.returncode == 2 and "names the external data of ext.onnx" in result.stderr
    assert (folder / "weights.bin").read_bytes() == before
    assert not (folder / "out.onnx").exists()
    # A file no model names is the report's to replace, as before.
    (folder / "other.bin").write_bytes(b"\0" * 8)
    assert cli(folder, *arguments, "--report", "other.bin").returncode in (0, 1)
    assert json.loads((folder / "other.bin").read_text())["command"] == command


@pytest.mark.parametrize("holder", ["initializers", "constant"])
def test_the_data_file_of_the_output_is_never_one_the_input_reads(cli, sample, holder):
    folder = sample.parent
    _with_weights_in(folder, sample, holder, location="out.onnx.data")
    before = (folder / "out.onnx.data").read_bytes()
    result = cli(folder, "optimize", "ext.onnx", "-o", "out.onnx", "--force", "--external-data", "always")
    assert result.returncode == 2 and "the input's own data file" in result.stderr
    assert (folder / "out.onnx.data").read_bytes() == before


@pytest.mark.parametrize("holder", ["initializers", "constant", "unknown field"])
def test_the_output_never_replaces_the_external_data_an_input_reads(cli, sample, holder):
    folder = sample.parent
    _with_weights_in(folder, sample, holder)
    before = (folder / "weights.bin").read_bytes()
    result = cli(folder, "optimize", "ext.onnx", "-o", "weights.bin", "--force")
    assert result.returncode == 2 and "refusing to overwrite the input's external data" in result.stderr
    assert (folder / "weights.bin").read_bytes() == before


def test_report_at_external_data_reached_through_links_as_in_a_hub_cache(cli, sample, tmp_path):
    # snapshots/rev/model.onnx and model.onnx_data are links into blobs/, as Hugging Face's cache
    # lays them out: onnxruntime reads the weights through the link (fuser's own load refuses it).
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    onnx.save(onnx.load(sample), blobs / "aaa", save_as_external_data=True, location="bbb", size_threshold=0)
    (snapshot / "model.onnx").symlink_to("../../blobs/aaa")
    (snapshot / "model.onnx_data").symlink_to("../../blobs/bbb")
    model = onnx.load(blobs / "aaa", load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "model.onnx_data"
    onnx.save(model, blobs / "aaa")
    before = (blobs / "bbb").read_bytes()
    for report in ("model.onnx_data", "../../blobs/bbb"):
        result = cli(snapshot, "check", "model.onnx", "--report", report)
        assert result.returncode == 2 and "names the external data of model.onnx" in result.stderr
        assert (blobs / "bbb").read_bytes() == before


def test_a_model_read_from_a_pipe_is_not_spent_by_the_report_path_check(sample, tmp_path):
    # The report path names a file that exists: the models are looked at for their external
    # data, but a pipe must be left to the load, which reads it once.
    os.mkfifo(tmp_path / "p.onnx")
    (tmp_path / "existing.txt").write_text("earlier")
    writer = subprocess.Popen(f"cat {sample} > p.onnx", shell=True, cwd=tmp_path)
    result = fuser_cli("check", "p.onnx", "-q", "--report", "existing.txt", cwd=tmp_path)
    writer.wait(timeout=60)
    assert result.returncode == 1, result.stderr
    assert json.loads((tmp_path / "existing.txt").read_text())["command"] == "check"


def test_report_to_dev_stdout_appends_to_where_stdout_goes(sample, tmp_path):
    # /dev/stdout is a link, through /proc, to the file stdout was opened on: written through, the
    # log appended to, not replaced by a file holding the report alone.
    log = tmp_path / "app.log"
    log.write_text("earlier line\n")
    with open(log, "a") as stream:
        done = subprocess.run(
            [sys.executable, "-m", "fuser", "check", sample, "-q", "--report", "/dev/stdout"],
            stdout=stream,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            timeout=300,
            check=False,
        )
    assert done.returncode == 1, done.stderr
    text = log.read_text()
    assert text.startswith("earlier line\n")
    assert json.loads(text.removeprefix("earlier line\n"))["command"] == "check"


def test_a_report_path_that_is_a_link_or_a_pipe_is_written_through(cli, sample, tmp_path):
    import os
    import threading

    # A link is followed, as a shell's `>` follows it: the file it names gets the report.
    (tmp_path / "reports").mkdir()
    (tmp_path / "latest.json").symlink_to(tmp_path / "reports" / "run.json")
    assert cli(sample.parent, "check", sample.name, "--exit-zero", "--report", "latest.json").returncode == 0
    assert (tmp_path / "latest.json").is_symlink()
    assert json.loads((tmp_path / "reports" / "run.json").read_text())["command"] == "check"
    # The file it names is then replaced whole, as any report is (a new file, not rewritten in place).
    first = (tmp_path / "reports" / "run.json").stat().st_ino
    assert cli(sample.parent, "check", sample.name, "--exit-zero", "--report", "latest.json").returncode == 0
    assert (tmp_path / "latest.json").is_symlink() and (tmp_path / "reports" / "run.json").stat().st_ino != first
    # A named pipe stays one, and its reader gets the report.
    os.mkfifo(tmp_path / "pipe")
    heard = []
    reader = threading.Thread(target=lambda: heard.append((tmp_path / "pipe").read_text()))
    reader.start()
    assert cli(sample.parent, "check", sample.name, "--exit-zero", "--report", "pipe").returncode == 0
    reader.join(timeout=60)
    assert json.loads(heard[0])["command"] == "check" and (tmp_path / "pipe").is_fifo()
    # A link to itself is a usage error, not fuser's.
    (tmp_path / "loop.json").symlink_to(tmp_path / "loop.json")
    result = cli(sample.parent, "check", sample.name, "--report", "loop.json")
    assert result.returncode == 2 and "cannot follow the path" in result.stderr


@pytest.mark.parametrize("args", [["optimize"], ["optimize", "x.onnx", "--target", "tpu"], ["no-such-command"]])
def test_usage_errors_are_one_line(cli, tmp_path, args):
    result = cli(tmp_path, *args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("fuser: error:")


@pytest.mark.parametrize("command", [["check", "missing.onnx"], ["compare", "missing.onnx", "other.onnx"]])
def test_errors_still_produce_the_requested_report(cli, tmp_path, command):
    result = cli(tmp_path, *command, "--report", "r.json")
    assert result.returncode == 2
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verdict"] == "error" and report["exit_code"] == 2 and "no such file" in report["error"]


def test_enable_on_the_command_line_wins_over_a_configured_disable(cli, sample):
    (sample.parent / "pyproject.toml").write_text('[tool.fuser]\ndisable = ["conv-bn-fold"]\n')
    kept = cli(sample.parent, "optimize", sample.name, "-o", "a.onnx")
    assert kept.returncode == 0 and "conv-bn-fold" not in kept.stderr
    enabled = cli(sample.parent, "optimize", sample.name, "-o", "b.onnx", "--enable", "conv-bn-fold")
    assert enabled.returncode == 0 and "conv-bn-fold" in enabled.stderr


def test_mismatch_on_an_external_data_model_exits_3_with_evidence(cli, tmp_path):
    rng = np.random.default_rng(0)
    model = make_model(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), helper.make_node("Relu", ["c"], ["y"], name="relu")],
        [("x", np.float32, [1, 2, 4, 4])],
        [("y", np.float32, [1, 2, 4, 4])],
        {"w": rng.standard_normal((2, 2, 1, 1)).astype(np.float32)},
    )
    folder = tmp_path / "m"
    folder.mkdir()
    onnx.save(model, folder / "m.onnx", save_as_external_data=True, location="m.bin", size_threshold=0)
    (folder / "bad_rule.py").write_text(NEGATING_RULE)
    result = cli(folder, "optimize", "m.onnx", "--rules", "bad_rule.py")
    assert result.returncode == 3, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "relu-to-neg-wrong" in result.stderr
    evidence = Path(re.search(r"evidence kept in (\S+)", result.stderr).group(1))
    assert (evidence / "report.json").exists()
    for name in ("original", "optimized"):  # each with its own weights, runnable from the evidence folder
        written = onnx.load(evidence / f"{name}.onnx", load_external_data=False)
        assert {e.value for t in written.graph.initializer for e in t.external_data if e.key == "location"} == {
            f"{name}.onnx.data"
        }
        onnx.checker.check_model(str(evidence / f"{name}.onnx"), full_check=True)
    assert sorted(p.name for p in folder.iterdir()) == ["bad_rule.py", "m.bin", "m.onnx"]


def _if_model() -> onnx.ModelProto:
    """y = If(cond, Relu(Relu(x)), Relu(Relu(-x))): each branch has a rewritable double Relu."""

    def branch(name, source):
        nodes = [
            helper.make_node("Relu", [source], [f"{name}_a"], name=f"{name}_r1"),
            helper.make_node("Relu", [f"{name}_a"], [f"{name}_b"], name=f"{name}_r2"),
        ]
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_b", 1, [2])])

    nodes = [
        helper.make_node("Neg", ["x"], ["nx"], name="neg"),
        helper.make_node(
            "If", ["cond"], ["y"], name="if", then_branch=branch("then", "x"), else_branch=branch("else", "nx")
        ),
    ]
    return make_model(nodes, [("cond", np.bool_, []), ("x", np.float32, [2])], [("y", np.float32, [2])])


def test_rewrites_inside_subgraphs_are_checked_with_more_inputs_and_said_so():
    @fuser.rule("double-relu", pattern=fuser.op.Relu(fuser.op.Relu(fuser.var("x"), name="inner")), exact=True)
    def double_relu(m, b):
        """Relu(Relu(x)) => Relu(x)."""
        return b.Relu(m["x"])

    _, report = fuser.optimize(_if_model(), rules=[double_relu])
    assert report.counts == {"double-relu": 2}
    assert {r.scope for r in report.rewrites} == {"main/if.then_branch", "main/if.else_branch"}
    assert len(report.notes) == 1 and "3 input sets" in report.notes[0]
    assert report.verdict.passed


def test_a_branch_only_the_added_input_sets_reach_is_checked():
    """The original's side of the check is prepared while the rewrite runs, with one input set;
    rewrites inside a branch call for three, so it is built again with them: a wrong rewrite in
    the branch the first set does not take is caught."""
    from fuser.errors import NumericsMismatch
    from fuser.verify import session, synthesize_inputs

    @fuser.rule("double-relu-wrong-else", pattern=fuser.op.Relu(fuser.op.Relu(fuser.var("x"), name="inner")))
    def double_relu(m, b):
        """Relu(Relu(x)) => Relu(x), but Abs(x) in the else branch."""
        return b.Abs(m["x"]) if m.root.name.startswith("else") else b.Relu(m["x"])

    model = _if_model()
    conds = [bool(synthesize_inputs(session(model), seed=s)["cond"]) for s in range(20)]
    seed = next(s for s in range(18) if conds[s] and not all(conds[s : s + 3]))
    with pytest.raises(NumericsMismatch):
        fuser.optimize(model, rules=[double_relu], seed=seed)


def test_a_rule_that_edits_the_loaded_model_in_place_is_still_caught():
    """Rules must build new nodes, never edit the model's own protos; one that does edits the
    model the check's original is read from. The check copies it before any rule runs, so the
    edit is still a difference it sees."""
    from fuser.errors import NumericsMismatch

    done = []

    @fuser.rule("relu-that-edits-a-weight", pattern=fuser.op.Relu(fuser.var("x")))
    def relu_that_edits_a_weight(m, b):
        """Relu(x) => Relu(Identity(x)), once, after doubling the scale weight in place."""
        m.require(not done, "done already")
        done.append(True)
        m.graph.initializer("scale").raw_data = np.full(4, 2.0, np.float32).tobytes()
        return b.Relu(b.Identity(m["x"]))

    model = make_model(
        [helper.make_node("Mul", ["x", "scale"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
        [("x", np.float32, [4])],
        [("y", np.float32, [4])],
        {"scale": np.ones(4, np.float32)},
    )
    with pytest.raises(NumericsMismatch):
        fuser.optimize(model, rules=[relu_that_edits_a_weight], ranges={"x": (1.0, 2.0)})


def test_a_rule_that_does_not_claim_to_stabilize_cannot_hide_behind_nan():
    """Sqrt(x) => Sqrt(Abs(x)) agrees wherever x >= 0 and is finite where the original is NaN.
    Only rules declared with stabilizes=True may turn inf/NaN into finite values."""
    from fuser.errors import NumericsMismatch

    @fuser.rule("sqrt-abs-wrong", pattern=fuser.op.Sqrt(fuser.var("x"), name="sqrt"))
    def sqrt_abs_wrong(m, b):
        """Sqrt(x) => Sqrt(Abs(x)): wrong for negative x."""
        m.require(m.graph.producer(m["x"]) is None, "x is already computed by a node")
        return b.Sqrt(b.Abs(m["x"]))

    model = make_model(
        [helper.make_node("Sqrt", ["x"], ["y"], name="sqrt")], [("x", np.float32, [64])], [("y", np.float32, [64])]
    )
    with pytest.raises(NumericsMismatch) as raised:
        fuser.optimize(model, rules=[sqrt_abs_wrong])
    assert "sqrt-abs-wrong" in str(raised.value)
    sqrt_abs_wrong.stabilizes = True  # what a stabilizing rule would declare: now accepted
    _, report = fuser.optimize(model, rules=[sqrt_abs_wrong])
    assert report.verdict.passed and report.verdict.stabilized == ["y"]


# --------------------------------------------------------------------------- clean failures


def _assert_clean_failure(result, folder: Path, before: dict, message: str) -> None:
    """Exit 2, one line naming the problem, no traceback, nothing written, the input untouched."""
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("fuser: error:"), result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def _symbolic_model(folder: Path) -> Path:
    model = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["y"])],
        [("x", np.float32, ["batch", 4])],
        [("y", np.float32, ["batch", 4])],
        {"w": np.eye(4, dtype=np.float32), "b": np.ones(4, np.float32)},
    )
    onnx.save(model, folder / "m.onnx")
    return folder / "m.onnx"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dim", "btch=8"], "--dim: the model's inputs have no symbolic dimension btch (symbolic dimensions: batch)"),
        (["--input-shape", "nosuch:1,4"], "--input-shape: the model has no input nosuch (its inputs: x)"),
        (["--input-range", "nosuch:0,3"], "--input-range: the model has no input nosuch (its inputs: x)"),
        (["--seed", "-1"], "Invalid value for '--seed'"),
        (["--atol", "-1"], "Invalid value for '--atol'"),
        (["--rtol", "-0.5"], "Invalid value for '--rtol'"),
        (["--dim", f"batch={2**40}"], "cannot make a check input 'x' of shape [1099511627776,4]"),
        (["--input-shape", f"x:{2**40},4"], "cannot make a check input 'x'"),
        (["-o", "m.onnx/inside.onnx"], "m.onnx is not a folder"),
        (["-o", "o" * 300 + ".onnx"], "cannot write there (File name too long)"),
    ],
)
def test_unusable_settings_and_paths_exit_2_with_one_line(cli, tmp_path, args, message):
    model = _symbolic_model(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = cli(tmp_path, "optimize", model.name, *args)
    _assert_clean_failure(result, tmp_path, before, message)


@pytest.mark.parametrize(
    "command, arguments",
    [("optimize", ["-o", "out.onnx"]), ("optimize", []), ("optimize", ["m.onnx", "-o", "out"]), ("check", [])],
)
def test_a_model_path_the_system_refuses_is_the_inputs_fault(cli, tmp_path, command, arguments):
    # A name longer than a file name may be (the same goes for a folder on the way that may not
    # be searched): the system's own error, not fuser's crash, and the input's, not the output
    # named after it.
    _symbolic_model(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = cli(tmp_path, command, "m" * 300 + ".onnx", *arguments)
    if "out" in arguments:  # several models: each its own line, the worst exit code
        assert result.returncode == 2 and "cannot read (File name too long)" in result.stderr
        assert "Traceback" not in result.stderr and (tmp_path / "out" / "m.onnx").exists()
        return
    _assert_clean_failure(result, tmp_path, before, "cannot read (File name too long)")


@pytest.mark.parametrize("command", ["optimize", "check"])
def test_a_loop_of_links_is_the_inputs_fault(cli, tmp_path, command):
    (tmp_path / "a.onnx").symlink_to(tmp_path / "b.onnx")
    (tmp_path / "b.onnx").symlink_to(tmp_path / "a.onnx")
    result = cli(tmp_path, command, "a.onnx")
    assert result.returncode == 2 and "a.onnx: cannot read (Too many levels of symbolic links)" in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "arguments",
    [
        ["--report", "r" * 300 + "/report.json"],
        ["m.onnx", "--report", "r" * 300 + "/report.json"],
        ["m.onnx", "other.onnx", "-o", "o" * 300],
    ],
)
def test_an_output_path_the_system_refuses_is_a_usage_error(cli, tmp_path, arguments):
    model = _symbolic_model(tmp_path)
    shutil.copy(model, tmp_path / "other.onnx")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = cli(tmp_path, "optimize", *(["m.onnx"] if arguments[0].startswith("--") else []), *arguments)
    _assert_clean_failure(result, tmp_path, before, "(File name too long)")


def test_a_name_with_a_nul_is_the_callers_input_error(tmp_path):
    with pytest.raises(InputError, match="cannot read"):
        fuser.optimize(str(tmp_path / "m\0.onnx"))


@pytest.mark.parametrize("width", [16, 160])  # a weight left out of the skeleton: 1 KiB, and over SKELETON_BYTES
def test_a_weight_is_not_an_input_the_settings_may_name(cli, tmp_path, width):
    """The skeleton lists the weights it leaves out as typed inputs; settings are checked against
    the inputs a caller feeds, not against those."""
    model = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [("x", np.float32, ["batch", width])],
        [("y", np.float32, ["batch", width])],
        {"w": np.ones((width, width), np.float32)},
    )
    onnx.save(model, tmp_path / "m.onnx")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = cli(tmp_path, "optimize", "m.onnx", "--input-shape", f"w:{width},{width}")
    _assert_clean_failure(result, tmp_path, before, "--input-shape: the model has no input w (its inputs: x)")


def test_unknown_names_in_given_inputs_are_listed(cli, tmp_path):
    model = _symbolic_model(tmp_path)
    np.savez(tmp_path / "inputs.npz", x=np.ones((2, 4), np.float32), typo=np.ones(1, np.float32))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = cli(tmp_path, "optimize", model.name, "--inputs", "inputs.npz")
    _assert_clean_failure(result, tmp_path, before, "--inputs: the model has no input typo (its inputs: x)")


def test_unknown_names_in_compare_are_usage_errors(cli, tmp_path):
    model = _symbolic_model(tmp_path)
    result = cli(tmp_path, "compare", model.name, model.name, "--input-shape", "y:2,4")
    assert result.returncode == 2 and "no input y (its inputs: x)" in result.stderr


def test_compare_names_each_difference_of_the_interfaces_both_ways(cli, tmp_path):
    head = onnx.load(ROOT / "models" / "classifier_head.onnx")
    onnx.save(head, tmp_path / "all.onnx")
    dropped = head.graph.output[1].name
    del head.graph.output[1]
    onnx.save(head, tmp_path / "fewer.onnx")
    forward = cli(tmp_path, "compare", "all.onnx", "fewer.onnx")
    backward = cli(tmp_path, "compare", "fewer.onnx", "all.onnx")
    assert forward.returncode == backward.returncode == 3  # an extra output is a difference too
    assert f"the models' interfaces differ: outputs only the first has: {dropped}" in forward.stderr
    assert f"the models' interfaces differ: outputs only the second has: {dropped}" in backward.stderr
    assert "optimized" not in forward.stderr + backward.stderr  # neither model is fuser's output here
    shutil.copy(ROOT / "models" / "mlp.onnx", tmp_path / "mlp.onnx")
    other = cli(tmp_path, "compare", "mlp.onnx", "all.onnx")
    assert "inputs only the first has: x; inputs only the second has: features" in other.stderr, other.stderr


@pytest.mark.parametrize("command", [["check", "missing.onnx"], ["compare", "s.onnx", "missing.onnx"]])
def test_the_report_of_a_model_that_cannot_be_read_names_it(cli, sample, command):
    result = cli(sample.parent, *command, "--format", "json")
    assert result.returncode == 2, result.stderr
    report = json.loads(result.stdout)
    named = report["output"] if command[0] == "compare" else report["input"]
    assert named == {"path": "missing.onnx", "sha256": None}


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="a device that is always full is Linux's")
def test_data_stdout_cannot_take_is_the_outputs_error_not_fusers(tmp_path):
    for command in (
        ["schema"],
        ["rules", "--format", "json"],
        ["check", ROOT / "models" / "mlp.onnx", "--format", "json"],
    ):
        with open("/dev/full", "w") as full:
            result = subprocess.run(
                [sys.executable, "-m", "fuser", *map(str, command)],
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
                cwd=tmp_path,
                timeout=300,
                check=False,
            )
        assert result.returncode == 2, result.stderr
        assert result.stderr == "fuser: error: cannot write to standard output (No space left on device)\n"


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--selftest", "--seed", "-3"], "Invalid value for '--seed'"),
        (["--selftest", "--save-dir", "afile"], "is a file"),
        (["--rule", "matmul-add-gemm"], "--rule picks the rules of --selftest"),
    ],
)
def test_rules_options_that_cannot_be_used_are_usage_errors(cli, tmp_path, arguments, said):
    (tmp_path / "afile").write_text("")
    result = cli(tmp_path, "rules", *arguments)
    assert result.returncode == 2 and said in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--rtol", "nan"], "nan is not a finite number"),
        (["--atol", "inf"], "inf is not a finite number"),
        (["--dim", "batch=2", "--dim", "batch=3"], "--dim gives batch two values, 2 and 3"),
        (["--input-shape", "x:-1,4"], "--input-shape x:-1,4: a size is 0 or more"),
        (["--input-shape", "x:2,4", "--input-shape", "x:3,4"], "--input-shape gives x two values"),
        (["--input-range", "x:0,1", "--input-range", "x:0,2"], "--input-range gives x two values"),
    ],
)
def test_check_settings_that_would_make_it_say_nothing_true_are_usage_errors(cli, tmp_path, arguments, said):
    model = _symbolic_model(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = cli(tmp_path, "optimize", model.name, *arguments)
    _assert_clean_failure(result, tmp_path, before, said)


def test_sizes_given_beside_real_inputs_are_said_to_go_unused(cli, tmp_path):
    model = _symbolic_model(tmp_path)
    np.savez(tmp_path / "inputs.npz", x=np.ones((3, 4), np.float32))
    result = cli(tmp_path, "optimize", model.name, "--inputs", "inputs.npz", "--dim", "batch=2", "-o", "out.onnx")
    assert result.returncode == 0, result.stderr
    assert "fuser: warning: --dim not used: the check runs on the inputs --inputs gives" in result.stderr
    assert "x[3,4]" in result.stderr  # the check's shapes are the given inputs'
    fixed = cli(
        tmp_path, "optimize", model.name, "--inputs", "inputs.npz", "--dim", "batch=3", "--fix-shapes", "-o", "f.onnx"
    )
    assert fixed.returncode == 0 and "not used" not in fixed.stderr, fixed.stderr  # the size is written


def test_a_size_of_0_is_checked_and_an_output_it_empties_is_said_to_be_empty(cli, tmp_path):
    """A KV cache's empty past is a size of 0 models take; an output it leaves empty compares nothing."""
    model = _symbolic_model(tmp_path)
    result = cli(tmp_path, "optimize", model.name, "--dim", "batch=0", "-o", "out.onnx")
    assert result.returncode == 0, result.stderr
    assert (
        "passed on x[0,4]" in result.stderr
        and "warning: output 'y' is empty on the check inputs [0,4]" in result.stderr
    )


def test_a_setting_given_twice_alike_is_given_once(cli, tmp_path):
    model = _symbolic_model(tmp_path)
    result = cli(tmp_path, "optimize", model.name, "--dim", "batch=2", "--dim", "batch=2", "-o", "out.onnx")
    assert result.returncode == 0, result.stderr


def test_debug_is_accepted_anywhere(cli, tmp_path):
    _symbolic_model(tmp_path)
    for args in (["--debug", "optimize", "missing.onnx"], ["optimize", "missing.onnx", "--debug"]):
        result = cli(tmp_path, *args)
        assert result.returncode == 2 and "no such file" in result.stderr, result.stderr
    passed = cli(tmp_path, "optimize", "m.onnx", "--debug")
    assert passed.returncode == 0, passed.stderr


def test_onnxruntime_log_lines_never_reach_the_user(cli, tmp_path):
    """A model the original cannot run on the given inputs: onnxruntime logs an error of its own,
    which fuser keeps to itself; the user sees fuser's one line."""
    model = make_model(
        [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Relu", ["r"], ["y"])],
        [("x", np.float32, ["n"])],
        [("y", np.float32, [2, 3])],
        {"shape": np.array([2, 3], np.int64)},
    )
    onnx.save(model, tmp_path / "m.onnx")
    result = cli(tmp_path, "compare", "m.onnx", "m.onnx", "--input-shape", "x:5")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "[E:onnxruntime" not in result.stderr, result.stderr
    assert "the original model cannot run on these inputs (x[5])" in result.stderr


@pytest.mark.parametrize("command", [["optimize", "m.onnx"], ["check", "m.onnx"], ["compare", "m.onnx", "m.onnx"]])
def test_a_report_path_under_a_file_exits_2_before_anything_is_written(cli, tmp_path, command):
    _symbolic_model(tmp_path)
    (tmp_path / "afile").write_text("")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = cli(tmp_path, *command, "--report", "afile/r.json")
    _assert_clean_failure(result, tmp_path, before, "--report afile/r.json: cannot write there, afile is not a folder")


def test_a_constant_whose_bytes_do_not_fit_its_dims_is_the_inputs_fault(cli, tmp_path):
    """Exp / ReduceSum(axes from a Constant) is what softmax-decomposed reads: a Constant holding
    four int64 values but declaring three must stop at loading, naming the node."""
    axes = helper.make_tensor("axes", onnx.TensorProto.INT64, [1], [1])
    nodes = [
        helper.make_node("Constant", [], ["axes"], name="axes_constant", value=axes),
        helper.make_node("Exp", ["x"], ["e"]),
        helper.make_node("ReduceSum", ["e", "axes"], ["s"], keepdims=1),
        helper.make_node("Div", ["e", "s"], ["y"]),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])])
    model.graph.node[0].attribute[0].t.raw_data = np.array([1, 1, 1, 1], np.int64).tobytes()
    del model.graph.node[0].attribute[0].t.int64_data[:]
    model.graph.node[0].attribute[0].t.dims[:] = [3]
    onnx.save(model, tmp_path / "m.onnx")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = cli(tmp_path, "optimize", "m.onnx")
    _assert_clean_failure(result, tmp_path, before, "Constant node 'axes_constant'")
