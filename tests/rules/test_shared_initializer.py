"""Tests for shared-initializer (rules/shared_initializer.py): rewiring only, so outputs must be bit-identical."""

from __future__ import annotations

import numpy as np
import onnx
from fuser.rules.shared_initializer import shared_initializer
from onnx import helper

import fuser
from tests.helpers import assert_declined, assert_rewritten, assert_same_outputs, make_model

RULE = "shared-initializer"
RNG = np.random.default_rng(0)
W = RNG.standard_normal((2, 3)).astype(np.float32)
FEEDS = {"x": RNG.standard_normal((2, 3)).astype(np.float32)}


def _two_adds(first, second, outputs=("y", "z"), inputs=(("x", np.float32, [2, 3]),), dtype=np.float32):
    nodes = [helper.make_node("Add", ["x", "a"], [outputs[0]]), helper.make_node("Mul", ["x", "b"], [outputs[1]])]
    return make_model(nodes, list(inputs), [(o, dtype, [2, 3]) for o in outputs], {"a": first, "b": second})


def test_equal_initializers_become_one():
    model = _two_adds(W, W.copy())
    after, report = assert_rewritten(model, shared_initializer, counts={RULE: 1}, feeds=FEEDS)
    assert [t.name for t in after.graph.initializer] == ["a"]
    assert [n.input[1] for n in after.graph.node] == ["a", "a"]
    assert (report.rewrites[0].matched, report.rewrites[0].created) == (["b"], ["a"])


def test_equal_integer_and_float16_initializers_become_one():
    for value in (np.arange(6, dtype=np.int64).reshape(2, 3), W.astype(np.float16)):
        feeds = {"x": np.ones((2, 3), value.dtype)}
        model = _two_adds(value, value.copy(), inputs=(("x", value.dtype, [2, 3]),), dtype=value.dtype)
        assert_rewritten(model, shared_initializer, counts={RULE: 1}, feeds=feeds)


def test_three_copies_share_the_first():
    nodes = [helper.make_node("Add", ["x", name], [f"y{i}"]) for i, name in enumerate("abc")]
    model = make_model(
        nodes,
        [("x", np.float32, [2, 3])],
        [(f"y{i}", np.float32, [2, 3]) for i in range(3)],
        {"a": W, "b": W.copy(), "c": W.copy()},
    )
    after, _ = assert_rewritten(model, shared_initializer, counts={RULE: 2}, feeds=FEEDS)
    assert [t.name for t in after.graph.initializer] == ["a"]


def test_same_bytes_in_another_shape_or_dtype_stay_apart():
    nodes = [
        helper.make_node("Add", ["x", "a"], ["y"]),
        helper.make_node("Reshape", ["b", "shape"], ["b2"]),
        helper.make_node("Add", ["x", "b2"], ["z"]),
    ]
    model = make_model(
        nodes,
        [("x", np.float32, [2, 3])],
        [("y", np.float32, [2, 3]), ("z", np.float32, [2, 3])],
        {"a": W, "b": W.reshape(3, 2), "shape": np.array([2, 3], np.int64)},
    )
    assert_declined(model, shared_initializer, None)
    as_ints = W.view(np.int32)
    nodes = [helper.make_node("Add", ["x", "a"], ["y"]), helper.make_node("Add", ["i", "b"], ["z"])]
    model = make_model(
        nodes,
        [("x", np.float32, [2, 3]), ("i", np.int32, [2, 3])],
        [("y", np.float32, [2, 3]), ("z", np.int32, [2, 3])],
        {"a": W, "b": as_ints},
    )
    assert_declined(model, shared_initializer, None)


def test_initializers_differing_only_after_their_first_bytes_stay_apart():
    big = RNG.standard_normal((64, 64)).astype(np.float32)
    other = big.copy()
    other[-1, -1] += 1.0
    nodes = [helper.make_node("Add", ["x", "a"], ["y"]), helper.make_node("Add", ["x", "b"], ["z"])]
    model = make_model(
        nodes,
        [("x", np.float32, [64, 64])],
        [("y", np.float32, [64, 64]), ("z", np.float32, [64, 64])],
        {"a": big, "b": other},
    )
    assert_declined(model, shared_initializer, None)


def test_an_overridable_initializer_is_never_merged():
    # IR >= 4: "b" is listed as a graph input, so a caller may feed another value.
    model = _two_adds(W, W.copy(), inputs=(("x", np.float32, [2, 3]), ("b", np.float32, [2, 3])))
    assert_declined(model, shared_initializer, None)


