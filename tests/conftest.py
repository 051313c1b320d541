"""What every test shares."""

from __future__ import annotations

import tempfile

import pytest


@pytest.fixture(scope="session", autouse=True)
def temporary_files_in_the_test_folder(tmp_path_factory):
    """Temporary files the code under test makes (a mismatch's evidence, onnxruntime's saved
    sessions), in this process and in the ones it starts, go under pytest's own folder, which
    pytest clears in later runs, rather than piling up in the system's temporary folder."""
    folder = tmp_path_factory.mktemp("system-tmp")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(folder))
        patch.setattr(tempfile, "tempdir", str(folder))
        yield folder
