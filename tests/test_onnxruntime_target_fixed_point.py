"""fuser reads what its onnxruntime target writes, and a second run finds nothing to do.

Below opset 23 the onnxruntime target writes RMS norms as SimplifiedLayerNormalization, an
operator onnxruntime registers in the default domain and onnx.checker does not know. fuser's
loader accepts such operators (everything else in the model is still fully checked) and keeps
refusing operators nobody knows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

import fuser
from fuser.errors import InputError
from fuser.model import Model
from tests.helpers import make_model

LLAMA = Path(__file__).resolve().parent / "data" / "transformers" / "llama_legacy.onnx"


def one_node_model(op_type: str, tmp_path: Path, *, broken_elsewhere: bool = False) -> Path:
    nodes = [helper.make_node(op_type, ["x", "scale"], ["n"], axis=-1, epsilon=1e-6)]
    nodes.append(helper.make_node("Relu", ["n", "n"] if broken_elsewhere else ["n"], ["y"]))
    model = make_model(
        nodes,
        [("x", np.float32, [2, 8])],
        [("y", np.float32, [2, 8])],
        {"scale": np.ones(8, np.float32)},
        opset=18,
        check=False,
    )
    path = tmp_path / f"{op_type}.onnx"
    onnx.save(model, path)
    return path


def test_onnxruntime_default_domain_operators_load(tmp_path):
    model = Model.load(one_node_model("SimplifiedLayerNormalization", tmp_path))
    assert [n.op_type for n in model.graph.nodes()] == ["SimplifiedLayerNormalization", "Relu"]


def test_unknown_operators_and_other_errors_are_still_refused(tmp_path):
    with pytest.raises(InputError, match="No Op registered for NoSuchNorm"):
        Model.load(one_node_model("NoSuchNorm", tmp_path))
    with pytest.raises(InputError, match="invalid ONNX model"):  # Relu with two inputs
        Model.load(one_node_model("SimplifiedLayerNormalization", tmp_path, broken_elsewhere=True))


def test_a_second_run_over_the_onnxruntime_output_changes_nothing(tmp_path):
    first = tmp_path / "first.onnx"
    optimized, report = fuser.optimize(LLAMA, target="onnxruntime")
    assert report.counts.get("rms-norm-ort") and report.verdict.passed
    onnx.save(optimized, first)
    again, second = fuser.optimize(first, target="onnxruntime")
    assert second.counts == {}
    assert fuser.find_opportunities(first, target="onnxruntime").opportunities == []
    assert [n.op_type for n in again.graph.node] == [n.op_type for n in optimized.graph.node]
