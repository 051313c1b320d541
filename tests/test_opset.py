"""`--opset N`: an explicit upgrade with onnx's version converter before the rules run.

The portable target emits a standard fused op only at its opset (Gelu 20): a GELU written
out in an opset-14 model stays as it is unless the user asks for the upgrade, and then
becomes Gelu, with the converted model checked against the original.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

import fuser
from fuser.errors import UsageError
from fuser.model import Model
from fuser.opset import upgrade
from tests.helpers import in_process_cli, make_model, opsets_of, op_types, run


def erf_gelu_model(opset: int) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Div", ["x", "root_two"], ["scaled"]),
        helper.make_node("Erf", ["scaled"], ["erf"]),
        helper.make_node("Add", ["erf", "one"], ["plus"]),
        helper.make_node("Mul", ["x", "plus"], ["product"]),
        helper.make_node("Mul", ["product", "half"], ["y"]),
    ]
    constants = {"root_two": np.float32(np.sqrt(2)), "one": np.float32(1), "half": np.float32(0.5)}
    return make_model(nodes, [("x", np.float32, ["batch", 16])], [("y", np.float32, ["batch", 16])], constants, opset)


@pytest.fixture
def cli(monkeypatch, capfd):
    return in_process_cli(monkeypatch, capfd)


def test_without_opset_the_model_keeps_its_opset_and_the_gelu():
    after, report = fuser.optimize(erf_gelu_model(14))
    assert opsets_of(after)[""] == 14
    assert "Erf" in op_types(after)
    assert report.counts == {}


def test_opset_upgrades_then_fuses_and_checks_against_the_original():
    before = erf_gelu_model(14)
    after, report = fuser.optimize(before, opset=20)
    assert opsets_of(after)[""] == 20
    assert op_types(after) == ["Gelu"]
    assert report.counts == {"gelu": 1}
    assert report.verdict is not None and report.verdict.passed
    assert any("upgraded from opset 14 to 20" in note for note in report.notes)
    onnx.checker.check_model(after, full_check=True)
    x = np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32)
    np.testing.assert_allclose(run(after, {"x": x})[0], run(before, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_an_upgrade_alone_is_checked_and_reported():
    model = make_model(
        [helper.make_node("Relu", ["x"], ["y"])], [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], opset=13
    )
    after, report = fuser.optimize(model, opset=18)
    assert opsets_of(after)[""] == 18 and report.counts == {}
    assert report.verdict is not None and report.verdict.passed


def test_the_same_opset_changes_nothing():
    after, report = fuser.optimize(erf_gelu_model(20), opset=20)
    assert report.counts == {"gelu": 1}
    assert not any("upgraded" in note for note in report.notes)


@pytest.mark.parametrize("opset, message", [(13, "below the model's opset 14"), (999, "beyond the newest opset")])
def test_downgrades_and_unknown_opsets_are_usage_errors(opset, message):
    with pytest.raises(UsageError, match=message):
        fuser.optimize(erf_gelu_model(14), opset=opset)


def test_the_command_line_and_pyproject_take_the_opset(cli, tmp_path):
    onnx.save(erf_gelu_model(14), tmp_path / "m.onnx")
    done = cli(tmp_path, "optimize", "m.onnx", "--opset", "20", "--format", "json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rule_counts"] == {"gelu": 1}
    assert opsets_of(onnx.load(tmp_path / "m.fused.onnx"))[""] == 20

    (tmp_path / "pyproject.toml").write_text("[tool.fuser]\nopset = 20\n")
    done = cli(tmp_path, "optimize", "m.onnx", "-o", "from_config.onnx")
    assert done.returncode == 0, done.stderr
    assert op_types(onnx.load(tmp_path / "from_config.onnx")) == ["Gelu"]

    done = cli(tmp_path, "optimize", "m.onnx", "-o", "low.onnx", "--opset", "12")
    assert done.returncode == 2
    assert "below the model's opset 14" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "low.onnx").exists()


def test_check_mode_counts_what_the_upgrade_would_allow(cli, tmp_path):
    onnx.save(erf_gelu_model(14), tmp_path / "m.onnx")
    assert cli(tmp_path, "check", "m.onnx").returncode == 0
    done = cli(tmp_path, "check", "m.onnx", "--opset", "20")
    assert done.returncode == 1, done.stderr


def test_the_summary_says_which_rules_need_a_newer_opset(cli, tmp_path):
    onnx.save(erf_gelu_model(14), tmp_path / "m.onnx")
    done = cli(tmp_path, "optimize", "m.onnx")
    (hint,) = [line for line in done.stderr.splitlines() if "need a newer opset:" in line]
    assert "gelu" in hint and "skip-layer-norm" not in hint  # rules rooted at ops the model has
    relu = make_model(
        [helper.make_node("Relu", ["x"], ["y"])], [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], opset=14
    )
    onnx.save(relu, tmp_path / "relu.onnx")
    done = cli(tmp_path, "optimize", "relu.onnx", "-o", "relu_out.onnx")
    assert "need a newer opset" not in done.stderr  # no rule needing one has anything to look at


def test_the_hint_leaves_out_rules_whose_pattern_another_rule_fused(cli, tmp_path):
    """On onnxruntime, gelu-ort fuses the Erf GELU at opset 14 already: an upgrade would give
    gelu (opset 20) nothing left to fuse. On the onnx target the GELU stays, and the hint names it."""
    onnx.save(erf_gelu_model(14), tmp_path / "m.onnx")
    done = cli(tmp_path, "optimize", "m.onnx", "-o", "ort.onnx", "--target", "onnxruntime")
    assert done.returncode == 0, done.stderr
    assert "com.microsoft.Gelu" in [f"{n.domain}.{n.op_type}" for n in onnx.load(tmp_path / "ort.onnx").graph.node]
    assert "need a newer opset" not in done.stderr
    done = cli(tmp_path, "optimize", "m.onnx", "-o", "onnx.onnx")
    (hint,) = [line for line in done.stderr.splitlines() if "need a newer opset:" in line]
    assert "gelu" in hint


def test_the_hint_leaves_out_rules_whose_patterns_need_ops_the_model_lacks(cli, tmp_path):
    """A residual Add and a Mul are the roots of rotary-embedding's and rms-norm's patterns (opset
    23), but without a Neg, a Slice or a ReduceMean neither can match anywhere."""
    nodes = [helper.make_node("Mul", ["x", "x"], ["m"]), helper.make_node("Add", ["m", "x"], ["y"])]
    model = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], opset=14)
    onnx.save(model, tmp_path / "residual.onnx")
    done = cli(tmp_path, "optimize", "residual.onnx", "-o", "residual_out.onnx")
    assert done.returncode == 0, done.stderr
    assert "need a newer opset" not in done.stderr


BERT_DYNAMO = Path(__file__).resolve().parent / "data" / "transformers" / "bert_dynamo.onnx"


def test_the_upgrade_keeps_the_exporters_shape_annotations():
    """onnx's converter re-infers shapes with unnamed dims; kept, the exporter's named dims let
    attention fuse into the standard Attention op at opset 23."""
    original = onnx.load(BERT_DYNAMO)
    upgraded = upgrade(Model(original), 23).to_proto()
    annotated = {v.name: v.type for v in original.graph.value_info}
    assert [v for v in upgraded.graph.value_info if annotated.get(v.name) != v.type] == []
    optimized, report = fuser.optimize(BERT_DYNAMO, target="onnx", opset=23)
    assert "Softmax" not in op_types(optimized) and "Attention" in op_types(optimized)
    assert report.verdict.passed


def _relu_model(imports_microsoft: bool) -> onnx.ModelProto:
    model = make_model(
        [helper.make_node("Relu", ["x"], ["y"])], [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], {}, 17
    )
    if imports_microsoft:
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


@fuser.rule("relu-quick-gelu-test", pattern=fuser.op.Relu(fuser.var("x")), emits={"com.microsoft": 1})
def _relu_to_microsoft(m, b):
    """Relu => com.microsoft QuickGelu (not the same function: checked off)."""
    return b.op("QuickGelu", m["x"], domain="com.microsoft")


@fuser.rule("quick-gelu-abs-test", pattern=fuser.op.domain("com.microsoft").QuickGelu(fuser.var("x")), phase=1)
def _microsoft_to_abs(m, b):
    """com.microsoft QuickGelu => Abs."""
    return b.Abs(m["x"])


@pytest.mark.parametrize("imports_microsoft", [False, True])
def test_an_import_a_rewrite_added_goes_when_no_node_uses_it(imports_microsoft):
    """A later rewrite replaced every node of the domain an earlier one imported: the written
    model does not import it. One the model itself imported stays."""
    rules = [_relu_to_microsoft, _microsoft_to_abs]
    optimized, report = fuser.optimize(_relu_model(imports_microsoft), rules=rules, check=False)
    assert report.counts == {"relu-quick-gelu-test": 1, "quick-gelu-abs-test": 1}
    assert op_types(optimized) == ["Abs"]
    assert ("com.microsoft" in opsets_of(optimized)) == imports_microsoft
    halfway, _ = fuser.optimize(_relu_model(False), rules=rules[:1], check=False)
    assert opsets_of(halfway)["com.microsoft"] == 1


@pytest.mark.parametrize("check", [[], ["--no-check"]])
def test_an_invalid_model_is_refused_with_opset_as_without(cli, tmp_path, check):
    """The converted model is another: the run's end waited for the original's verdict only without --opset."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])]
    model = make_model(nodes, [("x", np.float32, [2])], [("y", np.float32, [2])], opset=17)
    model.graph.output.append(helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, None))  # onnx: needs a shape
    onnx.save(model, tmp_path / "m.onnx")
    for opset in ([], ["--opset", "18"]):
        result = cli(tmp_path, "optimize", "m.onnx", *opset, *check, "--force")
        assert result.returncode == 2, (opset, result.stderr)
        assert "invalid ONNX model: Field 'shape' of 'type' is required but missing" in result.stderr
    assert not (tmp_path / "m.fused.onnx").exists()
