"""How fuser's time and memory grow with the model: synthetic stacks of many nodes, and large weights.

    python bench/scale.py [--sizes 1000,10000,100000] [--families resnet,mlp] [--weights-mb 500]
                          [--real PATH.onnx] [--no-check-only] [--check-first] [--repeat 3]
                          [--dir /tmp/fuser-scale]

Every measurement is its own process, so its peak memory (max RSS, from the kernel's rusage
of that child, and of the child fuser forks to check a large model) is its own; `tree GB` is
the peak of the memory fuser and that child hold together (their proportional set sizes,
summed, sampled four times a second). Per model it runs --repeat rounds of, in this order:

* `onnx load+save`: `onnx.save(onnx.load(model))`, the floor for any Python tool;
* `fuser optimize --no-check`, and `fuser optimize` (with the onnxruntime numerics check).

and prints the medians over the rounds of wall time, peak memory and the stage times from
fuser's JSON report. The ratios are taken within each round, where the machine's speed was
the same for both sides (fuser's time and memory over onnx load+save's, fuser's time with the
check over its time without it), then their medians are printed, and for time x its range. Models:

* `resnet`: blocks Conv-BatchNormalization-Relu-Conv-BatchNormalization-Add-Relu (7 nodes, 4 channels);
* `mlp`: blocks MatMul-Add-Relu-MatMul-Add-Add (6 nodes, width 16, a residual Add);
* `weights`: a 12-block MLP whose weights total --weights-mb (GPT-2 small is about 500 MB),
  stored inside the .onnx file, as a single-file export is;
* `--real PATH`: any model, e.g. a GPT-2 small export made by
  `python tests/data/make_transformers.py --size real --out bench/models/`.

Sizes are total node counts; 1M nodes is `--sizes 1000000` (a few minutes and several GB).
`--check-first` runs fuser as it runs where the machine has not the second core or the memory
to check a large model beside building its graph (fuser/validation.py): the load waits for
the check's child before it builds the graph, and the two never hold memory together.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def resnet_stack(nodes: int, channels: int = 4) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    graph_nodes, inits = [], []
    current = "x"
    for i in range(max(1, nodes // 7)):
        for j in (0, 1):
            inits.append(_tensor(rng.standard_normal((channels, channels, 3, 3)) * 0.1, f"w{i}_{j}"))
            inits.append(_tensor(1 + 0.1 * rng.standard_normal(channels), f"scale{i}_{j}"))
            inits.append(_tensor(0.1 * rng.standard_normal(channels), f"beta{i}_{j}"))
            inits.append(_tensor(0.1 * rng.standard_normal(channels), f"mean{i}_{j}"))
            inits.append(_tensor(1 + rng.random(channels), f"var{i}_{j}"))
        for j, source, target in ((0, current, f"r{i}"), (1, f"r{i}", f"n{i}")):
            graph_nodes.append(helper.make_node("Conv", [source, f"w{i}_{j}"], [f"c{i}_{j}"], pads=[1, 1, 1, 1]))
            bn_inputs = [f"c{i}_{j}", f"scale{i}_{j}", f"beta{i}_{j}", f"mean{i}_{j}", f"var{i}_{j}"]
            graph_nodes.append(helper.make_node("BatchNormalization", bn_inputs, [target if j else f"b{i}"]))
            if j == 0:
                graph_nodes.append(helper.make_node("Relu", [f"b{i}"], [target]))
        graph_nodes.append(helper.make_node("Add", [f"n{i}", current], [f"a{i}"]))
        graph_nodes.append(helper.make_node("Relu", [f"a{i}"], [f"y{i}"]))
        current = f"y{i}"
    shape = ["batch", channels, 8, 8]
    return _model(graph_nodes, inits, "x", current, shape)


def mlp_stack(nodes: int, width: int = 16, blocks: int | None = None, hidden: int | None = None) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    hidden = hidden or width
    graph_nodes, inits = [], []
    current = "x"
    for i in range(blocks or max(1, nodes // 6)):
        inits.append(_tensor(rng.standard_normal((width, hidden)) / np.sqrt(width), f"w{i}_0"))
        inits.append(_tensor(0.1 * rng.standard_normal(hidden), f"b{i}_0"))
        inits.append(_tensor(rng.standard_normal((hidden, width)) / np.sqrt(hidden), f"w{i}_1"))
        inits.append(_tensor(0.1 * rng.standard_normal(width), f"b{i}_1"))
        graph_nodes += [
            helper.make_node("MatMul", [current, f"w{i}_0"], [f"m{i}_0"]),
            helper.make_node("Add", [f"m{i}_0", f"b{i}_0"], [f"h{i}_0"]),
            helper.make_node("Relu", [f"h{i}_0"], [f"r{i}"]),
            helper.make_node("MatMul", [f"r{i}", f"w{i}_1"], [f"m{i}_1"]),
            helper.make_node("Add", [f"m{i}_1", f"b{i}_1"], [f"h{i}_1"]),
            helper.make_node("Add", [f"h{i}_1", current], [f"y{i}"]),
        ]
        current = f"y{i}"
    return _model(graph_nodes, inits, "x", current, ["batch", width])


def large_weights(megabytes: int) -> onnx.ModelProto:
    """12 MLP blocks of width 768 whose hidden size makes the weights total `megabytes`."""
    width, blocks = 768, 12
    hidden = max(1, int(megabytes * 1e6 / (4 * blocks * 2 * width)))
    return mlp_stack(0, width=width, blocks=blocks, hidden=hidden)


def _tensor(value, name: str) -> TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _model(nodes, inits, source: str, result: str, shape) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "stack",
        [helper.make_tensor_value_info(source, TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(result, TensorProto.FLOAT, shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


# ------------------------------------------------------------------------------------- measuring

ONNX_ROUND_TRIP = "import onnx, sys; onnx.save(onnx.load(sys.argv[1]), sys.argv[2])"


def measure(command: list[str]) -> tuple[float, float, float | None, int]:
    """Wall seconds, peak RSS in GB, peak memory of the process tree in GB and exit code of
    `command`, run as a child of its own. The peak RSS is the kernel's, of the child and of
    any child of its own it waited for (fuser checks a large model in one while it builds the
    graph); the tree's is the sum of their proportional set sizes (shared pages counted once),
    sampled every TREE_SAMPLE seconds or less often (TREE_SAMPLE_SPACING), which the RSS of each
    alone does not show (None where /proc cannot tell it)."""
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tree, sampled, interval = 0.0, 0.0, TREE_SAMPLE
    while True:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            break
        now = time.perf_counter()
        if tree is not None and now - sampled >= interval:
            sampled = now
            size = _tree_pss(child.pid)
            tree = None if size is None else max(tree, size)
            interval = max(TREE_SAMPLE, TREE_SAMPLE_SPACING * (time.perf_counter() - now))
        time.sleep(0.02)
    seconds = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)
    error = child.stderr.read().decode(errors="replace").strip()
    child.stderr.close()
    if child.returncode not in (0,):
        print(f"    {' '.join(command[:4])}... exited {child.returncode}: {error.splitlines()[-1:]}", file=sys.stderr)
    return seconds, usage.ru_maxrss / 1e6, tree, child.returncode  # ru_maxrss is in KiB on Linux


TREE_SAMPLE = 0.25  # seconds between samples of the process tree's memory, at least
# Each sample walks the tree's pages in the kernel, 60 ms for a process of 3.6 GB: four a second
# would take a quarter of a core from the run measured. The time from one sample to the next is at
# least this many times what the last one took, so that sampling takes about 2% of a core.
TREE_SAMPLE_SPACING = 50


def _tree_pss(root: int) -> float | None:
    """The summed proportional set size of `root` and its descendants, in GB (None off Linux)."""
    if not os.path.exists("/proc/self/smaps_rollup"):
        return None
    total, pending = 0, [root]
    while pending:
        pid = pending.pop()
        try:
            with open(f"/proc/{pid}/smaps_rollup") as handle:
                total += next((int(line.split()[1]) for line in handle if line.startswith("Pss:")), 0)
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as handle:
                    pending.extend(int(child) for child in handle.read().split())
        except (OSError, ValueError):  # it ended meanwhile
            continue
    return total / 1e6


# `python -m fuser` (the same entry point: a process that ends at once when its output is out),
# with the load's check counted as having no second core beside it.
CHECK_FIRST = "import fuser.validation; fuser.validation.CORES = 1; from fuser.cli import program; program()"


def fuser_command(model: Path, output: Path, report: Path, check: bool, check_first: bool = False) -> list[str]:
    launcher = ["-c", CHECK_FIRST] if check_first else ["-m", "fuser"]
    command = [sys.executable, *launcher, "optimize", str(model), "-o", str(output), "--force", "-q"]
    command += ["--report", str(report)]
    return command + ([] if check else ["--no-check"])


def stage_times(report: Path) -> dict[str, float]:
    try:
        return json.loads(report.read_text()).get("timings") or {}
    except (OSError, ValueError):
        return {}


# Linux carries a process's peak RSS over fork and exec into the child's rusage, so this
# process never holds a model itself: building and counting run in children of their own.
COUNT_NODES = "import onnx, sys; print(len(onnx.load(sys.argv[1], load_external_data=False).graph.node))"
BUILD = "import sys; sys.path.insert(0, sys.argv[1]); import scale, onnx; onnx.save(eval(sys.argv[2]), sys.argv[3])"
# fuser's modules compiled to bytecode before anything is measured, as an installed fuser has
# them (onnx's are, in site-packages): where PYTHONDONTWRITEBYTECODE is set, as on the machines
# these tables come from, every run would otherwise compile them anew (0.1 to 0.15 s of its
# imports). compileall skips a linked folder, so the rules are compiled as a package of their own.
COMPILE = (
    "import compileall, importlib.util, sys; "
    "folders = [d for name in ('fuser', 'fuser.rules') "
    "for d in importlib.util.find_spec(name).submodule_search_locations]; "
    "sys.exit(0 if all(compileall.compile_dir(d, quiet=1) for d in folders) else 1)"
)


def run_model(
    label: str, path: Path, workdir: Path, checks: list[bool], check_first: bool = False, repeat: int = 1
) -> list[dict]:
    """One row per mode, the medians of `repeat` rounds. A round runs onnx load+save and then
    fuser in every mode, so that a slow minute of the machine weighs on both sides of a ratio."""
    nodes = int(
        subprocess.run(
            [sys.executable, "-c", COUNT_NODES, str(path)], check=True, capture_output=True, text=True
        ).stdout
    )
    rounds: dict[bool, list[dict]] = {check: [] for check in checks}
    for _ in range(repeat):
        reference = measure([sys.executable, "-c", ONNX_ROUND_TRIP, str(path), str(workdir / "roundtrip.onnx")])
        for check in checks:
            report = workdir / "report.json"
            seconds, peak, tree, code = measure(fuser_command(path, workdir / "out.onnx", report, check, check_first))
            rounds[check].append(
                {
                    "onnx_s": reference[0],
                    "onnx_gb": reference[1],
                    "fuser_s": seconds,
                    "fuser_gb": peak,
                    "tree_gb": tree,
                    "exit": code,
                    "stages": stage_times(report),
                }
            )
    rows = [_medians(label, nodes, "check" if check else "no-check", runs) for check, runs in rounds.items()]
    if False in rounds and True in rounds:  # what the check adds, taken in each round
        added = [on["fuser_s"] / off["fuser_s"] for on, off in zip(rounds[True], rounds[False])]
        rows[checks.index(True)]["check_x"] = statistics.median(added)
    return rows


def _medians(label: str, nodes: int, mode: str, runs: list[dict]) -> dict:
    """The medians of `runs`. A ratio is taken in each round (fuser over the onnx run just before
    it), then its median and range over the rounds."""
    median = statistics.median
    times = [run["fuser_s"] / run["onnx_s"] for run in runs]
    trees = [run["tree_gb"] for run in runs if run["tree_gb"] is not None]
    stages = {s: [run["stages"][s] for run in runs if s in run["stages"]] for s in STAGES}
    return {
        "model": label,
        "nodes": nodes,
        "mode": mode,
        "onnx_s": median(run["onnx_s"] for run in runs),
        "onnx_gb": median(run["onnx_gb"] for run in runs),
        "fuser_s": median(run["fuser_s"] for run in runs),
        "fuser_gb": median(run["fuser_gb"] for run in runs),
        "tree_gb": median(trees) if trees else None,
        "time_x": median(times),
        "time_x_range": (min(times), max(times)),
        "mem_x": median(run["fuser_gb"] / run["onnx_gb"] for run in runs),
        "exit": next((run["exit"] for run in runs if run["exit"] != 0), 0),
        "stages": {s: median(values) for s, values in stages.items() if values},
    }


STAGES = ["load", "rewrite", "check", "blame", "write"]  # the report's timings (fuser/progress.py)


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def header() -> str:
    text = (
        f"{'model':<16} {'nodes':>8} {'mode':<8} {'onnx s':>7} {'onnx GB':>8} {'fuser s':>8} {'fuser GB':>9} {'tree GB':>8} "
        f"{'time x':>7} {'range':>9} {'check x':>8} {'mem x':>6} {'us/node':>8}  " + " ".join(f"{s:>7}" for s in STAGES)
    )
    return text + "\n" + "-" * len(text)


def line(row: dict) -> str:
    times = " ".join(f"{row['stages'][s]:>7.2f}" if s in row["stages"] else f"{'-':>7}" for s in STAGES)
    low, high = row["time_x_range"]
    spread = f"{low:.1f}-{high:.1f}" if high - low >= 0.05 else "-"
    check_x = f"{row['check_x']:.2f}" if "check_x" in row else "-"
    return (
        f"{row['model']:<16} {row['nodes']:>8} {row['mode']:<8} {row['onnx_s']:>7.2f} {row['onnx_gb']:>8.2f} "
        f"{row['fuser_s']:>8.2f} {row['fuser_gb']:>9.2f} {_gb(row['tree_gb']):>8} {row['time_x']:>7.2f} {spread:>9} "
        f"{check_x:>8} {row['mem_x']:>6.2f} {row['fuser_s'] / max(row['nodes'], 1) * 1e6:>8.1f}  {times}"
        + ("" if row["exit"] == 0 else f"  exit {row['exit']}")
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="total node counts, comma-separated")
    parser.add_argument("--families", default="resnet,mlp")
    parser.add_argument("--weights-mb", type=int, default=500, help="size of the large-weights model (0: none)")
    parser.add_argument("--real", action="append", default=[], help="an existing model to measure too")
    parser.add_argument("--no-check-only", action="store_true", help="skip the runs with the numerics check")
    parser.add_argument("--check-up-to", type=int, default=100_000, help="largest stack measured with the check")
    parser.add_argument(
        "--check-first", action="store_true", help="the load's check before the graph is built, not beside it"
    )
    parser.add_argument("--dir", default=None, help="where to write the models (default: a temporary folder)")
    parser.add_argument(
        "--repeat", type=int, default=3, help="rounds per model, interleaved; the tables give medians (default 3)"
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="fuser-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    builders = {"resnet": resnet_stack, "mlp": mlp_stack}
    print(f"python {sys.version.split()[0]}, onnx {onnx.__version__}, {os.cpu_count()} cores; models in {workdir}")
    print(
        "time x / mem x: fuser's wall time / peak RSS over onnx load+save of the same file, measured in the same "
        f"round; medians of {args.repeat} interleaved round(s); range: the lowest and highest time x; "
        "check x: fuser's time with the check over its time without it, in the same round"
    )
    subprocess.run([sys.executable, "-c", COMPILE], check=True)
    print(header(), flush=True)
    models: list[tuple[str, Path, list[bool], str | None]] = []  # label, file, checks, how to build it
    for size in (int(s) for s in args.sizes.split(",") if s):
        for family in args.families.split(","):
            path = workdir / f"{family}_{size}.onnx"
            checks = [False] if args.no_check_only or size > args.check_up_to else [False, True]
            models.append((family, path, checks, f"scale.{builders[family].__name__}({size})"))
    if args.weights_mb:
        path = workdir / f"weights_{args.weights_mb}mb.onnx"
        checks = [False] if args.no_check_only else [False, True]
        models.append((f"weights {args.weights_mb}MB", path, checks, f"scale.large_weights({args.weights_mb})"))
    for real in args.real:
        checks = [False] if args.no_check_only else [False, True]
        models.append((Path(real).stem[:16], Path(real), checks, None))
    try:
        for label, path, checks, build in models:
            if build is not None and not path.exists():
                subprocess.run([sys.executable, "-c", BUILD, str(Path(__file__).parent), build, str(path)], check=True)
            for row in run_model(label, path, workdir, checks, args.check_first, args.repeat):
                print(line(row), flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
