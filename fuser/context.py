"""What a rule may know beyond the graph: choices about the machine the model is for.

They are resolved once per run, at the edge (the command line, `[tool.fuser]`, the
`fuser.optimize` arguments), recorded in the report, and reach every rule as `m.context`;
no rule probes the machine itself, so a run is reproducible on another machine by giving
the same values.
"""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import dataclass

from fuser.errors import UsageError

# The widths of onnxruntime's NCHWc layout: 8 floats per block with AVX2, 16 with AVX-512.
NCHWC_BLOCKS = (8, 16)
NCHWC_CHOICES = ("auto", *(str(b) for b in NCHWC_BLOCKS))


@dataclass(frozen=True)
class Context:
    """nchwc_block: the channel block of onnxruntime's NCHWc layout the model is written for
    (8 or 16), or 0 for no NCHWc layout (`auto` on a machine whose onnxruntime has none)."""

    nchwc_block: int = 0

    def to_dict(self) -> dict:
        return {"nchwc_block": self.nchwc_block}


def resolve_context(nchwc_block: str | int | None = "auto") -> Context:
    return Context(nchwc_block=resolve_nchwc_block(nchwc_block))


def resolve_nchwc_block(choice: str | int | None) -> int:
    """`auto` (or None): this machine's block size, 0 without NCHWc kernels; 8 or 16 as given."""
    if choice is None or choice == "auto":
        return machine_nchwc_block()
    text = str(choice).strip()
    if isinstance(choice, bool) or text not in NCHWC_CHOICES:
        raise UsageError(f"--nchwc-block must be one of {', '.join(NCHWC_CHOICES)}, not {choice!r}")
    return machine_nchwc_block() if text == "auto" else int(text)


@functools.cache
def machine_nchwc_block() -> int:
    """The block size onnxruntime's own NCHWc transformer uses on this machine; 0 if it has none.

    Read off the transformer itself: it pads a one-channel convolution's filter to B output
    channels. (onnxruntime's kernel library picks B from the CPU; nothing else reports it.)
    """
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.ones((1, 3, 1, 1), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = os.path.join(folder, "probe.onnx")
        options.log_severity_level = 3
        try:
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            optimized = onnx.load(options.optimized_model_filepath)
        except Exception:  # noqa: BLE001 - no NCHWc support is an answer, not an error
            return 0
    sizes = {t.name: t.dims[0] for t in optimized.graph.initializer if len(t.dims) == 4}
    for node in optimized.graph.node:
        if node.domain == "com.microsoft.nchwc" and node.op_type == "Conv":
            return int(sizes.get(node.input[1], 0))
    return 0
