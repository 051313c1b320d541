"""Recognising scaled dot-product attention written out as MatMul/Softmax/MatMul, for the
attention rules (one per target) and the advisory that says why a Softmax stayed.

Exporters spell multi-head attention as

    q_heads = Transpose(Reshape(q, [B, S, N, H]), [0, 2, 1, 3])          likewise k, v
    scores  = MatMul(q_heads * a, kᵀ * b) * c (+ mask)                    a, b, c scalars
    probs   = Softmax(scores, axis=-1)  [then Where(IsNaN(probs), 0, probs)]
    output  = Reshape(Transpose(MatMul(probs, v_heads), [0, 2, 1, 3]), [B, S, N*H])

with kᵀ written as Transpose(k_split, [0, 2, 3, 1]), as Transpose(k_heads, [0, 1, 3, 2]),
or (torch.export) as Reshape(Transpose(Reshape(k_heads, [B*N, S, H]), [0, 2, 1]), [B, N, H, S]).
The rules match the merge (Reshape of Transpose of MatMul) and `trace_attention` walks the
rest, checking every layout step against the inferred shapes, so a lookalike with different
axes is declined rather than fused. The mask is whatever is added to the scores (any
tensor that broadcasts to [B, N, S, L]); scalings are multiplied into one `scale`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx
from fuser.rules._simplify import unsqueeze_axes

from fuser import Builder, Decline, Match, op, var
from fuser.graph import NodeInfo

FUSABLE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))

# The root every attention rule matches: heads merged back into [B, S, N*H].
# Only the Reshape itself: the shape computations of exported models read the tensors inside
# the attention (Shape of the transposed heads), so the nodes below are taken by walking, with
# those computations, and checked by the engine once all are known (Match.absorb).
MERGE_HEADS = op.Reshape(var("merged"), var("merge_shape"), name="merge")

_HEADS_FIRST = [0, 2, 1, 3]

# How deep below a rewrite the engine looks again at a merge Reshape (walks=): trace_attention
# reads far above it, up to 16 nodes on torch.export's longest spelling (the merge's Transpose
# and pass-through Reshape, the context MatMul, the NaN guard's Where, a Cast, the Softmax, the
# mask's Add, the scores' scaling, the Q·Kᵀ MatMul, the key's scaling, the Reshape-Transpose-
# Reshape of Kᵀ, the key's head Transpose and split Reshape). 8 is the depth of the fusion
# phase's deepest patterns (layer-norm, gelu): as deep as the engine always looked, while a
# full 16 made the onnxruntime target's rewrite of the 80-layer Llama export 16% slower. Within
# a pass a merge is looked at after every node above it (position order), so only a rewrite
# that comes later and reaches far above it goes unseen, as before.
WALK_DEPTH = 8


@dataclass
class Attention:
    """What the fused op needs: 3-D q [B, S, N*H], k [B, L, N*H], v [B, L, N*Hv]."""

    q: str
    k: str
    v: str
    num_heads: int
    head_size: int
    v_head_size: int
    scale: float
    mask: str | None  # added to the scores; broadcasts to [B, N, S, L]
    mask_is_full: bool  # known to be [B or 1, N or 1, S, L] already
    nan_guard: bool  # fully masked rows give 0 (Where(IsNaN(probs), 0, probs)), not NaN
    merged_rank: int  # 3: [B, S, N*Hv]; 2: [B*S, N*Hv], flattened for a Gemm
    dtype: np.dtype
    # The model's own merge (Reshape target, allowzero), applied again to the fused op's
    # [B, S, N*Hv] when the shapes do not show what the merge gives (see _check_merge).
    merge_target: tuple[str, int] | None = None
    # K and V as [B, Nkv, L, H] before grouped-query attention repeated their heads to N
    # (_unrepeated): a fused op that repeats them itself reads these instead.
    kv_unrepeated: tuple[str, str] | None = None
    nodes: set[int] = field(default_factory=set)

    @property
    def reads(self) -> set[str]:
        """The tensors the fused op reads from outside the attention."""
        read = {self.q, self.k, self.v}
        if self.mask is not None:
            read.add(self.mask)
        if self.merge_target is not None:
            read.add(self.merge_target[0])
        return read


class _Walk:
    def __init__(self, m: Match):
        self.m = m
        self.graph = m.graph
        self.nodes: set[int] = set()

    def producer(self, tensor: str, what: str, *op_types: str):
        node_id = self.graph.producer(tensor) if tensor else None
        info = self.graph.node(node_id) if node_id is not None else None
        if info is None or info.op_type not in op_types or info.domain not in ("", "ai.onnx"):
            found = "a graph input or constant" if info is None else info.op_type
            raise Decline(f"{what} comes from {found}, not {' or '.join(op_types)}")
        self.nodes.add(node_id)
        return info

    def is_op(self, tensor: str, *op_types: str) -> bool:
        node_id = self.graph.producer(tensor) if tensor else None
        return node_id is not None and self.graph.node(node_id).op_type in op_types

    def scalar(self, tensor: str) -> float | None:
        value = self.graph.constant_value(tensor)
        if value is None or value.size != 1 or value.ndim > 4 or value.dtype.kind != "f":
            return None
        return float(value.reshape(()))

    def strip_scaling(self, tensor: str) -> tuple[str, float]:
        """Through Mul/Div by constant scalars: the tensor underneath and the factor applied."""
        factor = 1.0
        while self.is_op(tensor, "Mul", "Div"):
            info = self.graph.node(self.graph.producer(tensor))
            a, b = info.inputs[0], info.inputs[1]
            if info.op_type == "Mul" and self.scalar(a) is not None and self.scalar(b) is None:
                a, b = b, a
            c = self.scalar(b)
            if c is None or c == 0:
                break
            factor *= c if info.op_type == "Mul" else 1.0 / c
            self.nodes.add(info.id)
            tensor = a
        return tensor, factor

    def transpose(self, tensor: str, what: str, perm: list[int]) -> str:
        info = self.producer(tensor, what, "Transpose")
        actual = list(info.attr("perm") or [])
        if actual != perm:
            raise Decline(f"{what} is a Transpose with perm {actual}, not {perm}")
        return info.inputs[0]

    def shape(self, tensor: str) -> tuple | None:
        return self.m.shape_of(tensor)


def _same_dim(a, b) -> bool:
    """Known to be equal: the same number or the same symbol (never '?')."""
    return a == b and a not in (None, "?")


def trace_attention(m: Match, merge: NodeInfo | None = None) -> Attention:
    """Walk from the merge Reshape (the root of MERGE_HEADS unless given) to q, k, v; declines
    say which part did not fit."""
    merge = merge or m.root
    walk = _Walk(m)
    walk.nodes.add(merge.id)
    context = walk.transpose(merge.inputs[0], "the Reshape's input", _HEADS_FIRST)
    passthrough = None
    if walk.is_op(context, "Reshape"):  # torch.onnx's scaled_dot_product_attention reshapes to [B, -1, S, Hv]
        passthrough = walk.producer(context, "the merged heads", "Reshape")
        context = passthrough.inputs[0]
    context_matmul = walk.producer(context, "the merged heads", "MatMul")
    probs, v_heads = context_matmul.inputs

    nan_guard = False
    if walk.is_op(probs, "Where"):
        guard = walk.producer(probs, "the attention probabilities", "Where")
        cond, zero, probs = guard.inputs
        is_nan = walk.producer(cond, "the Where before the context MatMul", "IsNaN")
        value = walk.graph.constant_value(zero)
        m.require(
            is_nan.inputs[0] == probs and value is not None and value.size == 1 and float(value.reshape(())) == 0.0,
            "the Where before the context MatMul is not Where(IsNaN(p), 0, p)",
        )
        nan_guard = True
    while walk.is_op(probs, "Cast"):  # eager attention: softmax(..., dtype=float32).to(dtype)
        cast = walk.producer(probs, "the attention probabilities", "Cast")
        m.require(
            m.dtype_of(cast.inputs[0]) == m.dtype_of(probs) and m.dtype_of(probs) is not None,
            f"the Softmax's {m.dtype_of(cast.inputs[0])} result is cast to {m.dtype_of(probs)}",
        )
        probs = cast.inputs[0]
    softmax = walk.producer(probs, "the attention probabilities", "Softmax")
    axis = softmax.attr("axis")
    m.require(axis in (-1, 3), f"the Softmax is over axis {axis}, not the last of four")

    scores, mask, scale = _scores(walk, softmax.inputs[0])
    qk = walk.producer(scores, "the attention scores", "MatMul")
    q_heads, q_factor = walk.strip_scaling(qk.inputs[0])
    k_side, k_factor = walk.strip_scaling(qk.inputs[1])
    scale *= q_factor * k_factor

    q, num_heads, head_size, q_batch_seq = _source(walk, q_heads, "Q")
    k_kind, k_tensor = _key_split(walk, k_side)
    if k_kind == "split":
        k, k_num_heads, k_head_size = _split_heads(walk, k_tensor, "K")
    else:
        k, k_num_heads, k_head_size, _ = _source(walk, k_tensor, "K")
    v, v_num_heads, v_head_size, _ = _source(walk, v_heads, "V")
    m.require(
        k_num_heads == num_heads and v_num_heads == num_heads,
        f"Q has {num_heads} heads but K has {k_num_heads} and V {v_num_heads} (grouped-query attention without "
        "the heads repeated)",
    )
    m.require(k_head_size == head_size, f"Q and K have different head sizes ({head_size}, {k_head_size})")
    if passthrough is not None:
        _check_passthrough(walk, passthrough, q_heads, v_heads)
    merged_rank, merge_target = _check_merge(walk, merge, q_batch_seq, num_heads * v_head_size)

    dtype = m.dtype_of(q)
    for name, tensor in (("K", k), ("V", v)):
        m.require(m.dtype_of(tensor) == dtype, "%s is %s but Q is %s", name, m.dtype_of(tensor), dtype)
    k_source, v_source = _unrepeated(walk, k, num_heads), _unrepeated(walk, v, num_heads)
    kv_unrepeated = None
    if k_source is not None and v_source is not None and k_source[1] == v_source[1]:
        kv_unrepeated = (k_source[0], v_source[0])
    mask_is_full = False
    if mask is not None:
        m.require(m.dtype_of(mask) == dtype, "the mask is %s, not %s like Q", m.dtype_of(mask), dtype)
        mask_shape, scores_shape = walk.shape(mask), walk.shape(scores)
        m.require(mask_shape is None or len(mask_shape) <= 4, f"the mask has shape {mask_shape}, more than 4-D")
        mask_is_full = (
            mask_shape is not None
            and scores_shape is not None
            and len(mask_shape) == 4
            and all(_same_dim(mask_shape[i], scores_shape[i]) for i in (2, 3))
        )
    return Attention(
        q=q,
        k=k,
        v=v,
        num_heads=num_heads,
        head_size=head_size,
        v_head_size=v_head_size,
        scale=scale,
        mask=mask,
        mask_is_full=mask_is_full,
        nan_guard=nan_guard,
        merged_rank=merged_rank,
        dtype=dtype,
        merge_target=merge_target,
        kv_unrepeated=kv_unrepeated,
        nodes=walk.nodes,
    )


def _scores(walk: _Walk, tensor: str) -> tuple[str, str | None, float]:
    """From the Softmax input back to the Q·Kᵀ MatMul: (its output, the mask, the scale)."""
    scale = 1.0
    mask = None
    while True:
        tensor, factor = walk.strip_scaling(tensor)
        scale *= factor
        if not walk.is_op(tensor, "Add"):
            return tensor, mask, scale
        add = walk.producer(tensor, "the scores", "Add")
        if mask is not None:
            raise Decline("more than one mask is added to the scores")
        chain = [i for i in add.inputs if _leads_to_matmul(walk, i)]
        if len(chain) != 1:
            raise Decline("cannot tell the scores from the mask in the Add before the Softmax")
        if scale != 1.0:
            raise Decline("the mask is added before the scores are scaled")
        mask = add.inputs[1] if chain[0] == add.inputs[0] else add.inputs[0]
        tensor = chain[0]


def _leads_to_matmul(walk: _Walk, tensor: str) -> bool:
    probe = _Walk(walk.m)
    tensor, _ = probe.strip_scaling(tensor)
    if not probe.is_op(tensor, "MatMul"):
        return False
    qk = walk.graph.node(walk.graph.producer(tensor))
    shape = walk.shape(qk.outputs[0])
    return shape is None or len(shape) == 4


def _key_split(walk: _Walk, k_side: str) -> tuple[str, str]:
    """Under Kᵀ [B, N, H, L], in any of the exporters' spellings: ("split", the K Reshape output
    [B, L, N, H]) or ("heads", K as [B, N, L, H])."""
    what = "Kᵀ (second input of the scores MatMul)"
    if walk.is_op(k_side, "Transpose"):
        info = walk.graph.node(walk.graph.producer(k_side))
        perm = list(info.attr("perm") or [])
        if perm == [0, 2, 3, 1]:
            walk.nodes.add(info.id)
            return "split", info.inputs[0]
        if perm == [0, 1, 3, 2]:
            walk.nodes.add(info.id)
            k_heads, factor = walk.strip_scaling(info.inputs[0])
            if factor != 1.0:
                raise Decline("K is scaled twice around its transposition")
            return "heads", k_heads
        raise Decline(f"{what} is a Transpose with perm {perm}")
    if walk.is_op(k_side, "Reshape"):
        # torch.export: heads folded into the batch, a 3-D transpose, heads unfolded again.
        unfold = walk.producer(k_side, what, "Reshape")
        swap = walk.producer(unfold.inputs[0], what, "Transpose")
        walk.m.require(list(swap.attr("perm") or []) == [0, 2, 1], "Kᵀ's 3-D Transpose does not swap the last two axes")
        fold = walk.producer(swap.inputs[0], what, "Reshape")
        k_heads = fold.inputs[0]
        heads, folded, result = walk.shape(k_heads), walk.shape(fold.outputs[0]), walk.shape(k_side)
        walk.m.require(
            heads is not None
            and folded is not None
            and result is not None
            and len(heads) == 4
            and len(folded) == 3
            and len(result) == 4
            and all(_same_dim(a, b) for a, b in zip(folded[1:], heads[2:]))
            and all(_same_dim(a, b) for a, b in zip(result, (heads[0], heads[1], heads[3], heads[2]))),
            f"cannot tell from the shapes that the Reshape/Transpose/Reshape before the scores transposes K "
            f"(K {heads}, folded {folded}, result {result})",
        )
        return "heads", k_heads
    found = walk.graph.node(walk.graph.producer(k_side)).op_type if walk.graph.producer(k_side) is not None else "input"
    raise Decline(f"{what} comes from {found}, not a transposition of K")


def _source(walk: _Walk, heads: str, what: str) -> tuple[str, int, int, tuple]:
    """What the fused op reads for Q, K or V given as heads [B, N, S, H]: (tensor, N, H, (B, S)).

    The tensor is [B, S, N*H] where the graph splits it into heads right there (the split
    then goes into the fused op). Otherwise (rotary embeddings applied to the heads, heads
    repeated for grouped-query attention) it is the heads tensor itself, which the fused
    ops also take: that needs N and H known."""
    probe = _Walk(walk.m)
    try:
        split = probe.transpose(heads, what, _HEADS_FIRST)
        source, num_heads, head_size = _split_heads(probe, split, what)
    except Decline as not_split:
        shape = walk.shape(heads)
        if shape is None or len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
            raise Decline(f"{not_split}; nor are {what}'s heads of known count and size (shape {shape})") from None
        return heads, shape[1], shape[3], (shape[0], shape[2])
    walk.nodes |= probe.nodes
    shape = walk.shape(source)
    return source, num_heads, head_size, (shape[0], shape[1])


def _split_heads(walk: _Walk, split: str, what: str) -> tuple[str, int, int]:
    """The Reshape [B, S, D] -> [B, S, N, H]: (its input, N, H), checked against the shapes."""
    reshape = walk.producer(split, f"{what}'s heads", "Reshape")
    source = reshape.inputs[0]
    before, after = walk.shape(source), walk.shape(split)
    walk.m.require(
        before is not None and after is not None and len(before) == 3 and len(after) == 4,
        f"cannot tell from the shapes that {what} is split into heads ({before} -> {after})",
    )
    hidden, head_size = before[2], after[3]
    walk.m.require(
        isinstance(hidden, int) and isinstance(head_size, int) and head_size > 0 and hidden % head_size == 0,
        f"{what}'s hidden size {hidden} and head size {head_size} are not known numbers that divide",
    )
    same_batch, same_sequence = _same_dim(before[0], after[0]), _same_dim(before[1], after[1])
    # With the hidden size kept (N*H = D), the element count makes the other one equal too:
    # view(batch, -1, N, H) leaves the sequence to -1, which shape inference cannot name.
    keeps_hidden = isinstance(after[2], int) and after[2] * head_size == hidden
    walk.m.require(
        (same_batch and same_sequence) or (keeps_hidden and (same_batch or same_sequence)),
        f"cannot tell from the shapes that {what}'s Reshape keeps batch and sequence ({before} -> {after})",
    )
    return source, hidden // head_size, head_size


def _unrepeated(walk: _Walk, heads: str, num_heads: int) -> tuple[str, int] | None:
    """Where `heads` [B, N, L, H] are [B, Nkv, L, H] with each head repeated N/Nkv times in a row,
    as transformers' repeat_kv does (Unsqueeze at axis 2, Expand to [B, Nkv, N/Nkv, L, H],
    Reshape to [B, N, L, H]): (the [B, Nkv, L, H] tensor, Nkv). None unless the shapes prove it:
    an Expand of unknown dims could broadcast the batch where the heads should repeat."""
    m = walk.m

    def producer(tensor: str, op_type: str) -> NodeInfo | None:
        node_id = m.graph.producer(tensor)
        node = m.graph.node(node_id) if node_id is not None else None
        return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None

    reshape = producer(heads, "Reshape")
    expand = producer(reshape.inputs[0], "Expand") if reshape is not None else None
    unsqueeze = producer(expand.inputs[0], "Unsqueeze") if expand is not None else None
    if unsqueeze is None:
        return None
    expand_output = reshape.inputs[0]
    axes = unsqueeze_axes(m, unsqueeze)
    source = unsqueeze.inputs[0]
    before, expanded, after = walk.shape(source), walk.shape(expand_output), walk.shape(heads)
    if axes not in ([2], [-3]) or None in (before, expanded, after):
        return None
    if (len(before), len(expanded), len(after)) != (4, 5, 4):
        return None
    kv_heads, head_size, repeats = before[1], before[3], expanded[2]
    if not all(isinstance(d, int) and d > 0 for d in (kv_heads, head_size, repeats)) or repeats == 1:
        return None
    repeated_only = (
        _same_dim(expanded[0], before[0])
        and expanded[1] == kv_heads
        and _same_dim(expanded[3], before[2])
        and expanded[4] == head_size
    )
    # [B, Nkv, R, L, H] merged at axes 1, 2 in row-major order; the element count fixes the
    # one of B and L not known equal.
    merged_heads = (
        after[1] == kv_heads * repeats == num_heads
        and after[3] == head_size
        and (_same_dim(after[0], before[0]) or _same_dim(after[2], before[2]))
    )
    return (source, kv_heads) if repeated_only and merged_heads else None


def _check_passthrough(walk: _Walk, reshape, q_heads: str, v_heads: str) -> None:
    """A Reshape of the context [B, N, S, Hv] that must change nothing: three of its four output
    dims known equal to the context's (the fourth follows from the element count)."""
    context = reshape.inputs[0]
    inferred, q_shape, v_shape, result = (walk.shape(t) for t in (context, q_heads, v_heads, reshape.outputs[0]))
    walk.m.require(
        None not in (inferred, q_shape, v_shape, result) and len(result) == 4,
        f"cannot tell from the shapes that the Reshape after the context MatMul changes nothing ({inferred} -> {result})",
    )
    known = [{inferred[0], q_shape[0]}, {inferred[1], q_shape[1]}, {inferred[2], q_shape[2]}, {inferred[3], v_shape[3]}]
    equal = sum(1 for dim, options in zip(result, known) if any(_same_dim(dim, o) for o in options))
    walk.m.require(
        equal >= 3,
        f"cannot tell from the shapes that the Reshape after the context MatMul changes nothing ({inferred} -> {result})",
    )


