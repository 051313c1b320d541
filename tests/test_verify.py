"""The numerics check: compare(), Checker, input synthesis and loading, `fuser compare`.

Everything runs in real onnxruntime; nothing is mocked.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import fuser
from fuser.errors import InputError, UsageError
from fuser.verify import TOLERANCES, Checker, CheckOptions, compare, load_inputs, session, synthesize_inputs
from tests.helpers import fuser_cli, in_process_cli, make_model

BFLOAT16 = helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16)


def fuser_cli_many(*commands, cwd=None):
    """Several `fuser` invocations at once (each is mostly interpreter start-up)."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "fuser.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
        )
        for args in commands
    ]
    results = []
    for process, args in zip(processes, commands):
        stdout, stderr = process.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(args, process.returncode, stdout, stderr))
    return results


def values(dtype, n=12, seed=0):
    """Non-trivial values of about unit size (none near zero, so relative changes are clear)."""
    rng = np.random.default_rng(seed)
    magnitude = rng.uniform(0.5, 2.0, n)
    sign = np.where(rng.integers(0, 2, n) == 1, 1.0, -1.0)
    return (magnitude * sign).astype(dtype)


# --------------------------------------------------------------------------- compare()


@pytest.mark.parametrize(
    "dtype, passes, fails",
    [
        ("float32", 1e-6, 1e-2),
        ("float16", 1e-3, 5e-2),
        ("float64", 1e-11, 1e-6),
    ],
)
def test_default_tolerance_per_dtype(dtype, passes, fails):
    expected = values(dtype)
    small = (expected.astype(np.float64) * (1 + passes)).astype(dtype)
    large = (expected.astype(np.float64) * (1 + fails)).astype(dtype)
    ok = compare("y", expected, small, exact=False)
    assert ok.status == "ok", ok
    assert (ok.rtol, ok.atol) == TOLERANCES[dtype]
    bad = compare("y", expected, large, exact=False)
    assert bad.status == "mismatch", bad
    assert bad.fraction_out_of_tolerance == 1.0


def test_float64_is_stricter_than_float32():
    # The same 1e-6 relative change: rounding for float32, a real difference for float64.
    change = 1 + 1e-6
    e32 = values(np.float32)
    e64 = values(np.float64)
    assert compare("y", e32, (e32 * np.float32(change)).astype(np.float32), exact=False).status == "ok"
    assert compare("y", e64, e64 * change, exact=False).status == "mismatch"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_exact_fails_a_one_ulp_difference(dtype):
    expected = values(dtype)
    actual = expected.copy()
    actual[3] = np.nextafter(actual[3], np.array(np.inf, dtype=dtype))
    assert compare("y", expected, actual, exact=False).status == "ok"
    check = compare("y", expected, actual, exact=True)
    assert check.status == "mismatch"
    assert (check.rtol, check.atol) == (0.0, 0.0)
    assert check.worst_index == (3,)
    assert check.fraction_out_of_tolerance == pytest.approx(1 / 12)
    assert compare("y", expected, expected.copy(), exact=True).status == "ok"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_exact_rewrites_of_16_bit_floats_get_the_dtypes_tolerance(dtype):
    """onnxruntime's CPU runs many 16-bit operators in float32, depending on the graph around
    them: rewiring alone moves such outputs by an ulp or two (a wav2vec2 float16 export loses an
    Identity between a LayerNormalization and the bias it shares with a Conv: 2 ulps)."""
    expected = values("float32").astype(np.float16 if dtype == "float16" else BFLOAT16)
    nudged = expected.copy()
    nudged[3] = expected[3] + expected[3] * np.float32(2**-8)  # a couple of ulps
    check = compare("y", expected, nudged, exact=True)
    assert check.status == "ok" and (check.rtol, check.atol) == TOLERANCES[dtype]
    wrong = expected.copy()
    wrong[3] = expected[3] * 2 + 1
    assert compare("y", expected, wrong, exact=True).status == "mismatch"


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int8, np.uint8])
def test_integers_compare_exactly(dtype):
    expected = np.arange(12, dtype=dtype).reshape(3, 4)
    assert compare("y", expected, expected.copy(), exact=False).status == "ok"
    actual = expected.copy()
    actual[1, 2] += 1
    check = compare("y", expected, actual, exact=False, rtol=0.5, atol=10)
    assert check.status == "mismatch"  # tolerances never apply to integers
    assert check.worst_index == (1, 2)
    assert check.fraction_out_of_tolerance == pytest.approx(1 / 12)


def test_bools_compare_exactly():
    expected = np.array([[True, False], [False, True]])
    assert compare("y", expected, expected.copy(), exact=False).status == "ok"
    actual = expected.copy()
    actual[1, 0] = True
    check = compare("y", expected, actual, exact=False)
    assert check.status == "mismatch" and check.worst_index == (1, 0)
    assert check.fraction_out_of_tolerance == 0.25


def test_integer_mismatch_reports_its_error_size():
    """max_abs_error / max_rel_error describe integer mismatches too: the summary a user reads
    ("max abs error 0, 25% of elements out of tolerance") must not contradict itself."""
    expected = np.array([10, 20, 30, 40], dtype=np.int64)
    actual = np.array([10, 21, 30, 47], dtype=np.int64)
    check = compare("y", expected, actual, exact=False)
    assert check.status == "mismatch"
    assert check.max_abs_error == 7.0
    assert check.max_rel_error == pytest.approx(7 / 40)
    assert check.worst_index == (3,)


def test_large_outputs_say_what_the_tolerance_is_a_fraction_of():
    """atol scales with the original's largest magnitude: the report says how large that is, so
    an error of 1e6 that passes on outputs of 1e13 reads as the rounding it is."""
    from fuser.verify import Verdict

    expected = np.array([1e13, -2e13, 3.0, 4.0], np.float32)
    close = compare("y", expected, expected + np.float32(1e6), exact=False)
    assert close.status == "ok" and close.max_abs_expected == pytest.approx(2e13)
    assert close.to_dict()["max_abs_expected"] == pytest.approx(2e13)
    far = compare("y", expected, expected * np.float32(1.01), exact=False)
    assert far.status == "mismatch"
    assert "(rtol=0.0001, atol=1e-05 times the largest expected magnitude, 2e+13)" in Verdict(outputs=[far]).summary()
    small = compare("y", np.array([0.5, 0.25], np.float32), np.array([0.5, 0.75], np.float32), exact=False)
    assert small.max_abs_expected == 0.5
    assert "(rtol=0.0001, atol=1e-05), worst" in Verdict(outputs=[small]).summary()


def test_the_summary_line_gives_the_outputs_scale_beside_a_large_error(tmp_path):
    from fuser.report import summary_lines

    model = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["y"])],
        [("x", np.float32, [2, 3])],
        [("y", np.float32, [2, 3])],
        {"w": np.eye(3, dtype=np.float32), "b": np.ones(3, np.float32)},
    )
    _, report = fuser.optimize(model)
    expected = np.array([1e13, -2e13, 3.0], np.float32)
    report.verdict.outputs = [compare("y", expected, expected + np.float32(1e6), exact=False)]
    (line,) = [text for text in summary_lines(report, tmp_path / "out.onnx") if text.startswith("numerics")]
    assert "max abs error 1.0" in line and line.endswith("e+06 (outputs up to 2e+13)")
    report.verdict.outputs = [compare("y", expected, expected, exact=False)]
    (line,) = [text for text in summary_lines(report, tmp_path / "out.onnx") if text.startswith("numerics")]
    assert line.endswith("max abs error 0")


