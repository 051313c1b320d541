"""What onnxruntime's session start costs as a model grows: the floor under fuser's check.

    python bench/ort_sessions.py [--sizes 10000,20000,40000,80000]

The check opens an onnxruntime session (optimizations off) for the original model and one for
the rewritten model, so it cannot take less than those two session starts. This times them on
a chain of N Add nodes, each adding its own 4-float constant, in three spellings of the same
model: constants as initializers (as exporters write them), the same N tensors as graph inputs
instead, and a chain of N Relu nodes without constants; and, as `kept`, the initializers again
in a session asked to save its model, which keeps them instead of removing them one at a time
(what fuser's check does for a model of many small initializers, fuser/verify.py). Each start
runs in a process of its own; medians of --runs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

TIME_SESSION = """
import sys, time, onnxruntime as ort
ort.set_default_logger_severity(4)
options = ort.SessionOptions()
options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
if sys.argv[2]:
    options.optimized_model_filepath = sys.argv[2]
started = time.perf_counter()
ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
print(time.perf_counter() - started)
"""


def chain(n: int, spelling: str) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])]
    if spelling == "relu":
        nodes = [helper.make_node("Relu", ["x" if i == 0 else f"r{i - 1}"], [f"r{i}"]) for i in range(n)]
        initializers = []
    else:
        nodes = [helper.make_node("Add", ["x" if i == 0 else f"r{i - 1}", f"c{i}"], [f"r{i}"]) for i in range(n)]
        constants = [np.full(4, i, np.float32) for i in range(n)]
        if spelling == "initializers":
            initializers = [numpy_helper.from_array(c, f"c{i}") for i, c in enumerate(constants)]
        else:
            initializers = []
            inputs += [helper.make_tensor_value_info(f"c{i}", TensorProto.FLOAT, [4]) for i in range(n)]
    output = helper.make_tensor_value_info(f"r{n - 1}", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph(nodes, "chain", inputs, [output], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,20000,40000,80000")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    spellings = ["initializers", "kept", "inputs", "relu"]
    print(f"{'nodes':>8} " + " ".join(f"{s:>14}" for s in spellings) + "   (seconds to start a session, median)")
    with tempfile.TemporaryDirectory() as folder:
        for n in (int(s) for s in args.sizes.split(",") if s):
            cells = []
            for spelling in spellings:
                path = Path(folder) / f"{spelling}_{n}.onnx"
                onnx.save(chain(n, "initializers" if spelling == "kept" else spelling), path)
                saved = str(Path(folder) / "saved.onnx") if spelling == "kept" else ""
                times = [
                    float(
                        subprocess.run(
                            [sys.executable, "-c", TIME_SESSION, str(path), saved], capture_output=True, text=True, check=True
                        ).stdout
                    )
                    for _ in range(args.runs)
                ]
                cells.append(statistics.median(times))
            print(f"{n:>8} " + " ".join(f"{c:>14.2f}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
