"""What keeps large models cheap: skeletons without weights, the streaming writer, shared check weights.

Each test states the property the memory work relies on and would fail if it broke: the
skeleton infers the same shapes as the full model, the streamed file is byte for byte what
protobuf writes, the check still catches a wrong weight when weights are fed as inputs.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import time

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from fuser import model as model_module
from fuser.errors import OutputPathError
from fuser.graph import SKELETON_BYTES, add_weightless, weightless_model
from fuser.model import Model, _write_streaming, write_model
from fuser.testing import make_model
from fuser.verify import FEED_BYTES, Checker, WeightFeeds

WIDE = 160  # 160 x 160 float32 = 100 KiB: over the skeleton and feeding thresholds


def mlp(seed: int = 0, width: int = WIDE) -> onnx.ModelProto:
    """MatMul by a large weight, Reshape by a small shape tensor, a com.microsoft op on another weight."""
    rng = np.random.default_rng(seed)
    return make_model(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Reshape", ["h", "shape"], ["r"]),
            helper.make_node("Relu", ["r"], ["y"]),
        ],
        [("x", np.float32, ["batch", width])],
        [("y", np.float32, ["batch", 2, width // 2])],
        {
            "w": rng.standard_normal((width, width)).astype(np.float32),
            "shape": np.array([0, 2, width // 2], np.int64),
        },
    )


def test_weightless_model_keeps_small_tensors_and_declares_large_ones_as_inputs():
    model = mlp()
    skeleton = weightless_model(model)
    assert [t.name for t in skeleton.graph.initializer] == ["shape"]
    declared = {v.name: v for v in skeleton.graph.input}
    assert "w" in declared
    assert [d.dim_value for d in declared["w"].type.tensor_type.shape.dim] == [WIDE, WIDE]
    assert skeleton.ByteSize() < model.ByteSize() - SKELETON_BYTES // 2
    onnx.checker.check_model(skeleton, full_check=True)


@pytest.mark.parametrize("ir_version", [3, 8])
def test_a_skeleton_made_in_place_is_the_copy_made_of_the_model(ir_version):
    """The child checking a large model turns its own copy of it into the skeleton: the bytes
    are those of the skeleton copied from it, before IR 4 too (where an initializer that is not
    also an input stays, however large)."""
    model = mlp()
    model.ir_version = ir_version
    if ir_version < 4:  # the small initializer listed as an input, the large one not
        model.graph.input.append(helper.make_tensor_value_info("shape", onnx.TensorProto.INT64, [3]))
    copied = weightless_model(model)
    assert len(model.graph.initializer) == 2  # the copy leaves the model as it was
    assert ("w" in {t.name for t in copied.graph.initializer}) == (ir_version < 4)
    made = weightless_model(model, in_place=True)
    assert made is model
    assert made.SerializeToString() == copied.SerializeToString()


def test_shape_inference_on_the_skeleton_equals_inference_on_the_full_model():
    model = mlp()

    def inferred(m):
        result = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
        return {v.name: v.type.SerializeToString() for v in result.graph.value_info}

    full = inferred(model)
    assert "r" in full  # the Reshape's output is known only from the small shape tensor's value
    assert inferred(Model(model).to_proto(weights=False)) == full


def test_skeleton_keeps_the_values_inference_reads_and_only_those():
    """Small float weights leave the skeleton too (a graph of many of them would be copied whole for
    every inference); integer tensors and tiny float ones (Resize scales) stay, so shapes are the same."""
    rng = np.random.default_rng(0)
    model = make_model(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Reshape", ["h", "shape"], ["r"]),
            helper.make_node("Resize", ["r", "", "scales"], ["y"], mode="nearest"),
        ],
        [("x", np.float32, [1, 16])],
        [("y", np.float32, ["n", "c", "h", "w"])],
        {
            "w": rng.standard_normal((16, 16)).astype(np.float32),  # 1 KiB: far under SKELETON_BYTES
            "shape": np.array([1, 1, 4, 4], np.int64),
            "scales": np.array([1, 1, 2, 2], np.float32),
        },
    )
    skeleton = weightless_model(model)
    assert sorted(t.name for t in skeleton.graph.initializer) == ["scales", "shape"]
    assert "w" in {v.name for v in skeleton.graph.input}

    def inferred(m):
        result = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
        return {v.name: v.type.SerializeToString() for v in [*result.graph.value_info, *result.graph.output]}

    full = inferred(model)
    assert "r" in full  # known only from the shape tensor's values
    y = onnx.TypeProto.FromString(full["y"]).tensor_type.shape.dim
    assert [d.dim_value for d in y] == [1, 1, 8, 8]  # known only from the scales' values
    assert inferred(skeleton) == full


_WEIGHT_TYPES = [onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=80),
            st.sampled_from(_WEIGHT_TYPES),
            st.lists(st.integers(0, 300), max_size=4),
        ),
        unique_by=lambda weight: weight[0],
        max_size=12,
    ),
    st.data(),
)
def test_weights_are_declared_as_the_typed_inputs_protobuf_itself_would_hold(weights, data):
    """The skeleton's typed inputs are written as protobuf's bytes: parsed, they are the
    ValueInfoProtos onnx.helper makes, in the weights' order, after the graph's own inputs."""
    weights = [*weights, ("a/long/name/" + "\u00e9" * 80, onnx.TensorProto.FLOAT, [3, 3])]  # over 127 bytes
    graph = onnx.GraphProto()
    graph.input.append(helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4]))
    initializers = [
        onnx.TensorProto(name=name, data_type=data_type, dims=dims, data_location=onnx.TensorProto.EXTERNAL)
        for name, data_type, dims in weights
    ]
    already_inputs = data.draw(st.sets(st.sampled_from([name for name, _, _ in weights]))) if weights else set()
    add_weightless(graph, initializers, already_inputs)
    expected = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])] + [
        helper.make_tensor_value_info(name, data_type, dims)
        for name, data_type, dims in weights
        if name not in already_inputs
    ]
    assert [v.SerializeToString() for v in graph.input] == [v.SerializeToString() for v in expected]
    assert len(graph.initializer) == 0  # data kept outside is never a skeleton's to read


def matmul_add() -> onnx.ModelProto:
    """MatMul by a large weight and Add of a bias: one matmul-add-gemm rewrite."""
    rng = np.random.default_rng(0)
    return make_model(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])],
        [("x", np.float32, [4, WIDE])],
        [("y", np.float32, [4, WIDE])],
        {"w": rng.standard_normal((WIDE, WIDE)).astype(np.float32), "b": np.ones(WIDE, np.float32)},
    )


def test_to_proto_without_weights_matches_with_weights_except_the_weights():
    model = Model(mlp())
    with_weights, without = model.to_proto(), model.to_proto(weights=False)
    assert list(with_weights.graph.node) == list(without.graph.node)
    assert {t.name for t in with_weights.graph.initializer} == {"w", "shape"}
    assert {t.name for t in without.graph.initializer} == {"shape"}


@pytest.mark.parametrize("ir_version", [3, 8])
def test_streamed_file_is_byte_for_byte_what_protobuf_writes(ir_version):
    model = mlp()
    model.ir_version = ir_version
    if ir_version < 4:  # initializers must be listed as inputs too
        model.graph.input.extend(
            helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in model.graph.initializer
        )
    model.doc_string = "written after the graph field"
    model.metadata_props.add(key="k", value="v")
    stream = io.BytesIO()
    _write_streaming(model, model.graph.initializer, stream)
    assert stream.getvalue() == model.SerializeToString(deterministic=True)


def test_write_model_returns_the_files_it_wrote(tmp_path):
    model = mlp()
    inline = write_model(model, tmp_path / "inline.onnx", source_dir=None, external_data="never")
    assert inline == [tmp_path / "inline.onnx"]
    external = write_model(model, tmp_path / "ext.onnx", source_dir=None, external_data="always")
    assert external == [tmp_path / "ext.onnx", tmp_path / "ext.onnx.data"]
    reread = onnx.load(str(tmp_path / "ext.onnx"))
    for original, written in zip(model.graph.initializer, reread.graph.initializer):
        assert np.array_equal(onnx.numpy_helper.to_array(original), onnx.numpy_helper.to_array(written))
    assert len(model.graph.initializer[0].raw_data) > 0  # the caller's model is left as it was


def test_is_constant_does_not_decode_weights(monkeypatch):
    model = Model(mlp())
    decoded = []
    original_value = model.tensors.value
    monkeypatch.setattr(model.tensors, "value", lambda *a, **k: decoded.append(a[0].name) or original_value(*a, **k))
    assert model.graph.is_constant("w")
    assert decoded == []
    assert model.graph.constant_value("w") is not None
    assert decoded == ["w"]


def test_feeds_share_one_array_per_weight_and_leave_small_tensors_in_the_model():
    feeds = WeightFeeds()
    first_skeleton, first = feeds.split(mlp(), None)
    second_skeleton, second = feeds.split(mlp(), None)  # an equal copy, as the optimized model's is
    assert set(first) == {"w"}
    assert first["w"] is second["w"]
    assert [t.name for t in first_skeleton.graph.initializer] == ["shape"]
    assert first["w"].nbytes >= FEED_BYTES


def test_weights_of_com_microsoft_ops_stay_initializers():
    model = mlp()
    model.graph.node[2].op_type = "FastGelu"
    model.graph.node[2].domain = "com.microsoft"
    model.graph.node[0].output[0] = "h"
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    model.graph.node.append(helper.make_node("FusedMatMul", ["x", "w"], ["unused"], domain="com.microsoft"))
    _, feeds = WeightFeeds().split(model, None)
    assert feeds == {}


def test_the_check_with_fed_weights_passes_equal_models_and_catches_a_changed_weight():
    checker = Checker(mlp(seed=0))
    assert checker.check(mlp(seed=0), exact=True).passed
    assert checker.input_names == ["x"]
    changed = mlp(seed=0)
    weight = onnx.numpy_helper.to_array(changed.graph.initializer[0]).copy()
    weight += 0.5
    changed.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(weight, "w"))
    verdict = checker.check(changed, exact=False)
    assert not verdict.passed


def test_the_original_session_is_closed_once_its_outputs_are_known_and_opened_again_if_asked():
    # Open through the checks, it would hold its memory and slow the next session's start.
    checker = Checker(mlp(seed=0))
    assert checker.session is None
    assert checker.check(mlp(seed=0), exact=True).passed
    assert checker.unsteady_outputs() == []
    assert checker.session is None


@pytest.mark.parametrize("elements", [100, 20_000])  # under and over SKELETON_BYTES
def test_a_subgraph_keeps_its_weights_in_the_skeleton(elements):
    """An If/Loop/Scan body's inputs are fixed by its node: a weight turned into a body input
    would make inference reject the body and lose every shape in and after it."""
    from onnx import numpy_helper

    weight = numpy_helper.from_array(np.ones(elements, np.float32), "W")
    then_branch = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["t"]), helper.make_node("Relu", ["t"], ["ty"])],
        "then",
        [],
        [helper.make_tensor_value_info("ty", onnx.TensorProto.FLOAT, [2, elements])],
        [weight],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["ey"])],
        "else",
        [],
        [helper.make_tensor_value_info("ey", onnx.TensorProto.FLOAT, [2, elements])],
    )
    model = make_model(
        [helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch)],
        [("c", np.bool_, []), ("x", np.float32, [2, elements])],
        [("y", np.float32, [2, elements])],
    )
    loaded = Model(model)
    body = next(iter(loaded.graph.nodes())).subgraphs["then_branch"][0]
    body.revision += 1  # as after a rewrite inside it: the body is rebuilt from the graph
    skeleton = loaded.to_proto(weights=False)
    then_proto = next(a.g for a in skeleton.graph.node[0].attribute if a.name == "then_branch")
    assert len(then_proto.input) == 0 and [t.name for t in then_proto.initializer] == ["W"]
    inferred = onnx.shape_inference.infer_shapes(skeleton, strict_mode=True)  # raised with W as a body input
    inferred_then = next(a.g for a in inferred.graph.node[0].attribute if a.name == "then_branch")
    assert "t" in {v.name for v in inferred_then.value_info}


def test_an_ir3_model_whose_weight_is_not_an_input_is_still_refused(tmp_path):
    """Before IR 4 every initializer must also be a graph input; the skeleton must not hide a
    weight that is not by listing it as one."""
    from onnx import numpy_helper

    from fuser.errors import InputError
    from fuser.model import read_model

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [100])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [100])],
        [numpy_helper.from_array(np.ones(100, np.float32), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)], ir_version=3)
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(InputError, match="W in initializer but not in graph input"):
        read_model(tmp_path / "m.onnx")


def test_the_check_reads_the_original_from_the_loaded_model_not_from_a_copy(monkeypatch):
    """to_proto copies every weight (protobuf copies what it adds to a message): taken before
    the rewrite for the check, it doubled a large model's weights. The model as loaded is the
    original while nothing has changed it; after a change it must be built anew."""
    import fuser.api
    from fuser.engine import Engine

    proto = matmul_add()
    model = Model(proto)
    assert model.unchanged_proto() is proto
    from fuser.graph import ModelParts

    copies = []
    real_to_proto, real_joined = Model.to_proto, ModelParts.joined

    def to_proto(self, weights=True, **options):
        copies.append("to_proto" if weights else "skeleton")
        return real_to_proto(self, weights, **options)

    def joined(self):
        copies.append("joined")
        return real_joined(self)

    monkeypatch.setattr(Model, "to_proto", to_proto)
    monkeypatch.setattr(ModelParts, "joined", joined)
    report = fuser.api.optimize(Model(proto))[1]
    assert report.counts and report.verdict.passed
    # the check takes the original as loaded and the optimized model apart; the caller gets one copy
    assert [c for c in copies if c != "skeleton"] == ["joined"]
    Engine(model, fuser.api.resolve_rules(None, "onnx")).run()
    assert model.unchanged_proto() is None
    unchanged = Model(proto)
    unchanged.require_opset("com.microsoft", 1)
    assert unchanged.unchanged_proto() is None


def _if_model() -> onnx.ModelProto:
    """mlp() whose output goes through an If with a weight in each branch."""
    model = mlp()
    branches = []
    for value in (1.0, 2.0):
        branch = helper.make_graph(
            [helper.make_node("Mul", ["y", "k"], ["out"])],
            f"branch{value}",
            [],
            [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, None)],
            [onnx.numpy_helper.from_array(np.full(3, value, np.float32), "k")],
        )
        branches.append(branch)
    model.graph.input.append(helper.make_tensor_value_info("flag", onnx.TensorProto.BOOL, []))
    model.graph.node.append(helper.make_node("If", ["flag"], ["z"], then_branch=branches[0], else_branch=branches[1]))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None))
    return model


@pytest.mark.parametrize("build", [mlp, _if_model])
@pytest.mark.parametrize("external_data", ["never", "always"])
def test_parts_write_the_bytes_of_the_whole_model(tmp_path, build, external_data):
    model = Model(build())
    parts = model.parts()
    apart = write_model(parts, tmp_path / "apart.onnx", source_dir=None, external_data=external_data)
    if build is mlp:  # (weights inside a body are written from a whole copy of the model)
        assert parts.nodes is not None  # streamed from the graph's own nodes, not put in the model
    whole = write_model(model.to_proto(), tmp_path / "whole.onnx", source_dir=None, external_data=external_data)
    assert [p.name.replace("apart", "") for p in apart] == [p.name.replace("whole", "") for p in whole]
    for a, w in zip(apart, whole):
        # the data file's name is inside the model file: compare after naming both alike
        assert a.read_bytes().replace(b"apart", b"whole") == w.read_bytes()
    assert list(parts.proto.graph.initializer) == []
    assert parts.joined() == model.to_proto()


@pytest.mark.parametrize("build", [mlp, _if_model])
@pytest.mark.parametrize("external_data", ["never", "always"])
def test_the_digest_worked_out_beside_the_write_is_the_written_files(tmp_path, build, external_data):
    # Each write path: streamed inline, streamed with a data file, and a whole copy (weights in a body).
    digests = {}
    model = Model(build())
    written = write_model(
        model.parts(), tmp_path / "m.onnx", source_dir=None, external_data=external_data, digests=digests
    )
    assert list(digests) == [tmp_path / "m.onnx"]  # the model file's: what a report names
    assert digests[tmp_path / "m.onnx"] == hashlib.sha256(written[0].read_bytes()).hexdigest()


def test_a_digest_of_a_file_larger_than_a_write_follows_every_write(tmp_path, monkeypatch):
    # Writes past the buffer and reads in several chunks, a read per write and several per one.
    monkeypatch.setattr(model_module, "WRITE_BUFFER", 1 << 10)
    monkeypatch.setattr(model_module, "DIGEST_CHUNK", 3 << 10)
    pieces = [bytes([i]) * size for i, size in enumerate((10, 5000, 1, 70_000, 1023, 1024, 1025, 0, 9))]
    digests = {}
    model_module._write_atomically(tmp_path / "f.bin", lambda stream: [stream.write(p) for p in pieces], digests)
    assert (tmp_path / "f.bin").read_bytes() == b"".join(pieces)
    assert digests == {tmp_path / "f.bin": hashlib.sha256(b"".join(pieces)).hexdigest()}


def test_an_empty_file_has_the_digest_of_nothing(tmp_path):
    digests = {}
    model_module._write_atomically(tmp_path / "f.bin", lambda stream: None, digests)
    assert digests == {tmp_path / "f.bin": hashlib.sha256(b"").hexdigest()}


def test_a_write_that_fails_stops_its_digest_and_leaves_nothing(tmp_path):
    open_before = set(os.listdir("/proc/self/fd"))

    def fail(stream):
        stream.write(b"x" * (3 << 20))
        stream.flush()
        time.sleep(0.5)  # the digest's thread catches up and waits for more, which never comes
        raise OSError(28, "No space left on device")

    digests = {}
    with pytest.raises(OutputPathError, match="No space left on device"):
        model_module._write_atomically(tmp_path / "f.onnx", fail, digests)
    assert digests == {} and list(tmp_path.iterdir()) == []
    followers = [t for t in threading.enumerate() if t.name == "fuser-digest"]
    for thread in followers:
        thread.join(timeout=60)  # it stops at its next look, without reading the rest
    assert not any(t.is_alive() for t in followers)
    assert set(os.listdir("/proc/self/fd")) <= open_before  # its descriptor is closed too


def test_a_digest_its_thread_could_not_finish_is_not_given(tmp_path, monkeypatch):
    def fail(*args):
        raise MemoryError

    monkeypatch.setattr(model_module.os, "pread", fail)
    digests = {}
    model_module._write_atomically(tmp_path / "f.bin", lambda stream: stream.write(b"abc" * 1000), digests)
    assert digests == {}  # the caller reads the file instead (jobs._output_entry)
    assert (tmp_path / "f.bin").read_bytes() == b"abc" * 1000


def test_a_failed_write_leaves_the_model_and_its_data_file_as_they_were(tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    write_model(mlp(), path, source_dir=None, external_data="always")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["m.onnx", "m.onnx.data"]
    changed = mlp()
    changed.graph.initializer[0].raw_data = bytes(len(changed.graph.initializer[0].raw_data))

    def disk_full(*args, **kwargs):  # the model file's write fails after the data file's is done
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_module, "_write_streaming", disk_full)
    with pytest.raises(OutputPathError, match="No space left on device"):
        write_model(changed, path, source_dir=None, external_data="always")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no new data beside the old model


def test_parts_hold_the_graphs_own_nodes_until_the_model_is_asked_for():
    model = Model(_if_model())
    parts = model.parts()
    graph = model.graph
    order = graph.topological_order()
    assert len(parts.nodes) == len(order) == 4 and all(n is graph.node(i).proto for n, i in zip(parts.nodes, order))
    assert len(parts.shell.graph.node) == 0
    names = [g.name for g in parts.graph_protos()]
    assert names[0] == parts.shell.graph.name and sorted(names[1:]) == ["branch1.0", "branch2.0"]
    assert len(parts.nodes) == 4  # finding the bodies left the nodes apart
    assert [n.op_type for n in parts.proto.graph.node] == ["MatMul", "Reshape", "Relu", "If"]
    assert parts.nodes is None and len(parts.shell.graph.node) == 4


def test_parts_hold_the_models_own_weights_not_copies():
    model = Model(mlp())
    parts = model.parts()
    assert [t.name for t in parts.initializers] == ["w", "shape"]
    assert all(a is b for a, b in zip(parts.initializers, model.graph.initializers()))


def test_optimize_with_weights_apart_returns_the_loaded_weights_and_checks_them():
    import fuser.api
    from fuser.graph import ModelParts

    proto = matmul_add()
    model = Model(proto)
    parts, report = fuser.api.optimize(model, weights_apart=True)
    assert isinstance(parts, ModelParts)
    assert report.counts == {"matmul-add-gemm": 1} and report.verdict.passed
    assert any(t is w for t in parts.initializers for w in model.graph.initializers() if w.name == "w")
    joined, _ = fuser.api.optimize(Model(proto))
    assert joined == parts.joined()


def test_the_check_of_parts_catches_a_changed_weight():
    """The optimized model is checked apart from its weights (fed, not copied): a changed weight
    still fails the check, and an unchanged model passes it."""
    from fuser.graph import ModelParts

    checker = Checker(mlp(seed=0))
    same = Model(mlp(seed=0)).parts()
    assert checker.check(same, exact=True).passed
    changed = mlp(seed=0)
    weight = onnx.numpy_helper.to_array(changed.graph.initializer[0]) + 0.5
    changed.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(weight, "w"))
    parts = Model(changed).parts()
    assert isinstance(parts, ModelParts)
    assert not checker.check(parts, exact=False).passed
