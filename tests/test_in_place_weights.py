"""Large weights inside a .onnx file are read where they lie in it, not parsed into memory.

read_model turns each main-graph initializer of more than IN_PLACE_BYTES into a reference to
its bytes in the file itself (external data whose location is the file): nothing a user sees
may change. A model written from it is the file's own bytes where nothing was rewritten, a
ModelProto handed to a caller holds its weights inline, and the check reads them in place.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import fuser
import fuser.api
import fuser.errors
from fuser.errors import InputError
from fuser.graph import ModelParts
from fuser.model import Model, read_model, write_model
from fuser.tensors import uses_external_data
from fuser.verify import FEED_BYTES
from fuser.wire import IN_PLACE_BYTES, encode_varint, read_in_place, varint_size
from tests.helpers import in_process_cli, make_model

# float32 elements: just over the threshold, and large enough for the check to feed it (FEED_BYTES)
LARGE = max(IN_PLACE_BYTES, FEED_BYTES) // 4 + 64


@pytest.fixture
def cli(monkeypatch, capfd):
    return in_process_cli(monkeypatch, capfd)


def in_place(model: Model) -> list[bool]:
    """Which of the model's main-graph initializers are read in place (as the model was read)."""
    return [uses_external_data(t) for t in model.unchanged_proto().graph.initializer]


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
    assert in_place(model) == [True, False]
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
    assert in_place(model) == [True, False]
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
    external = matmul_add()
    external.graph.initializer[0].data_location = TensorProto.EXTERNAL
    external.graph.initializer[0].external_data.add(key="location", value="w.bin")
    assert read_in_place(memoryview(_raw(external)), "m.onnx") is None
    segmented = matmul_add()
    segmented.graph.initializer[0].segment.begin = 0
    assert read_in_place(memoryview(_raw(segmented)), "m.onnx") is None
    strings = matmul_add()
    strings.graph.initializer.append(helper.make_tensor("s", TensorProto.STRING, [LARGE], [b"x"] * LARGE))
    rewritten, _ = read_in_place(memoryview(_raw(strings)), "m.onnx")
    parsed = onnx.ModelProto.FromString(rewritten)
    assert [uses_external_data(t) for t in parsed.graph.initializer] == [True, False, False]
    assert read_in_place(memoryview(b"\xff\xff\xff"), "m.onnx") is None
    assert read_in_place(memoryview(_raw(matmul_add())[:-7]), "m.onnx") is None


def test_a_weight_of_the_wrong_length_is_refused_as_inline_data_is(tmp_path):
    proto = matmul_add()
    proto.graph.initializer[0].raw_data += b"\0\0\0\0"
    onnx.save(proto, tmp_path / "m.onnx")
    with pytest.raises(InputError, match=r"initializer 'w' holds \d+ bytes but its dtype float"):
        read_model(tmp_path / "m.onnx")


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


def test_a_linked_model_file_is_read_whole(tmp_path):
    """A model reached through a link into another folder (a Hugging Face cache's snapshots): its
    weights cannot be looked up beside it as external data, so they are parsed as before."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snapshot").mkdir()
    onnx.save(matmul_add(), tmp_path / "blobs" / "sha")
    (tmp_path / "snapshot" / "model.onnx").symlink_to(tmp_path / "blobs" / "sha")
    model = Model.load(tmp_path / "snapshot" / "model.onnx")
    assert in_place(model) == [False, False]
    report = fuser.optimize(tmp_path / "snapshot" / "model.onnx")[1]
    assert report.verdict.passed


def test_a_pipe_is_read_whole(tmp_path):
    data = _raw(matmul_add())
    os.mkfifo(tmp_path / "pipe.onnx")
    writer = threading.Thread(target=lambda: (tmp_path / "pipe.onnx").write_bytes(data))
    writer.start()
    try:
        model = Model.load(tmp_path / "pipe.onnx")
    finally:
        writer.join()
    assert in_place(model) == [False, False]
    assert model.to_proto() == onnx.ModelProto.FromString(data)


def test_weights_are_read_from_the_models_folder_whatever_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    onnx.save(matmul_add(), tmp_path / "m" / "m.onnx")
    monkeypatch.chdir(tmp_path)
    model = Model.load(Path("m") / "m.onnx")
    monkeypatch.chdir("/")
    optimized, report = fuser.optimize(model)
    assert report.verdict.passed and not any(uses_external_data(t) for t in optimized.graph.initializer)


def test_a_file_replaced_while_it_is_checked_is_refused(tmp_path, monkeypatch):
    """The file is known as it was when its weights were located, not as it is after the
    loader's checks: a file replaced in between is refused, not misread."""
    import fuser.model

    onnx.save(matmul_add(seed=0), tmp_path / "m.onnx")
    onnx.save(matmul_add(seed=1), tmp_path / "other.onnx")
    real_check = fuser.model.onnx.checker.check_model

    def replaced_meanwhile(*args, **kwargs):
        shutil.move(tmp_path / "other.onnx", tmp_path / "m.onnx")
        return real_check(*args, **kwargs)

    monkeypatch.setattr(fuser.model.onnx.checker, "check_model", replaced_meanwhile)
    model = Model.load(tmp_path / "m.onnx")
    monkeypatch.undo()
    with pytest.raises(InputError, match="changed since the model was read"):
        model.graph.constant_value("w")


