"""What a run the system killed while writing left beside its output is removed by the next run
writing there (fuser/leftovers.py); what a live run holds, or fuser did not make, stays."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fuser.verify
from fuser import jobs, leftovers
from fuser.errors import OutputPathError
from fuser.model import put_in_place
from tests.helpers import in_process_cli

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "models" / "resnet_small.onnx"

pytestmark = pytest.mark.skipif(leftovers.fcntl is None, reason="no file locks on this system")

# Every interpreter started with it on its path has memory too short for the check beside the
# rewrite, and is killed as the check after writing starts, as the system kills a process.
KILLED_WHILE_CHECKING = """\
import os
import signal

import fuser.jobs
import fuser.verify

fuser.jobs.available_memory = lambda: 1000


def killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


fuser.verify.check_written = killed
"""

# Writes a file through fuser's temporaries and is killed halfway.
KILLED_WHILE_WRITING = """\
import os
import signal
import sys
from pathlib import Path

from fuser.model import _write_files


def write(stream):
    stream.write(b"half a model")
    stream.flush()
    os.kill(os.getpid(), signal.SIGKILL)


_write_files([(Path(sys.argv[1]), write)], None)
"""


@pytest.fixture
def cli(monkeypatch, capfd):
    return in_process_cli(monkeypatch, capfd)


def aged(path: Path, seconds: float = 2 * leftovers.SETTLED_SECONDS) -> None:
    """Make `path` look unchanged for `seconds`, as a leftover found later is."""
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def test_a_run_killed_while_checking_after_writing_leaves_a_folder_the_next_run_removes(cli, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(KILLED_WHILE_CHECKING)
    out = tmp_path / "out" / "m.onnx"
    killed = subprocess.run(
        [sys.executable, "-m", "fuser.cli", "optimize", str(SAMPLE), "-o", str(out)],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])},
        timeout=300,
    )
    assert killed.returncode == -9, killed.stderr
    [staging] = out.parent.iterdir()
    assert staging.name.startswith(".fuser-") and (staging / "m.onnx").is_file()

    # Until it has been left alone a while, it may be a run's that has not locked it yet.
    fresh = cli(tmp_path, "optimize", SAMPLE, "-o", out)
    assert fresh.returncode == 0, fresh.stderr
    assert staging.is_dir() and "interrupted" not in fresh.stderr

    aged(staging / leftovers.LOCK_NAME)
    again = cli(tmp_path, "optimize", SAMPLE, "-o", out, "--force")
    assert again.returncode == 0, again.stderr
    [notice] = [line for line in again.stderr.splitlines() if "interrupted" in line]
    assert notice.startswith(f"fuser: removed what an interrupted run left in {out.parent}: {staging.name} (")
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.onnx"]


def test_the_temporary_of_a_write_killed_halfway_is_removed_by_the_next_run(cli, tmp_path):
    out = tmp_path / "m.onnx"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WHILE_WRITING, str(out)],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr
    [temporary] = tmp_path.iterdir()
    assert temporary.name.startswith(".m.onnx.") and temporary.name.endswith(".tmp")
    aged(temporary)
    quiet = cli(tmp_path, "optimize", SAMPLE, "-o", out, "-q")
    assert quiet.returncode == 0 and quiet.stderr == ""  # -q: removed without a word
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_what_a_live_run_holds_or_fuser_did_not_make_stays(tmp_path):
    held = leftovers.StagingFolder(tmp_path)  # held by this process's lock, as a live run's is
    aged(held.path / leftovers.LOCK_NAME)
    others = {
        ".fuser-notes": None,  # a folder without a lock file
        ".other.onnx.abcd1234.tmp": b"another file's temporary",
        ".m.onnx.fresh123.tmp": b"a temporary written just now",
        ".m.onnx.linked12.tmp": "target",  # a link, not a file
    }
    (tmp_path / "target").write_bytes(b"not fuser's")
    for name, content in others.items():
        path = tmp_path / name
        if content is None:
            path.mkdir()
        elif isinstance(content, str):
            path.symlink_to(tmp_path / content)
        else:
            path.write_bytes(content)
        if name != ".m.onnx.fresh123.tmp":
            aged(path)
    assert leftovers.remove_left(tmp_path, ["m.onnx", "m.onnx.data"]) == []
    assert held.path.is_dir() and all((tmp_path / name).exists() for name in others)

    held.remove()  # its run is done: gone, and nothing of it is left to find
    assert not held.path.exists()
    stale = tmp_path / ".m.onnx.data.stale123.tmp"
    stale.write_bytes(b"x" * 10)
    aged(stale)
    assert leftovers.remove_left(tmp_path, ["m.onnx", "m.onnx.data"]) == [(stale.name, 10)]
    assert all((tmp_path / name).exists() for name in others) and (tmp_path / "target").read_bytes() == b"not fuser's"


def test_a_name_is_matched_as_written_not_as_a_pattern(tmp_path):
    stale = tmp_path / ".m[1].onnx.abcd1234.tmp"
    unrelated = tmp_path / ".m1.onnx.abcd1234.tmp"
    for path in (stale, unrelated):
        path.write_bytes(b"x")
        aged(path)
    assert leftovers.remove_left(tmp_path, ["m[1].onnx"]) == [(stale.name, 1)]
    assert unrelated.exists()


def test_a_temporary_being_written_is_held_until_it_is_in_place(tmp_path):
    from fuser.model import _write_files

    out = tmp_path / "m.onnx"
    found = []

    def write(stream):
        stream.write(b"a model")
        [temporary] = tmp_path.glob(".m.onnx.????????.tmp")
        aged(temporary)  # as a write of a large model is, long after it began
        [data] = tmp_path.glob(".m.onnx.data.????????.tmp")
        aged(data)
        found.append(leftovers.remove_left(tmp_path, ["m.onnx", "m.onnx.data"]))

    def write_data(stream):
        stream.write(b"weights")

    # The data file is written and closed first, and still held while the model file is written.
    _write_files([(tmp_path / "m.onnx.data", write_data), (out, write)], None)
    assert found == [[]]
    assert out.read_bytes() == b"a model" and (tmp_path / "m.onnx.data").read_bytes() == b"weights"


def test_a_pipe_a_folder_of_another_name_or_a_file_being_removed_is_left_alone(tmp_path):
    """Nothing is opened but a regular file (a pipe would wait for a writer); a folder is fuser's
    only under its own names; one being removed by a run beside this one is that run's to report."""
    os.mkfifo(tmp_path / ".m.onnx.pipe1234.tmp")
    (tmp_path / ".fuser-abcdefgh").mkdir()
    os.mkfifo(tmp_path / ".fuser-abcdefgh" / leftovers.LOCK_NAME)
    settings = tmp_path / ".fuser-settings"  # a user's, named as fuser names its folders
    settings.mkdir()
    (settings / ".lock").write_bytes(b"")
    (settings / "config.toml").write_text("kept = true\n")
    taken = tmp_path / ".m.onnx.taken123.tmp"
    taken.write_bytes(b"x")
    for path in (tmp_path / ".m.onnx.pipe1234.tmp", tmp_path / ".fuser-abcdefgh" / leftovers.LOCK_NAME, taken):
        aged(path)
    aged(settings / ".lock")
    elsewhere = leftovers._claimed(taken)  # as a run cleaning the same folder holds it
    assert elsewhere is not None
    try:
        # In a process of its own, with a time limit: a regression would wait on the pipe forever.
        listed = subprocess.run(
            [
                sys.executable,
                "-c",
                (
                    "import sys; from pathlib import Path; from fuser import leftovers; "
                    "print(leftovers.remove_left(Path(sys.argv[1]), ['m.onnx']))"
                ),
                str(tmp_path),
            ],
            check=False,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=60,
        )
    finally:
        os.close(elsewhere)
    assert listed.returncode == 0 and listed.stdout.strip() == "[]", listed.stderr
    assert (settings / "config.toml").read_text() == "kept = true\n" and taken.exists()
    assert leftovers.remove_left(tmp_path, ["m.onnx"]) == [(taken.name, 1)]  # no longer held


