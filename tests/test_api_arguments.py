"""fuser.optimize's arguments from Python: what cannot work is a UsageError saying which argument
and why, raised before the work (not a numpy or onnxruntime error from deep inside the check, and
not only when some rule happened to rewrite something)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import fuser
from fuser.errors import InputError, UsageError
from fuser.registry import builtin_rules
from tests.helpers import make_model, run


def neg_model() -> onnx.ModelProto:
    """Nothing any built-in rule rewrites: an argument must be refused all the same."""
    return make_model([helper.make_node("Neg", ["x"], ["y"])], [("x", np.float32, [2, 4])], [("y", np.float32, [2, 4])])


def matmul_add() -> onnx.ModelProto:
    weights = {"w": np.eye(4, dtype=np.float32), "b": np.ones(4, np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    return make_model(nodes, [("x", np.float32, [2, 4])], [("y", np.float32, [2, 4])], weights)


def rule_named(name: str):
    return next(r for r in builtin_rules() if r.name == name)


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"runs": 0}, "runs must be a whole number, 1 or more, not 0"),
        ({"runs": 2.5}, "runs must be a whole number"),
        ({"seed": -1}, "seed must be a whole number, 0 or more, not -1"),
        ({"rtol": "1e-3"}, "rtol must be a finite number"),
        ({"atol": float("nan")}, "atol must be a finite number"),
        ({"dims": {"batch": -1}}, "dims['batch'] must be a size, 0 or more"),
        ({"shapes": {"x": (2, -1)}}, "shapes['x'] must be a tuple of sizes"),
        ({"ranges": {"x": (5, 1)}}, "ranges['x'] must have low < high, not (5, 1)"),
        ({"measure": "fast"}, "measure must be one of off, basic, extended, all"),
        ({"measure_threads": 0}, "measure_threads must be a whole number, 1 or more"),
    ],
)
@pytest.mark.parametrize("model", [neg_model, matmul_add])
def test_unusable_settings_are_refused_whatever_the_rules_do(model, settings, said):
    with pytest.raises(UsageError, match=said.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        fuser.optimize(model(), **settings)


def test_check_options_refuse_what_the_check_cannot_use():
    with pytest.raises(UsageError, match="CheckOptions: runs must be"):
        fuser.CheckOptions(runs=0)
    with pytest.raises(UsageError, match="CheckOptions: seed must be"):
        fuser.CheckOptions(seed=1).replace(seed=-3)
    assert fuser.CheckOptions(seed=np.int64(2), rtol=0, atol=np.float32(1e-4)).seed == 2


def test_a_rule_list_is_chosen_from_as_the_registered_rules_are():
    gemm = rule_named("matmul-add-gemm")
    _, report = fuser.optimize(matmul_add(), rules=[gemm], check=False)
    assert report.counts == {"matmul-add-gemm": 1}
    _, alone = fuser.optimize(matmul_add(), rules=gemm, check=False)  # one rule, not in a list
    assert alone.counts == {"matmul-add-gemm": 1}
    ort_only = next(r for r in builtin_rules() if r.target == "onnxruntime")
    _, report = fuser.optimize(matmul_add(), rules=[ort_only, gemm], check=False)
    assert report.rules == [gemm.name]  # onnxruntime's rules run for that target only, and the report says so
    assert (
        f"rule '{ort_only.name}' given in rules= did not run: onnxruntime's rule (target='onnxruntime')" in report.notes
    )
    _, report = fuser.optimize(matmul_add(), rules=[ort_only, gemm], target="onnxruntime", check=False)
    assert report.rules == [ort_only.name, gemm.name]
    assert not [n for n in report.notes if "did not run" in n]


def test_a_rule_given_but_off_by_default_is_said_not_to_run_unless_disabled():
    gemm = rule_named("matmul-add-gemm")
    off = next(r for r in builtin_rules() if not r.enabled_by_default and r.target == "onnx")
    _, report = fuser.optimize(matmul_add(), rules=[off, gemm], check=False)
    assert report.rules == [gemm.name]
    assert f"rule '{off.name}' given in rules= did not run: off by default (enable= names it)" in report.notes
    _, report = fuser.optimize(matmul_add(), rules=[off, gemm], enable=[off.name], check=False)
    assert report.rules == [off.name, gemm.name] and not [n for n in report.notes if "did not run" in n]
    _, report = fuser.optimize(matmul_add(), rules=[off, gemm], disable=[gemm.name], check=False)
    assert report.notes == [f"rule '{off.name}' given in rules= did not run: off by default (enable= names it)"]


@pytest.mark.parametrize("given", ["matmul-add-gemm", ["matmul-add-gemm"]])
def test_rules_by_name_are_told_to_go_through_enable_and_disable(given):
    with pytest.raises(UsageError, match="rules= takes rules made with @fuser.rule.*not 'matmul-add-gemm'"):
        fuser.optimize(matmul_add(), rules=given)


def test_one_name_as_a_string_is_one_name():
    optimized, report = fuser.optimize(matmul_add(), disable="matmul-add-gemm", check=False)
    assert "matmul-add-gemm" not in report.rules and report.counts == {}
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(run(optimized, {"x": x})[0], x + 1)


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        ({"opset": "17"}, "the opset must be a whole number, not '17'"),
        ({"opset": 17.0}, "the opset must be a whole number, not 17.0"),
        ({"enable": 5}, "rule names and rule files are strings"),
        ({"disable": [None]}, "rule names and rule files are strings"),
        ({"rule_files": [3]}, "rule names and rule files are strings"),
    ],
)
def test_arguments_of_the_wrong_type_are_usage_errors(arguments, said):
    with pytest.raises(UsageError, match=said):
        fuser.optimize(matmul_add(), check=False, **arguments)


def test_an_opset_as_a_numpy_integer_is_a_number():
    _, report = fuser.optimize(matmul_add(), opset=np.int64(18))
    assert report.counts == {"matmul-add-gemm": 1}


def test_a_model_may_be_given_as_its_serialized_bytes():
    optimized, report = fuser.optimize(matmul_add().SerializeToString())
    assert report.counts == {"matmul-add-gemm": 1} and report.verdict.passed
    assert fuser.find_opportunities(bytearray(matmul_add().SerializeToString())).opportunity_counts() == {
        "matmul-add-gemm": 1
    }


@pytest.mark.parametrize(
    ("given", "error", "said"),
    [
        (b"not a model", InputError, "the bytes given are not an ONNX model"),
        (b"", InputError, "the bytes given are not an ONNX model: they hold no graph"),
        (b"\x08\x07", InputError, "they hold no graph"),
        (12, UsageError, "not int"),
    ],
)
def test_what_is_no_model_is_said_to_be_none(given, error, said):
    with pytest.raises(error, match=said):
        fuser.optimize(given)


def test_names_given_as_an_iterator_are_read_once():
    gemm = rule_named("matmul-add-gemm")
    off = next(r for r in builtin_rules() if not r.enabled_by_default and r.target == "onnx")
    _, report = fuser.optimize(matmul_add(), rules=iter([off, gemm]), enable=iter([off.name]), check=False)
    assert report.rules == [off.name, gemm.name] and not [n for n in report.notes if "did not run" in n]
