"""16-bit float outputs weighed against float32 twins (fuser/float32_twin.py, Checker).

A float16 model's outputs move when a rewrite changes the order of its arithmetic; the check
tells that rounding from an error by running both models' float32 twins. Everything runs in
real onnxruntime.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuser.float32_twin import computed_in_sixteen_bit_float, float32_twin
from fuser.report import REPORT_SCHEMA
from fuser.verify import ROUNDING_FACTOR, TOLERANCES, Checker, CheckOptions, OutputCheck, _Weighing, session
from tests.helpers import in_process_cli

F16, F32 = TensorProto.FLOAT16, TensorProto.FLOAT
BFLOAT16 = helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16)
BIG = 100.0  # float16's unit in the last place at 100 is 1/16: x + 100 - 100 keeps little of x
WIDTH = 64


def _model(nodes, initializers=(), elem=F16, width=WIDTH, output_elem=None) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", elem, [1, width])],
        [helper.make_tensor_value_info("y", output_elem or elem, [1, width])],
        list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _constant(name: str, value: float, dtype=np.float16, width: int = 1) -> onnx.TensorProto:
    return numpy_helper.from_array(np.full([width], value, dtype), name)


def cancelling(big: float = BIG, width: int = WIDTH, bias: float = 0.0) -> onnx.ModelProto:
    """y = (x + big) - big, the sum rounded to float16 by a Cast, as mixed-precision exports
    round between float32 stretches; then scaled by float16 ones (and `bias` added)."""
    return _model(
        [
            helper.make_node("Cast", ["x"], ["x32"], to=F32),
            helper.make_node("Add", ["x32", "big"], ["s32"]),
            helper.make_node("Cast", ["s32"], ["s"], to=F16),
            helper.make_node("Cast", ["s"], ["t32"], to=F32),
            helper.make_node("Sub", ["t32", "big"], ["d32"]),
            helper.make_node("Cast", ["d32"], ["d"], to=F16),
            helper.make_node("Mul", ["d", "ones"], ["e"]),
            helper.make_node("Add", ["e", "bias"], ["y"]),
        ],
        [_constant("big", big, np.float32), _constant("ones", 1.0, width=width), _constant("bias", bias)],
        width=width,
    )


def accurate(width: int = WIDTH) -> onnx.ModelProto:
    """The same sum kept in float32: accurate to float16's last place of y."""
    return _model(
        [
            helper.make_node("Cast", ["x"], ["x32"], to=F32),
            helper.make_node("Add", ["x32", "big"], ["s32"]),
            helper.make_node("Sub", ["s32", "big"], ["d32"]),
            helper.make_node("Cast", ["d32"], ["d"], to=F16),
            helper.make_node("Mul", ["d", "ones"], ["y"]),
        ],
        [_constant("big", BIG, np.float32), _constant("ones", 1.0, width=width)],
        width=width,
    )


def scaled(factor: float) -> onnx.ModelProto:
    return _model([helper.make_node("Mul", ["x", "factor"], ["y"])], [_constant("factor", factor)])


def checker(original, **options) -> Checker:
    # Inputs in [-1, 1): near 0, where float16's relative precision is finest, the cancellation
    # loses most.
    names = {"ranges": {"x": (-1.0, 1.0)}, **options}
    return Checker(original, CheckOptions(**names))


# --------------------------------------------------------------------------- the twin


def _sixteen_bit_mentions(model: onnx.ModelProto) -> list[str]:
    text = str(model)
    return [word for word in ("elem_type: 10", "data_type: 10", "elem_type: 16", "data_type: 16") if word in text]


