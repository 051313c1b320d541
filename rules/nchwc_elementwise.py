"""unary(ReorderOutput(x))  =>  ReorderOutput(unary(x)) (onnxruntime target, NCHWc layout).

An element-wise operator does not care how its tensor's values are laid out, so it can run
on the blocked tensor itself: the reorder moves past it, and then cancels against the next
NCHWc operator's (nchwc-reorder-cancel). Without this an activation that the convolution
cannot apply itself (QuickGelu, Gelu, HardSwish) closes the blocked region, and every
block of an EfficientNet or a PoolFormer pays a ReorderOutput and a ReorderInput around it.
Only operators that keep finite padding channels finite (CARRIED_UNARY) move.
"""

from __future__ import annotations

from fuser import Builder, Match, op, rule, var
from fuser.rules._hard_activations import close_to
from fuser.rules._nchwc import (
    CARRIED_UNARY,
    EMITS,
    channels_of,
    conv_activations,
    is_carried_unary,
    nchwc,
    reorder_output,
)


def _unary(domain: str):
    names = sorted(CARRIED_UNARY[domain])
    alternatives = getattr(op.domain(domain), names[0])
    for name in names[1:]:
        alternatives = alternatives | getattr(op.domain(domain), name)
    # Clip's bounds are optional inputs; nothing else here has any.
    return alternatives(
        nchwc.ReorderOutput(var("x"), name="to_plain"),
        var("low", optional=True),
        var("high", optional=True),
        name="unary",
    )


def _convolution_applies_it(m: Match) -> bool:
    """nchwc-activation folds this activation into the convolution that produced its input:
    on its own, or as the HardSigmoid of x * HardSigmoid(x), which it applies as HardSwish."""
    producer = m.graph.producer(m["x"])
    if producer is None:
        return False
    conv, unary = m.graph.node(producer), m.node("unary")
    if conv.domain != "com.microsoft.nchwc" or conv.op_type != "Conv" or conv.attr("activation") is not None:
        return False
    if len(m.graph.consumers(conv.outputs[0])) != 1 or m.graph.is_graph_output(conv.outputs[0]):
        return False  # another reader of the blocked result would lose it: nchwc-activation declines
    if unary.domain != "" or not all(m.graph.is_constant(bound) for bound in unary.inputs[1:] if bound):
        return False
    if m.consumers("to_plain") == 1:
        return unary.op_type in conv_activations()
    return unary.op_type == "HardSigmoid" and "HardSwish" in conv_activations() and _hard_swish(m, unary)


def _hard_swish(m: Match, hard_sigmoid) -> bool:
    """x * HardSigmoid(x, 1/6, 0.5), x read by nothing else: nchwc-activation's HardSwish."""
    alpha, beta = float(hard_sigmoid.attr("alpha", 0.2)), float(hard_sigmoid.attr("beta", 0.5))
    if not close_to(alpha, 1 / 6) or beta != 0.5:
        return False
    plain, result = m.node("to_plain").outputs[0], hard_sigmoid.outputs[0]
    readers, products = m.graph.op_consumers(plain), m.graph.op_consumers(result)
    if len(readers) != 2 or len(products) != 1 or products[0] not in readers or m.graph.is_graph_output(plain):
        return False
    product = m.graph.node(products[0])
    return product.op_type == "Mul" and sorted(product.inputs) == sorted([plain, result])


@rule(
    "nchwc-elementwise",
    pattern=(_unary(""), _unary("com.microsoft")),
    target="onnxruntime",
    emits=EMITS,
    phase=1,
    shared_interior=True,
)
def nchwc_elementwise(m: Match, b: Builder):
    """unary(ReorderOutput(x))  =>  ReorderOutput(unary(x))."""
    unary = m.node("unary")
    m.require(is_carried_unary(unary), f"{unary.op_type} has inputs besides the tensor it maps")
    channels = channels_of(m, "to_plain")
    m.require(not _convolution_applies_it(m), "the convolution applies this activation itself (nchwc-activation)")
    inputs = [m["x"], *unary.inputs[1:]]
    blocked = b.op(unary.op_type, *inputs, domain=unary.domain, **m.attrs("unary"))
    return reorder_output(b, blocked, channels)
