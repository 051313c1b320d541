"""Match's type table across inference runs: what a later run cannot infer is carried over,
and the dim names shape inference made up stay unique to the run that made them, so that an
equal symbolic name keeps meaning an equal dim (rules compare names to prove shapes equal)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from fuser.rules.conv_bn_fold import conv_bn_fold
from fuser.rules.matmul_add_gemm import matmul_add_gemm
from onnx import TensorProto, helper

import fuser
from fuser.errors import InputError
from fuser.match import InferredTypes, TypeInfo, _carried, _entry_of, inferred_types
from fuser.model import Model
from fuser.skim import infer_serialized


def typed(name: str, dims: list):
    return _entry_of(helper.make_tensor_type_proto(TensorProto.FLOAT, dims))


def test_carried_entries_get_run_unique_names_and_fresh_ones_win():
    previous = {"old": typed("old", ["unk__1", "batch", 8]), "both": typed("both", ["unk__1"])}
    fresh = {"both": typed("both", ["unk__7"])}
    carried = _carried(previous, fresh, run=3)
    assert list(carried) == ["old"]
    assert carried["old"] == (TensorProto.FLOAT, ("run3.unk__1", "batch", 8))  # the model's own names and sizes kept
    assert previous["old"][1][0] == "unk__1"  # not changed in place


def test_a_fresh_runs_made_up_name_never_equals_a_carried_one():
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    types = TypeInfo(lambda: model)
    first = types.shape("y")
    types.refresh()
    types._previous["gone"] = typed("gone", ["unk__0"])  # a tensor the next run cannot infer
    assert types.shape("gone")[0].startswith("run1.")
    assert types.shape("y") == first or types.shape("y")[0] != types.shape("gone")[0]


def test_a_fresh_entry_that_knows_less_is_completed_by_the_earlier_one():
    """Shape inference stops at an operator it does not know (a com.microsoft op a rule made):
    a later run then infers the tensors after it with made-up dims or none. The earlier run's
    sizes and the model's own dim names describe the same tensor, and are kept."""
    previous = {
        "merged": typed("merged", ["batch", "sequence", 64]),
        "context": typed("context", ["unk__4", 4, "unk__5", 16]),
        "same": typed("same", ["unk__1", 8]),
    }
    fresh = {
        "merged": typed("merged", ["unk__17", "unk__18", "unk__19"]),
        "context": (TensorProto.FLOAT, None),
        "same": typed("same", ["unk__9", 8]),
    }
    carried = _carried(previous, fresh, run=2)
    assert carried["merged"] == (TensorProto.FLOAT, ("batch", "sequence", 64))
    assert carried["context"] == (TensorProto.FLOAT, ("run2.unk__4", 4, "run2.unk__5", 16))
    assert "same" not in carried  # nothing to add: the fresh entry stands


def test_entries_that_disagree_leave_the_fresh_one():
    previous = {"t": typed("t", [2, 3]), "u": typed("u", [2, 3])}
    other_type = _entry_of(helper.make_tensor_type_proto(TensorProto.INT64, [None, None]))
    fresh = {"t": typed("t", [None, None, None]), "u": other_type}
    assert _carried(previous, fresh, run=1) == {}


