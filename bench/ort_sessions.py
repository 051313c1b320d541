"""What onnxruntime's session start costs as a model grows: the floor under fuser's check.

    python bench/ort_sessions.py [--sizes 10000,20000,40000,80000]

The check opens an onnxruntime session (optimizations off) for the original model and one for
the rewritten model, so it cannot take less than those two session starts. This times them on
a chain of N Add nodes, each adding its own 4-float constant, in three spellings of the same
model: constants as initializers (as exporters write them), the same N tensors as graph inputs
instead, and a chain of N Relu nodes without constants; and, as `kept`, the initializers again
in a session asked to save its model, which keeps them instead of removing them one at a time
(what fuser's check does for a model of many small initializers, fuser/verify.py); and, as
`kept in K`, that model cut into K consecutive pieces (--pieces), the sessions of the pieces
started at once in K threads and timed until all are ready: onnxruntime's start of one session
runs on one core and grows faster than the model, so pieces started side by side are a way under
the floor of a whole-model check, and smaller pieces do less work in all. Each start runs in a
process of its own; medians of --runs.
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


def pieces_of(model: onnx.ModelProto, count: int) -> list[onnx.ModelProto]:
    """A chain cut into `count` consecutive pieces: each reads the tensor the one before computes."""
    graph = model.graph
    bounds = [round(len(graph.node) * i / count) for i in range(count + 1)]
    crossing = [helper.make_tensor_value_info(graph.node[b - 1].output[0], TensorProto.FLOAT, [1, 4]) for b in bounds[1:-1]]
    pieces = []
    for index, (start, end) in enumerate(zip(bounds, bounds[1:])):
        nodes = graph.node[start:end]
        inputs = list(graph.input) if index == 0 else [crossing[index - 1]]
        outputs = list(graph.output) if index == count - 1 else [crossing[index]]
        read = {name for node in nodes for name in node.input}
        weights = [t for t in graph.initializer if t.name in read]
        piece = helper.make_model(
            helper.make_graph(list(nodes), f"piece{index}", inputs, outputs, weights), opset_imports=model.opset_import
        )
        piece.ir_version = model.ir_version
        pieces.append(piece)
    return pieces


def pieces_agree(n: int = 1000) -> bool:
    """Whether four pieces, run one after the other, give the whole chain's output bit for bit."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL

    def outputs(model, feeds):
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
            None, feeds
        )

    model = chain(n, "initializers")
    x = np.random.default_rng(0).standard_normal((1, 4)).astype(np.float32)
    value = x
    for index, piece in enumerate(pieces_of(model, 4)):
        (value,) = outputs(piece, {piece.graph.input[0].name: value})
    return np.array_equal(outputs(model, {"x": x})[0], value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,20000,40000,80000")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pieces", default="2,4,16", help="the piece counts to time the kept model in")
    args = parser.parse_args(argv)
    counts = {f"kept in {k}": int(k) for k in args.pieces.split(",") if k}
    spellings = ["initializers", "kept", *counts, "inputs", "relu"]
    print(f"{'nodes':>8} " + " ".join(f"{s:>14}" for s in spellings) + "   (seconds to start a session, median)")
    with tempfile.TemporaryDirectory() as folder:
        for n in (int(s) for s in args.sizes.split(",") if s):
            cells = []
            for spelling in spellings:
                model = chain(n, spelling if spelling in ("inputs", "relu") else "initializers")
                models = pieces_of(model, counts[spelling]) if spelling in counts else [model]
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
    print(f"four pieces, chained, give the whole chain's output bit for bit: {pieces_agree()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
