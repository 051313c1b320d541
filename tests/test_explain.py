"""Why a rule did not fire: declines in the report, in `-v`, and in `fuser explain`."""

from __future__ import annotations

import json

import jsonschema
import onnx
import pytest

import fuser
from fuser.explain import explain
from fuser.registry import builtin_rules
from fuser.report import REPORT_SCHEMA
from fuser.testing import model_from_text
from tests.helpers import in_process_cli

# Three hand-written softmaxes; two reduce with keepdims=0, so softmax-decomposed declines them.
MODEL = """
g (float[5, 5] x) => (float[5, 5] a, float[5, 5] b, float[5, 5] c) <int64[1] axis = {0}> {
    ea = Exp (x)
    sa = ReduceSum <keepdims = 0> (ea, axis)
    a = Div (ea, sa)
    eb = Exp (x)
    sb = ReduceSum <keepdims = 0> (eb, axis)
    b = Div (eb, sb)
    ec = Exp (x)
    sc = ReduceSum <keepdims = 1> (ec, axis)
    c = Div (ec, sc)
}
"""
REASON = "ReduceSum drops the reduced axis (keepdims=0)"
KEEP_EXPS = ("--disable", "common-subexpression")


@pytest.fixture
def cli(monkeypatch, capfd):
    return in_process_cli(monkeypatch, capfd)


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(model_from_text(MODEL), path)
    return path


def test_explain_counts_matches_applies_and_declines_by_reason():
    rules = [r for r in builtin_rules() if r.name in ("softmax-decomposed", "log-sum-exp")]
    _, report = fuser.optimize(model_from_text(MODEL), rules=rules, trace=True, check=False)
    by_rule = {e.rule: e for e in explain(report.engine, rules)}
    softmax = by_rule["softmax-decomposed"]
    assert (softmax.matched, softmax.applied, softmax.declined) == (3, 1, 2)
    ((reason, count),) = softmax.reasons.items()
    assert REASON in reason and count == 2
    assert softmax.source.endswith("softmax_decomposed.py:" + softmax.source.rsplit(":", 1)[1])
    assert by_rule["log-sum-exp"].matched == 0


def test_the_report_lists_every_decline_with_the_rules_line(cli, model_path, tmp_path):
    report_path = tmp_path / "report.json"
    # common-subexpression would merge the Exp nodes, and the merged Exp declines for another reason
    result = cli(tmp_path, "optimize", model_path, "--report", report_path, "--no-check", *KEEP_EXPS)
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    assert report["schema_version"] >= 2  # declines are in the report since version 2
    declines = [d for d in report["declines"] if d["rule"] == "softmax-decomposed"]
    assert len(declines) == 2
    assert all(REASON in d["reason"] and d["source"].split(":")[0].endswith("softmax_decomposed.py") for d in declines)
    assert sorted(d["node"] for d in declines) == ["a", "b"] or all(d["nodes"] for d in declines)


def test_verbose_output_shows_declines(cli, model_path, tmp_path):
    result = cli(tmp_path, "optimize", model_path, "-v", "--force")
    assert result.returncode == 0, result.stderr
    assert "declined:" in result.stderr and "match(es)" in result.stderr
    assert sum("softmax-decomposed [main]" in line and REASON in line for line in result.stderr.splitlines()) == 2
    assert (
        "softmax-decomposed [main]" in result.stderr
        and REASON in result.stderr
        and "softmax_decomposed.py:" in result.stderr
    )


def test_explain_command(cli, model_path, tmp_path):
    result = cli(tmp_path, "explain", model_path, "--rule", "softmax-decomposed", *KEEP_EXPS)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("softmax-decomposed") and "matched 3, applied 1, declined 2" in lines[0]
    assert "softmax_decomposed.py:" in lines[0]
    assert lines[1].split()[:2] == ["2", "x"] and REASON in lines[1]
    assert len(lines) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]  # writes nothing
    as_json = cli(tmp_path, "explain", model_path, "--format", "json", *KEEP_EXPS)
    rules = {r["rule"]: r for r in json.loads(as_json.stdout)["rules"]}
    assert rules["softmax-decomposed"]["reasons"][0]["count"] == 2 and rules["conv-bn-fold"]["matched"] == 0
    assert "nchwc-conv" not in rules and "fused-conv" in {
        r["rule"]
        for r in json.loads(cli(tmp_path, "explain", model_path, "--target", "onnxruntime", "--format", "json").stdout)[
            "rules"
        ]
    }


