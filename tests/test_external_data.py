"""Models whose weights live in external data files, run from anywhere, written anywhere.

Every CLI test here runs from a third, unrelated folder: the input lives in one folder, the
output goes to another, so nothing works by accident of the working directory.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import fuser
from fuser.errors import UsageError
from fuser.model import writes_external_data
from tests.helpers import in_process_cli, make_model, run


@pytest.fixture
def cli(monkeypatch, capfd):
    return in_process_cli(monkeypatch, capfd)


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def conv_bn(channels: int = 8) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    return make_model(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["y"]),
        ],
        [("x", np.float32, ["batch", 3, "height", "width"])],
        [("y", np.float32, ["batch", channels, "height", "width"])],
        {
            "w": rng.standard_normal((channels, 3, 3, 3)).astype(np.float32),
            "scale": rng.uniform(0.5, 1.5, channels).astype(np.float32),
            "shift": rng.standard_normal(channels).astype(np.float32),
            "mean": rng.standard_normal(channels).astype(np.float32),
            "var": rng.uniform(0.5, 1.5, channels).astype(np.float32),
        },
    )


@pytest.fixture
def folders(tmp_path):
    """(input model with external data, an output folder, an unrelated working folder)."""
    source, target, elsewhere = tmp_path / "in", tmp_path / "out", tmp_path / "cwd"
    for folder in (source, target, elsewhere):
        folder.mkdir()
    onnx.save(conv_bn(16), source / "m.onnx", save_as_external_data=True, location="m.weights", size_threshold=0)
    return source / "m.onnx", target, elsewhere


def locations(path: Path) -> set[str]:
    model = onnx.load(path, load_external_data=False)
    return {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_external_data_model_optimized_from_elsewhere_into_a_third_folder(cli, folders):
    source, target, elsewhere = folders
    before = snapshot(source.parent)
    result = cli(elsewhere, "optimize", source, "-o", target / "fused.onnx")
    assert result.returncode == 0, result.stderr
    assert "numerics check: passed on x[1,3,224,224]" in result.stderr
    assert sorted(p.name for p in target.iterdir()) == ["fused.onnx", "fused.onnx.data"]
    assert locations(target / "fused.onnx") == {"fused.onnx.data"}  # relative, never the input's file
    assert snapshot(source.parent) == before and list(elsewhere.iterdir()) == []
    # The output stands alone: it runs with the input's folder gone, from yet another folder.
    os.rename(source.parent, source.parent.with_name("moved"))
    written = onnx.load(target / "fused.onnx")
    assert [n.op_type for n in written.graph.node] == ["Conv"]
    x = np.random.default_rng(1).standard_normal((1, 3, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(run(written, {"x": x})[0], run(conv_bn(16), {"x": x})[0], rtol=1e-4, atol=1e-5)


def test_external_data_never_writes_one_self_contained_file(cli, folders):
    source, target, elsewhere = folders
    result = cli(elsewhere, "optimize", source, "-o", target / "fused.onnx", "--external-data", "never")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in target.iterdir()) == ["fused.onnx"] and locations(target / "fused.onnx") == set()
    onnx.checker.check_model(str(target / "fused.onnx"), full_check=True)


def test_external_data_always_moves_inline_weights_out(cli, tmp_path):
    (tmp_path / "cwd").mkdir()
    onnx.save(conv_bn(channels=16), tmp_path / "m.onnx")
    result = cli(tmp_path / "cwd", "optimize", tmp_path / "m.onnx", "--external-data", "always")
    assert result.returncode == 0, result.stderr
    assert locations(tmp_path / "m.fused.onnx") == {"m.fused.onnx.data"}
    model = onnx.load(tmp_path / "m.fused.onnx", load_external_data=False)
    inline = [t.name for t in model.graph.initializer if not t.external_data]
    assert len(inline) == 1  # the 64-byte bias stays inline; the 1.7 KB weight goes out
    onnx.checker.check_model(str(tmp_path / "m.fused.onnx"), full_check=True)


def test_compare_and_check_work_from_elsewhere(cli, folders):
    source, target, elsewhere = folders
    assert cli(elsewhere, "optimize", source, "-o", target / "fused.onnx").returncode == 0
    compared = cli(elsewhere, "compare", source, target / "fused.onnx")
    assert compared.returncode == 0, compared.stderr
    assert cli(elsewhere, "check", target / "fused.onnx").returncode == 0


def test_python_api_from_elsewhere(folders, monkeypatch):
    source, _, elsewhere = folders
    monkeypatch.chdir(elsewhere)
    _, report = fuser.optimize(source)
    assert report.verdict.passed and report.verdict.input_shapes == {"x": (1, 3, 224, 224)}


def test_the_python_api_hands_back_weights_no_rule_touched_inline(tmp_path, monkeypatch):
    """Gemm takes MatMul's weight and Add's bias as they are: read from the data file, they must
    still be in the model handed back, which runs anywhere, saved or as bytes."""
    import onnxruntime as ort

    rng = np.random.default_rng(3)
    weights = {"w": rng.standard_normal((64, 64)).astype(np.float32), "b": rng.standard_normal(64).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    original = make_model(nodes, [("x", np.float32, [8, 64])], [("y", np.float32, [8, 64])], weights)
    (tmp_path / "in").mkdir()
    (tmp_path / "cwd").mkdir()
    source = tmp_path / "in" / "m.onnx"
    onnx.save(original, source, save_as_external_data=True, size_threshold=0, location="m.onnx.data")
    monkeypatch.chdir(tmp_path / "cwd")
    x = rng.standard_normal((8, 64)).astype(np.float32)
    for check in (True, False):
        optimized, report = fuser.optimize(source, check=check)
        assert report.counts == {"matmul-add-gemm": 1}
        assert not any(t.external_data for t in optimized.graph.initializer)
        session = ort.InferenceSession(optimized.SerializeToString(), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(
            session.run(None, {"x": x})[0], x @ weights["w"] + weights["b"], rtol=1e-5, atol=1e-5
        )


def test_files_get_the_usual_permissions(cli, folders, umask_022):
    source, target, elsewhere = folders
    result = cli(elsewhere, "optimize", source, "-o", target / "fused.onnx", "--report", target / "r.json")
    assert result.returncode == 0, result.stderr
    for name in ("fused.onnx", "fused.onnx.data", "r.json"):
        assert stat.S_IMODE((target / name).stat().st_mode) == 0o644, name
    assert [p.name for p in target.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_an_existing_data_file_is_not_replaced_without_force(cli, folders):
    source, target, elsewhere = folders
    (target / "fused.onnx.data").write_bytes(b"someone else's")
    result = cli(elsewhere, "optimize", source, "-o", target / "fused.onnx")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "fused.onnx.data already exists; pass --force" in result.stderr
    assert sorted(p.name for p in target.iterdir()) == ["fused.onnx.data"]
    assert cli(elsewhere, "optimize", source, "-o", target / "fused.onnx", "--force").returncode == 0


def test_the_output_may_not_take_the_inputs_data_file(cli, folders):
    source, _, elsewhere = folders
    os.rename(source.parent / "m.weights", source.parent / "out.onnx.data")
    model = onnx.load(source, load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "out.onnx.data"
    onnx.save(model, source)
    before = snapshot(source.parent)
    result = cli(elsewhere, "optimize", source, "-o", source.parent / "out.onnx", "--force")
    assert result.returncode == 2 and "input's own data file" in result.stderr, result.stderr
    assert snapshot(source.parent) == before


def test_the_output_may_not_replace_the_inputs_data_file_even_with_force(cli, folders):
    source, _, elsewhere = folders
    before = snapshot(source.parent)
    result = cli(elsewhere, "optimize", source, "-o", source.parent / "m.weights", "--force")
    assert result.returncode == 2 and "refusing to overwrite the input's external data" in result.stderr
    assert result.stderr.count("\n") == 1
    assert snapshot(source.parent) == before


def test_locations_escaping_the_models_folder_are_still_refused(cli, folders):
    source, target, elsewhere = folders
    model = onnx.load(source, load_external_data=False)
    model.graph.initializer[0].external_data[0].value = "../cwd/stolen"
    (elsewhere / "stolen").write_bytes(b"\0" * 4096)
    onnx.save(model, source)
    result = cli(elsewhere, "optimize", source, "-o", target / "fused.onnx")
    assert result.returncode == 2 and "outside the model's folder" in result.stderr
    assert list(target.iterdir()) == []


def test_models_over_2_gb_are_always_written_with_external_data():
    huge = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2**29 + 1])  # 2 GB + 4 bytes
    model = helper.make_model(helper.make_graph([], "g", [], [], [huge]))
    assert writes_external_data(model, "auto") and writes_external_data(model, "always")
    with pytest.raises(UsageError, match="exceed 2 GB"):
        writes_external_data(model, "never")
    small = helper.make_model(helper.make_graph([], "g", [], [], []))
    assert not writes_external_data(small, "auto")


def test_an_external_data_file_too_short_for_its_tensor_is_the_inputs_fault(cli, folders):
    source, target, elsewhere = folders
    data = source.parent / "m.weights"
    data.write_bytes(data.read_bytes()[:-8])  # the last tensor loses two floats
    before = snapshot(source.parent)
    result = cli(elsewhere, "optimize", source, "-o", target / "fused.onnx")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "does not hold the" in result.stderr and "m.weights" in result.stderr
    assert snapshot(source.parent) == before and list(target.iterdir()) == []


def test_size_on_disk_counts_the_data_file_and_only_a_referenced_one(cli, folders):
    source, target, elsewhere = folders
    first = cli(elsewhere, "optimize", source, "-o", target / "fused.onnx", "--report", target / "a.json")
    assert first.returncode == 0, first.stderr
    report = json.loads((target / "a.json").read_text())
    assert report["size_before"] == source.stat().st_size + (source.parent / "m.weights").stat().st_size
    assert report["size_after"] == sum((target / n).stat().st_size for n in ("fused.onnx", "fused.onnx.data"))
    again = cli(
        elsewhere, "optimize", source, "-o", target / "fused.onnx", "--force", "--external-data", "never",
        "--report", target / "b.json",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert json.loads((target / "b.json").read_text())["size_after"] == (target / "fused.onnx").stat().st_size


def test_weights_can_be_handed_to_onnxruntime_inline_from_any_folder(folders, monkeypatch):
    """The fallback for an onnxruntime without the external-data folder option."""
    import onnxruntime as ort

    from fuser.verify import with_inline_weights

    source, _, elsewhere = folders
    monkeypatch.chdir(elsewhere)
    model = onnx.load(source, load_external_data=False)
    inline = with_inline_weights(model, source.parent)
    assert all(not t.external_data for t in inline.graph.initializer)
    assert model.graph.initializer[0].external_data  # the given model is left as it was
    x = np.random.default_rng(2).standard_normal((1, 3, 4, 4)).astype(np.float32)
    session = ort.InferenceSession(inline.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], run(conv_bn(16), {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_a_location_with_a_nul_byte_is_an_input_error(cli, folders):
    source, target, elsewhere = folders
    model = onnx.load(source, load_external_data=False)
    model.graph.initializer[0].external_data[0].value = "weights\0.bin"
    onnx.save(model, source)
    result = cli(elsewhere, "optimize", source, "-o", target / "fused.onnx")
    assert result.returncode == 2 and "holds a NUL byte" in result.stderr, result.stderr
    assert list(target.iterdir()) == []


def held_in_attributes() -> onnx.ModelProto:
    """y = Identity((x + ConstantOfShape(Shape(x))) * k), with the fill and the Constant's value
    tensors that a model saved with convert_attribute=True keeps in external data."""
    fill = onnx.numpy_helper.from_array(np.array([1.5], np.float32))
    k = onnx.numpy_helper.from_array(np.arange(1, 7, dtype=np.float32).reshape(2, 3))
    return make_model(
        [
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("ConstantOfShape", ["shape"], ["filled"], value=fill),
            helper.make_node("Constant", [], ["k"], value=k),
            helper.make_node("Add", ["x", "filled"], ["sum"]),
            helper.make_node("Mul", ["sum", "k"], ["product"]),
            helper.make_node("Identity", ["product"], ["y"]),
        ],
        [("x", np.float32, ["rows", 3])],
        [("y", np.float32, ["rows", 3])],
        {},
    )


def attribute_locations(path: Path) -> set[str]:
    model = onnx.load(path, load_external_data=False)
    return {
        e.value
        for n in model.graph.node
        for a in n.attribute
        if a.HasField("t")
        for e in a.t.external_data
        if e.key == "location"
    }


@pytest.fixture
def attribute_data(tmp_path):
    """(a model whose attribute tensors are in 'attrs.bin' beside it, an output folder, an unrelated working folder)."""
    source, target, elsewhere = tmp_path / "in", tmp_path / "out", tmp_path / "cwd"
    for folder in (source, target, elsewhere):
        folder.mkdir()
    onnx.save(
        held_in_attributes(),
        source / "m.onnx",
        save_as_external_data=True,
        location="attrs.bin",
        size_threshold=0,
        convert_attribute=True,
    )
    assert attribute_locations(source / "m.onnx") == {"attrs.bin"}
    return source / "m.onnx", target, elsewhere


def test_attribute_tensors_in_external_data_are_read_from_beside_the_model(cli, attribute_data):
    # Left as references, onnx's checker read them against the working folder (the model was
    # refused as invalid) and the output named an attrs.bin beside it that does not exist.
    source, target, elsewhere = attribute_data
    before = snapshot(source.parent)
    result = cli(elsewhere, "optimize", source, "-o", target / "fused.onnx")
    assert result.returncode == 0, result.stderr
    assert "numerics check: passed" in result.stderr
    assert attribute_locations(target / "fused.onnx") == set()
    assert locations(target / "fused.onnx") <= {"fused.onnx.data"}
    assert snapshot(source.parent) == before and list(elsewhere.iterdir()) == []
    os.rename(source.parent, source.parent.with_name("moved"))  # the output needs nothing of the input's
    x = np.random.default_rng(2).standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(
        run(onnx.load(target / "fused.onnx"), {"x": x})[0], run(held_in_attributes(), {"x": x})[0]
    )


def test_check_and_compare_read_attribute_data_from_beside_the_model(cli, attribute_data):
    source, target, elsewhere = attribute_data
    checked = cli(elsewhere, "check", source)  # exit 1: it finds what optimize would fuse
    assert checked.returncode == 1 and "3 fusion opportunities" in checked.stderr, checked.stderr
    assert cli(elsewhere, "optimize", source, "-o", target / "fused.onnx").returncode == 0
    compared = cli(elsewhere, "compare", source, target / "fused.onnx")
    assert compared.returncode == 0, compared.stderr


def test_the_output_may_not_replace_a_file_attribute_data_was_read_from(cli, attribute_data):
    source, _, elsewhere = attribute_data
    before = snapshot(source.parent)
    result = cli(elsewhere, "optimize", source, "-o", source.parent / "attrs.bin", "--force")
    assert result.returncode == 2 and "refusing to overwrite the input's external data" in result.stderr
    assert snapshot(source.parent) == before


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda data: data.write_bytes(data.read_bytes()[:-4]), "does not hold the"),
        (lambda data: data.unlink(), "does not exist beside the model"),
    ],
    ids=["truncated", "missing"],
)
def test_attribute_data_that_is_not_there_is_the_inputs_fault(cli, attribute_data, damage, said):
    source, target, elsewhere = attribute_data
    damage(source.parent / "attrs.bin")
    result = cli(elsewhere, "optimize", source, "-o", target / "fused.onnx")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert said in result.stderr and list(target.iterdir()) == []


def test_a_large_main_graph_constant_kept_outside_becomes_an_initializer_read_lazily(tmp_path, monkeypatch):
    # Read in, a Constant of gigabytes would be held in memory and copied into the skeleton
    # onnx's checker reads (which protobuf cannot serialize past 2 GB). A small one is read in:
    # shape inference must see a shape's values.
    large = onnx.numpy_helper.from_array(np.linspace(-1, 1, 20_000, dtype=np.float32))
    small = onnx.numpy_helper.from_array(np.array([2, 10_000], np.int64))
    model = make_model(
        [
            helper.make_node("Constant", [], ["large"], value=large),
            helper.make_node("Constant", [], ["shape"], value=small),
            helper.make_node("Reshape", ["large", "shape"], ["table"]),
            helper.make_node("Add", ["x", "table"], ["y"]),
        ],
        [("x", np.float32, [2, 10_000])],
        [("y", np.float32, [2, 10_000])],
        {},
    )
    (tmp_path / "in").mkdir()
    source = tmp_path / "in" / "m.onnx"
    onnx.save(model, source, save_as_external_data=True, location="held.bin", size_threshold=0, convert_attribute=True)
    monkeypatch.chdir(tmp_path)
    loaded = fuser.Model.load(source)
    held = {t.name: t for t in loaded.initializers()}
    assert list(held) == ["large"] and [e.value for e in held["large"].external_data if e.key == "location"] == [
        "held.bin"
    ]
    assert [n.op_type for n in loaded.graph.nodes()] == ["Constant", "Reshape", "Add"]
    assert loaded.data_files() == {source.parent / "held.bin"}
    optimized, report = fuser.optimize(source)
    assert report.verdict.passed


def test_a_constant_kept_outside_stays_a_node_where_an_initializer_would_change_the_model(cli, tmp_path):
    # Named like a graph input, an initializer would be that input's default: fed, the input
    # would replace the constant. onnx's check refuses the model as it is.
    large = onnx.numpy_helper.from_array(np.ones(20_000, np.float32))
    vector = [20_000]
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["k"], value=large), helper.make_node("Add", ["x", "k"], ["y"])],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, vector) for n in ("x", "k")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, vector)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (tmp_path / "in").mkdir()
    onnx.save(
        model, tmp_path / "in" / "m.onnx", save_as_external_data=True, location="held.bin", convert_attribute=True
    )
    result = cli(tmp_path, "optimize", tmp_path / "in" / "m.onnx", "-o", tmp_path / "out.onnx")
    assert result.returncode == 2 and "invalid ONNX model" in result.stderr, result.stderr
    assert not (tmp_path / "out.onnx").exists()


def subgraph_and_function_holders() -> onnx.ModelProto:
    """y = If(c, then: x * k_then, else: Scaled(x)) where k_then is a Constant in the then-branch,
    the else-branch reads a body initializer, and Scaled is a model-local function whose Constant
    holds its factor: every place a tensor other than a main-graph initializer is stored."""
    float_type = TensorProto.FLOAT
    k_then = onnx.numpy_helper.from_array(np.arange(1, 4, dtype=np.float32))
    then_branch = helper.make_graph(
        [helper.make_node("Constant", [], ["k_then"], value=k_then), helper.make_node("Mul", ["x", "k_then"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", float_type, [3])],
    )
    else_branch = helper.make_graph(
        [
            helper.make_node("Scaled", ["x"], ["scaled"], domain="local"),
            helper.make_node("Add", ["scaled", "b"], ["e"]),
        ],
        "else",
        [],
        [helper.make_tensor_value_info("e", float_type, [3])],
        [onnx.numpy_helper.from_array(np.array([0.5, -1.0, 2.0], np.float32), "b")],
    )
    factor = onnx.numpy_helper.from_array(np.array([3.0, 4.0, 5.0], np.float32))
    scaled = helper.make_function(
        "local",
        "Scaled",
        ["v"],
        ["w"],
        [helper.make_node("Constant", [], ["f"], value=factor), helper.make_node("Mul", ["v", "f"], ["w"])],
        [helper.make_opsetid("", 17)],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch)],
        "g",
        [helper.make_tensor_value_info("x", float_type, [3]), helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", float_type, [3])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    model = helper.make_model(graph, opset_imports=opsets, functions=[scaled])
    model.ir_version = 8
    return model


def test_tensors_in_bodies_and_functions_kept_outside_are_read_from_beside_the_model(cli, tmp_path):
    source, target, elsewhere = tmp_path / "in", tmp_path / "out", tmp_path / "cwd"
    for folder in (source, target, elsewhere):
        folder.mkdir()
    original = subgraph_and_function_holders()
    stored = onnx.ModelProto()
    stored.CopyFrom(original)
    onnx.external_data_helper.convert_model_to_external_data(
        stored, location="held.bin", size_threshold=0, convert_attribute=True
    )
    onnx.save(stored, source / "m.onnx")
    assert "held.bin" in (source / "m.onnx").read_bytes().decode("latin-1")
    before = snapshot(source)
    result = cli(elsewhere, "optimize", source / "m.onnx", "-o", target / "fused.onnx", "--check-runs", "4")
    assert result.returncode == 0, result.stderr
    assert snapshot(source) == before and list(elsewhere.iterdir()) == []
    os.rename(source, source.with_name("moved"))  # the output needs nothing of the input's
    written = onnx.load(target / "fused.onnx")
    x = np.array([1.0, 2.0, 3.0], np.float32)
    for condition in (True, False):
        feeds = {"x": x, "c": np.array(condition)}
        np.testing.assert_array_equal(run(written, feeds)[0], run(original, feeds)[0])


def test_saving_may_not_replace_a_file_read_in_at_load(tmp_path):
    fill = onnx.numpy_helper.from_array(np.array([1.5], np.float32))
    model = make_model(
        [
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("ConstantOfShape", ["shape"], ["filled"], value=fill),
            helper.make_node("Add", ["x", "filled"], ["y"]),
        ],
        [("x", np.float32, ["rows", 3])],
        [("y", np.float32, ["rows", 3])],
        {},
    )
    onnx.save(
        model,
        tmp_path / "m.onnx",
        save_as_external_data=True,
        location="o.onnx.data",
        size_threshold=0,
        convert_attribute=True,
    )
    before = snapshot(tmp_path)
    loaded = fuser.Model.load(tmp_path / "m.onnx")
    assert not list(loaded.initializers()) and loaded.files_read_in == {tmp_path / "o.onnx.data"}
    with pytest.raises(UsageError, match="input's own data file"):
        loaded.save(tmp_path / "o.onnx", external_data="always")
    with pytest.raises(UsageError, match="refusing to overwrite a file the model's data is read from"):
        loaded.save(tmp_path / "o.onnx.data")
    assert snapshot(tmp_path) == before


def test_saving_may_not_replace_the_weights_file(folders):
    source, _, _ = folders
    before = snapshot(source.parent)
    with pytest.raises(UsageError, match="refusing to overwrite a file the model's data is read from"):
        fuser.Model.load(source).save(source.parent / "m.weights", external_data="never")
    assert snapshot(source.parent) == before
