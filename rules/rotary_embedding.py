"""Rotary position embedding written out, x * cos + rotate_half(x) * sin  =>  the standard ONNX
RotaryEmbedding operator (opset 23 and later), or com.microsoft RotaryEmbedding on the
onnxruntime target (any opset), for heads x [B, N, S, H].

rotate_half(x) = Concat(-x[..., H/2:], x[..., :H/2]) is the Hugging Face form (not the
interleaved one). Both operators want cos and sin as half-width caches. Exporters compute cos as
Unsqueeze(Cos(Concat(f, f)) [* scaling], axis 1), so both halves are equal by construction
(checked), and the first half is the cache; cos/sin tensors that are not built that way are
declined: their halves might differ.

- Standard: with no position_ids, the caches are [B, S, H/2] per batch row; onnxruntime wants
  the batch dimension in full, so a batch-1 cache is expanded to x's batch.
- com.microsoft: the caches are [positions, H/2] tables and position_ids a single offset 0, so
  row s of the cache rotates position s. That reads the cache per position, which holds only
  for a batch-1 cache (one row of positions for the whole batch, as Hugging Face builds it); a
  cache of one position (broadcast over the sequence in the original) is expanded to x's
  sequence first, unless shape inference shows the two lengths equal.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._attention import dim

from fuser import Builder, Match, op, rule, var


x = var("x")


def _slice(name: str):
    return op.Slice(
        x,
        var(f"{name}_start"),
        var(f"{name}_end"),
        var(f"{name}_axes", optional=True),
        var(f"{name}_steps", optional=True),
        name=name,
    )


ROTATE_HALF = op.Concat(op.Neg(_slice("second_half"), name="negated"), _slice("first_half"), name="rotate_half")
PATTERN = op.Add(op.Mul(x, var("cos"), name="x_cos"), op.Mul(ROTATE_HALF, var("sin"), name="rotated_sin"), name="sum")


def _int_values(m: Match, tensor: str | None, depth: int = 6) -> np.ndarray | None:
    """The integer value of a small shape computation (Slice bounds), evaluated from the known
    static dims where a Shape is involved; None when it depends on an unknown."""
    if tensor is None:
        return None
    value = m.graph.constant_value(tensor)
    if value is not None:
        return value.astype(np.int64) if value.dtype.kind in "iu" else None
    producer = m.graph.producer(tensor)
    if producer is None or depth == 0:
        return None
    info = m.graph.node(producer)
    inputs = [_int_values(m, i, depth - 1) if i else None for i in info.inputs]
    if info.op_type == "Gather" and info.inputs and m.graph.producer(info.inputs[0]) is not None:
        shape_node = m.graph.node(m.graph.producer(info.inputs[0]))
        dims = m.shape_of(shape_node.inputs[0]) if shape_node.op_type == "Shape" and not shape_node.attrs() else None
        if dims is None or inputs[1] is None:
            return None
        picked = [dims[int(i)] for i in np.ravel(inputs[1])]
        if not all(isinstance(d, int) for d in picked):
            return None
        return np.array(picked, np.int64).reshape(np.shape(inputs[1]))
    if any(v is None for v, name in zip(inputs, info.inputs) if name):
        return None
    if info.op_type in ("Unsqueeze", "Squeeze", "Reshape", "Cast", "Identity"):
        return np.ravel(inputs[0]) if info.op_type != "Identity" else inputs[0]
    arithmetic = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.floor_divide}
    if info.op_type in arithmetic:
        return arithmetic[info.op_type](inputs[0], inputs[1]).astype(np.int64)
    return None


def _require_half(m: Match, name: str, head_size: int, first: bool) -> None:
    """The Slice `name` takes x[..., :H/2] (first) or x[..., H/2:] along the last axis."""
    start, end = _int_values(m, m[f"{name}_start"]), _int_values(m, m[f"{name}_end"])
    axes, steps = _int_values(m, m[f"{name}_axes"]), _int_values(m, m[f"{name}_steps"])
    m.require(start is not None and end is not None, f"rotate_half's {name} Slice has bounds not known here")
    m.require(start.size == 1 and end.size == 1, f"rotate_half's {name} Slice cuts more than one axis")
    m.require(m[f"{name}_axes"] is not None and axes is not None, f"rotate_half's {name} Slice has no known axis")
    m.require(int(axes.ravel()[0]) in (-1, 3), f"rotate_half's {name} Slice is along axis {int(axes.ravel()[0])}")
    m.require(steps is None or int(steps.ravel()[0]) == 1, f"rotate_half's {name} Slice has a step")
    begin, stop = int(start.ravel()[0]), int(end.ravel()[0])
    half = head_size // 2
    expected = (begin == 0 and stop == half) if first else (begin == half and stop >= head_size)
    m.require(expected, f"rotate_half's {name} Slice is [{begin}:{stop}] of a head of {head_size}")


def _duplicated_halves(m: Match, tensor: str, function: str) -> str:
    """The [B, S, H] tensor under Unsqueeze(axis 1) whose two halves are equal by construction:
    elementwise scalar work (Cast, Mul/Div by a constant) over function(Concat(f, f, axis=-1))."""
    graph = m.graph
    unsqueeze = graph.producer(tensor)
    info = graph.node(unsqueeze) if unsqueeze is not None else None
    m.require(info is not None and info.op_type == "Unsqueeze", f"{function.lower()} is not Unsqueeze(..., axis 1)")
    axes = info.attr("axes") if m.opset < 13 else _int_values(m, info.inputs[1] if len(info.inputs) > 1 else None)
    m.require(axes is not None and list(np.ravel(axes)) == [1], f"{function.lower()} is not Unsqueeze(..., axis 1)")
    cache = info.inputs[0]
    current = cache
    for _ in range(6):
        producer = graph.producer(current)
        node = graph.node(producer) if producer is not None else None
        if node is None:
            break
        if node.op_type == function:
            concat = graph.producer(node.inputs[0])
            concat = graph.node(concat) if concat is not None else None
            m.require(
                concat is not None
                and concat.op_type == "Concat"
                and concat.attr("axis") in (-1, 2)
                and len(concat.inputs) == 2
                and concat.inputs[0] == concat.inputs[1],
                f"{function}'s input is not Concat(f, f) along the last axis: its halves may differ",
            )
            return cache
        if node.op_type == "Cast" or (
            node.op_type in ("Mul", "Div") and any(graph.constant_value(i) is not None for i in node.inputs)
        ):
            # A constant on either side: s * cos(...) as well as cos(...) * s, and c / cos(...).
            scalars = [graph.constant_value(i) for i in node.inputs]
            m.require(all(s is None or s.size == 1 for s in scalars), f"{function.lower()} is scaled per element")
            current = (
                next(i for i in node.inputs if graph.constant_value(i) is None)
                if node.op_type != "Cast"
                else node.inputs[0]
            )
            continue
        break
    m.require(False, f"{function.lower()} is not computed as {function}(Concat(f, f)): its halves may differ")
    return cache


def _checked_caches(m: Match) -> tuple[list[str], int]:
    """The checks both rules share; the [B or 1, S, H] tensors cos and sin unsqueeze, and the head size."""
    shape = m.shape("x")
    m.require(shape is not None and len(shape) == 4, f"x has shape {shape}, not heads [B, N, S, H]")
    head_size = shape[3]
    m.require(
        isinstance(head_size, int) and head_size % 2 == 0, f"the head size {head_size} is not a known even number"
    )
    dtype = m.dtype("x")
    m.require(dtype in (np.float32, np.float16), "x is %s; onnxruntime's RotaryEmbedding takes float32/float16", dtype)
    m.require(m.attr("rotate_half", "axis") in (-1, 3), "rotate_half's Concat is not along the last axis")
    _require_half(m, "first_half", head_size, first=True)
    _require_half(m, "second_half", head_size, first=False)
    caches = []
    for name, function in (("cos", "Cos"), ("sin", "Sin")):
        m.require(m.dtype(name) == dtype, "%s is %s, x is %s", name, m.dtype(name), dtype)
        cache = _duplicated_halves(m, m[name], function)
        _require_cache_shape(m, name, m.shape_of(cache), shape)
        caches.append(cache)
    return caches, head_size


def _require_cache_shape(m: Match, name: str, cache: tuple | None, heads: tuple) -> None:
    """The cache [B or 1, S or 1, H] unsqueezed to [., 1, ., H] meets x [B, N, S, H] position by
    position: of rank 3, no batch or sequence of its own that would broadcast x to a larger one.
    (A [S, H/2] table unsqueezed would rotate x along the heads axis.)"""
    m.require(cache is not None and len(cache) == 3, f"{name} is computed as {cache}, not [batch, positions, H]")
    m.require(cache[2] == heads[3], f"{name} is computed as {cache}, not of x's head size {heads[3]}")
    for axis, what in ((0, "batch"), (1, "sequence")):
        own, of_x = cache[axis], heads[axis + (1 if axis else 0)]
        m.require(
            not (isinstance(own, int) and own != 1 and own != of_x),
            f"{name}'s {what} of {own} is not x's {of_x}: the original broadcasts x to it",
        )


def _first_halves(b: Builder, caches: list[str], head_size: int, rule_name: str) -> list[str]:
    """cache[..., :H/2] of each cache, made once for all the rotations that read it."""
    return [
        b.once(
            f"{rule_name}:{cache}",
            lambda b, cache=cache: b.Slice(
                cache, np.array([0], np.int64), np.array([head_size // 2], np.int64), np.array([-1], np.int64)
            ),
        )
        for cache in caches
    ]


@rule("rotary-embedding", pattern=PATTERN, opsets=(23, None))
def rotary_embedding(m: Match, b: Builder):
    """x * cos + rotate_half(x) * sin (heads [B, N, S, H])  =>  RotaryEmbedding."""
    caches, head_size = _checked_caches(m)
    batch, sequence = m.shape("x")[0], m.shape("x")[2]
    shapes = [m.shape_of(cache) for cache in caches]
    full_batch = batch not in (None, "?") and all(shape[0] == batch for shape in shapes)
    # A cache of one position broadcast over x's sequence; a symbolic length is taken for x's (it
    # is, in every export seen: an Expand for it cost each rotation a Shape).
    full_sequence = not any(shape[1] == 1 and sequence != 1 for shape in shapes)
    halves = _first_halves(b, caches, head_size, "rotary-embedding")
    if not (full_batch and full_sequence):
        # onnxruntime wants the caches [B, S, H/2] in full, where the original may broadcast a
        # batch of 1 ([1, S, H/2], as Hugging Face builds them) or one position.
        batch_part = b.Shape(m["x"], start=0, end=1) if not full_batch else np.array([1], np.int64)
        if full_sequence:
            target = b.Concat(batch_part, np.array([1, 1], np.int64), axis=0)
        else:
            target = b.Concat(batch_part, b.Shape(m["x"], start=2, end=3), np.array([1], np.int64), axis=0)
        halves = [b.Expand(half, target) for half in halves]
    return b.RotaryEmbedding(m["x"], halves[0], halves[1])


@rule("rotary-embedding-ort", pattern=PATTERN, target="onnxruntime", emits={"com.microsoft": 1})
def rotary_embedding_ort(m: Match, b: Builder):
    """x * cos + rotate_half(x) * sin (heads [B, N, S, H])  =>  com.microsoft RotaryEmbedding."""
    caches, head_size = _checked_caches(m)
    shapes = [m.shape_of(cache) for cache in caches]
    for name, shape in zip(("cos", "sin"), shapes):
        m.require(
            shape[0] == 1,
            f"{name} is computed as {shape}, not [1, positions, H]: the fused op reads one row of positions "
            "for the whole batch",
        )
    # [positions, H/2] tables, made once for all the rotations that read the same cache
    tables = [
        b.once(
            f"rotary-embedding-ort:table:{half}",
            lambda b, half=half: b.Reshape(half, np.array([-1, head_size // 2], np.int64)),
        )
        for half in _first_halves(b, caches, head_size, "rotary-embedding-ort")
    ]
    sequence = m.shape("x")[2]
    if not all(shape[1] == sequence for shape in shapes) or sequence in (None, "?"):
        # Shape inference cannot show the cache has x's sequence length: it may be one position
        # that the original broadcasts over the sequence. A row per position of x, either way.
        rows = b.Concat(dim(b, m.opset, m["x"], 2), np.array([head_size // 2], np.int64), axis=0)
        tables = [b.Expand(table, rows) for table in tables]
    return b.op(
        "RotaryEmbedding",
        m["x"],
        np.array([0], np.int64),
        tables[0],
        tables[1],
        domain="com.microsoft",
        interleaved=0,
    )