def test_nan_at_the_same_positions_is_equal():
    expected = np.array([1.0, np.nan, 3.0, np.nan], dtype=np.float32)
    for exact in (False, True):
        check = compare("y", expected, expected.copy(), exact=exact)
        assert check.status == "ok" and check.stabilized_elements == 0


def test_a_number_becoming_nan_is_a_mismatch():
    expected = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    actual = expected.copy()
    actual[2] = np.nan
    check = compare("y", expected, actual, exact=False)
    assert check.status == "mismatch" and check.worst_index == (2,)
    assert check.fraction_out_of_tolerance == 0.25
    # NaN in both but at different positions: the finite side became NaN somewhere.
    shifted = np.array([np.nan, 2.0, 3.0, 4.0], dtype=np.float32)
    moved = np.array([1.0, np.nan, 3.0, 4.0], dtype=np.float32)
    check = compare("y", shifted, moved, exact=False)
    assert check.status == "mismatch" and check.worst_index == (1,)


def test_infinities():
    expected = np.array([np.inf, -np.inf, 1.0], dtype=np.float32)
    assert compare("y", expected, expected.copy(), exact=True).status == "ok"
    flipped = np.array([-np.inf, -np.inf, 1.0], dtype=np.float32)
    check = compare("y", expected, flipped, exact=False)
    assert check.status == "mismatch" and check.worst_index == (0,)
    overflowed = np.array([np.inf, -np.inf, np.inf], dtype=np.float32)  # finite -> inf
    check = compare("y", expected, overflowed, exact=False)
    assert check.status == "mismatch" and check.worst_index == (2,)
    assert compare("y", expected, np.array([np.inf, np.nan, 1.0], np.float32), False).status == "mismatch"


def test_original_inf_or_nan_becoming_finite_is_stabilized():
    expected = np.array([-np.inf, np.nan, 0.5, 2.0], dtype=np.float32)
    actual = np.array([-88.7, 0.0, 0.5, 2.0], dtype=np.float32)
    for exact in (False, True):
        check = compare("y", expected, actual, exact=exact)
        assert check.status == "stabilized"
        assert check.stabilized_elements == 2
        assert check.fraction_out_of_tolerance == 0.0
        assert check.max_abs_error == 0.0  # stabilized elements are not counted as errors


def test_stabilized_does_not_hide_a_real_mismatch():
    expected = np.array([-np.inf, 1.0, 2.0], dtype=np.float32)
    actual = np.array([-88.7, 1.5, 2.0], dtype=np.float32)
    check = compare("y", expected, actual, exact=False)
    assert check.status == "mismatch" and check.stabilized_elements == 1 and check.worst_index == (1,)


def test_shape_or_dtype_difference_is_a_mismatch():
    expected = np.zeros((2, 3), dtype=np.float32)
    assert compare("y", expected, np.zeros((3, 2), np.float32), exact=False).status == "mismatch"
    assert compare("y", expected, np.zeros((1, 3), np.float32), exact=False).status == "mismatch"  # broadcastable
    assert compare("y", expected, np.zeros((2, 3), np.float64), exact=False).status == "mismatch"
    assert compare("y", expected, np.zeros((2, 3), np.float16), exact=False).status == "mismatch"
    ints = np.zeros(3, np.int64)
    assert compare("y", ints, np.zeros(3, np.int32), exact=False).status == "mismatch"
    assert compare("y", ints, np.zeros(3, np.bool_), exact=False).status == "mismatch"


def test_report_fields_point_at_the_worst_element():
    expected = np.ones((3, 4), dtype=np.float32)
    actual = expected.copy()
    actual[0, 1] = 1.5
    actual[2, 3] = 0.25  # the worst: 0.75 off
    actual[1, 0] = 1.0 + 1e-7  # within tolerance
    check = compare("out", expected, actual, exact=False)
    assert check.status == "mismatch"
    assert check.name == "out" and check.dtype == "float32" and check.shape == (3, 4)
    assert check.worst_index == (2, 3)
    assert check.max_abs_error == pytest.approx(0.75)
    assert check.max_rel_error == pytest.approx(0.75)
    assert check.fraction_out_of_tolerance == pytest.approx(2 / 12)
    as_dict = check.to_dict()
    assert as_dict["worst_index"] == [2, 3] and as_dict["shape"] == [3, 4] and as_dict["status"] == "mismatch"
    json.dumps(as_dict)  # plain JSON types only


def test_relative_error_against_a_zero_expected_value_is_finite():
    check = compare("y", np.array([0.0, 1.0], np.float32), np.array([1e-3, 1.0], np.float32), exact=False)
    assert check.status == "mismatch" and check.worst_index == (0,)
    assert np.isfinite(check.max_rel_error) and check.max_rel_error > 1
    json.dumps(check.to_dict())


def test_rtol_and_atol_overrides():
    expected = values(np.float32)
    actual = (expected * np.float32(1.01)).astype(np.float32)  # 1% off everywhere
    assert compare("y", expected, actual, exact=False).status == "mismatch"
    loose = compare("y", expected, actual, exact=False, rtol=0.05)
    assert loose.status == "ok" and loose.rtol == 0.05 and loose.atol == TOLERANCES["float32"][1]
    assert compare("y", expected, actual, exact=False, atol=0.1).status == "ok"
    tiny = (expected * np.float32(1 + 1e-6)).astype(np.float32)
    strict = compare("y", expected, tiny, exact=False, rtol=0.0, atol=0.0)
    assert strict.status == "mismatch" and (strict.rtol, strict.atol) == (0.0, 0.0)


def test_empty_outputs_are_equal():
    assert compare("y", np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32), exact=True).status == "ok"


# --------------------------------------------------------------------------- Checker

CAST = {"f16": TensorProto.FLOAT16, "f64": TensorProto.DOUBLE, "i64": TensorProto.INT64}
OUTPUT_DTYPES = {"f16": np.float16, "f32": np.float32, "f64": np.float64, "i64": np.int64, "b": np.bool_}


def dtype_model(perturb: str | None = None, delta: float = 0.0):
    """One output per dtype; each goes through an Add/Xor with a constant that is neutral
    unless `perturb` names that output, which then gets `delta` added (or its bools flipped)."""
    nodes = [
        helper.make_node("Cast", ["x"], ["x16"], to=CAST["f16"]),
        helper.make_node("Cast", ["x"], ["x64"], to=CAST["f64"]),
        helper.make_node("Mul", ["x", "ten"], ["x10"]),
        helper.make_node("Cast", ["x10"], ["xi"], to=CAST["i64"]),
        helper.make_node("Greater", ["x", "zero"], ["positive"]),
        helper.make_node("Add", ["x16", "c_f16"], ["f16"]),
        helper.make_node("Add", ["x", "c_f32"], ["f32"]),
        helper.make_node("Add", ["x64", "c_f64"], ["f64"]),
        helper.make_node("Add", ["xi", "c_i64"], ["i64"]),
        helper.make_node("Xor", ["positive", "c_b"], ["b"]),
    ]
    constants = {
        "ten": np.array(10, np.float32),
        "zero": np.array(0, np.float32),
        "c_f16": np.array(0, np.float16),
        "c_f32": np.array(0, np.float32),
        "c_f64": np.array(0, np.float64),
        "c_i64": np.array(0, np.int64),
        "c_b": np.array(False),
    }
    if perturb == "b":
        constants["c_b"] = np.array(True)
    elif perturb is not None:
        dtype = OUTPUT_DTYPES[perturb]
        constants[f"c_{perturb}"] = np.array(delta).astype(dtype)
    outputs = [(name, dtype, ["batch", 16]) for name, dtype in OUTPUT_DTYPES.items()]
    return make_model(nodes, [("x", np.float32, ["batch", 16])], outputs, constants)


