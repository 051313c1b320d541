"""onnxruntime CPU latency of original vs fused models, per target and optimization level.

    python bench/latency.py [--runs 50] [--threads 2] [--models resnet_small,light_resnet50]

For each sample model (models/) and each onnx light model-zoo model, prints the median
latency (ms) of the original with onnxruntime's graph optimizations disabled ("off"), at
the extended level ("ext": every fusion but the CPU-specific NCHWc layout) and fully
enabled ("all"), and of fuser's output for each target with them off and all. Medians of
many runs after warm-up, taken round-robin across the columns so that drift hits them
alike; machines are noisy, so compare within one row of one run of this script.

The light models keep their weights as ConstantOfShape placeholders (one value
everywhere, which overflows to inf within a few layers); the benchmark replaces them with
seeded random weights of the same shapes so that every model computes finite values.
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
sys.path.insert(0, os.path.dirname(HERE))
from tests.helpers import LIGHT_MODELS, randomize_constants  # noqa: E402

SAMPLES = ["resnet_small", "mlp", "classifier_head"]


def model_path(name: str) -> str:
    if name.startswith("light_"):
        return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", f"{name}.onnx")
    return os.path.join(HERE, "..", "models", f"{name}.onnx")


LEVELS = {
    "off": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "ext": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def session(model: onnx.ModelProto, level: str, threads: int):
    """No spinning threads: the sessions are timed round-robin, and a session's spinning threads
    would take the cores from the next one (see fuser/measure.py's session)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    options.graph_optimization_level = LEVELS[level]
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def feeds_for(sess) -> dict:
    rng = np.random.default_rng(0)
    feeds = {}
    for spec in sess.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in spec.shape]
        feeds[spec.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def medians_ms(sessions: dict, feeds, runs: int) -> dict:
    """Median latency of each session, timed round-robin (one run of each per round) so that
    the machine's drift over the measurement hits every column alike."""
    for sess in sessions.values():
        for _ in range(max(3, runs // 10)):
            sess.run(None, feeds)
    samples = {key: [] for key in sessions}
    for _ in range(runs):
        for key, sess in sessions.items():
            start = time.perf_counter()
            sess.run(None, feeds)
            samples[key].append((time.perf_counter() - start) * 1000)
    return {key: statistics.median(values) for key, values in samples.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default=",".join(SAMPLES + [f"light_{n}" for n in LIGHT_MODELS]))
    args = parser.parse_args(argv)
    columns = [
        ("orig", "off"),
        ("orig", "ext"),
        ("orig", "all"),
        ("onnx", "off"),
        ("onnx", "all"),
        ("onnxruntime", "off"),
        ("onnxruntime", "all"),
    ]
    labels = {"orig": "orig", "onnx": "onnx", "onnxruntime": "ort"}
    header = f"{'model':<22}" + "".join(f"{labels[t] + '/' + lv:>10}" for t, lv in columns)
    header += f"{'ort/off:orig/ext':>18}{'ort/off:orig/all':>18}"
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        original = onnx.load(model_path(name))
        if name.startswith("light_"):
            original = randomize_constants(original)
        variants = {"orig": original}
        for target in ("onnx", "onnxruntime"):
            variants[target], _ = fuser.optimize(original, target=target)
        sessions = {(label, level): session(variants[label], level, args.threads) for label, level in columns}
        cells = medians_ms(sessions, feeds_for(sessions[columns[0]]), args.runs)
        row = f"{name:<22}" + "".join(f"{cells[c]:>10.3f}" for c in columns)
        row += f"{cells[('onnxruntime', 'off')] / cells[('orig', 'ext')]:>17.2f}x"
        row += f"{cells[('onnxruntime', 'off')] / cells[('orig', 'all')]:>17.2f}x"
        print(row)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
