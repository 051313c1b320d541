"""Tests for constant-fold (rules/constant_fold.py): nodes of constant inputs become initializers.

Numerics: every positive case runs both models in onnxruntime (graph optimizations off)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from fuser.rules.constant_fold import constant_fold
from fuser.rules.identity_elimination import identity_elimination
from onnx import TensorProto, helper, numpy_helper

import fuser
from tests.helpers import assert_declined, assert_rewritten, initializer_value, make_model, run

RULE = "constant-fold"
X = np.random.default_rng(0).standard_normal((2, 6)).astype(np.float32)


def shape_arithmetic_model(**kwargs):
    """y = Reshape(x, Concat(Constant([3]), Constant([-1])) cast through float and back)."""
    nodes = [
        helper.make_node("Constant", [], ["a"], value=helper.make_tensor("a", TensorProto.INT64, [1], [3])),
        helper.make_node("Constant", [], ["b"], value_ints=[-1]),
        helper.make_node("Concat", ["a", "b"], ["ab"], axis=0),
        helper.make_node("Cast", ["ab"], ["abf"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["abf"], ["shape"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    return make_model(nodes, [("x", np.float32, [2, 6])], [("y", np.float32, [3, 4])], **kwargs)


def test_shape_arithmetic_folds_into_one_initializer():
    after, _ = assert_rewritten(
        shape_arithmetic_model(), [constant_fold], counts={RULE: 5}, expected_ops=["Reshape"], feeds={"x": X}
    )
    np.testing.assert_array_equal(initializer_value(after, after.graph.node[0].input[1]), [3, -1])
    assert len(after.graph.initializer) == 1  # intermediate constants do not linger


def test_value_used_twice_is_folded_once_and_shared():
    nodes = [
        helper.make_node("Constant", [], ["c"], value_float=2.0),
        helper.make_node("Mul", ["x", "c"], ["m"]),
        helper.make_node("Add", ["m", "c"], ["y"]),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 6])], [("y", np.float32, [2, 6])])
    after, _ = assert_rewritten(model, [constant_fold], counts={RULE: 1}, expected_ops=["Mul", "Add"], feeds={"x": X})
    assert after.graph.node[0].input[1] == after.graph.node[1].input[1]


def test_constant_graph_output_keeps_its_name():
    nodes = [
        helper.make_node("Constant", [], ["c"], value_floats=[1.0, 2.0]),
        helper.make_node("Neg", ["c"], ["y"]),
        helper.make_node("Relu", ["x"], ["z"]),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 6])], [("y", np.float32, [2]), ("z", np.float32, [2, 6])])
    after, _ = assert_rewritten(
        model, [constant_fold, identity_elimination], counts={RULE: 2}, expected_ops=["Identity", "Relu"]
    )
    np.testing.assert_array_equal(initializer_value(after, after.graph.node[0].input[0]), [-1.0, -2.0])


def test_integer_and_fp16_values():
    nodes = [
        helper.make_node("Add", ["i", "i"], ["i2"]),
        helper.make_node("Cast", ["h"], ["h32"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "h32"], ["y"]),
        helper.make_node("Cast", ["i2"], ["i2f"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["y", "i2f"], ["z"]),
    ]
    inits = {"i": np.array([1, 2, 3, 4, 5, 6], np.int32), "h": np.full(6, 0.5, np.float16)}
    model = make_model(nodes, [("x", np.float32, [2, 6])], [("z", np.float32, [2, 6])], inits)
    assert_rewritten(model, [constant_fold], counts={RULE: 3}, expected_ops=["Mul", "Add"], feeds={"x": X})


def test_several_outputs():
    nodes = [
        helper.make_node("Split", ["c", "sizes"], ["p", "q"], axis=0),
        helper.make_node("Add", ["x", "p"], ["y"]),
        helper.make_node("Mul", ["y", "q"], ["z"]),
    ]
    inits = {"c": np.arange(12, dtype=np.float32), "sizes": np.array([6, 6], np.int64)}
    model = make_model(nodes, [("x", np.float32, [2, 6])], [("z", np.float32, [2, 6])], inits)
    assert_rewritten(model, [constant_fold], counts={RULE: 1}, expected_ops=["Add", "Mul"], feeds={"x": X})


# --------------------------------------------------------------------------- negatives


def test_large_result_stays_a_computation():
    nodes = [
        helper.make_node("ConstantOfShape", ["s"], ["big"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1])),
        helper.make_node("Add", ["x", "big"], ["y"]),
    ]
    model = make_model(
        nodes, [("x", np.float32, [512, 512])], [("y", np.float32, [512, 512])], {"s": np.array([512, 512], np.int64)}
    )
    assert_declined(model, constant_fold, "it stays a computation", check=False)


TABLE = np.random.default_rng(1).standard_normal((1000, 64)).astype(np.float32)  # 256 KB, above FOLD_BYTES


def tied_head_model(*, gathered: bool, unsqueezed: bool = False):
    """logits = h @ Transpose(table) (a decoder's LM head), the table also read by the embedding's
    Gather when `gathered`; `unsqueezed` puts an Unsqueeze / Squeeze pair between them."""
    head = "tt"
    nodes = [helper.make_node("Transpose", ["table"], ["tt"], name="transpose", perm=[1, 0])]
    if unsqueezed:
        nodes += [
            helper.make_node("Unsqueeze", ["tt", "axis"], ["tu"], name="unsqueeze"),
            helper.make_node("Squeeze", ["tu", "axis"], ["ts"], name="squeeze"),
        ]
        head = "ts"
    inputs, outputs = [("h", np.float32, [3, 64])], [("logits", np.float32, [3, 1000])]
    if gathered:
        nodes.append(helper.make_node("Gather", ["table", "ids"], ["embedded"], name="embedding", axis=0))
        inputs.append(("ids", np.int64, [3]))
        outputs.append(("embedded", np.float32, [3, 64]))
    nodes.append(helper.make_node("MatMul", ["h", head], ["logits"], name="head"))
    constants = {"table": TABLE, "axis": np.array([0], np.int64)} if unsqueezed else {"table": TABLE}
    return make_model(nodes, inputs, outputs, constants)


def test_a_large_weight_read_only_by_the_fold_is_replaced_by_its_result():
    feeds = {"h": np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)}
    after, _ = assert_rewritten(
        tied_head_model(gathered=False), [constant_fold], counts={RULE: 1}, expected_ops=["MatMul"], feeds=feeds
    )
    assert [list(t.dims) for t in after.graph.initializer if t.dims] == [[64, 1000]]


@pytest.mark.parametrize("unsqueezed", [False, True])
def test_a_large_weight_another_node_reads_is_not_copied(unsqueezed):
    # A tied embedding: folding the head's Transpose would write the table twice.
    model = tied_head_model(gathered=True, unsqueezed=unsqueezed)
    assert_declined(model, constant_fold, "the model would hold both", check=False)


LARGE_TABLE = np.random.default_rng(4).standard_normal((5000, 64)).astype(np.float32)  # 1.28 MB, above BODY_COPY_BYTES


def test_a_large_weight_captured_by_branches_is_not_copied_into_each():
    # Each branch of the If would fold its own Transpose of the outer table: two copies of it.
    def branch(name, op_type):
        nodes = [helper.make_node("Transpose", ["table"], [f"{name}_t"], perm=[1, 0])]
        nodes.append(helper.make_node(op_type, [f"{name}_t"], [f"{name}_out"]))
        out = helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [64, 5000])
        return helper.make_graph(nodes, name, [], [out])

    nodes = [
        helper.make_node(
            "If", ["flag"], ["chosen"], then_branch=branch("then", "Neg"), else_branch=branch("other", "Abs")
        )
    ]
    model = make_model(nodes, [("flag", np.bool_, [])], [("chosen", np.float32, [64, 5000])], {"table": LARGE_TABLE})
    after, report = fuser.optimize(model, rules=[constant_fold], check=False)
    assert report.counts == {}
    assert after.SerializeToString() == model.SerializeToString()


GATES = np.random.default_rng(3).standard_normal((4, 2048)).astype(np.float32)  # 32 KB, below FOLD_BYTES


def test_a_small_slice_of_a_weight_another_node_reads_is_not_copied():
    # Below FOLD_BYTES too: the slice would be a second copy of a quarter of a weight that stays.
    nodes = [
        helper.make_node("Slice", ["gates", "start", "end"], ["gate"], name="slice"),
        helper.make_node("Mul", ["row", "gate"], ["y"]),
        helper.make_node("MatMul", ["h", "gates"], ["z"]),
    ]
    constants = {"gates": GATES, "start": np.array([0], np.int64), "end": np.array([1], np.int64)}
    inputs = [("row", np.float32, [3, 2048]), ("h", np.float32, [3, 4])]
    model = make_model(nodes, inputs, [("y", np.float32, [3, 2048]), ("z", np.float32, [3, 2048])], constants)
    assert_declined(model, constant_fold, "likely a copy", check=False)


def gate_branches() -> onnx.ModelProto:
    """Silero VAD's LSTM: each branch of an If cuts the gates of a weight its parent holds and
    puts them together in another order (Slice, Slice, Concat), as PyTorch's exporter writes an
    LSTM's weights in ONNX's gate order."""

    def branch(name, op_type):
        nodes = [
            helper.make_node("Slice", ["gates", f"{name}_0", f"{name}_2"], [f"{name}_low"]),
            helper.make_node("Slice", ["gates", f"{name}_2", f"{name}_4"], [f"{name}_high"]),
            helper.make_node("Concat", [f"{name}_high", f"{name}_low"], [f"{name}_reordered"], axis=0),
            helper.make_node(op_type, ["x", f"{name}_reordered"], [f"{name}_out"]),
        ]
        bounds = [numpy_helper.from_array(np.array([i], np.int64), f"{name}_{i}") for i in (0, 2, 4)]
        out = helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [4, 2048])
        return helper.make_graph(nodes, name, [], [out], initializer=bounds)

    then_branch, else_branch = branch("then", "Mul"), branch("other", "Add")
    nodes = [helper.make_node("If", ["flag"], ["chosen"], then_branch=then_branch, else_branch=else_branch)]
    inputs = [("flag", np.bool_, []), ("x", np.float32, [1, 2048])]
    return make_model(nodes, inputs, [("chosen", np.float32, [4, 2048])], {"gates": GATES})


def test_the_gates_an_if_reads_are_reordered_ahead_of_time_in_each_branch():
    # A copy per branch (32 KB each here, 256 KB in Silero VAD) instead of two Slices and a
    # Concat at every run: the outer weight goes once both branches hold their own.
    model = gate_branches()
    after, report = fuser.optimize(model, rules=[constant_fold], check=False)
    assert report.counts == {RULE: 6}
    branches = {attribute.name: [n.op_type for n in attribute.g.node] for attribute in after.graph.node[0].attribute}
    assert branches == {"then_branch": ["Mul"], "else_branch": ["Add"]}
    assert [t.name for t in after.graph.initializer] == []
    x = np.random.default_rng(6).standard_normal((1, 2048)).astype(np.float32)
    for flag in (True, False):
        reordered = GATES[[2, 3, 0, 1]]
        expected = x * reordered if flag else x + reordered
        for candidate in (model, after):
            (got,) = run(candidate, {"flag": np.array(flag), "x": x})
            np.testing.assert_array_equal(got, expected)


def test_reordered_gates_in_the_main_graph_free_the_weight_they_come_from():
    # Both Slices read the weight: folding either alone frees nothing and would copy part of it;
    # folding the Concat frees all of it, whatever order the pass takes them in.
    nodes = [
        helper.make_node("Slice", ["gates", "i0", "i2"], ["low"]),
        helper.make_node("Slice", ["gates", "i2", "i4"], ["high"]),
        helper.make_node("Concat", ["high", "low"], ["reordered"], axis=0),
        helper.make_node("MatMul", ["h", "reordered"], ["y"]),
    ]
    constants = {"gates": GATES, **{f"i{i}": np.array([i], np.int64) for i in (0, 2, 4)}}
    model = make_model(nodes, [("h", np.float32, [3, 4])], [("y", np.float32, [3, 2048])], constants)
    feeds = {"h": np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)}
    after, _ = assert_rewritten(model, [constant_fold], counts={RULE: 1}, expected_ops=["MatMul"], feeds=feeds)
    assert [list(t.dims) for t in after.graph.initializer] == [[4, 2048]]


def test_a_mask_made_from_a_shape_another_node_reads_still_folds():
    # The float64 mask (128 KB) stays a computation; its float32 Cast (64 KB) is new data made from
    # a 16-byte shape the Reshape keeps, not a copy of anything stored: it folds.
    nodes = [
        helper.make_node(
            "ConstantOfShape", ["shape"], ["mask"], value=helper.make_tensor("v", TensorProto.DOUBLE, [1], [-1.0])
        ),
        helper.make_node("Cast", ["mask"], ["mask32"], to=TensorProto.FLOAT),
        helper.make_node("Reshape", ["x", "shape"], ["xr"]),
        helper.make_node("Add", ["xr", "mask32"], ["y"]),
    ]
    x = np.random.default_rng(4).standard_normal((128, 128)).astype(np.float32)
    model = make_model(
        nodes,
        [("x", np.float32, [128, 128])],
        [("y", np.float32, [128, 128])],
        {"shape": np.array([128, 128], np.int64)},
    )
    assert_rewritten(model, [constant_fold], counts={RULE: 1}, expected_ops=["Reshape", "Add"], feeds={"x": x})


def test_a_float32_result_of_exactly_fold_bytes_folds():
    nodes = [
        helper.make_node(
            "ConstantOfShape", ["shape"], ["mask"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [-1.0])
        ),
        helper.make_node("Add", ["x", "mask"], ["y"]),
    ]
    x = np.random.default_rng(5).standard_normal((128, 128)).astype(np.float32)
    model = make_model(
        nodes,
        [("x", np.float32, [128, 128])],
        [("y", np.float32, [128, 128])],
        {"shape": np.array([128, 128], np.int64)},
    )
    assert_rewritten(model, [constant_fold], counts={RULE: 1}, expected_ops=["Add"], feeds={"x": x})


def test_initializer_a_graph_input_can_override_is_not_folded():
    nodes = [helper.make_node("Neg", ["c"], ["n"]), helper.make_node("Add", ["x", "n"], ["y"])]
    model = make_model(
        nodes,
        [("x", np.float32, [2, 6]), ("c", np.float32, [6])],
        [("y", np.float32, [2, 6])],
        {"c": np.ones(6, np.float32)},
    )
    assert_declined(model, constant_fold, None, check=False)


def test_random_ops_are_not_folded():
    nodes = [helper.make_node("RandomNormal", [], ["r"], shape=[2, 6]), helper.make_node("Add", ["x", "r"], ["y"])]
    model = make_model(nodes, [("x", np.float32, [2, 6])], [("y", np.float32, [2, 6])])
    _, report = fuser.optimize(model, rules=[constant_fold], check=False)
    assert report.counts == {}


def test_symbolic_input_is_not_constant():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["y"])]
    model = make_model(nodes, [("x", np.float32, ["batch", 6])], [("y", np.float32, ["batch", 6])])
    assert_declined(model, constant_fold, None, check=False)


def test_a_node_far_below_a_tensor_made_constant_folds_in_the_same_pass():
    # shape-fold makes Shape(x) a constant; five Identities that must stay (their outputs are
    # graph outputs) lie between it and the Concat, which then reads a constant and folds
    # before reshape-dims-fold, later in the order, could take the Concat into the Reshape.
    from fuser.registry import builtin_rules

    nodes = [helper.make_node("Shape", ["x"], ["s0"], name="shape")]
    nodes += [helper.make_node("Identity", [f"s{i}"], [f"s{i + 1}"], name=f"id{i}") for i in range(5)]
    nodes += [
        helper.make_node("Concat", ["s5", "one"], ["target"], name="concat", axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape"),
    ]
    outputs = [("y", np.float32, [4, 6, 1])] + [(f"s{i + 1}", np.int64, [2]) for i in range(5)]
    model = make_model(nodes, [("x", np.float32, [4, 6])], outputs, {"one": np.array([1], np.int64)})
    _, report = fuser.optimize(model, rules=builtin_rules(), check=False)
    assert [(r.rule, r.matched) for r in report.rewrites[:2]] == [
        ("shape-fold", ["shape"]),
        ("constant-fold", ["concat"]),
    ]


def test_a_shape_folded_into_a_graph_outputs_copy_lets_what_reads_it_fold():
    # Listed out of order, the ReduceSum is asked first whether what it reads is constant (not
    # yet); shape-fold then makes Shape(x) a constant under the graph output's name "s".
    nodes = [
        helper.make_node("ReduceSum", ["c0"], ["r"], name="reduce", keepdims=0),
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node(
            "ConstantOfShape", ["s"], ["c0"], name="fill", value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "out_of_order",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64, 5])],
        [
            helper.make_tensor_value_info("r", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("s", TensorProto.INT64, [3]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    from fuser.registry import builtin_rules

    after, report = fuser.optimize(model, rules=builtin_rules())
    assert report.counts == {"shape-fold": 1, "constant-fold": 1} and report.verdict.passed
    folded = {t.name: t for t in after.graph.initializer}
    copies = {n.output[0]: n.input[0] for n in after.graph.node if n.op_type == "Identity"}
    assert sorted(copies) == ["r", "s"] and len(after.graph.node) == 2
    assert numpy_helper.to_array(folded[copies["r"]]) == 64 * 64 * 5


@st.composite
def _graphs_with_constants(draw):
    """A DAG over an input, two weights, a Constant and a Shape, listed in a shuffled order (so
    that a reader may come before the node it reads, as a rewrite's nodes do)."""
    tensors, nodes = ["x", "w", "v"], []
    for index in range(draw(st.integers(1, 14))):
        op = draw(st.sampled_from(["Neg", "Add", "Constant", "Shape", "Cast", "RandomNormalLike"]))
        out = f"t{index}"
        if op == "Constant":
            node = helper.make_node(op, [], [out], value=numpy_helper.from_array(np.ones((2, 3), np.float32)))
        elif op == "Add":
            node = helper.make_node(op, draw(st.lists(st.sampled_from(tensors), min_size=2, max_size=2)), [out])
        elif op == "Cast":
            node = helper.make_node(op, [draw(st.sampled_from(tensors))], [out], to=TensorProto.FLOAT)
        else:
            node = helper.make_node(op, [draw(st.sampled_from(tensors))], [out])
        nodes.append(node)
        tensors.append(out)
    order = draw(st.permutations(nodes))
    weights = {"w": np.ones((2, 3), np.float32), "v": np.ones((2, 3), np.float32)}
    return make_model(order, [("x", np.float32, [2, 3])], [(tensors[-1], np.float32, None)], weights, check=False)


@given(_graphs_with_constants())
@settings(max_examples=300, deadline=None)
def test_the_candidates_hold_every_node_of_constant_inputs(model):
    """maybe_constant names every node whose inputs the evaluator finds constant (what
    constant-fold's pattern asks), and every node below a Shape, which shape-fold may make so."""
    from fuser.model import Model
    from fuser.rules.constant_fold import maybe_constant

    graph = Model(model).graph
    named = maybe_constant(graph)
    for info in graph.nodes():
        if all(not name or graph.is_constant(name) for name in info.input_names):
            assert info.id in named, info
    below_shapes = {o for info in graph.nodes() if info.op_type == "Shape" for o in info.output_names}
    for info in graph.nodes():  # what reads only shapes and constants
        if all(not n or n in below_shapes or graph.is_constant(n) for n in info.input_names):
            assert info.id in named, info


def test_a_fold_a_far_rewrite_makes_possible_is_made_by_the_candidates_named_anew():
    """A rewrite far above a node can make it constant without touching it; constant-fold named
    its candidates as the pass started, and names them anew until a pass rewrites nothing."""
    from fuser.rules.constant_fold import constant_fold
    from fuser.rules.identity_elimination import identity_elimination

    @fuser.rule("frozen-sin", pattern=fuser.op.Sin(fuser.var("x"), name="sin"), phase=constant_fold.phase)
    def frozen_sin(m, b):
        """Sin(x) => zeros, a stand-in for a rule that finds a computed tensor constant."""
        return b.constant(np.zeros(2, np.int64), "frozen")

    from fuser.rules.shared_initializer import shared_initializer

    nodes = [helper.make_node("Sin", ["x"], ["s0"], name="sin")]
    nodes += [helper.make_node("Identity", [f"s{i}"], [f"s{i + 1}"], name=f"id{i}") for i in range(5)]
    nodes.append(helper.make_node("Concat", ["s5", "one"], ["target"], name="concat", axis=0))
    outputs = [("target", np.int64, [3])] + [(f"s{i + 1}", np.int64, [2]) for i in range(5)]
    model = make_model(nodes, [("x", np.int64, [2])], outputs, {"one": np.array([1], np.int64)}, check=False)
    _, report = fuser.optimize(model, rules=[frozen_sin, constant_fold, identity_elimination], check=False)
    assert ("constant-fold", ["concat"]) in [(r.rule, r.matched) for r in report.rewrites]
    # The same where a sweep after the pass changed something (it merges the frozen zeros with an
    # equal weight), and the next pass is seeded with what it changed.
    model.graph.node.append(helper.make_node("Add", ["x", "z"], ["u"], name="add"))
    model.graph.output.append(helper.make_tensor_value_info("u", TensorProto.INT64, [2]))
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(2, np.int64), "z"))
    rules = [frozen_sin, constant_fold, identity_elimination, shared_initializer]
    _, report = fuser.optimize(model, rules=rules, check=False)
    assert "shared-initializer" in report.counts
    assert ("constant-fold", ["concat"]) in [(r.rule, r.matched) for r in report.rewrites]