def test_the_twin_widens_every_sixteen_bit_tensor_the_model_states():
    then = helper.make_graph(
        [helper.make_node("Constant", [], ["t"], value=_constant("tv", 2.0))],
        "then",
        [],
        [helper.make_tensor_value_info("t", F16, [1])],
    )
    otherwise = helper.make_graph(
        [helper.make_node("Constant", [], ["e"], value=_constant("ev", 3.0))],
        "else",
        [],
        [helper.make_tensor_value_info("e", F16, [1])],
    )
    model = _model(
        [
            helper.make_node("Constant", [], ["one"], value=_constant("ov", 1.0)),
            helper.make_node("ConstantOfShape", ["shape"], ["half"], value=_constant("hv", 0.5)),
            helper.make_node("Cast", ["flag"], ["flag16"], to=F16),
            helper.make_node("If", ["cond"], ["branch"], then_branch=then, else_branch=otherwise),
            helper.make_node("Add", ["x", "one"], ["a"]),
            helper.make_node("Mul", ["a", "half"], ["b"]),
            helper.make_node("Mul", ["b", "flag16"], ["c"]),
            helper.make_node("Mul", ["c", "branch"], ["d"]),
            helper.make_node("Mul", ["d", "w"], ["y"]),
        ],
        [
            numpy_helper.from_array(np.array([1, WIDTH], np.int64), "shape"),
            numpy_helper.from_array(np.array([1.0], np.float32), "flag"),
            numpy_helper.from_array(np.array(True), "cond"),
            numpy_helper.from_array(np.linspace(0.5, 1.5, WIDTH).astype(np.float16), "w"),
        ],
    )
    assert _sixteen_bit_mentions(model)
    twin = float32_twin(model)
    assert _sixteen_bit_mentions(twin) == []
    assert _sixteen_bit_mentions(model), "the model itself is left as it was"
    onnx.checker.check_model(twin, full_check=True)
    x = np.linspace(-1, 1, WIDTH, dtype=np.float32).reshape(1, WIDTH)
    (narrow,) = session(model).run(None, {"x": x.astype(np.float16)})
    (wide,) = session(twin).run(None, {"x": x})
    assert wide.dtype == np.float32
    weights = np.linspace(0.5, 1.5, WIDTH).astype(np.float16).astype(np.float64)  # as stored
    expected = (x + 1) * 0.5 * 2.0 * weights
    np.testing.assert_allclose(wide, expected, rtol=1e-6)
    np.testing.assert_allclose(narrow, expected, rtol=2e-3)


def test_the_twin_widens_bfloat16_and_the_dtype_attributes():
    model = _model(
        [
            helper.make_node("EyeLike", ["x"], ["eye"], dtype=TensorProto.FLOAT16),
            helper.make_node("Cast", ["eye"], ["brain"], to=TensorProto.BFLOAT16),
            helper.make_node("Add", ["brain", "w"], ["y"]),
        ],
        [numpy_helper.from_array(np.full([WIDTH], 0.5, np.float32).astype(BFLOAT16), "w")],
        elem=F32,
        output_elem=TensorProto.BFLOAT16,
    )
    twin = float32_twin(model)
    assert _sixteen_bit_mentions(twin) == []
    onnx.checker.check_model(twin, full_check=True)
    (wide,) = session(twin).run(None, {"x": np.zeros([1, WIDTH], np.float32)})
    np.testing.assert_array_equal(wide, np.eye(1, WIDTH, dtype=np.float32) + 0.5)


# --------------------------------------------------------------------------- the check


@pytest.mark.parametrize(
    "candidate",
    [pytest.param(accurate(), id="more-accurate"), pytest.param(cancelling(BIG + 1 / 32), id="rounded-elsewhere")],
)
def test_float16_rounding_beyond_the_tolerance_passes_as_rounding(candidate):
    verdict = checker(cancelling()).check(candidate, exact=False)
    (output,) = verdict.outputs
    # The direct comparison alone fails: x + 100 rounds x to a sixteenth.
    assert output.max_abs_error > 0.01 and output.fraction_out_of_tolerance > 0
    assert verdict.passed and output.status == "rounding" and verdict.rounded == [output]
    assert output.reference_error <= ROUNDING_FACTOR * output.original_reference_error
    assert output.twins_error < 1e-4
    assert "float16 rounding: 'y' differs by up to" in output.rounding_text()


def test_a_wrong_float16_rewrite_stays_a_mismatch():
    verdict = checker(scaled(1.0)).check(scaled(1.05), exact=False)
    (output,) = verdict.outputs
    assert not verdict.passed and output.status == "mismatch"
    assert output.twins_error > 0.01  # in float32 the two compute different things


def test_a_rewrite_that_drops_an_upcast_stays_a_mismatch():
    """In float32 the twins agree (the Casts to float16 become no-ops), but rounding the sum to
    float16 loses far more than ROUNDING_FACTOR times what the original's final rounding does."""
    verdict = checker(accurate()).check(cancelling(), exact=False)
    (output,) = verdict.outputs
    assert not verdict.passed and output.status == "mismatch"
    assert output.twins_error < 1e-4
    assert output.reference_error > ROUNDING_FACTOR * output.original_reference_error


