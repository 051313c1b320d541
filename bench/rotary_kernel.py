"""onnxruntime CPU time of a rotary embedding written out against com.microsoft RotaryEmbedding, alone.

    python bench/rotary_kernel.py [--runs 300] [--threads 2]

For heads [1, N, S, H] of the Llama-style decoders in the transformer corpus (the real-size one:
8 heads of 64, sequence 128; the tiny one: 4 heads of 16, sequence 7), times
x * cos + rotate_half(x) * sin as exporters write it (Slice, Slice, Neg, Concat, Mul, Mul, Add)
against what rotary-embedding-ort builds: the cos/sin halves sliced and reshaped to
[positions, H/2] tables, then one RotaryEmbedding. Both at optimization levels off and all,
round-robin; medians in microseconds, and the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from fuser.measure import session

LEVELS = ("off", "all")
SIZES = [(8, 128, 64), (4, 7, 16)]  # heads, sequence, head size


def models(heads: int, sequence: int, head: int) -> dict[str, onnx.ModelProto]:
    half = head // 2

    def ints(name: str, values) -> TensorProto:
        return numpy_helper.from_array(np.array(values, np.int64), name)

    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, heads, sequence, head]),
        helper.make_tensor_value_info("cos", TensorProto.FLOAT, [1, 1, sequence, head]),
        helper.make_tensor_value_info("sin", TensorProto.FLOAT, [1, 1, sequence, head]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, heads, sequence, head])]
    written_out = helper.make_graph(
        [
            helper.make_node("Slice", ["x", "zero", "half", "last"], ["first"]),
            helper.make_node("Slice", ["x", "half", "head", "last"], ["second"]),
            helper.make_node("Neg", ["second"], ["negated"]),
            helper.make_node("Concat", ["negated", "first"], ["rotated"], axis=-1),
            helper.make_node("Mul", ["x", "cos"], ["x_cos"]),
            helper.make_node("Mul", ["rotated", "sin"], ["rotated_sin"]),
            helper.make_node("Add", ["x_cos", "rotated_sin"], ["y"]),
        ],
        "written_out",
        inputs,
        outputs,
        [ints("zero", [0]), ints("half", [half]), ints("head", [head]), ints("last", [-1])],
    )
    fused = helper.make_graph(
        [
            helper.make_node("Slice", ["cos", "zero", "half", "last"], ["cos_half"]),
            helper.make_node("Slice", ["sin", "zero", "half", "last"], ["sin_half"]),
            helper.make_node("Reshape", ["cos_half", "table"], ["cos_table"]),
            helper.make_node("Reshape", ["sin_half", "table"], ["sin_table"]),
            helper.make_node(
                "RotaryEmbedding", ["x", "offset", "cos_table", "sin_table"], ["y"], domain="com.microsoft"
            ),
        ],
        "fused",
        inputs,
        outputs,
        [ints("zero", [0]), ints("half", [half]), ints("last", [-1]), ints("table", [-1, half]), ints("offset", [0])],
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return {
        name: helper.make_model(graph, opset_imports=opsets)
        for name, graph in (("written out", written_out), ("fused", fused))
    }


def feeds(heads: int, sequence: int, head: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    angles = np.arange(sequence)[:, None] * 10000.0 ** (-np.arange(0, head, 2) / head)
    angles = np.concatenate([angles, angles], -1)[None, None]
    return {
        "x": rng.standard_normal((1, heads, sequence, head)).astype(np.float32),
        "cos": np.cos(angles).astype(np.float32),
        "sin": np.sin(angles).astype(np.float32),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"onnxruntime {ort.__version__}, {args.threads} threads, {args.runs} runs, median µs")
    print(f"{'heads x seq x head':<20} {'level':<6} {'written out':>12} {'fused':>10} {'ratio':>7} {'max diff':>10}")
    for size in SIZES:
        inputs = feeds(*size)
        sessions = {}
        for level_name in LEVELS:
            for name, model in models(*size).items():
                sessions[level_name, name] = session(model, level_name, args.threads)
        difference = float(
            np.abs(
                sessions["off", "written out"].run(None, inputs)[0] - sessions["off", "fused"].run(None, inputs)[0]
            ).max()
        )
        times = {key: [] for key in sessions}
        for _ in range(args.runs):
            for key, timed in sessions.items():
                started = time.perf_counter()
                timed.run(None, inputs)
                times[key].append(time.perf_counter() - started)
        label = "x".join(map(str, size))
        for level_name in LEVELS:
            plain = statistics.median(times[level_name, "written out"]) * 1e6
            fused = statistics.median(times[level_name, "fused"]) * 1e6
            print(
                f"{label:<20} {level_name:<6} {plain:>12.1f} {fused:>10.1f} {fused / plain:>6.2f}x {difference:>10.1e}"
            )


if __name__ == "__main__":
    main()