def test_a_body_names_its_candidates_without_reading_the_weights_it_captures(tmp_path):
    # A weight of the enclosing graph kept in a file counts as constant in the body without
    # being read: gone from disk, the candidates are still named.
    from fuser.model import Model
    from fuser.rules._simplify import may_be_constant

    table = np.arange(64, dtype=np.float32).reshape(8, 8)
    branch = helper.make_graph(
        [helper.make_node("Transpose", ["table"], ["t"], name="transpose"), helper.make_node("Add", ["t", "x"], ["y"])],
        "then",
        [],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [8, 8])],
    )
    z = helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [8, 8])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["z"])], "else", [], [z])
    model = make_model(
        [helper.make_node("If", ["flag"], ["out"], then_branch=branch, else_branch=other)],
        [("x", np.float32, [8, 8]), ("flag", np.bool_, [])],
        [("out", np.float32, [8, 8])],
        {"table": table},
    )
    path = tmp_path / "model.onnx"
    onnx.save(model, path, save_as_external_data=True, location="weights.bin", size_threshold=0)
    loaded = Model.load(path)
    (tmp_path / "weights.bin").unlink()
    body = loaded.graph.nodes_with_subgraphs()[0].subgraphs["then_branch"][0]
    found, _ = may_be_constant(body)
    assert sorted(body.node(n).name for n in found) == ["transpose"]


