"""Mistakes in a rule are reported early, at the rule's own file:line, and as the rule's fault."""

from __future__ import annotations

import textwrap

import onnx
import pytest

import fuser
from fuser import Builder, Match, op, rule, var
from fuser.errors import RuleError
from fuser.pattern import PatternError
from fuser.registry import builtin_rules
from fuser.testing import model_from_text
from tests.helpers import fuser_cli

SIGMOID_MODEL = "g (float[2, 3] x) => (float[2, 3] y) { y = Sigmoid (x) }"


def test_a_misspelled_pattern_op_fails_when_the_rule_is_defined():
    with pytest.raises(PatternError) as caught:

        @rule("typo", pattern=op.Sigmod(var("x")))
        def typo(m: Match, b: Builder):
            """Sigmod => nothing."""
            return b.Identity(m["x"])

    message = str(caught.value)
    assert "no operator 'Sigmod' in the default ONNX domain (did you mean 'Sigmoid'?)" in message
    assert f"{__file__}:" in message


def test_pattern_ops_are_checked_per_domain_and_opset():
    with pytest.raises(PatternError, match="added in opset 14"):
        rule("old-opsets", description="test", pattern=op.HardSwish(var("x")), opsets=(7, 13))(lambda m, b: m["x"])
    with pytest.raises(PatternError, match="domain 'com.microsoft'"):
        rule("bad-contrib", description="test", pattern=op.domain("com.microsoft").FusedKonv(var("x")))(
            lambda m, b: m["x"]
        )
    # onnxruntime's own operators, and domains fuser does not know, are accepted.
    rule("contrib", description="test", pattern=op.domain("com.microsoft").FusedConv(var("x"), var("w")))(
        lambda m, b: m["x"]
    )
    rule("custom", description="test", pattern=op.domain("my.company").Anything(var("x")))(lambda m, b: m["x"])
    rule("new-enough", description="test", pattern=op.HardSwish(var("x")), opsets=(14, None))(lambda m, b: m["x"])


def test_every_builtin_rule_passes_the_checks():
    assert {r.name for r in builtin_rules()} >= {"conv-bn-fold", "fused-conv", "nchwc-conv"}
    assert all(r.builtin for r in builtin_rules())


def _build_error(build, **rule_options) -> RuleError:
    the_rule = rule("builds", pattern=op.Sigmoid(var("x")), description="a test rule", **rule_options)(build)
    with pytest.raises(RuleError) as caught:
        fuser.optimize(model_from_text(SIGMOID_MODEL), rules=[the_rule], check=False)
    return caught.value


def test_a_misspelled_builder_op_is_the_rules_error_at_its_line():
    def build(m: Match, b: Builder):
        """Sigmoid => Sigmod."""
        return b.Sigmod(m["x"])  # the line the error must name

    error = _build_error(build)
    line = build.__code__.co_firstlineno + 2
    assert f"{__file__}:{line}" in str(error)
    assert "no operator 'Sigmod'" in str(error) and "did you mean 'Sigmoid'" in str(error)
    assert "please report" not in str(error) and "fix it there" in str(error)
    assert error.exit_code == 4


def test_builder_ops_are_checked_at_the_models_opset():
    error = _build_error(lambda m, b: b.Gelu(m["x"]))
    assert "'Gelu' does not exist in the default ONNX domain at opset 17 (it was added in opset 20)" in str(error)


def test_custom_builder_domains_must_be_declared():
    error = _build_error(lambda m, b: b.op("Fast", m["x"], domain="my.company"))
    assert "domain 'my.company', which the rule does not declare in emits=" in str(error)
    declared = rule("declared", pattern=op.Sigmoid(var("x")), emits={"my.company": 1}, description="test")(
        lambda m, b: b.op("Fast", m["x"], domain="my.company")
    )
    after, report = fuser.optimize(model_from_text(SIGMOID_MODEL), rules=[declared], check=False)
    assert report.counts == {"declared": 1} and after.graph.node[0].domain == "my.company"


def test_a_crash_in_a_users_rule_names_its_line_and_asks_no_bug_report():
    def build(m: Match, b: Builder):
        """Sigmoid => a crash."""
        return {}["missing"]

    error = _build_error(build)
    assert "rule 'builds' failed: KeyError" in str(error)
    assert f"{__file__}:{build.__code__.co_firstlineno + 2}" in str(error)
    assert "please report" not in str(error)


def test_a_builtin_rules_error_still_asks_for_a_bug_report():
    error = RuleError(builtin_rules()[0], "something broke")
    assert "please report it" in str(error)


def test_the_cli_names_the_rule_file_and_line(tmp_path):
    model = model_from_text(SIGMOID_MODEL)
    onnx.save(model, tmp_path / "m.onnx")
    typo = tmp_path / "typo_rules.py"
    typo.write_text(
        textwrap.dedent(
            """
            from fuser import op, rule, var

            @rule("typo", pattern=op.Sigmod(var("x")))
            def typo(m, b):
                '''Sigmod => x.'''
                return b.Identity(m["x"])
            """
        )
    )
    loaded = fuser_cli("check", tmp_path / "m.onnx", "--rules", typo)
    assert loaded.returncode == 2, loaded.stderr
    assert f"{typo}:4" in loaded.stderr and "did you mean 'Sigmoid'" in loaded.stderr
    crash = tmp_path / "crash_rules.py"
    crash.write_text(
        textwrap.dedent(
            """
            from fuser import op, rule, var

            @rule("crash", pattern=op.Sigmoid(var("x")))
            def crash(m, b):
                '''Sigmoid => a crash.'''
                return 1 / 0
            """
        )
    )
    crashed = fuser_cli("optimize", tmp_path / "m.onnx", "--rules", crash)
    assert crashed.returncode == 4
    lines = crashed.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{crash}:7" in lines[0] and "ZeroDivisionError" in lines[0]
    assert "please report" not in lines[0]
