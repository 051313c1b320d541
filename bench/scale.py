"""How fuser's time grows with graph size: synthetic Conv-BatchNormalization-Relu chains.

    python bench/scale.py [--sizes 10000,100000] [--repeats 3]

Prints, per size (total node count), the median seconds over repeats of: loading the
ONNX model into fuser's graph, the round trip back to ONNX, and the rewrite pass with
the built-in rules (no numerics check: this measures the engine, not onnxruntime).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import onnx
from onnx import helper, numpy_helper

import fuser
from fuser.engine import Engine
from fuser.model import Model
from fuser.registry import builtin_rules, select


def conv_bn_relu_chain(nodes: int, channels: int = 2) -> onnx.ModelProto:
    blocks = max(1, nodes // 3)
    rng = np.random.default_rng(0)
    graph_nodes, inits = [], []
    current = "x"
    for i in range(blocks):
        for name, value in (
            (f"w{i}", rng.standard_normal((channels, channels, 1, 1)).astype(np.float32)),
            (f"s{i}", np.ones(channels, np.float32)),
            (f"b{i}", np.zeros(channels, np.float32)),
            (f"m{i}", np.zeros(channels, np.float32)),
            (f"v{i}", np.ones(channels, np.float32)),
        ):
            inits.append(numpy_helper.from_array(value, name))
        graph_nodes += [
            helper.make_node("Conv", [current, f"w{i}"], [f"c{i}"], name=f"conv{i}"),
            helper.make_node(
                "BatchNormalization", [f"c{i}", f"s{i}", f"b{i}", f"m{i}", f"v{i}"], [f"n{i}"], name=f"bn{i}"
            ),
            helper.make_node("Relu", [f"n{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        current = f"r{i}"
    info = helper.make_tensor_value_info
    graph = helper.make_graph(
        graph_nodes,
        "chain",
        [info("x", onnx.TensorProto.FLOAT, [1, channels, 4, 4])],
        [info(current, onnx.TensorProto.FLOAT, [1, channels, 4, 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def median_seconds(function, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rules = select(builtin_rules(), "onnx")
    print(f"fuser {fuser.__version__}, rules: {len(rules)}")
    print(f"{'nodes':>9} {'load s':>9} {'to_onnx s':>10} {'optimize s':>11} {'rewrites':>9} {'us/node':>8}")
    for size in (int(s) for s in args.sizes.split(",")):
        proto = conv_bn_relu_chain(size)
        load = median_seconds(lambda proto=proto: Model(proto), args.repeats)
        loaded = Model(proto)
        to_onnx = median_seconds(loaded.to_proto, args.repeats)
        counts: list[int] = []

        def rewrite(proto=proto, counts=counts):
            model = Model(proto)
            counts.append(len(Engine(model, rules).run().rewrites))

        optimize = median_seconds(rewrite, args.repeats) - load
        print(
            f"{len(proto.graph.node):>9} {load:>9.2f} {to_onnx:>10.2f} {optimize:>11.2f} {counts[-1]:>9} "
            f"{optimize / len(proto.graph.node) * 1e6:>8.1f}"
        )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