def _check_merge(walk: _Walk, merge: NodeInfo, batch_seq: tuple, hidden: int) -> tuple[int, tuple[str, int] | None]:
    """The merge's rank: 3 for [B, S, hidden], 2 for [B*S, hidden] (a Gemm's input); and the
    merge itself (target, allowzero) when the shapes do not show which of the two it is.

    Reshape reads its input in row-major order, so reshaping [B, S, N, Hv] or the fused op's
    [B, S, N*Hv] to one target gives the same tensor, provided no target entry past the
    second is a 0 that copies an input dim (the two inputs differ there). Legacy Llama
    exports need this: their rotary embeddings broadcast Q against a cos/sin cache whose
    length shape inference cannot tie to the sequence, so S is not known to be the merge's."""
    m = walk.m
    result, heads = walk.shape(merge.outputs[0]), walk.shape(merge.inputs[0])
    q_shape = batch_seq
    three = False
    if result is not None and heads is not None and len(result) == 3 and len(heads) == 4:
        # Two of the three dims known equal to [B, S, hidden]; the third follows from the element count.
        known = [{q_shape[0], heads[0]}, {q_shape[1], heads[1]}, {hidden}]
        three = sum(1 for dim, options in zip(result, known) if any(_same_dim(dim, o) for o in options)) >= 2
    # [B, S, N, Hv] flattened to [x, hidden] can only be [B*S, hidden].
    two = result is not None and len(result) == 2 and result[1] == hidden
    if three or two:
        return (3 if three else 2), None
    target = merge.inputs[1]
    allowzero = merge.attr("allowzero") or 0
    entries = _target_entries(walk, target)
    m.require(
        entries is not None and (allowzero == 1 or all(e is not None and e != 0 for e in entries[2:])),
        f"cannot tell from the shapes that the last Reshape merges the heads back into [B, S, {hidden}] "
        f"(it gives {result}), nor that its target {_entries_text(entries)} leaves the dims past the second uncopied",
    )
    return 3, (target, allowzero)


