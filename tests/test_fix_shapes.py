"""--fix-shapes (fuser/specialize.py): the sizes --dim and --input-shape give are written into
the model, so what depends on them folds; without it a symbolic dim stays symbolic."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper

import fuser
from fuser.errors import UsageError
from tests.helpers import in_process_cli, make_model, op_types, run


@pytest.fixture
def cli(monkeypatch, capfd):
    return in_process_cli(monkeypatch, capfd)


def _ones_like_model():
    """y = x + ConstantOfShape(Shape(x)): the ones tensor folds only once the batch is known."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("ConstantOfShape", ["s"], ["ones"], value=helper.make_tensor("one", 1, [1], [1.0])),
        helper.make_node("Add", ["x", "ones"], ["y"]),
    ]
    return make_model(nodes, [("x", np.float32, ["batch", 4])], [("y", np.float32, ["batch", 4])])


def _dims(value) -> list:
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value.type.tensor_type.shape.dim]


def test_without_fix_shapes_a_symbolic_dim_stays_and_nothing_folds():
    after, report = fuser.optimize(_ones_like_model(), dims={"batch": 2})
    assert op_types(after) == ["Shape", "ConstantOfShape", "Add"]
    assert _dims(after.graph.input[0]) == ["batch", 4] and report.fixed_shapes is None


def test_fixed_dims_fold_and_show_in_the_model_and_report():
    after, report = fuser.optimize(_ones_like_model(), dims={"batch": 2}, fix_shapes=True)
    assert op_types(after) == ["Add"]
    assert _dims(after.graph.input[0]) == [2, 4] and _dims(after.graph.output[0]) == [2, 4]
    assert report.fixed_shapes == {"x": [2, 4]} and report.to_dict()["fixed_shapes"] == {"x": [2, 4]}
    assert any("accepts only these sizes" in note for note in report.notes)
    assert report.verdict.passed and report.verdict.input_shapes == {"x": (2, 4)}
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_array_equal(run(after, {"x": x})[0], x + 1)


def test_input_shape_binds_the_symbols_it_covers_everywhere():
    nodes = [helper.make_node("Add", ["x", "z"], ["y"])]
    model = make_model(
        nodes,
        [("x", np.float32, ["batch", "?"]), ("z", np.float32, ["batch", 1])],
        [("y", np.float32, ["batch", None])],
    )
    model.graph.input[0].type.tensor_type.shape.dim[1].Clear()  # an unnamed dim
    after, report = fuser.optimize(model, shapes={"x": (3, 5)}, fix_shapes=True)
    assert report.fixed_shapes == {"x": [3, 5], "z": [3, 1]}
    assert _dims(after.graph.input[1]) == [3, 1]


@pytest.mark.parametrize(
    ("dims", "shapes", "message"),
    [
        ({}, {}, "give at least one"),
        ({"height": 2}, {}, "no symbolic dimension height"),
        ({}, {"x": (2, 5)}, "dimension 1 of x is fixed at 4, not 5"),
        ({}, {"x": (2,)}, "x has 2 dimensions, not 1"),
        ({"batch": 3}, {"x": (2, 4)}, "'batch' would be both 3 and 2"),
    ],
)
def test_sizes_that_cannot_be_fixed_are_usage_errors(dims, shapes, message):
    with pytest.raises(UsageError, match=message):
        fuser.optimize(_ones_like_model(), dims=dims, shapes=shapes, fix_shapes=True)


def test_an_input_with_a_default_weight_is_not_one_whose_shape_can_be_fixed(cli, tmp_path):
    """Since IR 4 an initializer may also be listed as an input, a default a caller could
    replace; the check feeds only the inputs without one, and so do the settings: both the
    settings check and --fix-shapes, with the check or without, refuse to fix its shape."""
    model = _ones_like_model()
    model.graph.input.append(helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, ["n"]))
    model.graph.initializer.append(helper.make_tensor("w", onnx.TensorProto.FLOAT, [2], [1.0, 2.0]))
    with pytest.raises(UsageError, match=r"no input w \(its inputs: x\)"):
        fuser.optimize(model, shapes={"w": (2,)}, fix_shapes=True, check=False)
    with pytest.raises(UsageError, match="no symbolic dimension n"):
        fuser.optimize(model, dims={"n": 2}, fix_shapes=True, check=False)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    result = cli(tmp_path, "optimize", "m.onnx", "--fix-shapes", "--input-shape", "w:2")
    assert result.returncode == 2 and "no input w" in result.stderr, result.stderr


def test_the_command_line_states_the_fixed_shapes(cli, tmp_path):
    source = tmp_path / "m.onnx"
    onnx.save(_ones_like_model(), str(source))
    done = cli(tmp_path, "optimize", source, "--dim", "batch=2", "--fix-shapes", "--report", "r.json")
    assert done.returncode == 0, done.stderr
    assert "--fix-shapes: written for inputs x[2,4]" in done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["fixed_shapes"] == {"x": [2, 4]} and report["verdict"] == "optimized"
    written = onnx.load(str(tmp_path / "m.fused.onnx"))
    assert _dims(written.graph.input[0]) == [2, 4] and op_types(written) == ["Add"]


def test_fix_shapes_from_pyproject(cli, tmp_path):
    source = tmp_path / "m.onnx"
    onnx.save(_ones_like_model(), str(source))
    (tmp_path / "pyproject.toml").write_text("[tool.fuser]\ndims = { batch = 2 }\nfix-shapes = true\n")
    done = cli(tmp_path, "optimize", source, "-o", tmp_path / "out.onnx")
    assert done.returncode == 0, done.stderr
    assert _dims(onnx.load(str(tmp_path / "out.onnx")).graph.input[0]) == [2, 4]


def test_a_model_only_specialised_is_reported_as_changed(cli, tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    source = tmp_path / "m.onnx"
    onnx.save(make_model(nodes, [("x", np.float32, ["batch", 4])], [("y", np.float32, ["batch", 4])]), str(source))
    done = cli(tmp_path, "optimize", source, "--dim", "batch=3", "--fix-shapes", "--format", "json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["verdict"] == "optimized" and report["rewrites"] == [] and report["fixed_shapes"] == {"x": [3, 4]}
    assert report["numerics"]["passed"]
