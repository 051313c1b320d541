"""Large weights inside a .onnx file are read where they lie in it, not parsed into memory.

read_model turns each main-graph initializer of more than IN_PLACE_BYTES into a reference to
its bytes in the file itself (external data whose location is the file): nothing a user sees
may change. A model written from it is the file's own bytes where nothing was rewritten, a
ModelProto handed to a caller holds its weights inline, and the check reads them in place.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import fuser
from fuser.errors import InputError
from fuser.model import Model, read_model, write_model
from fuser.tensors import IN_PLACE_BYTES, read_in_place, uses_external_data
from tests.helpers import in_process_cli, make_model

LARGE = IN_PLACE_BYTES // 4 + 64  # float32 elements: just over the threshold


@pytest.fixture
def cli(monkeypatch, capfd):
    return in_process_cli(monkeypatch, capfd)


def matmul_add(seed: int = 0) -> onnx.ModelProto:
    """MatMul by a weight read in place, Add of a bias that stays inline, a Reshape target."""
    rng = np.random.default_rng(seed)
    width = 16
    return make_model(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Add", ["h", "b"], ["y"]),
        ],
        [("x", np.float32, ["batch", LARGE // width])],
        [("y", np.float32, ["batch", width])],
        {
            "w": rng.standard_normal((LARGE // width, width)).astype(np.float32),
            "b": rng.standard_normal(width).astype(np.float32),
        },
    )


def test_a_large_weight_is_a_reference_into_the_file_and_reads_the_same_values(tmp_path):
    proto = matmul_add()
    onnx.save(proto, tmp_path / "m.onnx")
    read = read_model(tmp_path / "m.onnx")
    weight, bias = read.graph.initializer
    assert uses_external_data(weight) and not uses_external_data(bias)
    fields = {e.key: e.value for e in weight.external_data}
    assert fields["location"] == "m.onnx"
    data = (tmp_path / "m.onnx").read_bytes()
    offset, length = int(fields["offset"]), int(fields["length"])
    assert data[offset : offset + length] == proto.graph.initializer[0].raw_data
    model = Model.load(tmp_path / "m.onnx")
    assert np.array_equal(model.graph.constant_value("w"), numpy_helper.to_array(proto.graph.initializer[0]))


@pytest.mark.parametrize("states_location", [False, True])
def test_the_model_given_back_is_the_file_exactly(tmp_path, states_location):
    """Whether the file wrote data_location DEFAULT out or left it implied, the weight comes
    back as it was: in to_proto, and in the bytes of the model written unchanged."""
    proto = matmul_add()
    if states_location:
        for tensor in proto.graph.initializer:
            tensor.data_location = TensorProto.DEFAULT
    onnx.save(proto, tmp_path / "m.onnx")
    model = Model.load(tmp_path / "m.onnx")
    assert model.to_proto() == onnx.load(tmp_path / "m.onnx")
    assert not any(uses_external_data(t) for t in model.to_proto().graph.initializer)
    written = write_model(model.parts(), tmp_path / "out.onnx", source_dir=tmp_path, tensors=model.tensors)
    assert written == [tmp_path / "out.onnx"]  # one file, as the input was
    assert (tmp_path / "out.onnx").read_bytes() == (tmp_path / "m.onnx").read_bytes()


def test_optimize_writes_what_the_model_parsed_whole_gives(cli, tmp_path):
    proto = matmul_add()
    onnx.save(proto, tmp_path / "m.onnx")
    done = cli(tmp_path, "optimize", "m.onnx", "-o", "out.onnx")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "out.onnx"]
    whole, report = fuser.optimize(Model(onnx.load(tmp_path / "m.onnx")), check=False)
    assert report.counts == {"matmul-add-gemm": 1}
    assert (tmp_path / "out.onnx").read_bytes() == whole.SerializeToString(deterministic=True)


def test_the_python_api_returns_the_weights_inline(tmp_path):
    onnx.save(matmul_add(), tmp_path / "m.onnx")
    optimized, report = fuser.optimize(tmp_path / "m.onnx")
    assert report.verdict.passed and report.counts == {"matmul-add-gemm": 1}
    assert not any(uses_external_data(t) for t in optimized.graph.initializer)
    onnx.checker.check_model(optimized)


def test_the_check_reads_the_weights_in_place_and_catches_a_changed_one(tmp_path):
    """The original's weights in place in its file, the candidate's changed in memory."""
    from fuser.verify import Checker

    onnx.save(matmul_add(), tmp_path / "m.onnx")
    model = Model.load(tmp_path / "m.onnx")
    checker = Checker(model.unchanged_proto(), base_dir=tmp_path)
    assert checker.check(model.parts(), exact=True).passed
    changed = onnx.load(tmp_path / "m.onnx")
    weight = numpy_helper.to_array(changed.graph.initializer[0]) + 0.5
    changed.graph.initializer[0].CopyFrom(numpy_helper.from_array(weight, "w"))
    assert not checker.check(changed, exact=False).passed


def test_external_data_of_its_own_stays_external(cli, tmp_path):
    onnx.save(matmul_add(), tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    done = cli(tmp_path, "optimize", "m.onnx", "-o", "out.onnx")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out.onnx.data").exists()


def _raw(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString()


def test_tensors_it_cannot_follow_are_parsed_as_they_are():
    """An IR 3 model (weights are graph inputs too), a string tensor, a tensor already external,
    and bytes that are not a model are left to protobuf."""
    ir3 = matmul_add()
    ir3.ir_version = 3
    assert read_in_place(memoryview(_raw(ir3)), "m.onnx") is None
    strings = matmul_add()
    strings.graph.initializer.append(helper.make_tensor("s", TensorProto.STRING, [LARGE], [b"x"] * LARGE))
    rewritten, _ = read_in_place(memoryview(_raw(strings)), "m.onnx")
    parsed = onnx.ModelProto.FromString(rewritten)
    assert [uses_external_data(t) for t in parsed.graph.initializer] == [True, False, False]
    assert read_in_place(memoryview(b"\xff\xff\xff"), "m.onnx") is None
    assert read_in_place(memoryview(_raw(matmul_add())[:-7]), "m.onnx") is None


def test_a_truncated_file_is_still_refused_with_a_message(tmp_path):
    data = _raw(matmul_add())
    (tmp_path / "cut.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="not an ONNX model"):
        read_model(tmp_path / "cut.onnx")


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(
        st.sampled_from([1, 16, IN_PLACE_BYTES // 4, IN_PLACE_BYTES // 4 + 1, LARGE]), min_size=1, max_size=5
    ),
    states=st.lists(st.booleans(), min_size=5, max_size=5),
    dtype=st.sampled_from([np.float32, np.float16, np.int64, np.uint8]),
)
def test_reading_in_place_changes_nothing_a_parse_would_see(tmp_path_factory, sizes, states, dtype):
    """Whatever the sizes and the stated data_location, the model read with its weights in place
    and put back inline equals the file parsed whole."""
    folder = tmp_path_factory.mktemp("in_place")
    rng = np.random.default_rng(len(sizes))
    initializers = []
    for index, size in enumerate(sizes):
        tensor = numpy_helper.from_array((rng.standard_normal(size) * 100).astype(dtype), f"t{index}")
        if states[index]:
            tensor.data_location = TensorProto.DEFAULT
        initializers.append(tensor)
    nodes = [helper.make_node("Identity", [t.name], [f"o{i}"]) for i, t in enumerate(initializers)]
    outputs = [helper.make_tensor_value_info(f"o{i}", t.data_type, list(t.dims)) for i, t in enumerate(initializers)]
    graph = helper.make_graph(nodes, "g", [], outputs, initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "m.onnx")
    model = Model.load(folder / "m.onnx")
    in_place = [uses_external_data(t) for t in model.graph.initializers()]
    assert in_place == [t.ByteSize() > IN_PLACE_BYTES and len(t.raw_data) > IN_PLACE_BYTES for t in initializers]
    assert model.to_proto() == onnx.load(folder / "m.onnx")