@pytest.fixture(scope="module")
def dtype_checker():
    return Checker(dtype_model(), CheckOptions(seed=0, dims={"batch": 4}))


def test_checker_same_model_is_ok_for_every_dtype(dtype_checker):
    for exact in (False, True):
        verdict = dtype_checker.check(dtype_model(), exact)
        assert verdict.passed and verdict.load_error is None
        assert {o.name: o.dtype for o in verdict.outputs} == {
            "f16": "float16",
            "f32": "float32",
            "f64": "float64",
            "i64": "int64",
            "b": "bool",
        }
        assert all(o.status == "ok" and o.max_abs_error == 0 for o in verdict.outputs)
        assert all(o.shape == (4, 16) for o in verdict.outputs)
        assert verdict.summary() == "all outputs match"


@pytest.mark.parametrize(
    "name, delta",
    [("f16", 0.25), ("f32", 1e-2), ("f64", 1e-6), ("i64", 1), ("b", None)],
)
def test_checker_perturbed_output_is_a_mismatch(dtype_checker, name, delta):
    verdict = dtype_checker.check(dtype_model(name, delta), exact=False)
    assert not verdict.passed
    statuses = {o.name: o.status for o in verdict.outputs}
    assert statuses == {n: ("mismatch" if n == name else "ok") for n in OUTPUT_DTYPES}
    assert [o.name for o in verdict.failures()] == [name]
    assert f"output '{name}' differs" in verdict.summary()
    json.dumps(verdict.to_dict())


@pytest.mark.parametrize("name, delta", [("f32", 1e-7), ("f64", 1e-13)])
def test_checker_rounding_sized_change_passes_unless_exact(dtype_checker, name, delta):
    candidate = dtype_model(name, delta)
    verdict = dtype_checker.check(candidate, exact=False)
    assert verdict.passed, verdict.summary()
    exact = dtype_checker.check(candidate, exact=True)
    assert not exact.passed and [o.name for o in exact.failures()] == [name]


def test_checker_rounding_sized_float16_change_passes_even_when_exact(dtype_checker):
    candidate = dtype_model("f16", 1e-4)
    assert dtype_checker.check(candidate, exact=False).passed
    assert dtype_checker.check(candidate, exact=True).passed


def test_checker_runs_keep_the_worst_result():
    model = make_model(
        [helper.make_node("Abs", ["x"], ["y"])], [("x", np.float32, [1, 1])], [("y", np.float32, [1, 1])]
    )
    identity = make_model(
        [helper.make_node("Identity", ["x"], ["y"])], [("x", np.float32, [1, 1])], [("y", np.float32, [1, 1])]
    )
    # Abs and Identity agree only on non-negative inputs; find a seed whose single value is
    # non-negative while the next seed's (used by the second run) is negative.
    negative = [bool(synthesize_inputs(session(model), seed=s)["x"][0, 0] < 0) for s in range(40)]
    seed = next(s for s in range(39) if not negative[s] and negative[s + 1])
    assert Checker(model, CheckOptions(seed=seed)).check(identity, False).passed
    assert not Checker(model, CheckOptions(seed=seed + 1)).check(identity, False).passed
    verdict = Checker(model, CheckOptions(seed=seed, runs=2)).check(identity, False)
    assert not verdict.passed and len(verdict.outputs) == 1  # one entry per output, the worst run


def masked_sum_models(mask_dtype=np.int64, mask_shape=(2, 8)):
    """y = x + mask (as float), and a stand-in that adds 1 instead: the two agree wherever the
    mask is one, as a rewrite that mishandles masked positions does."""
    inputs = [("x", np.float32, list(mask_shape)), ("attention_mask", mask_dtype, list(mask_shape))]
    outputs = [("y", np.float32, list(mask_shape))]
    original = make_model(
        [
            helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["x", "m"], ["y"]),
        ],
        inputs,
        outputs,
    )
    ignores_mask = make_model(
        [helper.make_node("Add", ["x", "one"], ["y"])], inputs, outputs, {"one": np.array(1.0, np.float32)}
    )
    return original, ignores_mask


@pytest.mark.parametrize("mask_dtype", [np.int64, np.int32, np.bool_])
def test_a_rewrite_wrong_only_under_padding_is_caught(mask_dtype):
    """Synthesized masks are ones, as real ones mostly are; the check also runs the first input
    set with each mask's last row half padded, and says so."""
    original, ignores_mask = masked_sum_models(mask_dtype)
    checker = Checker(original, CheckOptions())
    assert len(checker.feeds) == 2
    mask = checker.feeds[1]["attention_mask"]
    assert mask[:-1].all() and mask[-1, :4].all() and not mask[-1, 4:].any()
    verdict = checker.check(ignores_mask, False)
    assert not verdict.passed
    assert verdict.padded_masks == ["attention_mask"]
    assert (
        verdict.inputs_text() == "x[2,8], attention_mask[2,8] (again with the last row of attention_mask half padded)"
    )
    assert verdict.to_dict()["padded_masks"] == ["attention_mask"]
    assert checker.check(original, True).passed


def test_no_padded_set_for_given_inputs_given_ranges_or_a_mask_of_one_dim():
    original, ignores_mask = masked_sum_models()
    ones = {"x": np.zeros((2, 8), np.float32), "attention_mask": np.ones((2, 8), np.int64)}
    assert Checker(original, CheckOptions(inputs=ones)).check(ignores_mask, False).passed
    ranged = Checker(original, CheckOptions(ranges={"attention_mask": (1, 2)}))
    assert len(ranged.feeds) == 1 and ranged.check(ignores_mask, False).padded_masks == []
    flat, _ = masked_sum_models(mask_shape=(8,))
    assert len(Checker(flat, CheckOptions()).feeds) == 1


def test_checker_with_given_inputs_by_name_or_position():
    model = make_model([helper.make_node("Abs", ["x"], ["y"])], [("x", np.float32, ["n"])], [("y", np.float32, ["n"])])
    identity = make_model(
        [helper.make_node("Identity", ["x"], ["y"])], [("x", np.float32, ["n"])], [("y", np.float32, ["n"])]
    )
    positive = np.array([0.5, 1.0, 2.0], np.float32)
    assert Checker(model, CheckOptions(inputs={"x": positive})).check(identity, False).passed
    assert Checker(model, CheckOptions(inputs={"#0": positive})).check(identity, False).passed
    assert not Checker(model, CheckOptions(inputs={"x": -positive})).check(identity, False).passed
    with pytest.raises(InputError, match="no value for graph input 'x'"):
        Checker(model, CheckOptions(inputs={}))
    with pytest.raises(UsageError, match=r"--inputs: the model has no input other \(its inputs: x\)"):
        Checker(model, CheckOptions(inputs={"x": positive, "other": positive}))


