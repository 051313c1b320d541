"""What a run killed while writing leaves beside its output, and how a later run tells it apart.

A file is written through a temporary beside it (`.NAME.XXXXXXXX.tmp`), and a result checked
after writing through a hidden staging folder (`.fuser-XXXXXXXX`). Both go whatever fails,
except when the system kills the run (the out-of-memory killer, a CI job's timeout), where no
code of the run runs again; and the check after writing is chosen where memory is short. So
each is created under an exclusive lock (flock) held until it is gone: a later run writing the
same output removes what no process holds any more. The lock goes with its holder, however it
ends; one that cannot be taken or tested (a file system without locks) marks nothing as left.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: nothing is marked, nothing is removed
    fcntl = None

STAGING_PREFIX = ".fuser-"
LOCK_NAME = ".lock"  # inside a staging folder
# Newer than this, an unheld file may be one whose creator has not taken its lock yet.
SETTLED_SECONDS = 60.0


def held(handle: int) -> int | None:
    """A second descriptor of `handle`'s file holding an exclusive lock on it until it is
    closed (release), whoever closes `handle`; None where the lock cannot be taken."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return None
    return os.dup(handle)


def release(keeper: int | None) -> None:
    if keeper is not None:
        os.close(keeper)


class StagingFolder:
    """A new hidden folder in `parent`, marked as in use until `remove` (or this process ends)."""

    def __init__(self, parent: Path) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=parent))
        handle = os.open(self.path / LOCK_NAME, os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            self._keeper = held(handle)
        finally:
            os.close(handle)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        release(self._keeper)
        self._keeper = None


def remove_left(folder: Path, names: list[str]) -> list[tuple[str, int]]:
    """Remove from `folder` the temporaries of the files `names` and the staging folders that a
    run ended before it could remove them; their names and sizes in bytes."""
    # mkstemp's names: the prefix, eight random characters, the suffix.
    found = [(path, path) for name in names for path in folder.glob(f".{_escaped(name)}.{'?' * 8}.tmp")]
    found += [(path, path / LOCK_NAME) for path in folder.glob(f"{STAGING_PREFIX}*") if path.is_dir()]
    removed = []
    for path, lock in found:
        if not _abandoned(lock):
            continue
        size = _size(path)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                path.unlink()
            except OSError:
                continue
        if not path.exists():
            removed.append((path.name, size))
    return removed


def _abandoned(lock: Path) -> bool:
    """Whether `lock` is a regular file no process holds, unchanged for SETTLED_SECONDS."""
    if fcntl is None:
        return False
    try:
        handle = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False  # a folder without a lock file is not one fuser made
    try:
        status = os.fstat(handle)
        if not stat.S_ISREG(status.st_mode) or time.time() - status.st_mtime < SETTLED_SECONDS:
            return False
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False  # held, or locks cannot be tested here
    finally:
        os.close(handle)


def _escaped(name: str) -> str:
    """`name` as a glob pattern matching only itself."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _size(path: Path) -> int:
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        return path.stat().st_size
    except OSError:
        return 0