def test_explain_an_unknown_rule_is_bad_usage(cli, model_path, tmp_path):
    result = cli(tmp_path, "explain", model_path, "--rule", "no-such-rule")
    assert result.returncode == 2 and "no-such-rule" in result.stderr


@pytest.mark.parametrize("name", ["fused-conv", "nchwc-*"])
def test_explain_of_a_rule_of_another_target_says_which_target(cli, model_path, tmp_path, name):
    result = cli(tmp_path, "explain", model_path, "--rule", name)
    assert result.returncode == 2, result.stdout
    assert f"--rule {name}: onnxruntime's rules are explained with --target onnxruntime" in result.stderr
    assert cli(tmp_path, "explain", model_path, "--rule", name, "--target", "onnxruntime").returncode == 0


def test_explain_of_a_rule_the_command_line_disables_says_so(cli, model_path, tmp_path):
    result = cli(tmp_path, "explain", model_path, "--rule", "identity-output", "--disable", "identity-output")
    assert result.returncode == 2 and "--rule identity-output: turned off by --disable" in result.stderr


def test_every_declined_place_has_one_reason_its_last():
    """The passes decline a Reshape of BERT's again as its shapes become known, each time with
    other dims in the reason: counted once, under its last reason, the reasons add up to the
    places declined (before: reshape-noop's 18 places had 28 reasons)."""
    from pathlib import Path

    bert = onnx.load(Path(__file__).parent / "data" / "transformers" / "bert_legacy.onnx")
    rules = fuser.api.resolve_rules(None, "onnx")
    _, report = fuser.optimize(bert, rules=rules, trace=True, check=False)
    explained = explain(report.engine, rules)
    assert any(e.declined for e in explained)
    for e in explained:
        assert sum(e.reasons.values()) == e.declined, (e.rule, e.declined, dict(e.reasons))
        assert e.matched == e.applied + e.declined + e.advice


def test_a_place_declined_for_several_reasons_counts_under_its_last():
    from fuser.engine import Declined, EngineResult

    def declined(reason: str, node: str = "r1") -> Declined:
        return Declined("reshape-noop", "main", node, reason, [node])

    result = EngineResult(declined=[declined("shape unknown"), declined("other"), declined("changes the shape")])
    [entry] = explain(result, [])
    assert (entry.declined, dict(entry.reasons)) == (1, {"changes the shape": 1})


OFF_RULE = '''
from fuser import op, rule, var


@rule("exp-off", pattern=op.Exp(var("x"), name="e"), enabled=False)
def exp_off(m, b):
    """Exp(x), declined: a rule off by default."""
    m.require(False, "declined on purpose")
'''


@pytest.mark.parametrize("turned_on", [("--rule", "exp-off"), ("--enable", "exp-off")])
def test_explain_runs_a_rule_off_by_default_that_it_is_asked_about(cli, model_path, tmp_path, turned_on):
    """Asked about, a rule off by default is run; it used not to be, and was said to have no match."""
    (tmp_path / "off.py").write_text(OFF_RULE)
    result = cli(tmp_path, "explain", model_path, "--rules", "off.py", *turned_on, *KEEP_EXPS, "--format", "json")
    assert result.returncode == 0, result.stderr
    rules = {r["rule"]: r for r in json.loads(result.stdout)["rules"]}
    assert rules["exp-off"]["matched"] == 3 and rules["exp-off"]["declined"] == 3
    assert rules["exp-off"]["reasons"] == [
        {"reason": "declined on purpose", "count": 3, "example": rules["exp-off"]["reasons"][0]["example"]}
    ]
    without = cli(tmp_path, "explain", model_path, "--rules", "off.py", "--format", "json")
    assert "exp-off" not in {r["rule"] for r in json.loads(without.stdout)["rules"]}


