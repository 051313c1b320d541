"""onnxruntime CPU time of a residual Add + norm against the fused Skip* kernel, alone.

    python bench/skip_norm_kernels.py [--runs 1500] [--threads 2]

For the sizes of the transformer corpus (sequence 128; hidden 512 for the Llama-style
decoder, 768 for BERT-base and GPT-2, 197 x 768 for ViT-base, and the tiny 16 x 64), times
Add -> LayerNormalization against com.microsoft SkipLayerNormalization, and Add ->
SimplifiedLayerNormalization against SkipSimplifiedLayerNormalization, with the sum as a
second output as skip-layer-norm / skip-rms-norm build them, at optimization levels off and
all, round-robin. Medians in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from fuser.measure import session

LEVELS = ("off", "all")
SIZES = [(128, 512, "simplified"), (128, 768, "layer"), (197, 768, "layer"), (16, 64, "simplified")]


def models(sequence: int, hidden: int, kind: str) -> dict[str, onnx.ModelProto]:
    rng = np.random.default_rng(0)
    inits = [
        onnx.numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "scale"),
        onnx.numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "bias"),
    ]
    if kind == "simplified":
        inits = inits[:1]
        plain = helper.make_node("SimplifiedLayerNormalization", ["sum", "scale"], ["y"], epsilon=1e-5)
        fused = helper.make_node(
            "SkipSimplifiedLayerNormalization",
            ["x", "residual", "scale"],
            ["y", "", "", "sum"],
            domain="com.microsoft",
            epsilon=1e-5,
        )
    else:
        plain = helper.make_node("LayerNormalization", ["sum", "scale", "bias"], ["y"], epsilon=1e-5)
        fused = helper.make_node(
            "SkipLayerNormalization",
            ["x", "residual", "scale", "bias"],
            ["y", "", "", "sum"],
            domain="com.microsoft",
            epsilon=1e-5,
        )
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, sequence, hidden]) for n in ("x", "residual")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "sum")]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]

    def model(nodes):
        return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits), opset_imports=opsets)

    return {"add+norm": model([helper.make_node("Add", ["x", "residual"], ["sum"]), plain]), "skip": model([fused])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1500)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"onnxruntime {ort.__version__}, {args.threads} threads, {args.runs} runs; median microseconds")
    for sequence, hidden, kind in SIZES:
        sessions = {}
        for name, model in models(sequence, hidden, kind).items():
            for level in LEVELS:
                sessions[f"{name}/{level}"] = session(model, level, args.threads)
        rng = np.random.default_rng(1)
        feeds = {n: rng.standard_normal((1, sequence, hidden)).astype(np.float32) for n in ("x", "residual")}
        samples = {key: [] for key in sessions}
        for _ in range(args.runs):
            for key, sess in sessions.items():
                start = time.perf_counter()
                sess.run(None, feeds)
                samples[key].append((time.perf_counter() - start) * 1e6)
        cells = ", ".join(f"{key} {statistics.median(v):.0f}" for key, v in samples.items())
        print(f"{kind:10s} {sequence:3d} x {hidden:3d}: {cells}")


if __name__ == "__main__":
    main()