def _relu_add_graph():
    """Relu(x) -> r;  Add(r, w) -> y."""
    from fuser.model import Model

    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Add", ["r", "w"], ["y"], name="add"),
    ]
    model = make_model(nodes, [("x", np.float32, [2])], [("y", np.float32, [2])], {"w": np.ones(2, np.float32)})
    return Model(model).graph


def test_the_candidates_are_found_anew_once_the_graph_changes():
    # may_be_constant keeps its answer while the graph stays as it was: the rules naming their
    # candidates ask it in turn. A change (a weight added and read instead of an activation, a
    # node added, one removed) gives a new answer.
    from fuser.rules._simplify import may_be_constant

    graph = _relu_add_graph()

    def names():
        return sorted(graph.node(n).name for n in may_be_constant(graph)[0])

    assert names() == []
    assert may_be_constant(graph) is may_be_constant(graph)
    graph.add_initializer(numpy_helper.from_array(np.zeros(2, np.float32), "c"))
    graph.redirect("r", "c")
    assert names() == ["add"]
    neg = graph.add_node(helper.make_node("Neg", ["w"], ["n"], name="neg"), key=(5,))
    assert names() == ["add", "neg"]
    graph.remove_node(neg)
    assert names() == ["add"]


def test_a_bodys_candidates_are_found_anew_once_its_enclosing_graph_changes():
    # What a body reads from its enclosing graph may be constant when a node there computes it;
    # gone from there, it may not: the body's answer follows the enclosing graph's changes.
    from fuser.model import Model
    from fuser.rules._simplify import may_be_constant

    branch = helper.make_graph(
        [helper.make_node("Add", ["t", "x"], ["y"], name="add")],
        "then",
        [],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["z"])],
        "else",
        [],
        [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2])],
    )
    nodes = [
        helper.make_node("Neg", ["w"], ["t"], name="neg"),
        helper.make_node("If", ["flag"], ["out"], then_branch=branch, else_branch=other),
    ]
    graph = Model(
        make_model(
            nodes,
            [("x", np.float32, [2]), ("flag", np.bool_, [])],
            [("out", np.float32, [2])],
            {"w": np.ones(2, np.float32)},
        )
    ).graph
    body = graph.nodes_with_subgraphs()[0].subgraphs["then_branch"][0]
    assert "t" in may_be_constant(body)[1]
    graph.remove_node(graph.nodes_of_type("Neg")[0])
    assert "t" not in may_be_constant(body)[1]


