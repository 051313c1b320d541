"""Tests for --measure (fuser/measure.py): timing in onnxruntime, and phases that slow a model
down left out. The slow phase here is made slow on purpose (one Relu reads sixty Max nodes), so its
verdict does not depend on the machine's noise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper

import fuser
from fuser import Builder, Match, op, rule, var
from fuser.measure import compare, paying_rules
from tests.helpers import fuser_cli, make_model

X = {"x": np.random.default_rng(0).standard_normal((1, 64, 64, 64)).astype(np.float32)}


@rule("relu-sixty-times", pattern=op.Relu(var("x")), exact=True)
def relu_sixty_times(m: Match, b: Builder):
    """Relu(graph input)  =>  Relu(Max(x, x) sixty times): same values, sixty passes over memory."""
    m.require(m.graph.is_graph_input(m["x"]), "applied once, to the graph input")
    value = m["x"]
    for _ in range(60):
        value = b.Max(value, m["x"])
    return b.Relu(value)


@rule("neg-neg", pattern=op.Neg(op.Neg(var("x"), name="inner")), exact=True, phase=1)
def neg_neg(m: Match, b: Builder):
    """Neg(Neg(x))  =>  Identity(x)."""
    return b.Identity(m["x"])


def model():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Neg", ["r"], ["n1"]),
        helper.make_node("Neg", ["n1"], ["y"]),
    ]
    return make_model(nodes, [("x", np.float32, [1, 64, 64, 64])], [("y", np.float32, [1, 64, 64, 64])])


def test_compare_reports_a_ratio_and_noise():
    timing = compare(model(), model(), X, level="off", seconds=0.3)
    assert timing.rounds >= 5 and timing.original_ms > 0 and timing.optimized_ms > 0
    assert timing.noise >= 0.02 and 0.5 < timing.ratio < 2.0
    assert not timing.slower or timing.ratio > 1 + timing.noise
    assert set(timing.to_dict()) >= {"ratio", "noise", "slower", "level", "threads"}


def test_a_slower_phase_is_left_out_and_a_harmless_one_kept():
    kept, notes = paying_rules(model(), [relu_sixty_times, neg_neg], X, level="off", seconds=0.5)
    assert kept == [neg_neg]
    assert len(notes) == 1 and "phase-0" in notes[0] and "relu-sixty-times" in notes[0] and "slower" in notes[0]


def test_optimize_with_measure_reports_latency():
    after, report = fuser.optimize(model(), rules=[relu_sixty_times, neg_neg], measure="off")
    assert report.counts == {"neg-neg": 1}
    assert report.latency is not None and report.latency.level == "off"
    assert report.to_dict()["latency"]["ratio"] == report.latency.ratio
    assert any(n.startswith("--measure: left out the phase-0 rules") for n in report.notes)
    assert report.verdict.passed


@rule("chain-to-neg", pattern=op.Relu(var("v")), exact=True)
def chain_to_neg(m: Match, b: Builder):
    """Relu(sixty Max nodes over x)  =>  Neg(x): much faster, and wrong."""
    m.require(not m.graph.is_graph_input(m["v"]), "only after the Max chain")
    return b.Neg("x")


def test_measure_times_the_model_written_after_a_drop():
    value = "x"
    nodes = []
    for index in range(60):
        nodes.append(helper.make_node("Max", [value, "x"], [f"m{index}"]))
        value = f"m{index}"
    nodes += [
        helper.make_node("Relu", [value], ["y"]),
        helper.make_node("Neg", ["x"], ["n1"]),
        helper.make_node("Neg", ["n1"], ["z"]),
    ]
    slow = make_model(
        nodes, [("x", np.float32, [1, 64, 64, 64])], [(o, np.float32, [1, 64, 64, 64]) for o in ("y", "z")]
    )
    _, report = fuser.optimize(slow, rules=[chain_to_neg, neg_neg], measure="off", on_mismatch="drop")
    assert [r.rule for r in report.dropped] == ["chain-to-neg"] and report.counts == {"neg-neg": 1}
    # The model before the drop skipped the sixty Max nodes and ran in a fraction of the time;
    # the model written keeps them, like the original.
    assert report.latency.ratio > 0.5


def test_measure_reads_external_data_from_the_models_folder_not_the_working_directory(tmp_path):
    # onnxruntime resolves the external data of a model given as bytes against the working
    # directory; --measure runs from anywhere, like the check.
    folder = tmp_path / "models"
    folder.mkdir()
    weight = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    weights = {"w": weight, "b": np.ones(64, np.float32)}
    original = make_model(nodes, [("x", np.float32, [8, 64])], [("y", np.float32, [8, 64])], weights)
    onnx.save(original, folder / "m.onnx", save_as_external_data=True, size_threshold=0, location="m.onnx.data")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = fuser_cli("optimize", folder / "m.onnx", "-o", elsewhere / "out.onnx", "--measure", "off", cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    assert "matmul-add-gemm" in result.stderr and "--measure: latency" in result.stderr


def test_timed_sessions_do_not_spin():
    """Interleaved sessions whose idle threads spin take each other's cores."""
    from fuser.measure import session

    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", np.float32, [2])], [("y", np.float32, [2])])
    options = session(model, threads=2).get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert options.intra_op_num_threads == 2


def test_measure_times_an_export_on_inputs_its_embeddings_take(tmp_path):
    # BERT's token types index a table of two rows: timed on the integers [0, 10) the check would
    # never feed it, its Gather failed (an onnxruntime error line, then exit 4).
    bert = Path(__file__).parent / "data" / "transformers" / "bert_legacy.onnx"
    out = tmp_path / "out.onnx"
    result = fuser_cli("optimize", bert, "-o", out, "--measure", "basic", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--measure: latency" in result.stderr and "[E:onnxruntime" not in result.stderr