def test_an_anonymous_pipe_and_a_backslashed_name_load(tmp_path):
    onnx.save(matmul_add(), tmp_path / "m.onnx")
    reader, writer = os.pipe()
    data = (tmp_path / "m.onnx").read_bytes()
    feeder = threading.Thread(target=lambda: (os.write(writer, data), os.close(writer)))
    feeder.start()
    try:
        model = Model.load(Path(f"/dev/fd/{reader}"))
    finally:
        feeder.join()
        os.close(reader)
    assert in_place(model) == [False, False]
    shutil.copy(tmp_path / "m.onnx", tmp_path / "\\m.onnx")
    assert in_place(Model.load(tmp_path / "\\m.onnx")) == [False, False]


def test_saving_over_its_own_file_keeps_the_weights(tmp_path, monkeypatch):
    onnx.save(matmul_add(), tmp_path / "m.onnx")
    expected = onnx.load(tmp_path / "m.onnx")
    model = Model.load(tmp_path / "m.onnx")
    model.save(tmp_path / "m.onnx")
    assert onnx.load(tmp_path / "m.onnx") == expected
    assert model.to_proto() == expected  # the weights came into memory before the file was replaced
    monkeypatch.chdir(tmp_path)  # loaded by a relative path, saved from another working directory
    relative = Model.load(Path("m.onnx"))
    monkeypatch.chdir("/")
    relative.save(tmp_path / "m.onnx")
    assert relative.to_proto() == expected


def test_a_file_changed_since_it_was_read_is_refused_not_misread(tmp_path):
    onnx.save(matmul_add(seed=0), tmp_path / "m.onnx")
    model = Model.load(tmp_path / "m.onnx")
    onnx.save(matmul_add(seed=1), tmp_path / "other.onnx")
    shutil.move(tmp_path / "other.onnx", tmp_path / "m.onnx")  # same size, other weights
    with pytest.raises(InputError, match="changed since the model was read"):
        model.to_proto()


@pytest.mark.parametrize("states_location", [True, False])
@pytest.mark.parametrize("flag", [["--opset", "18"], ["--fix-shapes", "--dim", "batch=2"]])
def test_derived_models_write_the_weights_as_the_file_had_them(cli, tmp_path, flag, states_location):
    """--opset and --fix-shapes build a new model from the loaded one: it reads the same file, and
    writes the weight read in place as the file had it (onnx's converter rewrites the others)."""
    proto = matmul_add()
    if states_location:
        for tensor in proto.graph.initializer:
            tensor.data_location = TensorProto.DEFAULT
    onnx.save(proto, tmp_path / "m.onnx")
    done = cli(tmp_path, "optimize", "m.onnx", "-o", "out.onnx", "--disable", "matmul-add-gemm", *flag)
    assert done.returncode == 0, done.stderr
    written = onnx.load(tmp_path / "out.onnx")
    assert written.graph.initializer[0].HasField("data_location") == states_location
    assert written.graph.initializer[0].raw_data == proto.graph.initializer[0].raw_data


NEGATING_RULE = '''
from fuser import op, rule, var


@rule("add-to-sub-wrong", pattern=op.Add(var("x"), var("b"), name="add"))
def add_to_sub_wrong(m, b):
    """Add(x, b) => Sub(x, b): deliberately wrong."""
    return b.Sub(m["x"], m["b"])
'''


def test_a_mismatch_keeps_self_contained_evidence(cli, tmp_path):
    onnx.save(matmul_add(), tmp_path / "m.onnx")
    (tmp_path / "bad_rule.py").write_text(NEGATING_RULE)
    done = cli(tmp_path, "optimize", "m.onnx", "--rules", "bad_rule.py", "--disable", "matmul-add-gemm")
    assert done.returncode == 3, done.stderr
    evidence = Path(re.search(r"evidence kept in (\S+)", done.stderr).group(1))
    assert sorted(p.name for p in evidence.iterdir()) == ["optimized.onnx", "original.onnx", "report.json"]
    original = onnx.load(evidence / "original.onnx")
    assert original == onnx.load(tmp_path / "m.onnx")
    rules = fuser.api.resolve_rules(None, "onnx", rule_files=[tmp_path / "bad_rule.py"], disable=["matmul-add-gemm"])
    with pytest.raises(fuser.errors.NumericsMismatch) as raised:
        fuser.optimize(tmp_path / "m.onnx", rules=rules)
    for name in ("original", "optimized"):
        assert not any(uses_external_data(t) for t in raised.value.evidence[name].graph.initializer)


def test_the_command_writes_from_the_loaded_weights_without_joining_them(cli, tmp_path, monkeypatch):
    """A ModelProto of the whole model is a copy of every weight: the command never makes one."""
    onnx.save(matmul_add(), tmp_path / "m.onnx")

    def joined(self):
        raise AssertionError("the weights were copied into one ModelProto")

    monkeypatch.setattr(ModelParts, "joined", joined)
    for check in ([], ["--no-check"]):
        done = cli(tmp_path, "optimize", "m.onnx", "-o", "out.onnx", "--force", *check)
        assert done.returncode == 0, done.stderr
    parts, _ = fuser.optimize(tmp_path / "m.onnx", weights_apart=True)
    written = write_model(parts, tmp_path / "apart.onnx", source_dir=None)
    assert written == [tmp_path / "apart.onnx"]  # the parts know the weights came from one file
    assert (tmp_path / "apart.onnx").read_bytes() == (tmp_path / "out.onnx").read_bytes()


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.integers(0, 0x4000 + 1), st.integers(0, 2**63 - 1)))
def test_a_varint_is_encoded_as_protobuf_encodes_it(value):
    # protobuf writes an int64 field as its key, one byte here, then the value as a varint
    encoded = onnx.AttributeProto(i=value).SerializeToString()[1:]
    assert encode_varint(value) == encoded
    assert varint_size(value) == len(encoded)
