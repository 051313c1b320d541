"""fuser's own time against an earlier version of it, on the same model, in the same run.

    python bench/versions.py MODEL.onnx [--against REV] [--rounds 3] [--check]
    python bench/versions.py MODEL.onnx [--against REV] --instructions

Each round runs `fuser optimize MODEL -o ... --no-check` (and, with --check, `fuser optimize`
with the numerics check) once with the code of this checkout and once with the code of git
revision REV (default HEAD~1), alternating, each run a process of its own; it prints the median
wall time and stage times of each, and the ratio of this checkout's to REV's. Machines here are
noisy, and one machine's speed moves from hour to hour: only what is measured in the same run,
interleaved, compares.

Even so, two runs of the same code differ by up to a third on a busy machine, so a change of a
few percent cannot be seen in times. --instructions counts instead the machine instructions the
rewrite executes (`api.optimize` without the check, on the loaded model), under valgrind's
callgrind (`apt-get install valgrind`), with address-space randomization and string hashing
fixed: two runs of the same code agree to within 0.02%. It counts work, not
time (a cache miss costs no more than a hit), and runs some fifty times slower than the rewrite
itself: a model of a few thousand nodes (bench/scale.py's stacks) takes a minute or two.
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


# What a run under callgrind executes: the model is loaded, then only the rewrite, inside
# sys.call_tracing (which nothing else calls), is counted (--toggle-collect).
_COUNTED_REWRITE = """
import sys
from fuser import api
from fuser.context import machine_nchwc_block
from fuser.model import Model
model = Model.load(sys.argv[1], validated=True)
machine_nchwc_block()  # onnxruntime's probe (cached): its threads' instructions vary from run to run
sys.call_tracing(lambda: api.optimize(model, check=False, trace=True, weights_apart=True), ())
"""


def instructions(code: Path, model: str) -> subprocess.Popen:
    """Start counting the instructions of `code`'s rewrite of `model`; `counted` gives the count."""
    command = [
        "setarch",
        "-R",  # no address-space randomization: orders that follow addresses stay the same
        "valgrind",
        "--tool=callgrind",
        "--collect-atstart=no",
        "--toggle-collect=sys_call_tracing",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        "-c",
        _COUNTED_REWRITE,
        model,
    ]
    return subprocess.Popen(
        command,
        env={**os.environ, "PYTHONPATH": str(code), "PYTHONHASHSEED": "0"},
        cwd=code,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def counted(process: subprocess.Popen, code: Path) -> int:
    _, stderr = process.communicate()
    found = [line.split(":")[-1].strip() for line in stderr.splitlines() if "Collected :" in line]
    count = int(found[-1].replace(",", "")) if found else 0
    if process.returncode or not count:
        # Nothing counted: callgrind found no sys_call_tracing (an interpreter without symbols).
        sys.exit(f"{code}: counting the rewrite's instructions failed: {stderr.strip().splitlines()[-3:]}")
    return count


def count_instructions(trees: dict[str, Path], model: str) -> int:
    """Print each tree's count and its ratio to the last tree's (REV's)."""
    if shutil.which("valgrind") is None or shutil.which("setarch") is None:
        sys.exit("--instructions needs valgrind and setarch (apt-get install valgrind)")
    started = {label: instructions(code, model) for label, code in trees.items()}  # side by side
    counts = {label: counted(process, trees[label]) for label, process in started.items()}
    reference = counts[list(trees)[-1]]
    print(f"{model}: instructions of the rewrite (callgrind; the same code counts the same)")
    print(f"{'code':<16} {'instructions':>15} {'ratio':>6}")
    for label, count in counts.items():
        print(f"{label:<16} {count:>15,} {count / reference:>6.3f}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--against", default="HEAD~1", help="the git revision to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="also measure runs with the numerics check")
    parser.add_argument(
        "--instructions", action="store_true", help="count the rewrite's instructions (valgrind) instead of timing runs"
    )
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
        if args.instructions:
            return count_instructions(trees, args.model)
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