def test_every_change_to_a_graph_counts_in_its_revision():
    graph = _relu_add_graph()
    seen = [graph.revision]

    def changed():
        assert graph.revision > seen[-1]
        seen.append(graph.revision)

    graph.add_initializer(numpy_helper.from_array(np.zeros(2, np.float32), "c"))
    changed()
    graph.redirect("r", "c")
    changed()
    graph.remove_if_unused("r")  # the Relu, which nothing reads now, goes
    assert graph.nodes_of_type("Relu") == []
    changed()
    graph.remove_if_unused("x")  # a graph input stays
    assert graph.revision == seen[-1]
    added = graph.add_node(helper.make_node("Neg", ["c"], ["n"], name="neg"), key=(5,))
    changed()
    graph.replace_nodes([added], [helper.make_node("Abs", ["c"], ["n"], name="abs")], [], (5,), "test")
    changed()
    graph.remove_node(graph.nodes_of_type("Abs")[0])
    changed()


def test_a_float16_mean_the_reference_evaluator_overflows_stays_a_computation():
    """onnxruntime averages float16 in float32 (60000, 60000 -> 60000); onnx's reference
    evaluator sums them in float16 (inf)."""
    nodes = [
        helper.make_node("ReduceMean", ["big"], ["mean"], keepdims=0),
        helper.make_node("Add", ["x", "mean"], ["y"]),
    ]
    model = make_model(
        nodes, [("x", np.float16, [2])], [("y", np.float16, [2])], {"big": np.array([6e4, 6e4], np.float16)}
    )
    assert_declined(model, constant_fold, "inf or NaN where the constants are finite", check=False)
    x = {"x": np.zeros(2, np.float16)}
    assert np.isfinite(run(model, x)[0]).all()


def test_a_float16_constant_of_inf_still_folds():
    """An inf the constants hold (a mask's -inf) is no overflow."""
    nodes = [
        helper.make_node("Neg", ["inf"], ["minus"]),
        helper.make_node("Add", ["x", "minus"], ["y"]),
    ]
    model = make_model(
        nodes, [("x", np.float16, [2])], [("y", np.float16, [2])], {"inf": np.full(2, np.inf, np.float16)}
    )
    assert_rewritten(model, [constant_fold], counts={"constant-fold": 1}, check=False)


def test_a_float16_constant_of_shape_of_minus_inf_still_folds():
    """The -inf is ConstantOfShape's own value, not an overflow of its (integer) shape."""
    nodes = [
        helper.make_node(
            "ConstantOfShape", ["shape"], ["filled"], value=numpy_helper.from_array(np.array([-np.inf], np.float16))
        ),
        helper.make_node("Add", ["x", "filled"], ["y"]),
    ]
    model = make_model(nodes, [("x", np.float16, [2])], [("y", np.float16, [2])], {"shape": np.array([2], np.int64)})
    assert_rewritten(model, [constant_fold], counts={"constant-fold": 1}, check=False)