def test_a_rewrite_rounding_more_than_twice_as_far_stays_a_mismatch():
    """Both round x + big, but at 400 float16's step is 1/4: four times the original's error."""
    verdict = checker(cancelling()).check(cancelling(400.0), exact=False)
    (output,) = verdict.outputs
    assert not verdict.passed and output.status == "mismatch"
    assert output.twins_error < 1e-4
    assert output.reference_error > ROUNDING_FACTOR * output.original_reference_error > 0


def test_a_small_error_within_the_rounding_stays_a_mismatch_when_the_twins_disagree():
    """0.02 added: in float16 within twice the original's rounding, in float32 plainly wrong."""
    verdict = checker(cancelling()).check(cancelling(bias=0.02), exact=False)
    (output,) = verdict.outputs
    assert output.reference_error <= ROUNDING_FACTOR * output.original_reference_error
    assert not verdict.passed and output.status == "mismatch" and output.twins_error > 0.01


def test_an_inf_in_one_input_set_is_never_rounding():
    weighing = _Weighing()
    x = np.linspace(-1, 1, WIDTH).reshape(1, WIDTH)
    reference = x.astype(np.float32)
    rounded = (np.round(x * 16) / 16).astype(np.float16)
    weighing.add(rounded, x.astype(np.float16), reference, reference)
    with_inf = x.astype(np.float16)
    with_inf[0, -1] = np.inf
    weighing.add(rounded, with_inf, reference, reference)
    check = OutputCheck("y", "float16", (1, WIDTH), "mismatch")
    weighing.settle(check)
    assert check.status == "mismatch"


@pytest.mark.parametrize("changed", ["dtype", "shape"])
def test_an_output_of_another_dtype_or_shape_stays_a_mismatch(changed):
    candidate = accurate()
    output = candidate.graph.output[0]
    if changed == "dtype":
        candidate.graph.node[-1].output[0] = "y16"
        candidate.graph.node.append(helper.make_node("Cast", ["y16"], ["y"], to=F32))
        output.type.tensor_type.elem_type = F32
    else:
        candidate.graph.node[-1].output[0] = "flat"
        candidate.graph.initializer.append(numpy_helper.from_array(np.array([WIDTH, 1], np.int64), "column"))
        candidate.graph.node.append(helper.make_node("Reshape", ["flat", "column"], ["y"]))
        del output.type.tensor_type.shape.dim[:]
        output.type.tensor_type.shape.dim.add().dim_value = WIDTH
        output.type.tensor_type.shape.dim.add().dim_value = 1
    onnx.checker.check_model(candidate, full_check=True)
    verdict = checker(cancelling()).check(candidate, exact=False)
    assert not verdict.passed and verdict.outputs[0].status == "mismatch"


def test_the_twin_is_of_the_original_as_it_was_when_the_check_was_prepared():
    original = cancelling()

    def change_it():  # the caller may change the model once the session has its copy
        for node in original.graph.node:
            if node.op_type == "Sub":
                node.op_type = "Add"

    check = Checker(original, CheckOptions(ranges={"x": (-1.0, 1.0)}), on_serialized=change_it)
    assert any(node.op_type == "Add" and "t32" in node.input for node in original.graph.node)
    verdict = check.check(accurate(), exact=False)
    assert verdict.passed and verdict.outputs[0].status == "rounding"


def test_weighing_that_would_take_too_much_memory_is_not_tried_and_says_so(monkeypatch):
    import fuser.jobs

    monkeypatch.setattr(fuser.jobs, "available_memory", lambda: 100)
    verdict = checker(cancelling()).check(accurate(), exact=False)
    assert not verdict.passed and verdict.outputs[0].reference_error is None
    assert any("telling rounding from error takes float32 copies" in w for w in verdict.warnings)


def test_tolerances_the_user_gives_are_not_weighed():
    verdict = checker(cancelling(), rtol=1e-2, atol=1e-3).check(accurate(), exact=False)
    (output,) = verdict.outputs
    assert not verdict.passed and output.status == "mismatch" and output.reference_error is None


def test_float32_outputs_are_not_weighed():
    def times(factor):
        return _model(
            [helper.make_node("Mul", ["x", "factor"], ["y"])], [_constant("factor", factor, np.float32)], elem=F32
        )

    verdict = checker(times(1.0)).check(times(1.01), exact=False)
    assert not verdict.passed and verdict.outputs[0].reference_error is None