def test_type_info_keeps_shapes_an_unknown_operator_hides_from_a_later_run():
    """A model whose second run has a com.microsoft op in front of the tensor: the shapes of
    the first run are what a rule sees, not the later run's made-up dims."""
    relu = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Abs", ["h"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    fused = helper.make_graph(
        [helper.make_node("QuickGelu", ["x"], ["h"], domain="com.microsoft"), helper.make_node("Abs", ["h"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    models = iter([helper.make_model(relu, opset_imports=opsets), helper.make_model(fused, opset_imports=opsets)])
    types = TypeInfo(lambda: next(models))
    assert types.shape("y") == ("batch", 4)
    types.refresh()
    assert types.shape("y") == ("batch", 4)


def _relu_model(x_dims):
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _reshape_model(first_dim):
    """Reshape(x, s) with s fed at run time: r's first dim is known only as annotated."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "s"], ["r"]), helper.make_node("Relu", ["r"], ["y"])],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
            helper.make_tensor_value_info("s", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, [first_dim, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_learns_more_infers_again_only_after_an_answer_inference_could_complete():
    """A new inference cannot change a complete answer (a type, and for every dim a size or a
    name a graph input declares, which only the caller fixes), so after only complete answers
    the engine is spared a whole-graph inference; another dim without a size (a name a later
    inference may replace by a size, or none), an unknown rank or an unknown type asked for
    since the last call makes it infer again."""
    complete = TypeInfo(lambda: _relu_model([2, 4]))
    assert complete.shape("y") == (2, 4)
    assert complete.dtype("y") is not None
    assert complete.learns_more() is False
    assert complete._runs == 1  # no second inference
    assert complete.shape("y") == (2, 4)  # the table was refreshed: a query infers anew
    assert complete._runs == 2

    declared = TypeInfo(lambda: _relu_model(["batch", 4]))
    assert declared.shape("y") == ("batch", 4)
    assert declared.learns_more() is False
    assert declared._runs == 1

    for annotation in ("a", None):  # a name only the model's annotation gives, and no name
        named = TypeInfo(lambda annotation=annotation: _reshape_model(annotation))
        assert named.shape("r")[1] == 4
        assert named.learns_more() is False  # nothing new to learn, but it had to look
        assert named._runs == 2

    unknown = TypeInfo(lambda: _relu_model([2, 4]))
    assert unknown.shape("no-such-tensor") is None
    unknown.learns_more()
    assert unknown._runs == 2


def test_a_named_dim_a_rewrite_makes_computable_is_inferred_again():
    """The model annotates r as [a, b]; once constant-fold has folded Abs(c) into the Reshape's
    target, inference knows r is [2, 4], and reshape-noop removes the Reshape that the first
    answer, (a, b), could not prove a no-op."""
    import numpy as np

    import fuser
    from onnx import numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "k"], ["r0"]),
            helper.make_node("Abs", ["c"], ["s"]),
            helper.make_node("Reshape", ["x", "s"], ["r"]),
            helper.make_node("Relu", ["r"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4]),
            helper.make_tensor_value_info("r0", TensorProto.FLOAT, [8]),
        ],
        [
            numpy_helper.from_array(np.array([-2, -4], np.int64), "c"),
            numpy_helper.from_array(np.array([8], np.int64), "k"),
        ],
        value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, ["a", "b"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    optimized, _ = fuser.optimize(model, check=False)
    assert [n.op_type for n in optimized.graph.node] == ["Reshape", "Relu"]


def test_a_tensor_inference_could_not_type_is_not_inferred_again_at_every_rewrite():
    """After a rewrite, a query for a tensor the last inference did not know infers the whole
    graph again only when the tensor is new: one that inference saw and could not type (the
    output of an operator onnx does not know) would cost a whole-graph inference per rewrite,
    once per layer of a deep model, to learn nothing."""
    nodes = [helper.make_node("Fused", ["x"], ["t"], domain="com.example"), helper.make_node("Relu", ["t"], ["y"])]

    def model():
        graph = helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        )
        return helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.example", 1)]
        )

    types = TypeInfo(model)
    assert types.shape("t") is None and types._runs == 1
    types.invalidate()  # a rewrite elsewhere
    assert types.shape("t") is None and types._runs == 1
    nodes.append(helper.make_node("Abs", ["x"], ["new"]))  # a rewrite that creates a tensor
    types.invalidate()
    assert types.shape("new") == (2, 4) and types._runs == 2
    types.refresh()  # the engine's refresh between phases still infers everything again
    assert types.shape("t") is None and types._runs == 3
    # A rewrite that gives t a producer inference knows (a replacement keeps the names of what it
    # replaces) says so, and t is looked up anew.
    nodes[0] = helper.make_node("Neg", ["x"], ["t"])
    types.invalidate(produced=["t"])
    assert types.shape("t") == (2, 4) and types._runs == 4


# ------------------------------------------------------------ the load check's inference

TRANSFORMERS = Path(__file__).parent / "data" / "transformers"
SAMPLES = Path(__file__).resolve().parents[1] / "models"


def rewrite_inference(model: Model) -> InferredTypes:
    """What the rewrite's own inference of the model's skeleton finds."""
    return inferred_types(onnx.shape_inference.infer_shapes(model.to_proto(weights=False), data_prop=True))


@pytest.mark.parametrize(
    "path",
    [TRANSFORMERS / f"{name}.onnx" for name in ("bert_dynamo", "gpt2_dynamo", "llama_dynamo", "vit_dynamo")]
    + [TRANSFORMERS / "gpt2_legacy.onnx", SAMPLES / "resnet_small.onnx"],
    ids=lambda path: path.stem,
)
def test_the_types_the_load_check_inferred_are_those_the_rewrite_would_infer(path):
    """Loading a file checks it with a shape inference; the first rewrite takes its types
    instead of inferring the whole graph again. The dynamo exports compute shapes in the
    graph, which only data propagation follows: a check without it would give fewer dims."""
    model = Model.load(path)
    taken = model.take_inferred_types()
    expected = rewrite_inference(model)
    assert taken is not None
    given = taken()
    assert given is not None
    assert given.table == expected.table
    assert given.input_symbols == expected.input_symbols and given.untyped == expected.untyped


def test_the_inferred_types_are_given_once_and_not_for_a_changed_model():
    model = Model.load(SAMPLES / "mlp.onnx")
    assert model.take_inferred_types() is not None
    assert model.take_inferred_types() is None  # dropped: a later inference is the graph's own

    changed = Model.load(SAMPLES / "mlp.onnx")
    relu = next(info.id for info in changed.graph.nodes() if info.op_type == "Relu")
    changed.graph.redirect(changed.graph.node(relu).outputs[0], changed.graph.node(relu).inputs[0])
    assert changed.take_inferred_types() is None


def test_the_engine_takes_the_models_inference_at_its_start():
    """conv-bn-fold asks no shapes: the model hands its types over before the first rewrite
    changes it, and holds them no longer."""
    model = Model.load(SAMPLES / "resnet_small.onnx")
    assert model._types_source is not None
    report = fuser.optimize(model, check=False, rules=[conv_bn_fold])[1]
    assert report.counts["conv-bn-fold"] > 0
    assert model._types_source is None
    assert model._validation.take_types() is None  # nor does the load's check, once the rewrite ran


def test_the_models_inference_answers_for_the_tensors_a_change_left_as_they_were():
    """Asked after the graph changed, a tensor the load's inference typed is answered from it;
    only one it does not know makes TypeInfo infer the whole graph again."""
    model = Model.load(SAMPLES / "resnet_small.onnx")
    seed = model.take_inferred_types()()
    inferences = []

    def skeleton():
        inferences.append(1)
        return model.to_proto(weights=False)

    types = TypeInfo(skeleton, seed=seed)
    types.invalidate(produced=[])
    produced = {output for info in model.graph.nodes() for output in info.outputs}
    tensor, entry = next((name, e) for name, e in seed.table.items() if name in produced)
    assert types.shape(tensor) == entry[1]
    assert inferences == []
    assert types.shape("made-since") is None
    assert inferences == [1]


def _asked_after_a_refresh(seed_given_as_function: bool):
    """The answers and inferences of a TypeInfo refreshed by the end of a pass that asked
    nothing, then asked about an original tensor and one made since; and how often its seed
    function ran before the question."""
    model = Model.load(SAMPLES / "resnet_small.onnx")
    seed = model.take_inferred_types()()
    inferences, fetched = [], []

    def skeleton():
        inferences.append(1)
        return model.to_proto(weights=False)

    def handed_over():
        fetched.append(1)
        return seed

    types = TypeInfo(skeleton, seed=handed_over if seed_given_as_function else seed)
    types.invalidate(produced=[])
    assert not types.learns_more()
    types.refresh()
    fetched_before = len(fetched)
    produced = {output for info in model.graph.nodes() for output in info.outputs}
    tensor = next(name for name in seed.table if name in produced)
    answers = (types.shape(tensor), types.dtype(tensor), types.shape("made-since"))
    return answers, len(inferences), fetched_before, len(fetched), types._table


@pytest.mark.parametrize("seed_given_as_function", [True, False])
def test_a_refresh_before_any_question_waits_for_the_first_table_until_one_comes(seed_given_as_function):
    """A pass that asked nothing does not fetch the load's types (from its check's child); the
    first question fetches them and infers anew, as an eager refresh would have."""
    answers, inferences, fetched_before, fetched, table = _asked_after_a_refresh(seed_given_as_function)
    eager_answers, _, _, _, eager_table = _asked_after_a_refresh(not seed_given_as_function)
    assert answers == eager_answers and table == eager_table
    assert answers[0] is not None and answers[2] is None
    assert inferences == 1  # the refresh's inference, once
    if seed_given_as_function:
        assert (fetched_before, fetched) == (0, 1)


def test_the_load_checks_types_are_not_read_when_the_rewrite_asks_none(monkeypatch):
    from fuser import validation

    monkeypatch.setattr(validation, "CHILD_NODES", 0)  # the load's check runs in a child
    monkeypatch.setattr(validation, "CORES", 2)
    read = []
    interned = validation._interned
    monkeypatch.setattr(validation, "_interned", lambda found: read.append(found) or interned(found))
    model = Model.load(SAMPLES / "resnet_small.onnx", validated=False)
    assert model._validation._child is not None
    report = fuser.optimize(model, check=False, rules=[conv_bn_fold])[1]
    assert report.counts["conv-bn-fold"] > 0
    assert read == []  # conv-bn-fold asks no shapes
    model = Model.load(SAMPLES / "mlp.onnx", validated=False)
    assert model._validation._child is not None
    report = fuser.optimize(model, check=False, rules=[matmul_add_gemm])[1]
    assert report.counts["matmul-add-gemm"] > 0
    assert len(read) == 1 and read[0] is not None  # matmul-add-gemm asks the rank of its input


def body_tensors_annotated_in_the_main_graph() -> onnx.ModelProto:
    """Each If branch squeezes by axes given as an input, so inference cannot tell the rank of
    `ut` and `ue`; only the main graph's annotations say they are [2, 4]."""

    def branch(tag: str) -> onnx.GraphProto:
        nodes = [
            helper.make_node("Squeeze", ["xu", "axes"], [f"u{tag}"]),
            helper.make_node("MatMul", [f"u{tag}", "w"], [f"m{tag}"]),
            helper.make_node("Add", [f"m{tag}", "bias"], [f"o{tag}"]),
        ]
        return helper.make_graph(nodes, tag, [], [helper.make_tensor_value_info(f"o{tag}", TensorProto.FLOAT, [2, 4])])

    graph = helper.make_graph(
        [
            helper.make_node("Unsqueeze", ["x", "zero"], ["xu"]),
            helper.make_node("If", ["cond"], ["y"], then_branch=branch("t"), else_branch=branch("e")),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("axes", TensorProto.INT64, [1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        initializer=[
            helper.make_tensor("w", TensorProto.FLOAT, [4, 4], [1.0] * 16),
            helper.make_tensor("bias", TensorProto.FLOAT, [4], [0.0, 1.0, 2.0, 3.0]),
            helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
        ],
        value_info=[helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 4]) for name in ("ut", "ue")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_model_annotating_a_bodys_tensors_in_its_main_graph_gets_no_types_from_its_check(tmp_path):
    """The check infers with every annotation; the rewrite's skeleton keeps a scope's own only,
    and cannot tell that the branches' MatMul reads a 2-D tensor, as Gemm needs."""
    onnx.save(body_tensors_annotated_in_the_main_graph(), tmp_path / "m.onnx")
    model = Model.load(tmp_path / "m.onnx")
    assert model.take_inferred_types() is None
    report = fuser.optimize(Model.load(tmp_path / "m.onnx"), check=False, rules=[matmul_add_gemm])[1]
    assert report.counts == {}


def test_a_model_before_ir_4_gets_no_types_from_its_check(tmp_path):
    """Its check's skeleton keeps initializers that the rewrite's lists as inputs."""
    model = onnx.load(SAMPLES / "mlp.onnx")
    model.ir_version = 3
    for tensor in model.graph.initializer:
        model.graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
    onnx.save(model, tmp_path / "ir3.onnx")
    assert Model.load(tmp_path / "ir3.onnx").take_inferred_types() is None


def test_the_rewrite_takes_its_first_types_from_the_model():
    """The engine asks the model before inferring: types that make the input 3-D keep the first
    MatMul + Add from becoming a Gemm, which needs 2-D operands."""
    source = onnx.load(SAMPLES / "mlp.onnx")
    plain = fuser.optimize(Model(source), check=False, rules=[matmul_add_gemm])[1]
    assert plain.counts == {"matmul-add-gemm": 2}

    skeleton = onnx.shape_inference.infer_shapes(Model(source).to_proto(weights=False), data_prop=True)
    given = next(value for value in skeleton.graph.input if value.name == "x")
    given.type.CopyFrom(helper.make_tensor_type_proto(TensorProto.FLOAT, [1, 1, 784]))
    model = Model(source, inferred=inferred_types(skeleton))
    report = fuser.optimize(model, check=False, rules=[matmul_add_gemm])[1]
    assert report.counts == {"matmul-add-gemm": 1}


def reshape_against_its_annotation() -> onnx.ModelProto:
    """Reshape(x, Shape(x)) gives x's own shape [2, 3], but an annotation says [3, 2]: only
    data propagation, which follows Shape's values, sees the conflict."""
    graph = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["rows", "columns"])],
        value_info=[helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])],
    )
    graph.node.append(helper.make_node("Relu", ["y"], ["z"]))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def test_a_model_the_full_check_accepts_loads_though_the_inference_with_data_propagation_fails(tmp_path):
    model = reshape_against_its_annotation()
    onnx.checker.check_model(model, full_check=True)  # valid to onnx's own check
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    onnx.save(model, tmp_path / "m.onnx")
    loaded = Model.load(tmp_path / "m.onnx")
    assert loaded.take_inferred_types() is None  # the rewrite infers for itself, as before
    fuser.optimize(loaded, check=False)


