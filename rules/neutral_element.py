"""x + 0, x - 0, x * 1, x / 1  =>  x, where the constant changes neither shape nor dtype.

Exporters leave arithmetic with neutral constants behind (a scale of 1, a zero bias of a
layer that has none); it costs a pass over the tensor and hides x's producer from the
fusion rules. Only where the constant broadcasts to x's own shape: x + zeros([4, 1]) for an
x of shape [1, 1] is a [4, 1] tensor, not x. Adding zero turns -0.0 into +0.0, which every
comparison treats as equal.
"""

from __future__ import annotations

import struct

import numpy as np
from fuser.rules._simplify import SIMPLIFY_PHASE, broadcast_keeps_shape, may_be_constant
from fuser.tensors import plain_dtype

from fuser import Builder, Match, const, op, rule, var


NEUTRAL = {"Add": 0, "Sub": 0, "Mul": 1, "Div": 1}


def _maybe_neutral(graph, op_types: tuple[str, ...]) -> list[int]:
    """The nodes of `op_types` with an input that may be their neutral constant: nearly every
    bias Add and scale Mul of a model reads a weight that is not, and its first element, in the
    weight's first bytes, says so without decoding the rest (Rule.candidates)."""
    computed = None  # the tensors other than weights that may be constant, found once if asked
    initializer = graph.initializer
    found = []
    # Loops, not any() over a generator: asked of every Add and Mul of a large model, twice a run.
    for op_type in op_types:
        neutral = NEUTRAL[op_type]
        for node_id in graph.nodes_of_type(op_type):
            for name in graph.node(node_id).input_names:
                if not name:
                    continue
                weight = initializer(name)  # this scope's, or one an enclosing scope holds
                if weight is None:
                    if computed is None:
                        computed = may_be_constant(graph)[1]
                    if name in computed:
                        found.append(node_id)
                        break
                elif _may_be_weight(graph, weight, neutral):
                    found.append(node_id)
                    break
    return found


def _may_be_weight(graph, weight, neutral: int) -> bool:
    """Whether `weight` may be all `neutral`: not if its first element is another."""
    dtype = plain_dtype(weight.data_type)
    if dtype is None:
        return True
    head = graph.tensors.fingerprint(weight, whole=False)  # the raw layout's first bytes
    if len(head) < dtype.itemsize:
        return True
    unpack = _FIRST_ELEMENT.get(dtype)
    first = np.frombuffer(head, dtype, count=1)[0] if unpack is None else unpack(head)[0]
    return first == neutral


# Reading the first element with struct, for the dtypes it knows, takes an eighth of numpy's time.
_FIRST_ELEMENT = {
    np.dtype(code): struct.Struct("<" + code).unpack_from
    for code in ("f", "d", "e", "b", "B", "h", "H", "i", "I", "q", "Q")
}


def _maybe_neutral_sum_or_product(graph) -> list[int]:
    return _maybe_neutral(graph, ("Add", "Mul"))


def _maybe_neutral_difference_or_quotient(graph) -> list[int]:
    return _maybe_neutral(graph, ("Sub", "Div"))


@rule(
    "neutral-element",
    pattern=(op.Add | op.Mul)(var("x"), const("c"), name="arith"),
    phase=SIMPLIFY_PHASE,
    exact=True,
    candidates=_maybe_neutral_sum_or_product,
)
def neutral_element(m: Match, b: Builder):
    """x + 0  or  x * 1  =>  x."""
    return _neutral(m)


@rule(
    "neutral-element-right",
    pattern=(op.Sub | op.Div)(var("x"), const("c"), name="arith", commutative=False),
    phase=SIMPLIFY_PHASE,
    exact=True,
    candidates=_maybe_neutral_difference_or_quotient,
)
def neutral_element_right(m: Match, b: Builder):
    """x - 0  or  x / 1  =>  x."""
    return _neutral(m)


def _neutral(m: Match) -> str:
    kind = m.node("arith").op_type
    value = m.value("c")
    # Nearly every bias and scale in a model matches the pattern: only a neutral one is a candidate
    # (its first element, read first, turns most others away).
    neutral = NEUTRAL[kind]
    m.only_if(value.size > 0 and value.item(0) == neutral and bool(np.all(value == neutral)))
    dtype = m.dtype("x")
    m.require(dtype is not None and dtype == value.dtype, "x is %s, the constant %s", dtype, value.dtype)
    m.require(broadcast_keeps_shape(m, "x", value), f"the constant of shape {value.shape} may broadcast x's shape")
    return m["x"]