def test_weights_fed_to_the_session_are_widened_too(tmp_path):
    """float16 weights of 80 KB in external data: fed to the check's sessions as inputs, and to
    the twins widened."""
    width = 40_000
    path = tmp_path / "m.onnx"
    onnx.save(cancelling(width=width), path, save_as_external_data=True, location="m.data", size_threshold=0)
    original = onnx.load(path, load_external_data=False)
    check = Checker(original, CheckOptions(ranges={"x": (-1.0, 1.0)}), base_dir=tmp_path)
    assert check._twin_source[1], "the weights are fed"
    verdict = check.check(accurate(width), exact=False)
    (output,) = verdict.outputs
    assert verdict.passed and output.status == "rounding"


@pytest.fixture
def cli(monkeypatch, capfd):
    return in_process_cli(monkeypatch, capfd)


def test_fuser_compare_says_why_a_float16_output_passed(cli, tmp_path):
    onnx.save(cancelling(), tmp_path / "a.onnx")
    onnx.save(accurate(), tmp_path / "b.onnx")
    result = cli(tmp_path, "compare", "a.onnx", "b.onnx", "--input-range", "x:-1,1", "--report", "r.json")
    assert result.returncode == 0, result.stderr
    assert "float16 rounding: 'y' differs by up to" in result.stderr + result.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    (output,) = report["numerics"]["outputs"]
    assert output["status"] == "rounding" and output["twins_error"] < 1e-4


# ------------------------------------------------------- float16 inside, float32 at the edges


