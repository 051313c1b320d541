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

import contextlib
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
LOCK_NAME = ".fuser-staging.lock"  # inside a staging folder: what makes it one, whatever its name
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
    """A new hidden folder in `parent` (made, with the folders above it, where there is none),
    marked as in use until it is removed or this process ends."""

    def __init__(self, parent: Path) -> None:
        self._made = _missing_folders(parent)
        self._keeper = None
        self.path: Path | None = None
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=parent))
            handle = os.open(self.path / LOCK_NAME, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
        except BaseException:
            self.discard()  # no folder a later run could not tell as left is left
            raise
        try:
            self._keeper = held(handle)
        finally:
            os.close(handle)

    def remove(self) -> None:
        """Remove the folder and what it holds; the folders made for it stay."""
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        release(self._keeper)
        self._keeper = None

    def discard(self) -> None:
        """Remove the folder, and the folders made for it that are empty now."""
        self.remove()
        for folder in self._made:
            try:
                folder.rmdir()
            except OSError:
                break


def _missing_folders(folder: Path) -> list[Path]:
    """`folder` and the folders above it that do not exist, deepest first."""
    missing = []
    while not folder.exists() and folder.parent != folder:
        missing.append(folder)
        folder = folder.parent
    return missing


def remove_left(folder: Path, names: list[str]) -> list[tuple[str, int]]:
    """Remove from `folder` the temporaries of the files `names` and the staging folders that runs
    ended before they could remove them; their names and sizes in bytes."""
    random = "?" * 8  # what mkstemp and mkdtemp put between the prefix and the suffix
    found = [(path, path) for name in names for path in folder.glob(f".{_escaped(name)}.{random}.tmp")]
    found += [(path, path / LOCK_NAME) for path in folder.glob(f"{STAGING_PREFIX}{random}")]
    removed = []
    for path, lock in found:
        if path.is_symlink():
            continue
        # The lock is held while the path goes: a run cleaning the same folder beside this one
        # finds it held, or gone, and neither removes it nor says it did.
        keeper = _claimed(lock)
        if keeper is None:
            continue
        try:
            size = _size(path)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    path.unlink()
            if not os.path.lexists(path):
                removed.append((path.name, size))
        finally:
            os.close(keeper)
    return removed


def _claimed(lock: Path) -> int | None:
    """A descriptor holding the lock of `lock`, a regular file unchanged for SETTLED_SECONDS that
    no process held; None for anything else."""
    if fcntl is None:
        return None
    try:
        status = os.lstat(lock)
    except OSError:
        return None  # a folder without a lock file is not one fuser made
    # Only a regular file is opened: opening a pipe would wait for a writer.
    if not stat.S_ISREG(status.st_mode) or time.time() - status.st_mtime < SETTLED_SECONDS:
        return None
    try:
        # Read and write: an exclusive lock over NFS needs a descriptor that may write.
        handle = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(handle).st_mode):  # still the file looked at
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
    except OSError:
        pass  # held, or locks cannot be tested here
    os.close(handle)
    return None


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
