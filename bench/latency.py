"""onnxruntime CPU latency of original vs fused models, per target and optimization level.

    python bench/latency.py [--runs 50] [--threads 2] [--models resnet_small,light_resnet50]

For each sample model (models/) and each onnx light model-zoo model, prints the median
latency (ms) of: the original with onnxruntime's graph optimizations disabled and fully
enabled, and fuser's output for each target under both settings. Ratios compare each
output with the original under the same setting (< 1.00 is faster). Medians of many runs
after warm-up; machines are noisy, so compare within one run of this script only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort

import fuser

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLES = ["resnet_small", "mlp", "classifier_head"]
LIGHT = ["resnet50", "densenet121", "inception_v1", "inception_v2", "shufflenet", "squeezenet",
         "vgg19", "bvlc_alexnet", "zfnet512"]


def model_path(name: str) -> str:
    if name.startswith("light_"):
        return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", f"{name}.onnx")
    return os.path.join(HERE, "..", "models", f"{name}.onnx")


def session(model: onnx.ModelProto, optimized: bool, threads: int):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimized else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def feeds_for(sess) -> dict:
    rng = np.random.default_rng(0)
    feeds = {}
    for spec in sess.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in spec.shape]
        feeds[spec.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def median_ms(sess, feeds, runs: int) -> float:
    for _ in range(max(3, runs // 10)):
        sess.run(None, feeds)
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        sess.run(None, feeds)
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default=",".join(SAMPLES + [f"light_{n}" for n in LIGHT]))
    args = parser.parse_args(argv)
    header = (f"{'model':<22} {'orig/off':>9} {'orig/all':>9} {'onnx/off':>9} {'onnx/all':>9} "
              f"{'ort/off':>9} {'ort/all':>9} {'ort/off vs orig/all':>20}")
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        original = onnx.load(model_path(name))
        variants = {"orig": original}
        for target in ("onnx", "onnxruntime"):
            variants[target], _ = fuser.optimize(original, target=target)
        cells = {}
        feeds = None
        for label, model in variants.items():
            for optimized in (False, True):
                sess = session(model, optimized, args.threads)
                feeds = feeds or feeds_for(sess)
                cells[(label, optimized)] = median_ms(sess, feeds, args.runs)
        ratio = cells[("onnxruntime", False)] / cells[("orig", True)]
        print(f"{name:<22} {cells[('orig', False)]:>9.3f} {cells[('orig', True)]:>9.3f} "
              f"{cells[('onnx', False)]:>9.3f} {cells[('onnx', True)]:>9.3f} "
              f"{cells[('onnxruntime', False)]:>9.3f} {cells[('onnxruntime', True)]:>9.3f} {ratio:>19.2f}x")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
