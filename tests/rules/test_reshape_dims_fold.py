"""Tests for reshape-dims-fold (rules/reshape_dims_fold.py): a Reshape target computed from the
input's own dims becomes a constant with 0 (copy the dim) and at most one -1.

The exporters' spellings of "dim i of x": Unsqueeze(Gather(Shape(x), i)) and
Unsqueeze(Squeeze(Slice(Shape(x), i, i + 1))), Slice with a negative start and an INT64_MAX end
included. Numerics run at batch 3 and sequence 5, not at the check's default sizes, so a 0 or
-1 in the wrong place would change the result's shape; rewiring must be bit-exact.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from fuser.rules.reshape_dims_fold import reshape_dims_fold
from tests.helpers import assert_declined, assert_rewritten, initializer_value, make_model, nodes_of

HEADS, HEAD_DIM = 4, 8
HIDDEN = HEADS * HEAD_DIM
INT64_MAX = np.iinfo(np.int64).max


def dim_of(x: str, index: int, name: str, spelling: str = "gather") -> list:
    """Nodes computing [dim index of x] as a 1-element tensor `name`."""
    if spelling == "gather":
        return [
            helper.make_node("Shape", [x], [f"{name}_shape"]),
            helper.make_node("Gather", [f"{name}_shape", f"{name}_index"], [f"{name}_scalar"], axis=0),
            helper.make_node("Unsqueeze", [f"{name}_scalar", "zero_axis"], [name]),
        ]
    return [
        helper.make_node("Shape", [x], [f"{name}_shape"]),
        helper.make_node("Slice", [f"{name}_shape", f"{name}_start", f"{name}_end", "zero_axis"], [f"{name}_sliced"]),
        helper.make_node("Squeeze", [f"{name}_sliced", "zero_axis"], [f"{name}_scalar"]),
        helper.make_node("Unsqueeze", [f"{name}_scalar", "zero_axis"], [name]),
    ]


def split_heads(parts, constants, *, allowzero=None, x_shape=("batch", "seq", HIDDEN), out_rank=4):
    """y = Reshape(x, Concat(parts)); parts: (name, list of nodes computing it) or (name, array)."""
    nodes, inits = [], {"zero_axis": np.array([0], np.int64), **constants}
    names = []
    for name, made in parts:
        names.append(name)
        if isinstance(made, list):
            nodes += made
        else:
            inits[name] = np.asarray(made, np.int64)
    nodes.append(helper.make_node("Concat", names, ["target"], axis=0))
    attrs = {} if allowzero is None else {"allowzero": allowzero}
    nodes.append(helper.make_node("Reshape", ["x", "target"], ["y"], **attrs))
    return make_model(
        nodes, [("x", np.float32, list(x_shape))], [("y", np.float32, [None] * out_rank)], inits, opset=18, check=False
    )


def index(name, i):
    return {f"{name}_index": np.array(i, np.int64)}


FEEDS = {"x": np.random.default_rng(0).normal(size=(3, 5, HIDDEN)).astype(np.float32)}


@pytest.mark.parametrize("spelling", ["gather", "slice"])
def test_heads_split_from_the_inputs_own_dims_becomes_a_constant_target(spelling):
    constants = {**index("b", 0), **index("s", 1)}
    if spelling == "slice":
        constants.update({"b_start": np.array([0]), "b_end": np.array([1]), "s_start": np.array([-2]),
                          "s_end": np.array([-1])})
    model = split_heads(
        [("b", dim_of("x", 0, "b", spelling)), ("s", dim_of("x", 1, "s", spelling)), ("heads", np.array([HEADS, HEAD_DIM]))],
        constants,
    )
    after, _ = assert_rewritten(
        model, [reshape_dims_fold], counts={"reshape-dims-fold": 1}, expected_ops=["Reshape"], feeds=FEEDS
    )
    (reshape,) = nodes_of(after, "Reshape")
    assert initializer_value(after, reshape.input[1]).tolist() == [0, 0, HEADS, HEAD_DIM]


def test_the_last_dim_read_with_an_open_ended_slice_is_its_fixed_size():
    constants = {"h_start": np.array([-1]), "h_end": np.array([INT64_MAX])}
    model = split_heads([("flat", np.array([-1])), ("h", dim_of("x", 2, "h", "slice"))], constants, out_rank=2)
    after, _ = assert_rewritten(
        model, [reshape_dims_fold], counts={"reshape-dims-fold": 1}, expected_ops=["Reshape"], feeds=FEEDS
    )
    assert initializer_value(after, nodes_of(after, "Reshape")[0].input[1]).tolist() == [-1, HIDDEN]


def test_one_entry_computed_otherwise_becomes_minus_one():
    # [batch, seq * hidden]: the product is arithmetic on dims, not a dim itself
    nodes = dim_of("x", 1, "s") + [helper.make_node("Mul", ["s", "hidden"], ["flat"])]
    constants = {**index("b", 0), **index("s", 1), "hidden": np.array([HIDDEN], np.int64)}
    model = split_heads([("b", dim_of("x", 0, "b")), ("flat", nodes)], constants, out_rank=2)
    after, _ = assert_rewritten(
        model, [reshape_dims_fold], counts={"reshape-dims-fold": 1}, expected_ops=["Reshape"], feeds=FEEDS
    )
    assert initializer_value(after, nodes_of(after, "Reshape")[0].input[1]).tolist() == [0, -1]


def test_declines_two_entries_it_cannot_express():
    nodes = dim_of("x", 1, "s") + [
        helper.make_node("Mul", ["s", "two"], ["double_seq"]),
        helper.make_node("Div", ["s", "two"], ["half_seq"]),
    ]
    constants = {**index("s", 1), "two": np.array([2], np.int64)}
    model = split_heads([("double_seq", nodes), ("half_seq", []), ("h", np.array([HIDDEN]))], constants, out_rank=3)
    assert_declined(model, reshape_dims_fold, "target dims are not known", check=False)


def test_declines_a_target_that_already_has_minus_one_plus_an_unknown():
    nodes = dim_of("x", 1, "s") + [helper.make_node("Mul", ["s", "two"], ["double_seq"])]
    constants = {**index("s", 1), "two": np.array([2], np.int64)}
    model = split_heads([("double_seq", nodes), ("rest", np.array([-1]))], constants, out_rank=2)
    assert_declined(model, reshape_dims_fold, "1 target dims are not known", check=False)


def test_a_dim_of_x_at_another_position_is_not_a_copy():
    # [seq, batch, hidden] read from x = [batch, seq, hidden]: 0 would copy the wrong dims
    model = split_heads(
        [("s", dim_of("x", 1, "s")), ("b", dim_of("x", 0, "b")), ("h", np.array([HIDDEN]))],
        {**index("b", 0), **index("s", 1)},
        out_rank=3,
    )
    assert_declined(model, reshape_dims_fold, "2 target dims are not known", check=False)


def test_allowzero_is_left_alone():
    model = split_heads(
        [("b", dim_of("x", 0, "b")), ("s", dim_of("x", 1, "s")), ("heads", np.array([HEADS, HEAD_DIM]))],
        {**index("b", 0), **index("s", 1)},
        allowzero=1,
    )
    assert_declined(model, reshape_dims_fold, "allowzero=1", check=False)


def test_a_dim_of_another_tensor_with_the_same_symbolic_size_is_a_copy():
    nodes = [helper.make_node("Relu", ["x"], ["other"])] + dim_of("other", 0, "b")
    model = split_heads([("b", nodes), ("rest", np.array([-1, HEADS, HEAD_DIM]))], index("b", 0))
    after, _ = assert_rewritten(
        model,
        [reshape_dims_fold],
        counts={"reshape-dims-fold": 1},
        expected_ops=["Reshape"],
        feeds=FEEDS,
    )
    assert initializer_value(after, nodes_of(after, "Reshape")[0].input[1]).tolist() == [0, -1, HEADS, HEAD_DIM]
