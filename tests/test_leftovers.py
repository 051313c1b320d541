"""What a run the system killed while writing left beside its output is removed by the next run
writing there (fuser/leftovers.py); what a live run holds, or fuser did not make, stays."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fuser import leftovers
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
    assert notice.startswith(f"fuser: removed what an interrupted run left beside {out}: {staging.name} (")
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.onnx"]


def test_the_temporary_of_a_write_killed_halfway_is_removed_by_the_next_run(cli, tmp_path):
    out = tmp_path / "m.onnx"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WHILE_WRITING, str(out)],
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