def test_a_duplicate_that_is_a_graph_output_keeps_its_name():
    nodes = [helper.make_node("Add", ["x", "a"], ["y"]), helper.make_node("Mul", ["x", "b"], ["z"])]
    model = make_model(
        nodes,
        [("x", np.float32, [2, 3])],
        [("y", np.float32, [2, 3]), ("z", np.float32, [2, 3]), ("b", np.float32, [2, 3])],
        {"a": W, "b": W.copy()},
    )
    assert_declined(model, shared_initializer, "'b' is a graph output")


def test_a_duplicate_read_inside_a_subgraph_stays():
    onnx_float = helper.np_dtype_to_tensor_dtype(np.dtype(np.float32))

    def branch(name, node):
        return helper.make_graph([node], name, [], [helper.make_tensor_value_info(f"{name}_out", onnx_float, [2, 3])])

    nodes = [
        helper.make_node("Add", ["x", "a"], ["y"]),
        helper.make_node(
            "If",
            ["cond"],
            ["z"],
            name="if",
            then_branch=branch("then", helper.make_node("Mul", ["x", "b"], ["then_out"])),
            else_branch=branch("else", helper.make_node("Neg", ["x"], ["else_out"])),
        ),
    ]
    model = make_model(
        nodes,
        [("x", np.float32, [2, 3]), ("cond", np.bool_, [])],
        [("y", np.float32, [2, 3]), ("z", np.float32, [2, 3])],
        {"a": W, "b": W.copy()},
    )
    assert_declined(model, shared_initializer, "'b' is read inside a subgraph")


def test_equal_external_data_tensors_become_one(tmp_path):
    big = RNG.standard_normal((32, 32)).astype(np.float32)
    nodes = [helper.make_node("Add", ["x", "a"], ["y"]), helper.make_node("Mul", ["x", "b"], ["z"])]
    model = make_model(
        nodes,
        [("x", np.float32, [32, 32])],
        [("y", np.float32, [32, 32]), ("z", np.float32, [32, 32])],
        {"a": big, "b": big.copy()},
    )
    original = onnx.ModelProto()
    original.CopyFrom(model)
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    after, report = fuser.optimize(str(path), rules=[shared_initializer])
    assert report.counts == {RULE: 1} and report.verdict.passed
    assert [t.name for t in after.graph.initializer] == ["a"]
    onnx.external_data_helper.load_external_data_for_model(after, str(tmp_path))
    assert_same_outputs(original, after, {"x": np.ones((32, 32), np.float32)})


def test_fingerprints_tell_external_and_inline_copies_alike(tmp_path):
    from fuser.tensors import TensorStore

    big = RNG.standard_normal((40, 40)).astype(np.float32)
    model = make_model([helper.make_node("Neg", ["stored"], ["y"])], [], [("y", np.float32, [40, 40])], {"stored": big})
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    external = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False).graph.initializer[0]
    store = TensorStore(tmp_path)
    inline = onnx.numpy_helper.from_array(big.copy(), "inline")
    for whole in (False, True):
        assert store.fingerprint(external, whole) == store.fingerprint(inline, whole)
    changed = onnx.numpy_helper.from_array(big + 1, "changed")
    assert store.fingerprint(changed) != store.fingerprint(inline)


def test_fingerprints_are_kept_for_data_read_from_a_file_or_large_only(tmp_path):
    """A small inline tensor's fingerprint costs less to compute again than to hold for each
    of a large model's many weights; reading a file (or hashing much) is done once."""
    from fuser.tensors import KEPT_FINGERPRINT_BYTES, TensorStore

    big = RNG.standard_normal((40, 40)).astype(np.float32)  # 6400 bytes
    model = make_model([helper.make_node("Neg", ["stored"], ["y"])], [], [("y", np.float32, [40, 40])], {"stored": big})
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    external = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False).graph.initializer[0]
    small = onnx.numpy_helper.from_array(big[:2], "small")
    large = onnx.numpy_helper.from_array(big, "large")
    assert onnx.numpy_helper.to_array(small).nbytes <= KEPT_FINGERPRINT_BYTES < big.nbytes
    store = TensorStore(tmp_path)
    for tensor in (external, small, large):
        first = store.fingerprint(tensor, whole=True)
        assert store.fingerprint(tensor, whole=True) == first
    assert {key[0] for key in store._fingerprints} == {id(external), id(large)}