def _entries_text(entries: list[int | None] | None) -> str:
    if entries is None:
        return "(of unknown length)"
    return "[" + ", ".join("?" if e is None else str(e) for e in entries) + "]"


def _target_entries(walk: _Walk, target: str) -> list[int | None] | None:
    """A Reshape target's entries: known numbers, None where computed at run time; None when
    not even its length is known. Exports build targets with Concat from the input's dims."""
    value = walk.graph.constant_value(target)
    if value is not None:
        return [int(v) for v in value.reshape(-1)] if value.ndim == 1 else None
    if not walk.is_op(target, "Concat"):
        shape = walk.shape(target)
        return [None] * shape[0] if shape is not None and len(shape) == 1 and isinstance(shape[0], int) else None
    entries: list[int | None] = []
    for part in walk.graph.node(walk.graph.producer(target)).inputs:
        value = walk.graph.constant_value(part)
        shape = walk.shape(part)
        if value is not None and value.ndim == 1:
            entries += [int(v) for v in value]
        elif shape is not None and len(shape) == 1 and isinstance(shape[0], int):
            entries += [None] * shape[0]
        else:
            return None
    return entries


def merged(b: Builder, attention: Attention, output: str, rank: int = 3) -> str:
    """The fused op's output, given as [B, S, N*Hv] (rank 3) or [B, S, N, Hv] (rank 4), in the
    shape the model's merge Reshape gave."""
    if attention.merge_target is not None:
        target, allowzero = attention.merge_target
        return b.Reshape(output, target, allowzero=allowzero or None)
    hidden = attention.num_heads * attention.v_head_size
    if attention.merged_rank == 2:
        return b.Reshape(output, np.array([-1, hidden], np.int64))
    return output if rank == 3 else b.Reshape(output, np.array([0, 0, hidden], np.int64))


