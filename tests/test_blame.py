"""A deliberately wrong rule among dozens of correct rewrites: fail with blame, or drop it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import helper

import fuser
from fuser.errors import NumericsMismatch
from fuser.rules.conv_bn_fold import conv_bn_fold
from tests.helpers import assert_same_outputs, make_model

GOOD_BLOCKS = 24
BAD_BLOCKS = 3  # BatchNormalization with epsilon 0.5: the wrong rule ignores it

WRONG_RULE = '''
import numpy as np
from fuser import const, op, rule, var


@rule(
    "bn-fold-wrong-epsilon",
    pattern=op.BatchNormalization(
        op.Conv(var("x"), const("w"), name="conv"), const("scale"), const("beta"), const("mean"), const("var"),
        name="bn", epsilon=lambda e: e is not None and e > 0.1,
    ),
)
def bn_fold_wrong_epsilon(m, b):
    """Conv -> BatchNormalization with a large epsilon, folded with the default epsilon (wrong)."""
    s = m.value("scale") / np.sqrt(m.value("var") + 1e-5)
    w = m.value("w") * s.reshape(-1, 1, 1, 1)
    bias = m.value("beta") - m.value("mean") * s
    return b.Conv(m["x"], w.astype(np.float32), bias.astype(np.float32), **m.attrs("conv"))
'''


UNLOADABLE_RULE = '''
import numpy as np
from fuser import op, rule, var


@rule(
    "bn-squeeze-wrong",
    pattern=op.BatchNormalization(var("x"), var("scale"), var("beta"), var("mean"), var("var"),
                                  name="bn", epsilon=lambda e: e is not None and e > 0.1),
)
def bn_squeeze_wrong(m, b):
    """BatchNormalization => a Squeeze of its 4 channels (onnxruntime refuses to load it)."""
    return b.Squeeze(m["x"], np.array([1], np.int64))
'''


def chain_model(seed: int = 0) -> onnx.ModelProto:
    """Conv-BN-Relu blocks; every ninth block's BN has epsilon 0.5."""
    rng = np.random.default_rng(seed)
    channels = 4
    nodes, inits = [], {}
    current = "x"
    bad = 0
    for i in range(GOOD_BLOCKS + BAD_BLOCKS):
        is_bad = i % 9 == 4 and bad < BAD_BLOCKS
        bad += is_bad
        inits[f"w{i}"] = (rng.standard_normal((channels, channels, 3, 3)) * 0.25).astype(np.float32)
        inits[f"scale{i}"] = rng.uniform(0.5, 1.5, channels).astype(np.float32)
        # A positive shift keeps every layer alive after Relu, so no block's error is masked.
        inits[f"beta{i}"] = rng.uniform(0.3, 0.6, channels).astype(np.float32)
        inits[f"mean{i}"] = rng.normal(0, 0.1, channels).astype(np.float32)
        inits[f"var{i}"] = rng.uniform(0.5, 1.5, channels).astype(np.float32)
        nodes.append(helper.make_node("Conv", [current, f"w{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]))
        nodes.append(
            helper.make_node(
                "BatchNormalization",
                [f"c{i}", f"scale{i}", f"beta{i}", f"mean{i}", f"var{i}"],
                [f"n{i}"],
                name=f"bn{i}",
                epsilon=0.5 if is_bad else 1e-5,
            )
        )
        nodes.append(helper.make_node("Relu", [f"n{i}"], [f"r{i}"], name=f"relu{i}"))
        current = f"r{i}"
    nodes.append(helper.make_node("Identity", [current], ["y"], name="out"))
    return make_model(
        nodes, [("x", np.float32, [1, channels, 8, 8])], [("y", np.float32, [1, channels, 8, 8])], inits, opset=17
    )


def _rule_file(tmp_path_factory, name: str, source: str):
    """A rule file written from `source`, and the rule it defines."""
    from fuser.registry import load_rule_file

    path = tmp_path_factory.mktemp("rules") / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    (rule,) = load_rule_file(path)
    return path, rule


@pytest.fixture(scope="module")
def wrong_rule(tmp_path_factory):
    return _rule_file(tmp_path_factory, "wrong_rule", WRONG_RULE)


@pytest.fixture(scope="module")
def unloadable_rule(tmp_path_factory):
    return _rule_file(tmp_path_factory, "unloadable_rule", UNLOADABLE_RULE)


def bad_bn_names(model) -> set[str]:
    return {
        n.name
        for n in model.graph.node
        if n.op_type == "BatchNormalization" and any(a.name == "epsilon" and a.f > 0.1 for a in n.attribute)
    }


def test_blame_names_exactly_the_wrong_rewrites(wrong_rule):
    _, rule = wrong_rule
    model = chain_model()
    with pytest.raises(NumericsMismatch) as raised:
        fuser.optimize(model, rules=[rule, conv_bn_fold])
    report = raised.value.evidence["report"]
    assert raised.value.exit_code == 3
    assert {r.rule for r in report.blamed} == {"bn-fold-wrong-epsilon"}
    blamed_bns = {name for r in report.blamed for name in r.matched if name.startswith("bn")}
    assert blamed_bns == bad_bn_names(model)
    assert len(report.blamed) == BAD_BLOCKS
    assert "bn-fold-wrong-epsilon" in str(raised.value)
    # Bisection: about log2(n) checks per guilty rewrite, far fewer than one per rewrite.
    assert report.blame_checks <= BAD_BLOCKS * (int(np.ceil(np.log2(GOOD_BLOCKS + BAD_BLOCKS))) + 2)


def test_drop_keeps_every_correct_rewrite_and_passes(wrong_rule):
    _, rule = wrong_rule
    model = chain_model()
    optimized, report = fuser.optimize(model, rules=[rule, conv_bn_fold], on_mismatch="drop")
    assert report.verdict.passed
    assert len(report.dropped) == BAD_BLOCKS
    assert {r.rule for r in report.dropped} == {"bn-fold-wrong-epsilon"}
    # The vetoed matches fall to the correct rule, so every BatchNormalization is still folded.
    assert report.counts == {"conv-bn-fold": GOOD_BLOCKS + BAD_BLOCKS}
    assert "BatchNormalization" not in {n.op_type for n in optimized.graph.node}
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 4, 8, 8)).astype(np.float32)}
    assert_same_outputs(model, optimized, feeds, rtol=1e-4, atol=1e-5)


