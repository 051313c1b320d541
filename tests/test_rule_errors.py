"""Mistakes in a rule are reported early, at the rule's own file:line, and as the rule's fault."""

from __future__ import annotations

import json
import textwrap

import numpy as np
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


def test_an_onnxruntime_domain_must_be_declared_too():
    """com.microsoft is known to fuser, but a rule that builds in it without emits= would only
    work on models that already import the domain."""

    def build(m: Match, b: Builder):
        """Sigmoid => QuickGelu."""
        return b.op("QuickGelu", m["x"], domain="com.microsoft", alpha=1.0)  # the line the error names

    error = _build_error(build)
    assert "builds 'QuickGelu' in domain 'com.microsoft', which the rule does not declare in emits=" in str(error)
    assert f"{__file__}:{build.__code__.co_firstlineno + 2}" in str(error)
    assert "please report" not in str(error) and error.exit_code == 4
    after, report = fuser.optimize(
        model_from_text(SIGMOID_MODEL), rules=[_named_rule("declared", build, emits={"com.microsoft": 1})], check=False
    )
    assert report.counts == {"declared": 1}
    assert {o.domain: o.version for o in after.opset_import}["com.microsoft"] == 1


def _named_rule(name, build, pattern=None, **options):
    return rule(name, pattern=pattern or op.Sigmoid(var("x")), description="test", **options)(build)


MICROSOFT_GELU_MODEL = """
<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
g (float[2, 3] x) => (float[2, 3] y) { y = com.microsoft.Gelu (x) }
"""


def test_a_rule_may_rebuild_operators_of_the_domain_its_pattern_matches():
    def build(m: Match, b: Builder):
        """Gelu(x) => BiasGelu(x, 0)."""
        return b.op("BiasGelu", m["x"], np.zeros(3, np.float32), domain="com.microsoft")

    rebuild = _named_rule("rebuild", build, pattern=op.domain("com.microsoft").Gelu(var("x")))
    after, report = fuser.optimize(onnx.parser.parse_model(MICROSOFT_GELU_MODEL), rules=[rebuild])
    assert report.counts == {"rebuild": 1} and [n.op_type for n in after.graph.node] == ["BiasGelu"]


def test_a_pattern_domain_the_model_does_not_import_needs_emits():
    """A pattern with several spellings may match in the default domain and still build in
    the other spelling's domain, which the model then lacks."""
    pattern = (op.Sigmoid(var("x")), op.domain("com.microsoft").QuickGelu(var("x")))
    build = _named_rule("mixed", lambda m, b: b.op("QuickGelu", m["x"], domain="com.microsoft"), pattern=pattern)
    with pytest.raises(RuleError, match="domain 'com.microsoft', which this model does not import; declare"):
        fuser.optimize(model_from_text(SIGMOID_MODEL), rules=[build], check=False)


def test_emits_is_checked_when_the_rule_is_defined():
    with pytest.raises(PatternError, match="emits= names the default domain") as caught:
        _named_rule("default", lambda m, b: m["x"], emits={"": 20})
    assert f"{__file__}:" in str(caught.value)
    with pytest.raises(PatternError, match="needs an opset version >= 1"):
        _named_rule("versionless", lambda m, b: m["x"], emits={"com.microsoft": "1"})


def test_a_declared_domain_is_imported_only_when_a_replacement_uses_it():
    """emits= allows a domain; a rewrite that builds only standard operators adds no import."""

    def build(m: Match, b: Builder):
        """Sigmoid(x) => 1 / (1 + exp(-x))."""
        return b.Reciprocal(b.Add(b.Exp(b.Neg(m["x"])), np.ones(1, np.float32)))

    plain = _named_rule("plain", build, emits={"com.microsoft": 1})
    after, report = fuser.optimize(model_from_text(SIGMOID_MODEL), rules=[plain])
    assert report.counts == {"plain": 1}
    assert [o.domain for o in after.opset_import] == [""]


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


@pytest.mark.parametrize(
    ("text", "line", "said"),
    [
        ("from fuser import op, rule, var\nx = 1\ny = undefined_name\n", 3, "NameError: name 'undefined_name'"),
        ("from fuser import op, rule, var\ndef f(:\n", 2, "SyntaxError"),
        (
            (
                'from fuser import op, rule, var\n\n\n@rule("nn", pattern=op.Neg(op.Neg(var("x"))))\n'
                'def nn(m, b):\n    """Neg(Neg(x)) => x."""\n    return b.Identity(m["x"])\n'
            ),
            4,
            "two different nodes are named 'Neg'",
        ),
    ],
)
def test_a_rule_file_that_fails_to_load_is_named_with_its_line(tmp_path, text, line, said):
    path = tmp_path / "broken_rules.py"
    path.write_text(text)
    result = fuser_cli("rules", "--rules", path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"fuser: error: rule file {path}:{line}: ") and said in result.stderr


def test_rule_files_in_two_folders_each_import_their_own_neighbour(tmp_path):
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        (tmp_path / side / "shared.py").write_text(f"DESCRIPTION = 'Neg(Neg(x)) => x, from {side}.'\n")
        (tmp_path / side / f"rules_{side}.py").write_text(
            "from shared import DESCRIPTION\nfrom fuser import op, rule, var\n\n\n"
            f'@rule("neg-neg-{side}", pattern=op.Neg(op.Neg(var("x"), name="inner")), description=DESCRIPTION)\n'
            'def neg_neg(m, b):\n    return b.Identity(m["x"])\n'
        )
    result = fuser_cli(
        "rules", "--rules", tmp_path / "a" / "rules_a.py", "--rules", tmp_path / "b" / "rules_b.py", "--format", "json"
    )
    assert result.returncode == 0, result.stderr
    described = {r["name"]: r["description"] for r in json.loads(result.stdout)}
    assert described["neg-neg-a"].endswith("from a.") and described["neg-neg-b"].endswith("from b.")