def absorb_attention(m: Match, attention: Attention, reads: set[str]) -> None:
    """Hand every node of the attention to the engine, with the shape computations that only
    fed them (the Reshapes' target shapes), but nothing that produces a tensor in `reads`."""
    graph = m.graph
    removed = set(attention.nodes)
    changed = True
    while changed:
        changed = False
        for node_id in list(removed):
            for tensor in graph.node(node_id).inputs:
                producer = graph.producer(tensor) if tensor else None
                if producer is None or producer in removed:
                    continue
                info = graph.node(producer)
                if info.domain not in ("", "ai.onnx") or any(o in reads for o in info.outputs if o):
                    continue
                if any(graph.is_graph_output(o) for o in info.outputs if o):
                    continue
                if all(c in removed for o in info.outputs if o for c, _ in graph.consumers(o)):
                    removed.add(producer)
                    changed = True
    m.absorb(sorted(removed - set(m.node_ids), key=graph.sort_key))


# ------------------------------------------------------------------------ building


def dim(b: Builder, opset: int, tensor: str, axis: int) -> str:
    """The 1-D int64 [size of `tensor` along `axis`]."""
    if opset >= 15:
        return b.Shape(tensor, start=axis, end=axis + 1)
    return b.Slice(b.Shape(tensor), np.array([axis], np.int64), np.array([axis + 1], np.int64))


