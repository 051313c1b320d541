"""Constant node  =>  an initializer of the same name.

Exporters spell every literal as a Constant node: the torch.onnx legacy exporter writes one
for each index, axis and shape piece, two in five nodes of a GPT-2 export. An initializer
holds the same value without a node to run, and the rules read either as a constant. Done as
a sweep, the readers keep reading the tensor they read, under its name, and a model of many
thousand Constants pays no pattern match and no rewiring per node.

A Constant whose output is a graph output stays for constant-fold, which copies the value
into the output's name. A sparse Constant, or one holding a list of strings, stays as it is.
"""

from __future__ import annotations

from onnx import TensorProto, numpy_helper

from fuser.constants import constant_node_value
from fuser.rules._simplify import SIMPLIFY_PHASE

from fuser import Change, sweep


def _value(info) -> TensorProto | None:
    """The Constant's value as an initializer named after its output (its `value` tensor as it
    is, not decoded and encoded again); None for a sparse one or a list of strings."""
    (output,) = info.proto.output
    for attribute in info.proto.attribute[:]:
        if attribute.name == "value":
            tensor = TensorProto()
            tensor.CopyFrom(attribute.t)
            tensor.name = output
            return tensor
    value = constant_node_value(info.proto)
    return None if value is None else numpy_helper.from_array(value, output)


@sweep("constant-node", phase=SIMPLIFY_PHASE)
def constant_node(graph):
    """Constant node  =>  an initializer of the same name."""
    for node_id in graph.nodes_of_type("Constant"):
        info = graph.node(node_id)
        if len(info.proto.output) != 1 or not info.proto.output[0] or graph.is_graph_output(info.proto.output[0]):
            continue
        value = _value(info)
        if value is not None:
            yield Change(nodes=(node_id,), values=(value,))