def keep_io_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` converted to float16 inside, its inputs and outputs kept float32 with Casts (as
    mixed-precision converters' keep_io_types writes it)."""
    converted = onnx.ModelProto()
    converted.CopyFrom(model)
    graph = converted.graph
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type == F32:
            value = numpy_helper.to_array(tensor).astype(np.float16)
            graph.initializer[index].CopyFrom(numpy_helper.from_array(value, tensor.name))
    entry = [helper.make_node("Cast", [f"{v.name}_f32"], [v.name], to=F16) for v in graph.input]
    exit_ = [helper.make_node("Cast", [f"{v.name}_f16"], [v.name], to=F32) for v in graph.output]
    for node in graph.node:
        node.output[:] = [f"{o}_f16" if o in {v.name for v in graph.output} else o for o in node.output]
        for attribute in node.attribute:
            if attribute.name == "to" and attribute.i == F32:
                attribute.i = F16
    nodes = [*entry, *graph.node, *exit_]
    del graph.node[:]
    graph.node.extend(nodes)
    for value in graph.input:
        value.name = f"{value.name}_f32"
        value.type.tensor_type.elem_type = F32
    for value in graph.output:
        value.type.tensor_type.elem_type = F32
    del graph.value_info[:]
    onnx.checker.check_model(converted, full_check=True)
    return converted


def test_a_float32_output_of_a_float16_computation_gets_float16_s_tolerance():
    """The rounding a float16 model makes does not vanish when its edges are float32: such a
    model's rewrites were held to float32's tolerance and refused."""
    verdict = checker(keep_io_float16(cancelling()), ranges={"x_f32": (-1.0, 1.0)}).check(
        keep_io_float16(cancelling(BIG + 1 / 32)), exact=False
    )
    (output,) = verdict.outputs
    assert output.dtype == "float32" and output.computed_in == "float16"
    assert (output.rtol, output.atol) == TOLERANCES["float16"]
    assert verdict.passed


def test_a_wrong_rewrite_of_a_float16_computation_with_float32_edges_stays_a_mismatch():
    verdict = checker(keep_io_float16(scaled(1.0)), ranges={"x_f32": (-1.0, 1.0)}).check(
        keep_io_float16(scaled(1.05)), exact=False
    )
    (output,) = verdict.outputs
    assert not verdict.passed and output.status == "mismatch" and output.computed_in == "float16"


def test_a_float32_model_s_outputs_keep_float32_s_tolerance():
    plain = _model([helper.make_node("Mul", ["x", "f"], ["y"])], [_constant("f", 1.0, np.float32)], elem=F32)
    (output,) = checker(plain).check(plain, exact=False).outputs
    assert output.computed_in is None and (output.rtol, output.atol) == TOLERANCES["float32"]


def test_a_float16_resnet_with_float32_edges_is_optimized_and_says_at_what_tolerance(cli, tmp_path):
    """conv-bn-fold rounds the folded weights to float16: beyond float32's tolerance on a model
    that computes in float16 anyway (exit 3 before)."""
    resnet = Path(__file__).parent.parent / "models" / "resnet_small.onnx"
    onnx.save(keep_io_float16(onnx.load(resnet)), tmp_path / "half.onnx")
    result = cli(tmp_path, "optimize", "half.onnx", "--report", "r.json")
    assert result.returncode == 0, result.stderr
    assert "float32 output(s) 'logits' compared at float16's tolerance: computed through float16" in result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    assert report["rule_counts"]["conv-bn-fold"] == 8
    assert [o["computed_in"] for o in report["numerics"]["outputs"]] == ["float16"]


def test_only_the_outputs_a_sixteen_bit_tensor_reaches_are_computed_in_it():
    """A model with a float16 branch and a float32 one: the float32 branch keeps its tolerance."""
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["h"], to=F16),
            helper.make_node("Relu", ["h"], ["h2"]),
            helper.make_node("Cast", ["h2"], ["through_half"], to=F32),
            helper.make_node("Relu", ["x"], ["plain"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", F32, [2])],
        [helper.make_tensor_value_info(n, F32, [2]) for n in ("through_half", "plain")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert computed_in_sixteen_bit_float(model) == {"through_half": "float16"}
    statuses = {o.name: (o.computed_in, o.rtol) for o in Checker(model).check(model, exact=True).outputs}
    assert statuses == {"through_half": ("float16", TOLERANCES["float16"][0]), "plain": (None, 0.0)}
    assert computed_in_sixteen_bit_float(cancelling()) == {"y": "float16"}
    assert computed_in_sixteen_bit_float(keep_io_float16(scaled(1.0))) == {"y": "float16"}


def test_a_float16_tensor_read_only_for_its_shape_leaves_float32_s_tolerance():
    """A float16 input whose shape reshapes a float32 result: no float16 value reaches it, and a
    rewrite 0.5% wrong must fail as in a float32 model."""
    graph = helper.make_graph(
        [
            helper.make_node("Tanh", ["x"], ["t"]),
            helper.make_node("Shape", ["h"], ["s"]),
            helper.make_node("Reshape", ["t", "s"], ["y"]),
            helper.make_node("ArgMax", ["h"], ["index"], axis=1),
            helper.make_node("Cast", ["h"], ["h_int"], to=TensorProto.INT32),
            helper.make_node("Cast", ["h_int"], ["z"], to=F32),
        ],
        "g",
        [helper.make_tensor_value_info("x", F32, [4, 8]), helper.make_tensor_value_info("h", F16, [8, 4])],
        [helper.make_tensor_value_info(n, t, None) for n, t in (("y", F32), ("index", TensorProto.INT64), ("z", F32))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert computed_in_sixteen_bit_float(model) == {}
    wrong = onnx.ModelProto()
    wrong.CopyFrom(model)
    wrong.graph.node[0].op_type = "Sigmoid"
    verdict = Checker(model).check(wrong, exact=False)
    assert not verdict.passed and [o.name for o in verdict.failures()] == ["y"]


def test_tolerances_the_user_gives_are_not_replaced_by_float16_s():
    half = keep_io_float16(scaled(1.0))
    (output,) = checker(half, ranges={"x_f32": (-1.0, 1.0)}, rtol=1e-6, atol=1e-7).check(half, exact=False).outputs
    assert output.computed_in is None and (output.rtol, output.atol) == (1e-6, 1e-7)


def test_a_result_annotated_as_integers_stops_float16_whatever_makes_it():
    """NonMaxSuppression is not among the operators known to give integers: its annotation says so."""
    graph = helper.make_graph(
        [
            helper.make_node("NonMaxSuppression", ["boxes", "scores"], ["index"]),
            helper.make_node("Cast", ["index"], ["y"], to=F32),
        ],
        "g",
        [
            helper.make_tensor_value_info("boxes", F16, [1, 4, 4]),
            helper.make_tensor_value_info("scores", F16, [1, 1, 4]),
        ],
        [helper.make_tensor_value_info("y", F32, None)],
        value_info=[helper.make_tensor_value_info("index", TensorProto.INT64, None)],
    )
    assert computed_in_sixteen_bit_float(helper.make_model(graph)) == {}
    graph.value_info.pop()  # unannotated, it is taken to carry float16 (the tolerance errs wide)
    assert computed_in_sixteen_bit_float(helper.make_model(graph)) == {"y": "float16"}


def _through_half(prefix: str, source: str, target: str) -> list[onnx.NodeProto]:
    """target = float32(Tanh(float16(source)))."""
    return [
        helper.make_node("Cast", [source], [f"{prefix}_h"], to=F16),
        helper.make_node("Tanh", [f"{prefix}_h"], [f"{prefix}_t"]),
        helper.make_node("Cast", [f"{prefix}_t"], [target], to=F32),
    ]


def _if_model(then_half: bool, else_half: bool) -> onnx.ModelProto:
    def branch(name, half):
        nodes = _through_half(name, "x", f"{name}_y") if half else [helper.make_node("Tanh", ["x"], [f"{name}_y"])]
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_y", F32, [2])])

    graph = helper.make_graph(
        [
            helper.make_node(
                "If", ["cond"], ["y"], then_branch=branch("then", then_half), else_branch=branch("else", else_half)
            ),
            helper.make_node("Relu", ["x"], ["plain"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", F32, [2]), helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info(n, F32, [2]) for n in ("y", "plain")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("then_half", "else_half"), [(True, False), (False, True), (False, False)])
def test_float16_inside_a_branch_reaches_the_if_s_output(then_half, else_half):
    """Either branch rounding in float16 makes the If's output so; a float32 output beside it and
    an If of two float32 branches keep float32's tolerance."""
    model = _if_model(then_half, else_half)
    expected = {"y": "float16"} if then_half or else_half else {}
    assert computed_in_sixteen_bit_float(model) == expected


def _loop_model(shadowing: bool) -> onnx.ModelProto:
    """A Loop carrying `a` through float16 and `b` in float32. With `shadowing`, the outer graph
    has a float16 tensor named like the body's float32 input `b_in`."""
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            *_through_half("a", "a_in", "a_out"),
            helper.make_node("Tanh", ["b_in"], ["b_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("a_in", F32, [2]),
            helper.make_tensor_value_info("b_in", F32 if shadowing else 0, [2] if shadowing else None),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("a_out", F32, [2]),
            helper.make_tensor_value_info("b_out", F32, [2]),
        ],
    )
    if not shadowing:
        body.input[3].type.Clear()
    nodes = [
        helper.make_node("Constant", [], ["trips"], value=numpy_helper.from_array(np.array(2, np.int64))),
        helper.make_node("Loop", ["trips", "", "x", "x"], ["a_final", "b_final"], body=body),
    ]
    if shadowing:
        nodes.insert(0, helper.make_node("Cast", ["x"], ["b_in"], to=F16))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", F32, [2])],
        [helper.make_tensor_value_info(n, F32, [2]) for n in ("a_final", "b_final")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("shadowing", [False, True], ids=["plain", "shadowing"])
def test_float16_inside_a_loop_reaches_only_its_own_carried_value(shadowing):
    """The Loop's body outputs its condition first: `a` (through float16) is the node's first
    output, `b` (float32) its second. A float16 tensor outside with the name of the body's own
    float32 input is another tensor."""
    model = _loop_model(shadowing)
    onnx.checker.check_model(model, full_check=True)
    assert computed_in_sixteen_bit_float(model) == {"a_final": "float16"}


def test_an_if_with_a_float16_branch_is_checked_at_float16_s_tolerance():
    """A rewrite that moves the If's output by 0.3% passes at float16's tolerance, and the plain
    output beside it still fails at float32's."""
    model = _if_model(True, False)
    moved = onnx.ModelProto()
    moved.CopyFrom(model)
    (then,) = [a.g for a in moved.graph.node[0].attribute if a.name == "then_branch"]
    then.node.append(helper.make_node("Mul", ["then_y", "scale"], ["then_scaled"]))
    then.initializer.append(numpy_helper.from_array(np.array([1.003], np.float32), "scale"))
    then.output[0].name = "then_scaled"
    verdict = Checker(model).check(moved, exact=False)
    statuses = {o.name: (o.computed_in, o.status) for o in verdict.outputs}
    assert statuses == {"y": ("float16", "ok"), "plain": (None, "ok")}
    wrong = onnx.ModelProto()
    wrong.CopyFrom(moved)
    wrong.graph.node[1].op_type = "Sigmoid"
    assert [o.name for o in Checker(model).check(wrong, exact=False).failures()] == ["plain"]