def test_each_dropped_rewrite_says_why(wrong_rule, unloadable_rule):
    model = chain_model()
    _, report = fuser.optimize(model, rules=[wrong_rule[1]], on_mismatch="drop", trace=True)
    assert {r.failure for r in report.dropped} == {"it failed the numerics check"}
    _, report = fuser.optimize(model, rules=[unloadable_rule[1]], on_mismatch="drop", trace=True)
    assert len(report.dropped) == BAD_BLOCKS
    assert {r.failure for r in report.dropped} == {"onnxruntime could not load or run the model with it"}
    assert report.to_dict()["dropped"][0]["failure"] == "onnxruntime could not load or run the model with it"
    reasons = {d.reason for d in report.engine.declined if d.rule == "bn-squeeze-wrong"}
    assert reasons == {"dropped: onnxruntime could not load or run the model with it"}


def test_drop_without_a_correct_alternative_leaves_the_nodes(wrong_rule):
    _, rule = wrong_rule
    model = chain_model()
    optimized, report = fuser.optimize(model, rules=[rule], on_mismatch="drop")
    assert report.verdict.passed and len(report.dropped) == BAD_BLOCKS
    assert report.counts == {}
    assert {n.name for n in optimized.graph.node if n.op_type == "BatchNormalization"} == {
        f"bn{i}" for i in range(GOOD_BLOCKS + BAD_BLOCKS)
    }


def _run(*args):
    return subprocess.run([sys.executable, "-m", "fuser.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_fails_with_exit_3_writes_nothing_and_keeps_evidence(wrong_rule, tmp_path):
    path, _ = wrong_rule
    model_path = tmp_path / "chain.onnx"
    onnx.save(chain_model(), model_path)
    report_path = tmp_path / "report.json"
    result = _run("optimize", str(model_path), "--rules", str(path), "--report", str(report_path))
    assert result.returncode == 3, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "bn-fold-wrong-epsilon" in result.stderr
    assert not (tmp_path / "chain.fused.onnx").exists()
    folder = re.search(r"evidence kept in (\S+)", result.stderr).group(1)
    for name in ("original.onnx", "optimized.onnx", "report.json"):
        assert (tmp_path.parent / folder).exists() or __import__("os").path.exists(f"{folder}/{name}")
    evidence = json.loads(open(f"{folder}/report.json").read())
    assert evidence["verdict"] == "mismatch" and evidence["exit_code"] == 3
    assert len(evidence["blamed"]) == BAD_BLOCKS
    assert json.loads(report_path.read_text()) == evidence
    onnx.checker.check_model(onnx.load(f"{folder}/optimized.onnx"))


def test_cli_drop_writes_a_passing_model(wrong_rule, tmp_path):
    path, _ = wrong_rule
    model_path = tmp_path / "chain.onnx"
    onnx.save(chain_model(), model_path)
    result = _run("optimize", str(model_path), "--rules", str(path), "--on-mismatch", "drop", "--format", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["numerics"]["passed"] is True
    assert len(report["dropped"]) == BAD_BLOCKS
    assert "dropped bn-fold-wrong-epsilon" not in result.stdout
    assert (tmp_path / "chain.fused.onnx").exists()
