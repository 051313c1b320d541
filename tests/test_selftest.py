"""The rule self-test: every built-in rule passes it, and it catches a wrong rule."""

from __future__ import annotations

import textwrap

import onnx
import pytest

import fuser
from fuser import Builder, Match, const, op, rule, var
from fuser.errors import NumericsMismatch
from fuser.registry import builtin_rules
from fuser.selftest import selftest, selftest_rule
from tests.helpers import fuser_cli


@rule("forgets-the-scale", pattern=op.Mul(op.Conv(var("x"), const("w"), name="conv"), const("s")))
def forgets_the_scale(m: Match, b: Builder):
    """Conv * s => Conv (wrong: the scale is dropped)."""
    return b.Conv(m["x"], m["w"], **m.attrs("conv"))


@rule("crashes", pattern=op.Relu(var("x")))
def crashes(m: Match, b: Builder):
    """Relu => a crash."""
    return b.Relu(m["x"], alpha=[][0])  # noqa: PLE0643 - the crash under test


def test_every_builtin_rule_passes(tmp_path):
    results = selftest(builtin_rules(), seed=0, instances=3, save_dir=tmp_path)
    problems = [(r.rule, r.failures + r.errors) for r in results if not r.passed]
    assert problems == []
    # A rule never tried says why: its instances could not be built, or did not run.
    assert [r.rule for r in results if r.tried == 0 and not (r.unsynthesizable or r.not_runnable)] == []
    # Random constants rarely hit the exact values some rules need (GELU's 0.5, an exponent
    # of 2); the rules whose conditions random instances do meet must rewrite them.
    rewritten = {r.rule for r in results if r.rewritten}
    assert {"conv-bn-fold", "conv-add-bias", "softmax-decomposed", "log-sum-exp", "matmul-add-gemm",
            "norm-scale-fold", "fused-conv"} <= rewritten
    assert list(tmp_path.iterdir()) == []


def test_it_is_deterministic_under_a_seed(tmp_path):
    rules = [r for r in builtin_rules() if r.name in ("conv-add-bias", "softmax-decomposed")]
    first = [r.to_dict() for r in selftest(rules, seed=5, instances=3, save_dir=tmp_path)]
    again = [r.to_dict() for r in selftest(rules, seed=5, instances=3, save_dir=tmp_path)]
    alone = selftest_rule(rules[1], seed=5, instances=3, save_dir=tmp_path).to_dict()
    assert first == again and first[1] == alone


def test_a_wrong_rule_fails_with_a_saved_model(tmp_path):
    result = selftest_rule(forgets_the_scale, seed=0, instances=3, save_dir=tmp_path)
    assert not result.passed and result.failures and result.rewritten == 0
    saved = sorted(tmp_path.iterdir())
    assert len(saved) == len(result.failures)
    model = onnx.load(str(saved[0]))
    assert [n.op_type for n in model.graph.node] == ["Conv", "Mul"]  # the pattern alone
    with pytest.raises(NumericsMismatch):
        fuser.optimize(model, rules=[forgets_the_scale])


def test_a_crashing_rule_is_reported(tmp_path):
    result = selftest_rule(crashes, seed=0, instances=2, save_dir=tmp_path)
    assert len(result.errors) == 2 and "IndexError" in result.errors[0]


def test_the_command(tmp_path):
    rules_file = tmp_path / "my_rules.py"
    rules_file.write_text(
        textwrap.dedent(
            """
            from fuser import const, op, rule, var

            @rule("forgets-the-scale", pattern=op.Mul(op.Conv(var("x"), const("w"), name="conv"), const("s")))
            def forgets_the_scale(m, b):
                '''Conv * s => Conv (wrong).'''
                return b.Conv(m["x"], m["w"], **m.attrs("conv"))
            """
        )
    )
    failed = fuser_cli(
        "rules", "--selftest", "--rules", rules_file, "--rule", "forgets-the-scale", "--seed", "1", cwd=tmp_path
    )
    assert failed.returncode == 3, failed.stderr
    assert failed.stdout.startswith("forgets-the-scale  tried 4, rewritten 0") and "FAILED" in failed.stdout
    assert list((tmp_path / "fuser-selftest").iterdir())
    passed = fuser_cli("rules", "--selftest", "--rule", "log-*", "--instances", "2", cwd=tmp_path)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert [line.split()[0] for line in passed.stdout.splitlines() if not line.startswith(" ")] == [
        "log-softmax",
        "log-sum-exp",
    ]
    unknown = fuser_cli("rules", "--selftest", "--rule", "no-such-rule", cwd=tmp_path)
    assert unknown.returncode == 2 and "no-such-rule" in unknown.stderr
