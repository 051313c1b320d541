"""Initializers of equal dtype, shape and bytes  =>  one initializer that all their readers read.

Exporters store a weight once per use (a tied embedding and output projection, the same
constant folded in two places, the scale of every LayerNorm of an untrained model), and
constant folding writes the same small shape tensor many times. One copy makes the file
smaller and lets common-subexpression see that two nodes read the same value.

Comparing is cheap first. A weight of at most FINGERPRINT_HEAD bytes stored inline as raw bytes
is compared by dtype and bytes, and by dims only where those agree; such a weight and an equal one
stored otherwise (as float_data, or in a file) stay apart, which no exporter writes. Other
weights are compared by dtype and dims (no bytes read), then by their first bytes, and only
tensors still alike are hashed whole (BLAKE2b; external data read in chunks, each tensor once).
The first initializer in file order is kept. An initializer that a graph input can override
(listed as an input, IR >= 4) is an input, not a constant, and is never merged; neither is a
graph output (its name must survive) or a tensor a subgraph reads (the engine declines those).
String tensors are left alone.
"""

from __future__ import annotations

import weakref

from onnx import TensorProto

from fuser.rules._simplify import SIMPLIFY_PHASE
from fuser.tensors import FINGERPRINT_HEAD

from fuser import Change, sweep


def _alike(graph, tensors: list[TensorProto], whole: bool) -> list[list[TensorProto]]:
    """`tensors` split into groups of two or more with equal fingerprints, in file order."""
    return _split(tensors, lambda tensor: graph.tensors.fingerprint(tensor, whole=whole))


# Per graph scope, the weights read there when a sweep of it found nothing, in file order (the
# tensors held, not copied). Tensors are not changed in place, and a weight added later comes
# after them: while the weights read are those, in that order, less any removed since, none is
# found again. The sweep runs after every phase that rewrote (the fusions of a large model leave
# its weights as they were), and comparing the weights took 0.27 s per sweep of the 100k-node
# MLP stack of bench/scale.py; a dict or set of them would hold 40 MB more at a million nodes.
_QUIET: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@sweep("shared-initializer", phase=SIMPLIFY_PHASE)
def shared_initializer(graph):
    """Initializers of equal dtype, shape and bytes  =>  one, read by all their readers."""
    weights = graph.read_initializers()
    quiet = _QUIET.get(graph)
    if quiet is not None and _among(weights, quiet):
        return
    found = False
    for change in _merges(graph, weights):
        found = True
        yield change
    if not found:
        _QUIET[graph] = weights


def _among(weights: list[TensorProto], seen: list[TensorProto]) -> bool:
    """Whether `weights` are some of `seen`, in the same order (the same objects)."""
    rest = iter(seen)
    return all(any(tensor is other for other in rest) for tensor in weights)


def _merges(graph, weights: list[TensorProto]):
    by_bytes: dict[tuple, list[TensorProto]] = {}
    by_type: dict[tuple, list[TensorProto]] = {}
    for tensor in weights:  # every weight of the model: each protobuf field read once, or not at all
        data_type = tensor.data_type
        if data_type == TensorProto.STRING:
            continue
        # A small weight stored as raw bytes (most of a large model's: its biases and norm
        # scales) is its own key: one look at it, and its dims read only if another has its bytes.
        # (An unset raw_data reads as empty; a weight in a file has none inline.)
        raw = tensor.raw_data
        if (
            len(raw) <= FINGERPRINT_HEAD
            and (raw or tensor.HasField("raw_data"))
            and tensor.data_location != TensorProto.EXTERNAL
        ):
            by_bytes.setdefault((data_type, raw), []).append(tensor)
        else:
            by_type.setdefault((data_type, tuple(tensor.dims)), []).append(tensor)
    for candidates in by_bytes.values():
        if len(candidates) > 1:
            for equal in _split(candidates, lambda tensor: tuple(tensor.dims)):
                yield from _onto_first(equal)
    for candidates in by_type.values():
        if len(candidates) < 2:
            continue
        for similar in _alike(graph, candidates, whole=False):
            for equal in _alike(graph, similar, whole=True):
                yield from _onto_first(equal)


def _split(tensors: list[TensorProto], key) -> list[list[TensorProto]]:
    """`tensors` split into groups of two or more of equal `key`, in file order."""
    groups: dict = {}
    for tensor in tensors:
        groups.setdefault(key(tensor), []).append(tensor)
    return [group for group in groups.values() if len(group) > 1]


def _onto_first(equal: list[TensorProto]):
    kept = equal[0].name
    for duplicate in equal[1:]:
        yield Change(redirects=((duplicate.name, kept),))
