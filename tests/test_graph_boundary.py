"""fuser/graph.py is the only module that knows the graph is held in networkx: everything
else asks Graph's own queries, so the representation can change in one file."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from onnx import helper

import fuser
from fuser.model import Model
from tests.helpers import make_model

F32 = np.float32
_NETWORKX = re.compile(r"\bnetworkx\b|\.nx\b")


def test_no_module_but_graph_py_touches_networkx():
    package = Path(fuser.__file__).parent
    rules = package.parent / "rules"
    offending = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted([*package.glob("*.py"), *rules.glob("*.py")])
        if path != package / "graph.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _NETWORKX.search(line)
    ]
    assert offending == []


def test_op_successors_are_the_op_nodes_reading_a_node_through_any_output_or_subgraph():
    then_branch = helper.make_graph(
        [helper.make_node("Neg", ["a"], ["then_out"], name="neg")],
        "then",
        [],
        [helper.make_tensor_value_info("then_out", 1, [2])],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Abs", ["b"], ["else_out"], name="abs")],
        "else",
        [],
        [helper.make_tensor_value_info("else_out", 1, [2])],
    )
    nodes = [
        helper.make_node("Split", ["x"], ["a", "b"], name="split", axis=0, num_outputs=2),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("Mul", ["b", "b"], ["m"], name="mul"),
        helper.make_node("If", ["c"], ["i"], name="if", then_branch=then_branch, else_branch=else_branch),
    ]
    proto = make_model(
        nodes,
        [("x", F32, [4]), ("c", np.bool_, [])],
        [("r", F32, [2]), ("m", F32, [2]), ("i", F32, [2]), ("a", F32, [2])],
        opset=18,
    )
    g = Model(proto).graph
    ids = {info.name: info.id for info in g.nodes()}
    assert g.op_successors(ids["split"]) == {ids["relu"], ids["mul"], ids["if"]}
    assert g.op_successors(ids["relu"]) == set()  # a graph output only