def test_a_model_only_the_inference_refuses_is_refused_with_the_full_checks_message(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "n"], ["y"])],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("n", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(model)  # structurally sound
    with pytest.raises(onnx.shape_inference.InferenceError) as refused:
        onnx.checker.check_model(model, full_check=True)
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(InputError) as error:
        Model.load(tmp_path / "m.onnx")
    first_line = str(refused.value).strip().splitlines()[0]
    assert str(error.value) == f"{tmp_path / 'm.onnx'}: invalid ONNX model: {first_line}"


def _types_read_from_the_whole_model(model: onnx.ModelProto) -> InferredTypes:
    """The table read from a parsed ModelProto, tensor by tensor: what inferred_types, which
    reads only some fields of the serialized model (fuser/skim.py), must find."""
    from fuser.graph import all_graph_protos

    graphs = list(all_graph_protos(model.graph))
    table = {}
    for graph in graphs:
        for value in [*graph.value_info, *graph.input, *graph.output]:
            if value.type.HasField("tensor_type"):
                table[value.name] = _entry_of(value.type)
        for tensor in graph.initializer:
            table.setdefault(tensor.name, (tensor.data_type, tuple(tensor.dims)))
    symbols = {
        dim.dim_param for value in model.graph.input for dim in value.type.tensor_type.shape.dim if dim.dim_param
    } - {"?"}
    untyped = {o for graph in graphs for node in graph.node for o in node.output if o} - set(table)
    return InferredTypes(table, symbols, untyped)


def _model_with_bodies() -> onnx.ModelProto:
    """Symbolic and unknown dims, a sequence, an op inference cannot type, initializers, and
    tensors typed only inside an If's branches and a Loop's body."""

    def branch(name: str, op: str) -> onnx.GraphProto:
        nodes = [
            helper.make_node(op, ["x"], [f"{name}_inner"]),
            helper.make_node("Neg", [f"{name}_inner"], [f"{name}_out"]),
        ]
        return helper.make_graph(
            nodes, name, [], [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None)]
        )

    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["v_in", "w"], ["v_out"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_in", TensorProto.FLOAT, ["batch", 4]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", TensorProto.FLOAT, ["batch", 4]),
        ],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node(
            "If", ["flag"], ["chosen"], then_branch=branch("then", "Abs"), else_branch=branch("else", "Sigmoid")
        ),
        helper.make_node("Loop", ["trips", "", "x"], ["looped"], body=body),
        helper.make_node("Mystery", ["r"], ["mystery"], domain="example.custom"),
        helper.make_node("Neg", ["mystery"], ["after"]),
        helper.make_node("SequenceConstruct", ["r", "r"], ["seq"]),
    ]
    graph = helper.make_graph(
        nodes,
        "bodies",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
            helper.make_tensor_value_info("trips", TensorProto.INT64, [None]),
        ],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("chosen", "looped", "after")]
        + [helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, None)],
        [helper.make_tensor("w", TensorProto.FLOAT, [4], [1.0, 2.0, 3.0, 4.0])],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example.custom", 1)]
    )


