"""What the graph structure alone costs: a networkx MultiDiGraph with the vertices and edges fuser
builds for bench/scale.py's MLP stack, and no ONNX data at all.

    python bench/networkx_floor.py [NODES ...]     # default: 100000 1000000

Built two ways: through networkx's own API, one vertex per op node, initializer and graph input,
one edge per tensor an op reads, each edge carrying a dict of the tensor and the input slot
(`api`); and as fuser's Graph lays it out (`fuser`): the slot the edge's key and the tensor's
name its value, written into networkx's dicts, and the weights no vertices of their own, their
reads kept by name in the same layout. Prints the build time and the memory it added (resident
set, measured around the build).
"""

from __future__ import annotations

import gc
import sys
import time

import networkx as nx


def resident_gb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096 / 1e9


def mlp_graph(nodes: int, layout: str) -> tuple[nx.MultiDiGraph, dict]:
    """Blocks MatMul-Add-Relu-MatMul-Add-Add(residual) with 4 weights each, as scale.mlp_stack;
    and, for the `fuser` layout, the weights' reads by name."""
    graph = nx.MultiDiGraph()
    succ, pred = graph._succ, graph._pred
    weight_reads: dict[str, dict] = {}
    graph.add_node(0, kind="input")
    previous, vertex = 0, 1
    for _ in range(max(1, nodes // 6)):
        weights = list(range(vertex, vertex + 4))
        if layout == "api":
            for w in weights:
                graph.add_node(w, kind="initializer")
        vertex += 4
        reads = [
            [(previous, 0), (weights[0], 1)],  # MatMul
            [(vertex, 0), (weights[1], 1)],  # Add bias: reads the MatMul just added
            [(vertex + 1, 0)],  # Relu
            [(vertex + 2, 0), (weights[2], 1)],  # MatMul
            [(vertex + 3, 0), (weights[3], 1)],  # Add bias
            [(vertex + 4, 0), (previous, 1)],  # residual Add
        ]
        for index, inputs in enumerate(reads):
            node = vertex + index
            graph.add_node(node, kind="op")
            for source, slot in inputs:
                tensor = f"t{source}"
                if layout == "api":
                    graph.add_edge(source, node, tensor=tensor, slot=slot)
                elif source in weights:
                    weight_reads.setdefault(tensor, {}).setdefault(node, {})[slot] = tensor
                else:
                    keys = succ[source].get(node)
                    if keys is None:
                        keys = succ[source][node] = pred[node][source] = {}
                    keys[slot] = tensor
        previous = vertex + 5
        vertex += 6
    return graph, weight_reads


def main(argv: list[str]) -> int:
    for nodes in [int(a) for a in argv] or [100_000, 1_000_000]:
        for layout in ("api", "fuser"):
            gc.collect()
            gc.disable()  # as fuser builds its graph: the collector's scans would dominate
            before, started = resident_gb(), time.perf_counter()
            graph, weight_reads = mlp_graph(nodes, layout)
            seconds, added = time.perf_counter() - started, resident_gb() - before
            reads = sum(len(readers) for readers in weight_reads.values())
            print(
                f"{nodes:>9} nodes, {layout:<5}: {graph.number_of_nodes()} vertices, "
                f"{graph.number_of_edges()} edges, {reads} weight reads, built in {seconds:.2f} s, {added:.2f} GB",
                flush=True,
            )
            del graph, weight_reads
            gc.enable()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