def heads_merged(b: Builder, tensor: str, rank: int, num_heads: int, head_size: int) -> str:
    """[B, N, S, H] -> [B, S, N*H]; a 3-D tensor is returned as it is."""
    if rank == 3:
        return tensor
    merged_heads = b.Transpose(tensor, perm=_HEADS_FIRST)
    return b.Reshape(merged_heads, np.array([0, 0, num_heads * head_size], np.int64))


def heads_split(b: Builder, tensor: str, rank: int, num_heads: int, head_size: int) -> str:
    """[B, S, N*H] -> [B, N, S, H]; a 4-D tensor is returned as it is."""
    if rank == 4:
        return tensor
    split = b.Reshape(tensor, np.array([0, 0, num_heads, head_size], np.int64))
    return b.Transpose(split, perm=_HEADS_FIRST)


def full_mask(m: Match, b: Builder, attention: Attention, mask: str | None = None) -> str:
    """The mask (`mask`, else the attention's) broadcast to [B or 1, N or 1, S, L], which the
    fused kernels require."""
    mask = mask or attention.mask
    if attention.mask_is_full:
        return mask
    seq_axis = {3: 1, 4: 2}
    shape = b.Concat(
        np.array([1, 1], np.int64),
        dim(b, m.opset, attention.q, seq_axis[m.rank_of(attention.q)]),
        dim(b, m.opset, attention.k, seq_axis[m.rank_of(attention.k)]),
        axis=0,
    )
    return b.Expand(mask, shape)


