"""Match's type table across inference runs: what a later run cannot infer is carried over,
and the dim names shape inference made up stay unique to the run that made them, so that an
equal symbolic name keeps meaning an equal dim (rules compare names to prove shapes equal)."""

from __future__ import annotations

from onnx import TensorProto, helper

from fuser.match import TypeInfo, _carried, _entry_of


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
