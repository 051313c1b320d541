"""onnxruntime CPU time of x * Sigmoid(x) against Swish (opset 24) and com.microsoft QuickGelu.

    python bench/swish_kernel.py [--runs 60] [--threads 2]

For a convnet's early and late activations and a transformer MLP's, times Sigmoid + Mul, the
Swish that `silu` builds and the QuickGelu that `silu-ort` builds, alone, at optimization
levels off and all, round-robin. Medians in milliseconds, and Swish's ratio to Sigmoid + Mul.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from onnx import TensorProto, helper

from fuser.measure import session as measured_session

SHAPES = ([1, 64, 112, 112], [1, 256, 28, 28], [8, 128, 2048])
LEVELS = ("off", "all")


def session(kind: str, shape: list[int], level: str, threads: int):
    if kind == "Swish":
        nodes = [helper.make_node("Swish", ["x"], ["y"], alpha=1.0)]
    elif kind == "QuickGelu":
        nodes = [helper.make_node("QuickGelu", ["x"], ["y"], domain="com.microsoft", alpha=1.0)]
    else:
        nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    graph = helper.make_graph(
        nodes,
        kind,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    opsets = [helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=11)
    return measured_session(model, level, threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    kinds = ("Sigmoid+Mul", "Swish", "QuickGelu")
    print(f"{'shape':>18} {'level':>5} " + " ".join(f"{k:>12}" for k in kinds) + f" {'Swish / Sigmoid+Mul':>20}")
    for shape in SHAPES:
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        for name in LEVELS:
            sessions = {kind: session(kind, shape, name, args.threads) for kind in kinds}
            times: dict[str, list[float]] = {kind: [] for kind in kinds}
            for _ in range(args.runs):
                for kind, sess in sessions.items():
                    start = time.perf_counter()
                    sess.run(None, {"x": x})
                    times[kind].append(time.perf_counter() - start)
            medians = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}
            row = " ".join(f"{medians[k]:10.3f}ms" for k in kinds)
            print(f"{str(shape):>18} {name:>5} {row} {medians['Swish'] / medians['Sigmoid+Mul']:19.2f}x")


if __name__ == "__main__":
    main()