def test_candidate_onnxruntime_cannot_load_gives_load_error_not_an_exception():
    original = make_model(
        [helper.make_node("Relu", ["x"], ["y"])], [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])]
    )
    broken = make_model(
        [helper.make_node("NoSuchFusedOp", ["x"], ["y"], domain="com.microsoft")],
        [("x", np.float32, [2, 3])],
        [("y", np.float32, [2, 3])],
        extra_opsets={"com.microsoft": 1},
        check=False,
    )
    verdict = Checker(original).check(broken, exact=False)
    assert verdict.passed is False
    assert verdict.load_error and "NoSuchFusedOp" in verdict.load_error
    assert not verdict.load_error.startswith("onnxruntime cannot load the model")
    assert verdict.summary().startswith("onnxruntime cannot run the optimized model")
    assert verdict.to_dict()["passed"] is False and verdict.to_dict()["load_error"] == verdict.load_error
    json.dumps(verdict.to_dict())


def test_inputs_of_the_wrong_size_name_the_dims_that_do_not_fit():
    """onnxruntime lists the misfit dims below its first line; the one-line error keeps them."""
    model = make_model(
        [helper.make_node("Abs", ["x"], ["y"])], [("x", np.float32, [1, 16])], [("y", np.float32, [1, 16])]
    )
    with pytest.raises(InputError, match=r"x\[2,8\]\): .*index: 0 Got: 2 Expected: 1; index: 1 Got: 8 Expected: 16$"):
        Checker(model, CheckOptions(inputs={"x": np.zeros((2, 8), np.float32)}))


def test_a_prepared_checker_raises_what_building_it_raised_when_asked_for_it():
    from fuser.verify import PreparedChecker

    model = make_model(
        [helper.make_node("Abs", ["x"], ["y"])], [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])]
    )
    misfit = CheckOptions(inputs={"x": np.zeros(5, np.float32)})
    prepared = PreparedChecker(model, misfit)
    with pytest.raises(InputError, match="cannot run on these inputs"):
        prepared.get()
    PreparedChecker(model, misfit).discard()  # not needed: nothing raised
    assert PreparedChecker(model, CheckOptions()).get().check(model, exact=True).passed


@pytest.fixture
def held_original(monkeypatch):
    """PreparedChecker's thread, held after the original's session has its copy of the model
    until the test releases it: the thread is still building the Checker, as during a rewrite."""
    import threading

    from fuser.verify import Checker as Built

    release = threading.Event()
    synthesize = Built._synthesize

    def held(self, *args):
        release.wait(timeout=60)
        return synthesize(self, *args)

    monkeypatch.setattr(Built, "_synthesize", held)
    yield release
    release.set()


def one_node(op_type: str, domain: str = "") -> onnx.ModelProto:
    """y = op_type(x) on a 2x3 float tensor; an unknown domain's node is left unchecked."""
    return make_model(
        [helper.make_node(op_type, ["x"], ["y"], domain=domain)],
        [("x", np.float32, [2, 3])],
        [("y", np.float32, [2, 3])],
        extra_opsets={domain: 1} if domain else None,
        check=not domain,
    )


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, SystemExit])
def test_an_interrupted_run_does_not_wait_for_the_originals_side(held_original, monkeypatch, interruption):
    """Ctrl-C (or a worker told to end) during the rewrite ends the run at once: onnxruntime's
    start of the original's session cannot be cut short, and nothing will use it."""
    import threading

    from fuser.engine import Engine

    def interrupted(self, apply=True):
        raise interruption()

    monkeypatch.setattr(Engine, "run", interrupted)
    with pytest.raises(interruption):
        fuser.optimize(one_node("Relu"))
    beside = [t for t in threading.enumerate() if t.name == "fuser-check-original"]
    assert beside and beside[0].is_alive() and beside[0].daemon  # still held: not waited for
    held_original.set()
    beside[0].join()


def test_a_candidates_session_starts_beside_the_original_while_its_side_is_built(held_original):
    from fuser.verify import PreparedChecker

    model, negated, unknown = one_node("Relu"), one_node("Neg"), one_node("NoSuchOp", "none.such")
    prepared = PreparedChecker(model, CheckOptions())
    started = prepared.start_beside(model)
    assert started is not None  # the thread waits: the candidate's session started now
    started_wrong = prepared.start_beside(negated)
    started_unloadable = prepared.start_beside(unknown)
    held_original.set()
    checker = prepared.get()
    assert prepared.start_beside(model) is None  # built: the candidate's session starts in check
    assert checker.check(model, exact=True, started=started).passed
    assert not checker.check(negated, exact=True, started=started_wrong).passed
    assert not checker.check(model, exact=True, started=started_wrong).passed  # the session given is what runs
    refused = checker.check(unknown, exact=True, started=started_unloadable)
    assert not refused.passed and "NoSuchOp" in refused.load_error


def test_a_process_ending_soon_keeps_the_originals_session_while_a_candidates_starts_beside():
    """Freeing the original's session holds Python's lock; while a candidate's session is being
    started beside the thread, a process that ends soon keeps it instead (run in a process of
    its own, as ending.ends_soon holds for the rest of it)."""
    script = """
import threading
import numpy as np
from onnx import helper
from fuser import ending, verify
from fuser.testing import make_model

release = threading.Event()
synthesize = verify.Checker._synthesize
verify.Checker._synthesize = lambda self, *args: (release.wait(60), synthesize(self, *args))[1]
ending.ends_soon()
model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])])
prepared = verify.PreparedChecker(model, verify.CheckOptions())
started = prepared.start_beside(model)
release.set()
checker = prepared.get()
assert type(ending._held.get("original session")).__name__ == "InferenceSession", ending._held
assert checker.check(model, exact=True, started=started).passed
kept = ending._held["original session"]
verify.PreparedChecker(model, verify.CheckOptions()).get()  # nothing beside: its session is not kept
assert ending._held["original session"] is kept
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_what_a_process_ending_soon_keeps_is_freed_only_by_its_end():
    """fuser.ending keeps nothing until the process says it ends soon (run in a process of its
    own: once said, it holds for the rest of the process)."""
    script = """
import gc, weakref
from fuser import ending

class Thing:
    pass

first, second, third = Thing(), Thing(), Thing()
refs = [weakref.ref(t) for t in (first, second, third)]
ending.keep(first)
ending.hold("slot", second)
del first, second
gc.collect()
assert [r() is None for r in refs[:2]] == [True, True]  # not ending: nothing kept
ending.ends_soon()
kept, held = Thing(), Thing()
refs = [weakref.ref(kept), weakref.ref(held), weakref.ref(third)]
ending.keep(kept)
ending.hold("slot", held)
ending.hold("slot", third)  # takes the slot: the value held before is freed
del kept, held, third
gc.collect()
assert [r() is None for r in refs] == [False, True, False], [r() for r in refs]
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_original_is_run_only_when_there_is_a_rewrite_to_check():
    """The original's side of the check is built during the rewrite; a model nothing rewrote
    needs no check, so inputs it cannot run on are no error then, as without the head start."""
    import fuser

    model = make_model(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Relu", ["r"], ["y"])],
        [("x", np.float32, [2, 3])],
        [("y", np.float32, [2, 3])],
    )
    misfit = {"x": np.zeros(5, np.float32)}

    @fuser.rule("double-relu", pattern=fuser.op.Relu(fuser.op.Relu(fuser.var("x"), name="inner")), exact=True)
    def double_relu(m, b):
        """Relu(Relu(x)) => Relu(x)."""
        return b.Relu(m["x"])

    _, report = fuser.optimize(model, rules=[], inputs=misfit)
    assert report.rewrites == [] and report.verdict is None
    with pytest.raises(InputError, match="cannot run on these inputs"):
        fuser.optimize(model, rules=[double_relu], inputs=misfit)


