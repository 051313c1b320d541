"""What onnxruntime's session start costs as a model grows: the floor under fuser's check.

    python bench/ort_sessions.py [--sizes 10000,20000,40000,80000]

The check opens an onnxruntime session (optimizations off) for the original model and one for
the rewritten model, so it cannot take less than those two session starts. This times them on
a chain of N Add nodes, each adding its own 4-float constant, in three spellings of the same
model: constants as initializers (as exporters write them), the same N tensors as graph inputs
instead, and a chain of N Relu nodes without constants; and, as `kept`, the initializers again
in a session asked to save its model, which keeps them instead of removing them one at a time
(what fuser's check does for a model of many small initializers, fuser/verify.py); and, as
`kept halves`, that model cut in two at its middle tensor, the sessions of the two halves started
at once in two threads and timed until both are ready: onnxruntime's start of one session runs on
one core and grows faster than the model, so pieces started side by side are a way under the
floor of a whole-model check. Each start runs in a process of its own; medians of --runs.
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
import os, sys, threading, time, onnxruntime as ort
ort.set_default_logger_severity(4)
def start(path, index):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if sys.argv[1]:
        options.optimized_model_filepath = os.path.join(sys.argv[1], f"saved{index}.onnx")
    ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
started = time.perf_counter()
threads = [threading.Thread(target=start, args=(path, i)) for i, path in enumerate(sys.argv[2:])]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
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


def halves(model: onnx.ModelProto) -> list[onnx.ModelProto]:
    """A chain cut at its middle tensor: the first half computes it, the second reads it."""
    graph = model.graph
    middle = len(graph.node) // 2
    cut = helper.make_tensor_value_info(graph.node[middle - 1].output[0], TensorProto.FLOAT, [1, 4])
    pieces = []
    for nodes, inputs, outputs in (
        (graph.node[:middle], list(graph.input), [cut]),
        (graph.node[middle:], [cut], list(graph.output)),
    ):
        read = {name for node in nodes for name in node.input}
        weights = [t for t in graph.initializer if t.name in read]
        piece = helper.make_model(
            helper.make_graph(list(nodes), "half", inputs, outputs, weights), opset_imports=model.opset_import
        )
        piece.ir_version = model.ir_version
        pieces.append(piece)
    return pieces


def halves_agree(n: int = 1000) -> bool:
    """Whether the halves, run one after the other, give the whole chain's output bit for bit."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL

    def outputs(model, feeds):
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
            None, feeds
        )

    model = chain(n, "initializers")
    first, second = halves(model)
    x = np.random.default_rng(0).standard_normal((1, 4)).astype(np.float32)
    (middle,) = outputs(first, {"x": x})
    return np.array_equal(outputs(model, {"x": x})[0], outputs(second, {first.graph.output[0].name: middle})[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,20000,40000,80000")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    spellings = ["initializers", "kept", "kept halves", "inputs", "relu"]
    print(f"{'nodes':>8} " + " ".join(f"{s:>14}" for s in spellings) + "   (seconds to start a session, median)")
    with tempfile.TemporaryDirectory() as folder:
        for n in (int(s) for s in args.sizes.split(",") if s):
            cells = []
            for spelling in spellings:
                model = chain(n, spelling if spelling in ("inputs", "relu") else "initializers")
                models = halves(model) if spelling == "kept halves" else [model]
                paths = [Path(folder) / f"{spelling.replace(' ', '_')}_{n}_{i}.onnx" for i in range(len(models))]
                for piece, path in zip(models, paths):
                    onnx.save(piece, path)
                saved = folder if spelling.startswith("kept") else ""
                command = [sys.executable, "-c", TIME_SESSION, saved, *map(str, paths)]
                times = [
                    float(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
                    for _ in range(args.runs)
                ]
                cells.append(statistics.median(times))
            print(f"{n:>8} " + " ".join(f"{c:>14.2f}" for c in cells), flush=True)
    print(f"the halves, chained, give the whole chain's output bit for bit: {halves_agree()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