@pytest.mark.parametrize(
    "source",
    ["bodies", TRANSFORMERS / "gpt2_dynamo.onnx", TRANSFORMERS / "llama_legacy.onnx", SAMPLES / "resnet_small.onnx"],
    ids=lambda source: getattr(source, "stem", source),
)
def test_the_types_read_from_the_serialized_inference_are_those_of_the_whole_model(source):
    model = _model_with_bodies() if source == "bodies" else Model.load(source).to_proto(weights=False)
    inferred = infer_serialized(model.SerializeToString(), data_prop=True)
    expected = _types_read_from_the_whole_model(onnx.load_from_string(inferred))
    found = inferred_types(inferred)
    assert found.table == expected.table
    assert found.input_symbols == expected.input_symbols
    assert found.untyped == expected.untyped
    if source == "bodies":  # the walk reached the bodies, and the untyped op's output is listed
        assert {"then_inner", "else_out", "v_out"} <= set(found.table)
        assert "mystery" in found.untyped and "seq" not in found.table
        assert found.input_symbols == {"batch"}


def test_where_graphs_declare_a_name_differently_the_later_graph_in_the_walk_decides():
    """Outermost first, each body before the next node's (fuser.graph.all_graph_protos): a name
    typed in the main graph, a Loop body and an If inside that body gets the innermost one's
    entry, unless a body after them types it again; an initializer's own type counts only where
    no value info types its name; an empty dim name is no input's symbol."""

    def typed_as(name: str, dims: list):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)

    def branch(name: str, declared: list) -> onnx.GraphProto:
        graph = helper.make_graph(
            [helper.make_node("Identity", ["x"], [f"{name}_out"])], name, [], [typed_as(f"{name}_out", [1])]
        )
        graph.value_info.extend(declared)
        return graph

    inner = helper.make_node(
        "If",
        ["flag"],
        ["inner_out"],
        then_branch=branch("then", [typed_as("dup", [3])]),
        else_branch=branch("else", [typed_as("only_else", [4])]),
    )
    body = helper.make_graph(
        [inner, helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [typed_as("i", []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, [])],
        [helper.make_tensor("body_weight", TensorProto.FLOAT, [2], [1.0, 2.0])],
    )
    body.value_info.extend([typed_as("dup", [2])])
    later = helper.make_node(
        "If", ["flag"], ["later_out"], then_branch=branch("later", []), else_branch=branch("late_else", [])
    )
    later.attribute[0].g.value_info.extend([typed_as("twice", [7])])
    unnamed = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["", "n"])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "flag"], ["looped"], body=body), later],
        "clashes",
        [unnamed, helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [typed_as("looped", [1])],
        [
            helper.make_tensor("weight", TensorProto.INT64, [5], [1, 2, 3, 4, 5]),
            helper.make_tensor("bare", TensorProto.INT32, [6], [0] * 6),
        ],
    )
    graph.value_info.extend([typed_as("dup", [1]), typed_as("weight", [5]), typed_as("twice", [8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    found = inferred_types(model.SerializeToString())
    assert found.table == _types_read_from_the_whole_model(model).table
    assert found.table["dup"] == typed("dup", [3])  # the If inside the Loop body came last
    assert found.table["twice"] == typed("twice", [7])
    assert found.table["weight"] == typed("weight", [5])  # its value info, not its int64 data type
    assert found.table["bare"] == (TensorProto.INT32, (6,))
    assert found.table["body_weight"] == (TensorProto.FLOAT, (2,))
    assert found.input_symbols == {"n"}