def test_the_line_is_found_through_a_linked_folder(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "bad_rules.py").write_text("from fuser import op, rule, var\nx = 1\ny = undefined_name\n")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    result = fuser_cli("rules", "--rules", tmp_path / "link" / ".." / "link" / "bad_rules.py")
    assert result.returncode == 2 and "bad_rules.py:3: NameError" in result.stderr, result.stderr


def test_a_rule_file_imports_the_modules_beside_it(tmp_path):
    (tmp_path / "shared_patterns.py").write_text("DESCRIPTION = 'Neg(Neg(x)) => x.'\n")
    (tmp_path / "my_rules.py").write_text(
        "from shared_patterns import DESCRIPTION\nfrom fuser import op, rule, var\n\n\n"
        '@rule("neg-neg-beside", pattern=op.Neg(op.Neg(var("x"), name="inner")), description=DESCRIPTION)\n'
        'def neg_neg(m, b):\n    return b.Identity(m["x"])\n'
    )
    result = fuser_cli("rules", "--rules", tmp_path / "my_rules.py", cwd=tmp_path.parent)
    assert result.returncode == 0, result.stderr
    assert any(line.startswith("neg-neg-beside") for line in result.stdout.splitlines())


@pytest.mark.parametrize("opsets", [(20, 14), (0, 3), ("13", None), (13,)])
def test_an_opset_range_no_opset_is_in_is_refused_where_the_rule_is_written(opsets):
    with pytest.raises(PatternError, match=r"rule 'no-range'.*opsets must be \(low, high\) with 1 <= low <= high"):
        rule("no-range", pattern=op.Neg(var("x")), opsets=opsets, description="Neg.")(lambda m, b: m["x"])


def _edits_the_sigmoid(then: str):
    def build(m: Match, b: Builder):
        """Sigmoid => edited in place."""
        m.node("s").proto.op_type = "Relu"
        if then == "declines":
            m.require(False, "declined after the edit")
        return b.Sigmoid(m["x"])

    return rule("edits", pattern=op.Sigmoid(var("x"), name="s"))(build)


@pytest.mark.parametrize("then", ["declines", "rewrites"])
@pytest.mark.parametrize("check", [True, False])
def test_a_rule_that_edits_a_matched_node_in_place_is_the_rules_error(then, check):
    """Declined after the edit, it changed the output with no rewrite logged, and unchecked."""
    with pytest.raises(RuleError, match="rule 'edits' failed: it changed node 'Sigmoid->y' in place"):
        fuser.optimize(model_from_text(SIGMOID_MODEL), rules=[_edits_the_sigmoid(then)], check=check)


def test_a_rule_that_edits_an_attribute_in_place_from_a_rule_file_exits_4(tmp_path):
    onnx.save(
        model_from_text("g (float[2, 3] x) => (float[2, 3] y) { y = LeakyRelu <alpha = 0.1> (x) }"), tmp_path / "m.onnx"
    )
    (tmp_path / "edits.py").write_text(
        textwrap.dedent(
            '''
            from fuser import op, rule, var


            @rule("alpha-edit", pattern=op.LeakyRelu(var("x"), name="r"))
            def alpha_edit(m, b):
                """LeakyRelu, its alpha edited in place, then declined."""
                m.node("r").proto.attribute[0].f = 0.5
                m.require(False, "never mind")
            '''
        )
    )
    result = fuser_cli("optimize", "m.onnx", "--rules", "edits.py", cwd=tmp_path)
    assert result.returncode == 4, result.stderr
    assert "rule 'alpha-edit' failed: it changed node 'LeakyRelu->y' in place" in result.stderr
    assert f"{tmp_path / 'edits.py'}:" in result.stderr
    assert not (tmp_path / "m.fused.onnx").exists()


def test_an_absorbed_node_edited_in_place_and_an_advisory_rule_s_edit_are_the_rule_s_error():
    model = model_from_text("g (float[2, 3] x) => (float[2, 3] y) { r = Relu (x) y = Neg (r) }")

    @rule("absorbs-and-edits", pattern=op.Neg(var("x"), name="neg"))
    def absorbs_and_edits(m: Match, b: Builder):
        """Neg(Relu(x)): the Relu absorbed, edited, then declined."""
        producer = next(n for n in m.graph.nodes() if n.op_type == "Relu")
        m.absorb([producer.id])
        producer.proto.op_type = "Sigmoid"
        m.require(False, "never mind")

    with pytest.raises(RuleError, match="it changed node 'Relu->r' in place"):
        fuser.optimize(model, rules=[absorbs_and_edits], check=False)

    @rule("advises-and-edits", pattern=op.Neg(var("x"), name="neg"), advisory=True)
    def advises_and_edits(m: Match, b: Builder):
        """Neg: advice, after an edit."""
        m.node("neg").proto.op_type = "Abs"
        return "a note"

    with pytest.raises(RuleError, match="it changed node 'Neg->y' in place"):
        fuser.optimize(model_from_text(SIGMOID_MODEL.replace("Sigmoid", "Neg")), rules=[advises_and_edits], check=False)