def add_chain(count: int, changed: int | None = None) -> onnx.ModelProto:
    """x + c0 + c1 + ... with `count` small constants; `changed` names one to alter."""
    nodes, constants, current = [], {}, "x"
    for i in range(count):
        value = np.full(4, 1e-3 * (i % 7 + 1), np.float32)
        if i == changed:
            value = value + 0.5
        constants[f"c{i}"] = value
        nodes.append(helper.make_node("Add", [current, f"c{i}"], [f"a{i}"]))
        current = f"a{i}"
    nodes.append(helper.make_node("Identity", [current], ["y"]))
    return make_model(nodes, [("x", np.float32, [4])], [("y", np.float32, [4])], initializers=constants)


def test_a_session_of_many_small_initializers_keeps_them_and_leaves_no_file(tmp_path, monkeypatch):
    from fuser.verify import MANY_INITIALIZERS, keeps_initializers

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    original = add_chain(MANY_INITIALIZERS)
    assert keeps_initializers(original) and not keeps_initializers(add_chain(100))
    checker = Checker(original)
    assert checker.check(add_chain(MANY_INITIALIZERS), exact=True).passed
    verdict = checker.check(add_chain(MANY_INITIALIZERS, changed=MANY_INITIALIZERS // 2), exact=False)
    assert not verdict.passed and verdict.failures()[0].max_abs_error == pytest.approx(0.5, rel=1e-3)
    assert list(scratch.iterdir()) == []  # the file onnxruntime saved went with its folder


def test_without_a_temporary_folder_a_session_of_many_initializers_starts_the_usual_way(tmp_path, monkeypatch):
    from fuser.verify import MANY_INITIALIZERS

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    original = add_chain(MANY_INITIALIZERS)
    assert Checker(original).check(add_chain(MANY_INITIALIZERS), exact=True).passed
    assert not (tmp_path / "missing").exists()


def test_a_session_keeps_neither_external_nor_large_initializers():
    from fuser.verify import KEPT_INITIALIZER_BYTES, MANY_INITIALIZERS, TOO_MANY_TO_REMOVE, keeps_initializers

    def model_of(tensors):
        model = onnx.ModelProto()
        model.graph.initializer.extend(tensors)
        return model

    many = [helper.make_tensor(f"c{i}", TensorProto.FLOAT, [4], [0.0] * 4) for i in range(MANY_INITIALIZERS)]
    assert keeps_initializers(model_of(many))
    external = onnx.TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4])
    external.data_location = TensorProto.EXTERNAL
    external.external_data.add(key="location", value="w.bin")
    assert not keeps_initializers(model_of([*many, external]))
    # dims only: the size is read from them, and no test should hold 64 MiB
    large = onnx.TensorProto(name="big", data_type=TensorProto.FLOAT, dims=[KEPT_INITIALIZER_BYTES // 4])
    assert not keeps_initializers(model_of([*many, large]))
    # unless there are so many that removing them one by one would take longer than keeping them
    more = [onnx.TensorProto(name=f"d{i}", data_type=TensorProto.FLOAT, dims=[4]) for i in range(TOO_MANY_TO_REMOVE)]
    assert keeps_initializers(model_of([*more, large]))


def test_compare_with_infinities_emits_no_runtime_warnings():
    expected = np.array([np.inf, -np.inf, np.nan, 1.0], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for exact in (False, True):
            assert compare("y", expected, expected.copy(), exact=exact).status == "ok"
            assert compare("y", expected, np.array([-np.inf, -np.inf, np.nan, 1.0], np.float32), exact).status == (
                "mismatch"
            )


@pytest.mark.parametrize(
    "settings",
    [
        {"inputs": {"x": np.ones((2, 3), np.float64)}},  # float64 for a float32 input
        {"inputs": {"x": np.ones((2, 5), np.float32)}},  # wrong shape
        {"shapes": {"x": (6,)}},  # wrong rank
    ],
    ids=["dtype", "shape", "rank"],
)
def test_inputs_that_do_not_fit_the_model_raise_input_error(settings):
    model = make_model(
        [helper.make_node("Relu", ["x"], ["y"])], [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])]
    )
    with pytest.raises(InputError):
        Checker(model, CheckOptions(**settings))


def test_an_empty_integer_range_is_an_input_error():
    model = make_model([helper.make_node("Identity", ["i"], ["o"])], [("i", np.int64, [4])], [("o", np.int64, [4])])
    with pytest.raises(InputError):
        synthesize_inputs(session(model), ranges={"i": (0.0, 0.5)})  # no integer in [0, 0.5)


def test_candidate_with_different_outputs_is_not_a_crash():
    """A candidate whose output is named differently cannot match; Checker must say so
    (a failed verdict or an InputError), not raise KeyError from its bookkeeping."""
    original = make_model(
        [helper.make_node("Relu", ["x"], ["y"])], [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])]
    )
    renamed = make_model(
        [helper.make_node("Relu", ["x"], ["z"])], [("x", np.float32, [2, 3])], [("z", np.float32, [2, 3])]
    )
    try:
        verdict = Checker(original).check(renamed, exact=False)
    except InputError:
        return
    assert not verdict.passed


# --------------------------------------------------------------------------- synthesize_inputs


@pytest.fixture(scope="module")
def mixed_session():
    model = make_model(
        [
            helper.make_node("Identity", ["f"], ["f_out"]),
            helper.make_node("Identity", ["i"], ["i_out"]),
            helper.make_node("Identity", ["j"], ["j_out"]),
            helper.make_node("Identity", ["b"], ["b_out"]),
            helper.make_node("Identity", ["h"], ["h_out"]),
        ],
        [
            ("f", np.float32, ["batch", 8]),
            ("i", np.int64, [3, "n"]),
            ("j", np.int32, [50]),
            ("b", np.bool_, [64]),
            ("h", np.float16, ["batch", "n"]),
        ],
        [
            ("f_out", np.float32, ["batch", 8]),
            ("i_out", np.int64, [3, "n"]),
            ("j_out", np.int32, [50]),
            ("b_out", np.bool_, [64]),
            ("h_out", np.float16, ["batch", "n"]),
        ],
    )
    return session(model)


def test_synthesized_inputs_are_seeded(mixed_session):
    first = synthesize_inputs(mixed_session, seed=3)
    again = synthesize_inputs(mixed_session, seed=3)
    other = synthesize_inputs(mixed_session, seed=4)
    assert list(first) == ["f", "i", "j", "b", "h"]
    for name in first:
        np.testing.assert_array_equal(first[name], again[name])
        assert first[name].dtype == again[name].dtype
    assert not np.array_equal(first["f"], other["f"])
    assert not np.array_equal(first["j"], other["j"])


def test_synthesized_dtypes_and_default_ranges(mixed_session):
    feeds = synthesize_inputs(mixed_session, seed=0, shapes={"i": (3, 400)})
    assert {n: v.dtype for n, v in feeds.items()} == {
        "f": np.float32,
        "i": np.int64,
        "j": np.int32,
        "b": np.bool_,
        "h": np.float16,
    }
    ints = feeds["i"]
    assert ints.min() == 0 and ints.max() == 9  # [0, 10), every value hit among 1200
    assert 0 <= feeds["j"].min() and feeds["j"].max() < 10
    assert feeds["b"].any() and not feeds["b"].all()
    assert feeds["f"].min() < 0 < feeds["f"].max()  # normal floats, not only positives


