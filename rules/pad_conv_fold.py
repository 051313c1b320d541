"""Conv(Pad(x)) with a constant zero pad of the spatial axes  =>  Conv with larger `pads`.

Exporters of "same" padding (TensorFlow-style models, Hugging Face MobileNets) write an
explicit Pad before the convolution. A convolution's own `pads` add zeros just the same, so
the Pad folds into them and the separate copy of the padded tensor disappears. AveragePool
takes it too when it counts padded zeros (count_include_pad=1), which then matches the explicit
zeros exactly; a pool that had pads of its own which it did not count, or a ceil_mode pool
whose last windows may reach past the padding, declines. MaxPool pads with -inf, not zeros,
and is left alone.
"""

from __future__ import annotations

from fuser.rules._simplify import SIMPLIFY_PHASE

from fuser import Builder, Match, const, op, rule, var


PAD = op.Pad(var("x"), const("pads", optional=True), const("value", optional=True), name="pad")


def _spatial_pads(m: Match, rank: int) -> list[int]:
    """The Pad's zero padding of the spatial axes as [begins..., ends...]; declines otherwise."""
    m.require(m.attr("pad", "mode", "constant") in ("constant", b"constant"), "the Pad is not in constant mode")
    m.require(len([i for i in m.node("pad").inputs if i]) <= 3, "the Pad names its axes")
    if m.opset < 11:
        pads, value = list(m.attr("pad", "pads", [])), float(m.attr("pad", "value", 0.0))
    else:
        m.require(m["pads"] is not None, "the Pad has no pads input")
        pads = [int(p) for p in m.value("pads").reshape(-1)]
        given = m.value("value")
        value = 0.0 if given is None or given.size == 0 else float(given.reshape(-1)[0])
    m.require(value == 0.0, f"the Pad fills with {value}, not zero")
    m.require(len(pads) == 2 * rank, f"the Pad has {len(pads)} pads for a rank-{rank} input")
    m.require(all(p >= 0 for p in pads), "the Pad crops (negative pads)")
    m.require(pads[0] == pads[1] == pads[rank] == pads[rank + 1] == 0, "the Pad pads the batch or channel axis")
    return pads[2:rank] + pads[rank + 2 :]


def _merged(m: Match, node: str, rank: int) -> dict:
    attrs = m.attrs(node)
    auto_pad = attrs.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    # VALID is no padding at all: explicit zero pads say the same (Hugging Face's EfficientNet).
    m.require(auto_pad in ("NOTSET", "VALID"), f"the {m.node(node).op_type} pads automatically ({auto_pad})")
    extra = _spatial_pads(m, rank)
    own = list(attrs.get("pads", [0] * len(extra))) if auto_pad == "NOTSET" else [0] * len(extra)
    attrs["pads"] = [int(a) + int(b) for a, b in zip(own, extra)]
    attrs.pop("auto_pad", None)
    return attrs


@rule(
    "pad-conv-fold",
    pattern=op.Conv(PAD, const("w"), var("b", optional=True), name="conv"),
    phase=SIMPLIFY_PHASE,
)
def pad_conv_fold(m: Match, b: Builder):
    """Conv(Pad(x, zeros on H, W))  =>  Conv(x) with the pads added to its own."""
    rank = len(m.value("w").shape)
    attrs = _merged(m, "conv", rank)
    return b.Conv(m["x"], m["w"], m["b"], **attrs)


@rule(
    "pad-pool-fold",
    pattern=op.AveragePool(PAD, name="pool"),
    phase=SIMPLIFY_PHASE,
)
def pad_pool_fold(m: Match, b: Builder):
    """AveragePool(Pad(x, zeros on H, W))  =>  AveragePool(x) counting its (larger) pads."""
    rank = m.rank("x")
    m.require(rank is not None, "the input's rank is unknown")
    m.require(not m.attr("pool", "ceil_mode", 0), "ceil_mode windows may reach past the padding")
    own = list(m.attr("pool", "pads", []) or [])
    m.require(
        m.attr("pool", "count_include_pad", 0) or not any(own),
        "the pool has pads of its own that it does not count",
    )
    attrs = _merged(m, "pool", rank)
    kernel = list(attrs.get("kernel_shape", []))
    m.require(
        len(attrs["pads"]) == 2 * len(kernel) and all(p < k for p, k in zip(attrs["pads"], kernel + kernel)),
        f"the pads {attrs['pads']} would not all be smaller than the kernel {kernel} (onnxruntime refuses such a pool)",
    )
    attrs["count_include_pad"] = 1
    return b.AveragePool(m["x"], **attrs)