def test_dims_shape_inference_made_up_read_as_question_marks():
    from fuser.explain import readable

    assert readable("shapes ['unk__17', 'unk__18', 32] and ['run2.unk__2', 'batch', 32]") == (
        "shapes [?, ?, 32] and [?, 'batch', 32]"
    )
    assert readable("(a, unk__3) and 'my.unk__1', 'funk__2'") == "(a, ?) and 'my.unk__1', 'funk__2'"


def test_places_declined_for_one_reason_but_other_made_up_dims_count_together(tmp_path, monkeypatch, capfd):
    """BERT's skip-layer-norm declines: each place's made-up dims are numbered apart, so every place
    was a reason of its own (six lines of '1 x')."""
    from pathlib import Path

    bert = Path(__file__).parent / "data" / "transformers" / "bert_legacy.onnx"
    cli = in_process_cli(monkeypatch, capfd)
    result = cli(tmp_path, "explain", bert, "--rule", "skip-layer-norm", "--target", "onnxruntime", "--format", "json")
    assert result.returncode == 0, result.stderr
    (entry,) = json.loads(result.stdout)["rules"]
    assert entry["declined"] == sum(r["count"] for r in entry["reasons"]) >= 6
    assert not [r for r in entry["reasons"] if "unk__" in r["reason"]]
    assert max(r["count"] for r in entry["reasons"]) >= 6


def late_softmax_rule(name: str, body: str) -> str:
    """A rule file: a rule of phase 1 matching the keepdims softmax softmax-decomposed (phase 0)
    rewrites first, whose function is `body`."""
    return f"""
from fuser import op, rule, var


@rule(
    "{name}",
    pattern=op.Div(
        op.Exp(var("x"), name="exp"),
        op.ReduceSum(op.Exp(var("x"), name="exp"), var("axes"), keepdims=1),
    ),
    phase=1,
    opsets=(13, None),
)
def late(m, b):
    '''Matches the softmax an earlier phase rewrites.'''
    {body}
"""


LATE_RULE = late_softmax_rule("late-softmax", 'return b.Softmax(m["x"], axis=0)')
DECLINING_RULE = late_softmax_rule("late-decliner", 'm.require(False, "never applies")')


def test_a_rule_whose_pattern_an_earlier_rule_took_says_which(cli, model_path, tmp_path):
    """late-softmax would rewrite the input's one keepdims softmax, but softmax-decomposed runs
    in an earlier phase and rewrites it: explain says so instead of a bare "no match"."""
    (tmp_path / "late.py").write_text(LATE_RULE)
    args = ("explain", model_path, "--rules", "late.py", "--rule", "late-softmax", *KEEP_EXPS)
    result = cli(tmp_path, *args)
    assert result.returncode == 0, result.stderr
    assert "no match (it would have rewritten 1 place(s) of the input, which softmax-decomposed (1) rewrote first)" in (
        result.stdout
    )
    as_json = json.loads(cli(tmp_path, *args, "--format", "json").stdout)
    (late,) = as_json["rules"]
    assert late["matched"] == 0 and late["taken_by"] == {"softmax-decomposed": 1}
    untouched = cli(
        tmp_path, "explain", model_path, "--rules", "late.py", "--disable", "softmax-decomposed", *KEEP_EXPS
    )
    assert "late-softmax" in untouched.stdout and "matched 1, applied 1, declined 0" in untouched.stdout


def test_a_rule_that_would_decline_where_another_rewrote_is_not_said_to_be_taken(cli, model_path, tmp_path):
    """Its pattern is at the softmax softmax-decomposed rewrote, but it would not have rewritten it."""
    (tmp_path / "decliner.py").write_text(DECLINING_RULE)
    args = ("explain", model_path, "--rules", "decliner.py", "--rule", "late-decliner", *KEEP_EXPS)
    result = cli(tmp_path, *args)
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert line.split()[:3] == ["late-decliner", "no", "match"] and " first" not in line, line
    alone = cli(tmp_path, *args, "--disable", "softmax-decomposed")
    assert "matched 1, applied 0, declined 1" in alone.stdout  # the pattern is there


def test_a_rule_with_no_match_and_no_pattern_in_the_input_says_no_match_alone(cli, model_path, tmp_path):
    result = cli(tmp_path, "explain", model_path, "--rule", "conv-bn-fold")
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert line.split()[:3] == ["conv-bn-fold", "no", "match"] and "rewritten first" not in line
