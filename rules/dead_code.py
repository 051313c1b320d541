"""Nodes whose outputs reach no graph output, and initializers nothing reads  =>  removed.

Exporters and hand edits leave computations behind that nothing uses: a branch of a model
that was cut off, a Shape kept for a debugging output that is gone, weights of a removed
head. They cost time in every session (onnxruntime runs them unless its own optimizer is
on) and space in the file, and their extra consumers keep fusions from firing on the tensors
they read.

A node is live when one of its outputs is a graph output, when a live node reads one of its
outputs (a subgraph's read from this scope counts as a read by the node holding it), or when
it cannot be proven free of side effects. Standard ONNX operators (the default and ai.onnx.ml
domains) are pure functions of their inputs; an operator of any other domain is whatever its
runtime registers, which may write a file or keep state, and removing it could not be caught
by the numerics check, so such nodes, and the nodes they read, always stay. A node holding
subgraphs is pure when every node inside them is.

Every group of dead nodes has one that nothing reads at all (the last of it): where no pure node
is unread, there is no dead node, which one look over the nodes' readers tells without the walk
from the outputs (most models, and each sweep after a rewrite). A scope holding bodies is walked:
a read inside a body may have no edge in it yet.

Each connected group of dead nodes is one rewrite; the initializers and captured tensors only
they read go with them. Initializers nothing reads at all go in one rewrite per graph scope.
An initializer that a graph input can override (listed as an input, IR >= 4) is an input and
stays.
"""

from __future__ import annotations

from fuser.rules._simplify import SIMPLIFY_PHASE

from fuser import Change, sweep

PURE_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")


def _pure(info) -> bool:
    if info.domain not in PURE_DOMAINS:
        return False
    return not info.subgraphs or all(
        _pure(inner) for graphs in info.subgraphs.values() for g in graphs for inner in g.nodes()
    )


def _producers_read(graph, info) -> set[int]:
    """The op nodes whose outputs the node reads, as its inputs or inside its subgraphs."""
    producers = graph.op_predecessors(info.id)
    if info.subgraphs:  # asked of the bodies too: a rewrite inside one may read a tensor this scope has no edge for
        captured = (graph.producer(name) for graphs in info.subgraphs.values() for g in graphs for name in g.captured())
        producers.update(p for p in captured if p is not None)
    return producers


@sweep("dead-code", phase=SIMPLIFY_PHASE)
def dead_code(graph):
    """Nodes whose outputs reach no graph output, and initializers nothing reads  =>  removed."""
    if graph.nodes_with_subgraphs() or any(_pure(graph.node(n)) for n in graph.unread_nodes()):
        yield from _dead_groups(graph)
    unused = graph.unread_initializers()
    if unused:
        yield Change(initializers=tuple(unused))


def _dead_groups(graph):
    """One Change per connected group of dead nodes, in graph order."""
    nodes = {info.id: info for info in graph.nodes()}
    live = {graph.producer(name) for name in graph.output_names()}
    live.discard(None)
    live.update(node_id for node_id, info in nodes.items() if not _pure(info))
    pending = list(live)
    while pending:
        for producer in _producers_read(graph, nodes[pending.pop()]):
            if producer not in live:
                live.add(producer)
                pending.append(producer)
    dead = sorted((node_id for node_id in nodes if node_id not in live), key=graph.sort_key)
    # Dead nodes connected through the tensors they share form one rewrite.
    group = {node_id: node_id for node_id in dead}

    def root(node_id: int) -> int:
        while group[node_id] != node_id:
            group[node_id] = group[group[node_id]]
            node_id = group[node_id]
        return node_id

    for node_id in dead:
        for producer in _producers_read(graph, nodes[node_id]):
            if producer in group:
                group[root(producer)] = root(node_id)
    members: dict[int, list[int]] = {}
    for node_id in dead:
        members.setdefault(root(node_id), []).append(node_id)
    for ids in sorted(members.values(), key=lambda ids: graph.sort_key(ids[0])):
        yield Change(nodes=tuple(ids))