def mask_without_lowest(m: Match, b: Builder, attention: Attention) -> str:
    """The mask with its entries of the dtype's lowest value moved one step up.

    transformers masks with that value, and a query row masked everywhere then gets a uniform
    softmax, as the spec's Attention adds the mask. onnxruntime's Attention kernel reads the
    value as -inf and gives 0 for such a row (a padded sequence's rows). One step up, every
    masked score still rounds to the same value, so the softmax is unchanged elsewhere; -inf
    stays -inf. The masks of all layers are one tensor: the replacement is built once.
    (In float16 a row masked everywhere is not uniform in the original either: adding the mask
    rounds its scores to a step of 32, which the kernel, computing in float32, does not.)
    """
    mask, dtype = attention.mask, attention.dtype
    lowest = np.finfo(dtype).min
    value = m.graph.constant_value(mask)
    if value is not None and not np.any(value == lowest):
        return mask
    above = np.nextafter(lowest, np.zeros((), dtype)).astype(dtype)
    return b.once(
        f"attention-mask-without-lowest:{mask}",
        lambda b: b.Where(b.Equal(mask, np.array(lowest, dtype)), above, mask),
    )


def zero_fully_masked_rows(m: Match, b: Builder, attention: Attention, mask: str, output: str) -> str:
    """Where every key of a query row is masked with -inf, the original gives 0 (its NaN guard)
    and the fused kernel NaN: zero those rows of `output` [B, S, N*Hv]; gives [B, S, N, Hv]."""
    if m.opset >= 18:
        row_max = b.ReduceMax(mask, np.array([3], np.int64), keepdims=1)
    else:
        row_max = b.ReduceMax(mask, axes=[3], keepdims=1)
    if attention.dtype != np.float32:
        row_max = b.Cast(row_max, to=onnx.TensorProto.FLOAT)  # onnxruntime's IsInf before opset 20: float, double
    masked = b.Transpose(b.IsInf(row_max, detect_positive=0), perm=_HEADS_FIRST)  # [B|1, S, N|1, 1]
    heads = b.Reshape(output, np.array([0, 0, attention.num_heads, attention.v_head_size], np.int64))
    return b.Where(masked, np.zeros((), attention.dtype), heads)