def test_a_failed_rename_puts_back_what_the_earlier_ones_replaced(tmp_path):
    data, model = tmp_path / "m.onnx.data", tmp_path / "m.onnx"
    data.write_bytes(b"old weights")
    model.mkdir()  # nothing can be renamed over a folder that holds something
    (model / "x").write_bytes(b"")
    new_data, new_model = tmp_path / "new.data", tmp_path / "new.onnx"
    new_data.write_bytes(b"new weights")
    new_model.write_bytes(b"new model")
    with pytest.raises(OutputPathError, match=f"{model}: cannot write it"):
        put_in_place([(new_data, data), (new_model, model)])
    assert data.read_bytes() == b"old weights"  # not the new weights beside the old model
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data", "new.onnx"]  # no second name

    data.unlink()  # where there was no data file, the new one does not stay either
    new_data.write_bytes(b"new weights")
    with pytest.raises(OutputPathError):
        put_in_place([(new_data, data), (new_model, model)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "new.onnx"]


class StoppedHere:
    """A path whose reading is where Ctrl-C lands: between one rename and the next."""

    def __fspath__(self):
        raise KeyboardInterrupt


def test_a_stop_between_the_renames_puts_back_what_the_earlier_ones_replaced(tmp_path):
    data, model = tmp_path / "m.onnx.data", tmp_path / "m.onnx"
    data.write_bytes(b"old weights")
    model.write_bytes(b"old model")
    new_data = tmp_path / "new.data"
    new_data.write_bytes(b"new weights")
    with pytest.raises(KeyboardInterrupt):
        put_in_place([(new_data, data), (StoppedHere(), model)])
    assert (data.read_bytes(), model.read_bytes()) == (b"old weights", b"old model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]


class SignalledHere:
    """A path whose reading is where Ctrl-C reaches the process: during the first rename."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __fspath__(self):
        os.kill(os.getpid(), signal.SIGINT)
        return str(self.path)


def test_ctrl_c_during_the_renames_is_taken_once_all_are_done(tmp_path):
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal gives it
    try:
        data, model = tmp_path / "m.onnx.data", tmp_path / "m.onnx"
        data.write_bytes(b"old weights")
        model.write_bytes(b"old model")
        new_data, new_model = tmp_path / "new.data", tmp_path / "new.onnx"
        new_data.write_bytes(b"new weights")
        new_model.write_bytes(b"new model")
        with pytest.raises(KeyboardInterrupt):
            put_in_place([(SignalledHere(new_data), data), (new_model, model)])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (data.read_bytes(), model.read_bytes()) == (b"new weights", b"new model")  # both, not one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]


WRONG_RULES = """\
from fuser import op, rule, var


@rule("wrong-relu", pattern=op.Relu(var("x")))
def wrong_relu(m, b):
    \"\"\"Relu(x) -> Sigmoid(x), which is wrong.\"\"\"
    return b.Sigmoid(m["x"])
"""


def test_a_check_after_writing_that_fails_leaves_no_folder_it_made(cli, tmp_path, monkeypatch):
    (tmp_path / "wrong_rules.py").write_text(WRONG_RULES)
    monkeypatch.setattr(jobs, "available_memory", lambda: 1000)
    out = tmp_path / "new" / "deeper" / "m.onnx"
    result = cli(tmp_path, "optimize", SAMPLE, "-o", out, "--rules", "wrong_rules.py")
    assert result.returncode == 3, result.stderr
    assert "the check after writing did not pass" in result.stderr
    assert not (tmp_path / "new").exists()


def test_an_error_between_the_write_and_the_check_leaves_nothing(cli, tmp_path, monkeypatch):
    monkeypatch.setattr(jobs, "available_memory", lambda: 1000)

    def out_of_memory():
        raise MemoryError

    monkeypatch.setattr(fuser.verify, "return_freed_memory", out_of_memory)
    out = tmp_path / "new" / "m.onnx"
    result = cli(tmp_path, "optimize", SAMPLE, "-o", out)
    assert result.returncode == 4, result.stderr  # what happened is said, as any error's
    assert not (tmp_path / "new").exists()
    assert not [link for link in open_files() if link.startswith(str(tmp_path))]  # no lock kept open


def open_files() -> list[str]:
    """What this process's descriptors refer to."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return found