def test_input_ranges(mixed_session):
    feeds = synthesize_inputs(
        mixed_session,
        seed=0,
        shapes={"i": (3, 300)},
        ranges={"i": (100, 105), "f": (5.0, 6.0), "j": (-3, 0)},
    )
    assert feeds["i"].min() == 100 and feeds["i"].max() == 104
    assert feeds["j"].min() >= -3 and feeds["j"].max() < 0
    assert feeds["f"].min() >= 5.0 and feeds["f"].max() < 6.0
    assert feeds["f"].dtype == np.float32 and feeds["i"].dtype == np.int64


def test_symbolic_dims_default_to_1_and_can_be_set(mixed_session):
    feeds = synthesize_inputs(mixed_session, seed=0)
    assert feeds["f"].shape == (1, 8) and feeds["i"].shape == (3, 1) and feeds["h"].shape == (1, 1)
    assert feeds["j"].shape == (50,)
    feeds = synthesize_inputs(mixed_session, seed=0, dims={"batch": 4})
    assert feeds["f"].shape == (4, 8) and feeds["h"].shape == (4, 1) and feeds["i"].shape == (3, 1)
    feeds = synthesize_inputs(mixed_session, seed=0, dims={"batch": 2, "n": 5}, shapes={"f": (7, 8)})
    assert feeds["f"].shape == (7, 8)  # an explicit shape wins over dims
    assert feeds["h"].shape == (2, 5) and feeds["i"].shape == (3, 5)


def test_synthesized_inputs_run_in_the_model(mixed_session):
    feeds = synthesize_inputs(mixed_session, seed=1, dims={"batch": 2, "n": 3})
    outputs = mixed_session.run(None, feeds)
    for (name, value), output in zip(feeds.items(), outputs):
        np.testing.assert_array_equal(output, value)


# --------------------------------------------------------------------------- load_inputs


def test_load_inputs_from_npz(tmp_path):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    ids = np.array([1, 2, 3], np.int64)
    np.savez(tmp_path / "data.npz", x=x, ids=ids)
    loaded = load_inputs(str(tmp_path / "data.npz"))
    assert set(loaded) == {"x", "ids"}
    np.testing.assert_array_equal(loaded["x"], x)
    assert loaded["ids"].dtype == np.int64


def test_load_inputs_from_a_folder_of_tensor_protos(tmp_path):
    folder = tmp_path / "test_data_set_0"
    folder.mkdir()
    arrays = [np.full((2,), i, np.float32) for i in range(12)]
    for i, array in enumerate(arrays):
        (folder / f"input_{i}.pb").write_bytes(numpy_helper.from_array(array, f"in{i}").SerializeToString())
    (folder / "output_0.pb").write_bytes(numpy_helper.from_array(np.zeros(1, np.float32), "out").SerializeToString())
    loaded = load_inputs(str(folder))
    assert list(loaded) == [f"in{i}" for i in range(12)]  # numeric order: input_2 before input_10
    for i in range(12):
        np.testing.assert_array_equal(loaded[f"in{i}"], arrays[i])


def test_load_inputs_unnamed_tensors_are_positional(tmp_path):
    (tmp_path / "input_0.pb").write_bytes(numpy_helper.from_array(np.ones(3, np.int64)).SerializeToString())
    loaded = load_inputs(str(tmp_path))
    assert list(loaded) == ["#0"]


@pytest.mark.parametrize(
    "name, content",
    [
        ("missing.npz", None),
        ("text.npz", b"this is not numpy data\n"),
        ("random.npz", bytes(range(256)) * 4),
        ("empty.npz", b""),
    ],
)
def test_load_inputs_bad_files_raise_input_error(tmp_path, name, content):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InputError, match=name) as raised:
        load_inputs(str(path))
    said = str(raised.value)
    assert "pickle" not in said  # numpy's word for any file that is not a zip archive
    assert said.endswith(
        "no such file" if content is None else "not a .npz file (a zip archive of arrays, as numpy.savez writes)"
    )


def test_load_inputs_bad_folders_raise_input_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no input_"):
        load_inputs(str(empty))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "input_0.pb").write_bytes(b"\xff\xff\xff")
    with pytest.raises(InputError, match="input_0.pb"):
        load_inputs(str(corrupt))


def test_load_inputs_npy_is_not_npz(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros(3))
    with pytest.raises(InputError):
        load_inputs(str(tmp_path / "x.npy"))


# --------------------------------------------------------------------------- fuser compare


def _unary(op_type, dtype=np.float32, shape=("batch", 64), constant=None, **attrs):
    inputs = ["x"] + (["c"] if constant is not None else [])
    return make_model(
        [helper.make_node(op_type, inputs, ["y"], **attrs)],
        [("x", dtype, list(shape))],
        [("y", dtype, list(shape))],
        {"c": constant} if constant is not None else {},
    )


@pytest.fixture(scope="module")
def compare_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compare")
    models = {
        "a.onnx": make_model(
            [helper.make_node("Mul", ["x", "c"], ["y"]), helper.make_node("Greater", ["x", "zero"], ["flag"])],
            [("x", np.float32, ["batch", 64])],
            [("y", np.float32, ["batch", 64]), ("flag", np.bool_, ["batch", 64])],
            {"c": np.array(0.1, np.float32), "zero": np.array(0, np.float32)},
        ),
        # x / 10 equals x * 0.1 up to float32 rounding only
        "rounded.onnx": make_model(
            [helper.make_node("Div", ["x", "c"], ["y"]), helper.make_node("Greater", ["x", "zero"], ["flag"])],
            [("x", np.float32, ["batch", 64])],
            [("y", np.float32, ["batch", 64]), ("flag", np.bool_, ["batch", 64])],
            {"c": np.array(10, np.float32), "zero": np.array(0, np.float32)},
        ),
        "perturbed.onnx": make_model(
            [
                helper.make_node("Mul", ["x", "c"], ["m"]),
                helper.make_node("Add", ["m", "d"], ["y"]),
                helper.make_node("Greater", ["x", "zero"], ["flag"]),
            ],
            [("x", np.float32, ["batch", 64])],
            [("y", np.float32, ["batch", 64]), ("flag", np.bool_, ["batch", 64])],
            {"c": np.array(0.1, np.float32), "d": np.array(0.01, np.float32), "zero": np.array(0, np.float32)},
        ),
        "abs.onnx": _unary("Abs"),
        "identity.onnx": _unary("Identity"),
        "renamed.onnx": make_model(
            [helper.make_node("Identity", ["x"], ["z"])],
            [("x", np.float32, ["batch", 64])],
            [("z", np.float32, ["batch", 64])],
        ),
    }
    for name, model in models.items():
        onnx.save(model, str(folder / name))
    np.savez(folder / "float64.npz", x=np.ones((2, 64)))
    return folder


@pytest.fixture
def cli(monkeypatch, capfd):
    """`fuser ...` in this process (much faster than a subprocess): cwd, exit code, stdout, stderr."""
    return in_process_cli(monkeypatch, capfd)