def test_equal_initializers_inside_a_branch_become_one_there():
    onnx_float = helper.np_dtype_to_tensor_dtype(np.dtype(np.float32))
    then_branch = helper.make_graph(
        [helper.make_node("Add", ["x", "p"], ["t1"]), helper.make_node("Mul", ["t1", "q"], ["then_out"])],
        "then",
        [],
        [helper.make_tensor_value_info("then_out", onnx_float, [2, 3])],
        [onnx.numpy_helper.from_array(W, "p"), onnx.numpy_helper.from_array(W.copy(), "q")],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["else_out"])],
        "else",
        [],
        [helper.make_tensor_value_info("else_out", onnx_float, [2, 3])],
    )
    nodes = [helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then_branch, else_branch=else_branch)]
    model = make_model(nodes, [("x", np.float32, [2, 3]), ("cond", np.bool_, [])], [("y", np.float32, [2, 3])])
    feeds = {"x": FEEDS["x"], "cond": np.array(True)}
    after, report = assert_rewritten(model, shared_initializer, counts={RULE: 1}, feeds=feeds)
    assert [r.scope for r in report.rewrites] == ["main/if.then_branch"]
    branch = next(a.g for a in after.graph.node[0].attribute if a.name == "then_branch")
    assert [t.name for t in branch.initializer] == ["p"] and branch.node[1].input[1] == "p"


def test_a_weight_added_after_a_quiet_sweep_is_compared_again():
    """A sweep that found nothing is remembered with the weights it saw: the next one looks
    again only when a weight read is not one of them, as one a rewrite adds is not."""
    from fuser.model import Model

    graph = Model(_two_adds(W, W + 1)).graph
    assert list(shared_initializer.sweep(graph)) == []
    assert list(shared_initializer.sweep(graph)) == []  # the same weights: nothing to compare
    graph.add_initializer(onnx.numpy_helper.from_array(W.copy(), "copy"))
    assert list(shared_initializer.sweep(graph)) == []  # read by nothing yet
    graph.add_node(helper.make_node("Sub", ["x", "copy"], ["d"]), (5,))
    (change,) = shared_initializer.sweep(graph)
    assert change.redirects == (("copy", "a"),)


def test_small_weights_of_equal_bytes_in_other_shapes_stay_apart():
    # Small raw weights are compared by their bytes first: their dims still decide.
    row = np.arange(4, dtype=np.float32)
    inits = {"row": row, "column": row.reshape(4, 1), "again": row.copy(), "wide": row.reshape(1, 4)}
    nodes = [helper.make_node("Add", ["x", name], [f"y_{name}"]) for name in inits]
    model = make_model(nodes, [("x", np.float32, [4, 4])], [(f"y_{name}", np.float32, [4, 4]) for name in inits], inits)
    graph = fuser.Model(model).graph
    changes = list(shared_initializer.sweep(graph))
    assert [change.redirects for change in changes] == [(("again", "row"),)]


def test_weights_without_raw_bytes_are_compared_by_their_values():
    # An empty raw_data is set all the same (a weight without elements): compared by its bytes,
    # none, and its dims. A weight stored as float_data has no raw_data: it is compared by its
    # values, and its inline raw twin stays apart, which no exporter writes.
    def listed(name, values):
        return helper.make_tensor(name, onnx.TensorProto.FLOAT, [4], values)

    weights = [
        onnx.numpy_helper.from_array(np.zeros((0, 3), np.float32), "empty"),
        onnx.numpy_helper.from_array(np.zeros((0, 3), np.float32), "twin"),
        onnx.numpy_helper.from_array(np.zeros((3, 0), np.float32), "other"),
        listed("listed", [0.0, 1.0, 2.0, 3.0]),
        listed("changed", [0.0, 1.0, 2.0, 4.0]),
        listed("again", [0.0, 1.0, 2.0, 3.0]),
        onnx.numpy_helper.from_array(np.arange(4, dtype=np.float32), "raw"),
    ]
    assert weights[0].HasField("raw_data") and not weights[0].raw_data and not weights[3].HasField("raw_data")
    nodes = [helper.make_node("Concat", ["x", name], [f"y_{name}"], axis=0) for name in ("empty", "twin")]
    nodes += [helper.make_node("Concat", ["x3", "other"], ["y_other"], axis=1)]
    four = ("listed", "changed", "again", "raw")
    nodes += [helper.make_node("Add", ["x4", name], [f"y_{name}"]) for name in four]
    shapes = {"empty": [2, 3], "twin": [2, 3], "other": [3, 2]} | {name: [4] for name in four}
    model = make_model(
        nodes,
        [("x", np.float32, [2, 3]), ("x3", np.float32, [3, 2]), ("x4", np.float32, [4])],
        [(f"y_{name}", np.float32, shape) for name, shape in shapes.items()],
        check=False,  # the weights come after
    )
    model.graph.initializer.extend(weights)
    onnx.checker.check_model(model, full_check=True)
    changes = list(shared_initializer.sweep(fuser.Model(model).graph))
    assert [change.redirects for change in changes] == [(("twin", "empty"),), (("again", "listed"),)]
