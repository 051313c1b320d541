"""Peak memory of `fuser optimize` per model, next to the estimate `-j` plans with.

    python bench/peaks.py [MODEL.onnx | FOLDER ...] [--targets onnx,onnxruntime] [--checks on,off]

Each run is a process of its own (`fuser optimize M -o TMP --force -q`); its peak is the kernel's
max RSS of that process. `estimate` is fuser.jobs.estimated_peak for the same options, from the
file's census (nodes, weights, convolution filters, weights made at run time); `est/peak` above 1
means the estimate is conservative. Without arguments: the onnx wheel's light model-zoo set and
models/. The fit in fuser/jobs.py (PEAKS) comes from this table over bench/ corpora.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import onnx

from fuser.jobs import OptimizeJob, estimated_peak, model_census

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
MODELS = Path(__file__).resolve().parent.parent / "models"


def peak_of(command: list[str]) -> tuple[int, int]:
    """Peak RSS in bytes and exit code of `command`, run as a child of its own."""
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    return usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)  # ru_maxrss is in KiB on Linux


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", type=Path)
    parser.add_argument("--targets", default="onnx,onnxruntime")
    parser.add_argument("--checks", default="on,off")
    args = parser.parse_args()
    sources: list[Path] = []
    for given in args.models or [LIGHT, MODELS]:
        sources += sorted(given.glob("*.onnx")) if given.is_dir() else [given]
    print(
        f"{'model':28} {'nodes':>8} {'weights MB':>10} {'target':11} {'check':5} {'peak MB':>8} {'estimate':>8} {'est/peak':>8}"
    )
    ratios = []
    with tempfile.TemporaryDirectory() as folder:
        for source in sources:
            found = model_census(source)
            nodes, weights = (found[0].nodes, found[0].weight_bytes) if found else (0, 0)
            for target in args.targets.split(","):
                for check in args.checks.split(","):
                    command = [sys.executable, "-m", "fuser", "optimize", str(source), "-o", f"{folder}/out.onnx"]
                    command += ["--force", "-q", "--target", target] + (["--no-check"] if check == "off" else [])
                    peak, code = peak_of(command)
                    job = OptimizeJob(source, Path(folder, "out.onnx"), target=target, check=check == "on")
                    estimate = estimated_peak(job)
                    ratios.append(estimate / peak)
                    failed = "" if code == 0 else f"  (exit {code})"
                    print(
                        f"{source.name[:28]:28} {nodes:>8} {weights / 1e6:>10.1f} {target:11} {check:5} "
                        f"{peak / 1e6:>8.0f} {estimate / 1e6:>8.0f} {estimate / peak:>8.2f}{failed}",
                        flush=True,
                    )
    print(f"est/peak over {len(ratios)} runs: {min(ratios):.2f} to {max(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