def test_compare_identical_models_exits_0_in_a_real_process(compare_models):
    result = fuser_cli("compare", "a.onnx", "a.onnx", cwd=compare_models)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "checked on x[1,64]"  # the symbolic batch stays 1
    assert len(lines) == 3 and lines[1].split()[:2] == ["y", "ok"] and lines[2].split()[:2] == ["flag", "ok"]


def test_compare_perturbed_model_exits_3_with_per_output_lines(cli, compare_models):
    result = cli(compare_models, "compare", "a.onnx", "perturbed.onnx")
    assert result.returncode == 3, result.stderr
    lines = {line.split()[0]: line for line in result.stderr.strip().splitlines()[1:]}
    assert set(lines) == {"y", "flag"}
    assert lines["y"].split()[1] == "mismatch" and "0.01" in lines["y"]
    assert lines["flag"].split()[1] == "ok"


def test_compare_exact_fails_on_rounding_differences(cli, compare_models):
    loose = cli(compare_models, "compare", "a.onnx", "rounded.onnx", "--dim", "batch=4")
    assert loose.returncode == 0, loose.stderr
    exact = cli(compare_models, "compare", "a.onnx", "rounded.onnx", "--dim", "batch=4", "--exact")
    assert exact.returncode == 3, exact.stderr
    assert "mismatch" in exact.stderr


def test_compare_with_inputs_and_json_report(cli, compare_models, tmp_path):
    # Abs and Identity differ on the synthesized (normal) inputs, agree on non-negative ones.
    synthesized = cli(compare_models, "compare", "abs.onnx", "identity.onnx")
    assert synthesized.returncode == 3, synthesized.stderr
    np.savez(tmp_path / "data.npz", x=np.abs(np.random.default_rng(0).standard_normal((3, 64))).astype(np.float32))
    report_path = tmp_path / "report.json"
    result = cli(
        compare_models,
        "compare",
        "abs.onnx",
        "identity.onnx",
        "--inputs",
        str(tmp_path / "data.npz"),
        "--format",
        "json",
        "--report",
        str(report_path),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report == json.loads(report_path.read_text())
    assert report["command"] == "compare" and report["verdict"] == "match" and report["exit_code"] == 0
    assert report["numerics"]["passed"] is True
    [output] = report["numerics"]["outputs"]
    assert output["name"] == "y" and output["shape"] == [3, 64] and output["status"] == "ok"


def test_compare_json_report_of_a_mismatch(cli, compare_models):
    result = cli(compare_models, "compare", "a.onnx", "perturbed.onnx", "--format", "json")
    assert result.returncode == 3
    report = json.loads(result.stdout)
    assert report["command"] == "compare" and report["verdict"] == "mismatch" and report["exit_code"] == 3
    outputs = {o["name"]: o for o in report["numerics"]["outputs"]}
    assert outputs["y"]["status"] == "mismatch" and outputs["y"]["max_abs_error"] == pytest.approx(0.01, rel=1e-3)
    assert outputs["flag"]["status"] == "ok"


def test_compare_tolerance_options(cli, compare_models):
    assert cli(compare_models, "compare", "a.onnx", "perturbed.onnx", "--atol", "0.02").returncode == 0
    assert cli(compare_models, "compare", "a.onnx", "rounded.onnx", "--rtol", "0", "--atol", "0").returncode == 3


@pytest.mark.parametrize(
    "args, name",
    [
        (("a.onnx", "nope.onnx"), "nope.onnx"),
        (("nope.onnx", "a.onnx"), "nope.onnx"),
        (("a.onnx", "a.onnx", "--inputs", "no.npz"), "no.npz"),
    ],
)
def test_compare_missing_file_exits_2(cli, compare_models, args, name):
    result = cli(compare_models, "compare", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and name in lines[0] and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("--inputs", "float64.npz"),  # the model takes float32
        ("--input-shape", "x:64"),  # wrong rank
    ],
)
def test_compare_inputs_that_do_not_fit_the_model_exit_2(cli, compare_models, args):
    """Wrong user inputs are bad usage (exit 2, one line), not "a bug in fuser" (exit 4)."""
    result = cli(compare_models, "compare", "abs.onnx", "identity.onnx", *args)
    assert "internal error" not in result.stderr, result.stderr
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_compare_models_with_different_outputs_is_not_an_internal_error(cli, compare_models):
    result = cli(compare_models, "compare", "identity.onnx", "renamed.onnx")
    assert "internal error" not in result.stderr, result.stderr
    assert result.returncode in (2, 3), result.stderr


def test_compare_of_outputs_with_infinities_prints_no_numpy_warnings(tmp_path):
    """In a real process numpy's RuntimeWarnings would reach the user's terminal."""
    model = make_model(
        [helper.make_node("Div", ["x", "zero"], ["y"])],
        [("x", np.float32, [2, 8])],
        [("y", np.float32, [2, 8])],
        {"zero": np.array(0, np.float32)},
    )  # every output element is +inf or -inf
    onnx.save(model, str(tmp_path / "inf.onnx"))
    loose, exact = fuser_cli_many(
        ("compare", "inf.onnx", "inf.onnx"),
        ("compare", "inf.onnx", "inf.onnx", "--exact"),
        cwd=tmp_path,
    )
    for result in (loose, exact):
        assert result.returncode == 0, result.stderr
        assert "Warning" not in result.stderr, result.stderr
        assert result.stderr.strip().splitlines()[:2] == [
            "checked on x[2,8]",
            "warning: output 'y' is entirely inf/NaN on the check inputs",
        ]
        assert len(result.stderr.strip().splitlines()) == 3, result.stderr


def test_a_mismatch_of_infinities_is_described_as_such():
    from fuser.verify import Verdict

    expected = np.array([1.0, 2.0, 3.0, 4.0], np.float16)
    actual = np.array([1.0, np.inf, 3.0, -np.inf], np.float16)
    check = compare("y", expected, actual, exact=False)
    assert check.status == "mismatch" and check.nonfinite_mismatches == 2 and check.max_abs_error == 0
    summary = Verdict(outputs=[check]).summary()
    assert summary.startswith(
        "output 'y' differs: 2 element(s) inf/NaN in one model and not the same in the other, "
        "max abs error 0 among finite values, 50.0% of elements out of tolerance"
    )


def random_original(op: str, training: bool = True) -> onnx.ModelProto:
    """A model whose outputs are random (unless a Dropout is not training), then an Add of zeros."""
    if op == "Dropout":
        random = helper.make_node("Dropout", ["x", "ratio", "training"], ["noisy"])
        constants = {"ratio": np.array(0.5, np.float32), "training": np.array(training)}
    else:
        random = helper.make_node("RandomNormalLike", ["x"], ["noisy"])
        constants = {}
    nodes = [random, helper.make_node("Add", ["noisy", "zeros"], ["y"])]
    constants["zeros"] = np.zeros(16, np.float32)
    return make_model(nodes, [("x", np.float32, [4, 16])], [("y", np.float32, [4, 16])], constants, opset=17)


def wrong_add_rule():
    from fuser import Builder, Match, op, rule, var

    @rule("test-wrong-add", pattern=op.Add(var("a"), var("b")))
    def wrong(m: Match, b: Builder):
        """Subtracts ones in place of whatever was added: a wrong rewrite."""
        return b.Sub(m["a"], np.ones(16, np.float32))

    return wrong