def multihead_pays(attention: Attention) -> bool:
    """Whether com.microsoft MultiHeadAttention can be faster than the attention as it is: only
    where the fusion removes work beyond MatMul, Softmax and MatMul, the NaN guard of
    scaled_dot_product_attention's exports (IsNaN and Where over every probability). Measured
    in rules/attention_multihead.py."""
    return attention.nan_guard


def require_fusable_dtype(m: Match, attention: Attention) -> None:
    m.require(attention.dtype in FUSABLE_DTYPES, "Q is %s; the fused kernels take float32/float16", attention.dtype)


def default_scale(attention: Attention) -> float:
    return 1.0 / math.sqrt(attention.head_size)


# ------------------------------------------------------------------------ advice


def merge_after_softmax(m: Match, softmax: NodeInfo) -> NodeInfo:
    """From a Softmax forward to the Reshape that merges the heads, the way trace_attention
    walks back; declines (with the reason) where the path is not attention's."""
    graph = m.graph

    tensor = softmax.outputs[0]
    consumers = [graph.node(c) for c in graph.op_consumers(tensor)]
    while len(consumers) == 1 and consumers[0].op_type == "Cast":
        tensor = consumers[0].outputs[0]
        consumers = [graph.node(c) for c in graph.op_consumers(tensor)]
    guard = [c for c in consumers if c.op_type == "Where"]
    if guard and {c.op_type for c in consumers} == {"Where", "IsNaN"}:
        tensor = guard[0].outputs[0]
        consumers = [graph.node(c) for c in graph.op_consumers(tensor)]
    context = [c for c in consumers if c.op_type == "MatMul" and c.inputs[0] == tensor]
    m.require(len(context) == 1, "no MatMul with V consumes the Softmax: not attention")
    m.require(len(consumers) == 1, "the attention probabilities are also used outside the attention")
    tensor = context[0].outputs[0]
    for op_type in ("Reshape", "Transpose", "Reshape"):
        consumers = [graph.node(c) for c in graph.op_consumers(tensor) if graph.node(c).op_type != "Shape"]
        if op_type == "Reshape" and consumers and consumers[0].op_type == "Transpose":
            continue  # the Reshape right after the context MatMul is optional
        if len(consumers) != 1 or consumers[0].op_type != op_type:
            found = ", ".join(sorted({c.op_type for c in consumers})) or "nothing"
            raise Decline(
                f"the context MatMul is followed by {found}, not the Transpose and Reshape that merge the heads"
            )
        tensor = consumers[0].outputs[0]
    return consumers[0]
