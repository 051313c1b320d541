"""fuser's own time against an earlier version of it, on the same model, in the same run.

    python bench/versions.py MODEL.onnx [--against REV] [--rounds 3] [--check]

Each round runs `fuser optimize MODEL -o ... --no-check` (and, with --check, `fuser optimize`
with the numerics check) once with the code of this checkout and once with the code of git
revision REV (default HEAD~1), alternating, each run a process of its own; it prints the median
wall time and stage times of each, and the ratio of this checkout's to REV's. Machines here are
noisy, and one machine's speed moves from hour to hour: only what is measured in the same run,
interleaved, compares.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["load", "rewrite", "check", "write"]


def checkout(revision: str | None, folder: Path) -> Path:
    """The fuser package (and its rules) of `revision` (None: as this checkout has them now),
    importable from `folder` whatever way fuser is installed."""
    if revision is None:
        for part in ("fuser", "rules"):
            shutil.copytree(ROOT / part, folder / part, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", revision, "fuser", "rules"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    (folder / "fuser" / "rules").symlink_to("../rules")  # the package maps fuser.rules to rules/
    # Compiled to bytecode first, as an installed fuser is: where PYTHONDONTWRITEBYTECODE is set,
    # every run would compile it anew (compileall skips the linked rules folder: named apart).
    for part in ("fuser", "rules"):
        compileall.compile_dir(folder / part, quiet=1)
    return folder


def run(code: Path, model: str, check: bool, out: Path) -> dict[str, float]:
    report = out.with_suffix(".json")
    command = [
        sys.executable,
        "-m",
        "fuser",
        "optimize",
        model,
        "-o",
        str(out),
        "--force",
        "-q",
        "--report",
        str(report),
    ]
    started = time.perf_counter()
    # Started in the code's own folder: `python -m` puts the working directory first on the
    # path, where a checkout of fuser would win over PYTHONPATH.
    done = subprocess.run(
        command + ([] if check else ["--no-check"]),
        env={**os.environ, "PYTHONPATH": str(code)},
        cwd=code,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"{code}: fuser optimize exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return {"wall": wall, **json.loads(report.read_text())["timings"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--against", default="HEAD~1", help="the git revision to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="also measure runs with the numerics check")
    args = parser.parse_args(argv)
    args.model = str(Path(args.model).resolve())
    with tempfile.TemporaryDirectory(prefix="fuser-versions-") as scratch:
        scratch = Path(scratch)
        for name in ("new", "old"):
            (scratch / name).mkdir()
        trees = {
            "this checkout": checkout(None, scratch / "new"),
            args.against: checkout(args.against, scratch / "old"),
        }
        modes = [False, True] if args.check else [False]
        runs: dict[tuple[str, bool], list[dict]] = {(label, mode): [] for label in trees for mode in modes}
        for _ in range(args.rounds):
            for mode in modes:
                for label, code in trees.items():
                    runs[(label, mode)].append(run(code, args.model, mode, scratch / "out.onnx"))
    print(f"{args.model}: medians of {args.rounds} runs each, interleaved")
    print(f"{'code':<16} {'mode':<9} {'wall s':>7} " + " ".join(f"{s:>8}" for s in STAGES) + f" {'ratio':>6}")
    for mode in modes:
        reference = statistics.median(r["wall"] for r in runs[(args.against, mode)])
        for label in trees:
            rows = runs[(label, mode)]
            wall = statistics.median(r["wall"] for r in rows)
            stages = " ".join(
                f"{statistics.median(r[s] for r in rows):>8.2f}" if s in rows[0] else f"{'-':>8}" for s in STAGES
            )
            print(f"{label:<16} {'check' if mode else 'no-check':<9} {wall:>7.2f} {stages} {wall / reference:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