def test_a_random_original_is_not_blamed_on_a_rewrite(cli, tmp_path):
    """Its outputs differ from run to run: the check says so, names the random operator, and
    exits as for an unusable input rather than blaming the rewrite (exit 3)."""
    onnx.save(random_original("Dropout"), tmp_path / "m.onnx")
    done = cli(tmp_path, "optimize", "m.onnx", "-o", "out.onnx")
    assert done.returncode == 2, done.stderr
    assert "gives other values of output 'y' when run again on the same inputs" in done.stderr
    assert "(Dropout 'noisy' in training mode)" in done.stderr
    assert "--no-check" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out.onnx").exists()
    done = cli(tmp_path, "optimize", "m.onnx", "-o", "out.onnx", "--no-check")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("op", ["Dropout", "RandomNormalLike"])
def test_random_operators_are_named(op):
    import fuser

    with pytest.raises(InputError, match=f"when run again on the same inputs \\({op} 'noisy'"):
        fuser.optimize(random_original(op), rules=[wrong_add_rule()])


def test_a_steady_original_with_a_wrong_rewrite_is_still_a_mismatch():
    """The same model with the Dropout in inference mode: its outputs are steady, so a rewrite
    that changes them is blamed as before."""
    import fuser
    from fuser.errors import NumericsMismatch

    with pytest.raises(NumericsMismatch, match="caused by 1 rewrite"):
        fuser.optimize(random_original("Dropout", training=False), rules=[wrong_add_rule()])


# ------------------------------------------------------------ outputs that are not tensors


def classifier_with_zipmap() -> onnx.ModelProto:
    """probabilities = ZipMap(Softmax(x @ W + b)): a sequence of {class: probability} maps, one
    per row, as skl2onnx exports every scikit-learn classifier by default."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["p"], axis=1),
        helper.make_node("ArgMax", ["p"], ["label"], axis=1, keepdims=0),
        helper.make_node("ZipMap", ["p"], ["probabilities"], domain="ai.onnx.ml", classlabels_int64s=[3, 1, 2]),
    ]
    maps = helper.make_sequence_type_proto(
        helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, []))
    )
    graph = helper.make_graph(
        nodes,
        "classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [
            helper.make_tensor_value_info("label", TensorProto.INT64, ["n"]),
            helper.make_value_info("probabilities", maps),
        ],
        [
            numpy_helper.from_array(rng.normal(size=(4, 3)).astype(np.float32), "w"),
            numpy_helper.from_array(rng.normal(size=3).astype(np.float32), "b"),
        ],
    )
    opsets = [helper.make_opsetid("", 13), helper.make_opsetid("ai.onnx.ml", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def test_a_classifier_returning_a_sequence_of_maps_is_checked():
    _, report = fuser.optimize(classifier_with_zipmap())
    assert report.counts == {"matmul-add-gemm": 1}
    assert report.verdict.passed
    (probabilities,) = [o for o in report.verdict.outputs if o.name == "probabilities"]
    assert probabilities.shape == (1, 3) and probabilities.dtype == "float32"  # one row, three classes


def test_maps_and_sequences_compare_as_arrays():
    from fuser.verify import as_array

    rows = [{3: np.float32(0.5), 1: np.float32(0.2), 2: np.float32(0.3)}, {1: 0.1, 2: 0.1, 3: 0.8}]
    assert np.array_equal(as_array(rows, np.float32), np.float32([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]]))
    changed = [dict(rows[0]), {**rows[1], 3: 0.7}]
    assert compare("p", as_array(rows), as_array(changed), exact=False).status == "mismatch"
    assert as_array([np.ones((2, 3)), np.zeros((2, 3))]).shape == (2, 2, 3)
    assert as_array([np.ones(2), np.zeros(3)]).tolist() == [1, 1, 0, 0, 0]  # ragged: joined flat
    assert as_array([]).shape == (0,)


def test_a_map_input_asks_for_no_check_rather_than_failing_obscurely():
    """skl2onnx's DictVectorizer pipelines take a map; neither synthesized nor in an .npz."""
    dictionary = helper.make_map_type_proto(TensorProto.STRING, helper.make_tensor_type_proto(TensorProto.FLOAT, []))
    nodes = [
        helper.make_node("DictVectorizer", ["features"], ["v"], domain="ai.onnx.ml", string_vocabulary=["a", "b"]),
        helper.make_node("Identity", ["v"], ["i"]),
        helper.make_node("Relu", ["i"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "vectorized",
        [helper.make_value_info("features", dictionary)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("ai.onnx.ml", 1)])
    model.ir_version = 8
    with pytest.raises(InputError, match="map.*--no-check"):
        fuser.optimize(model)
    assert fuser.optimize(model, check=False)[1].counts == {"identity-elimination": 1}


def test_an_operator_onnxruntime_does_not_know_points_to_no_check():
    nodes = [
        helper.make_node("Identity", ["x"], ["i"]),
        helper.make_node("Tokenize", ["i"], ["t"], domain="com.example"),
        helper.make_node("Relu", ["t"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "custom",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("com.example", 1)])
    with pytest.raises(InputError, match="Tokenize.*not a registered.*--no-check"):
        fuser.optimize(model)
    assert fuser.optimize(model, check=False)[1].counts == {"identity-elimination": 1}


def test_a_maps_keys_and_a_sequences_item_shapes_count():
    from fuser.verify import as_array

    assert (
        compare(
            "p", as_array([{1: 0.5, 2: 0.5}], np.float32), as_array([{1: 0.5, 3: 0.5}], np.float32), exact=False
        ).status
        == "mismatch"
    )
    first, second = [np.ones((1, 1)), np.ones((1, 2))], [np.ones((1, 2)), np.ones((1, 1))]
    assert compare("s", as_array(first), as_array(second), exact=False).status == "mismatch"
    assert compare("s", as_array(first), as_array(list(first)), exact=False).status == "ok"


def test_string_outputs_compare_without_a_distance():
    check = compare("label", np.array(["cat", "dog"]), np.array(["cat", "cow"]), exact=True)
    assert check.status == "mismatch" and check.worst_index == (1,) and check.fraction_out_of_tolerance == 0.5


_THREAD_FREES = """
import os, threading
from fuser.verify import return_freed_memory

def resident_mb():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6

pinned = []

def session_like():  # many small blocks, a few kept: glibc cannot trim them off the top
    blocks = [bytearray(60000) for _ in range(4000)]
    pinned.extend(blocks[::10])

worker = threading.Thread(target=session_like)
worker.start()
worker.join()
freed = resident_mb()
return_freed_memory()
print(freed, resident_mb())
"""


# Only glibc keeps a thread's freed memory in a per-thread arena and has malloc_trim to return it,
# and only Linux shows resident memory in /proc; elsewhere return_freed_memory does nothing by design.
@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="per-thread arenas and malloc_trim are glibc's, /proc/self/statm is Linux's",
)
def test_memory_another_thread_freed_goes_back_to_the_system():
    # What the original's session, built in PreparedChecker's thread, frees must not stay in that
    # thread's arena while the optimized model's session takes as much again.
    result = subprocess.run([sys.executable, "-c", _THREAD_FREES], capture_output=True, text=True, check=True)
    freed, returned = map(float, result.stdout.split())
    assert freed - returned > 150, (freed, returned)  # of the 216 MB the thread freed


def test_the_checks_sessions_do_not_spin():
    """Idle threads that spin take the core the rewrite, or the next piece of a large model, runs on."""
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", np.float32, [2])], [("y", np.float32, [2])])
    options = session(model).get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
