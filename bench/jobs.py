"""Throughput of `fuser optimize -j N` on the onnx wheel's light model-zoo set.

    python bench/jobs.py [--jobs 1,2] [--rounds 3] [--no-check]

Runs `fuser optimize LIGHT_DIR -o TMP -j N -q` for each N, round-robin, `--rounds` times, and
prints per N the median wall-clock seconds of the whole run, models per second and the speed-up
against the first N. The load average before each run says how busy the machine was.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import onnx
from scale import COMPILE

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="1,2", help="comma-separated values of -j")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-check", action="store_true", help="pass --no-check (times fuser, not onnxruntime)")
    args = parser.parse_args()
    counts = [int(n) for n in args.jobs.split(",")]
    models = sorted(name for name in os.listdir(LIGHT) if name.endswith(".onnx"))
    seconds: dict[int, list[float]] = {n: [] for n in counts}
    loads: list[float] = []
    subprocess.run([sys.executable, "-c", COMPILE], check=True)  # every worker would compile fuser anew
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            for n in counts:
                command = [sys.executable, "-m", "fuser.cli", "optimize", LIGHT, "-o", folder, "-j", str(n)]
                command += ["-q", "--force"] + (["--no-check"] if args.no_check else [])
                loads.append(os.getloadavg()[0])
                started = time.perf_counter()
                done = subprocess.run(command, capture_output=True, text=True)
                seconds[n].append(time.perf_counter() - started)
                if done.returncode != 0:
                    print(done.stderr, file=sys.stderr)
                    return done.returncode
    print(f"{len(models)} models from {LIGHT}, {args.rounds} rounds, check {'off' if args.no_check else 'on'}")
    print(f"load average before the runs: {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} cores")
    base = statistics.median(seconds[counts[0]])
    print(f"{'-j':>4} {'median s':>9} {'models/s':>9} {'speed-up':>9}   runs (s)")
    for n in counts:
        median = statistics.median(seconds[n])
        runs = " ".join(f"{s:.1f}" for s in seconds[n])
        print(f"{n:>4} {median:>9.1f} {len(models) / median:>9.2f} {base / median:>8.2f}x   {runs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
