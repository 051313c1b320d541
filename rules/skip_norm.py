"""Norm(a + b)  =>  com.microsoft SkipLayerNormalization / SkipSimplifiedLayerNormalization(a, b).

The residual Add in front of a transformer block's normalization. The fused kernels add,
normalize and (through their fourth output) return the sum, which stands in for the Add
where the residual also feeds the next block (pre-norm GPT-2/Llama). onnxruntime's CPU
kernels normalize the last axis of 2-D or 3-D float32/float16 inputs with a 1-D scale and
take the two addends with the same shape.
"""

from __future__ import annotations

from fuser.rules._common import require_float

from fuser import Builder, Match, const, op, rule, var

PRIORITY = 24
SKIP_DTYPES = ("float16", "float32")


def _residual(m: Match) -> None:
    require_float(m, "a", SKIP_DTYPES)
    shape_a, shape_b = m.shape("a"), m.shape("b")
    m.require(shape_a is not None and shape_b is not None, "the addends' shapes are unknown")
    m.require(shape_a == shape_b and "?" not in shape_a, f"the addends' shapes {shape_a} and {shape_b} differ")
    m.require(len(shape_a) in (2, 3), f"the input has rank {len(shape_a)}; the kernel takes 2-D or 3-D")
    axis = int(m.attr("norm", "axis", -1))
    m.require(axis in (-1, len(shape_a) - 1), "the normalization is not over the last axis only")
    m.require(m.value("s").ndim == 1, "the scale is not one-dimensional")
    m.require(m.value("beta") is None or m.value("beta").ndim == 1, "the bias is not one-dimensional")


def _fused(m: Match, b: Builder, op_type: str, *params):
    outputs = b.op(op_type, m["a"], m["b"], *params, domain="com.microsoft", outputs=4,
                   epsilon=float(m.attr("norm", "epsilon", 1e-5)))
    if m.consumers("sum") > 1 or m.is_graph_output("sum"):
        b.replaces(m["sum"], outputs[3])
    return outputs[0]


@rule(
    "skip-layer-norm",
    pattern=op.LayerNormalization(
        op.Add(var("a"), var("b"), name="sum"), const("s"), const("beta", optional=True), name="norm"
    ),
    target="onnxruntime",
    emits={"com.microsoft": 1},
)
def skip_layer_norm(m: Match, b: Builder):
    """Add -> LayerNormalization  =>  SkipLayerNormalization (the sum as its fourth output)."""
    _residual(m)
    return _fused(m, b, "SkipLayerNormalization", m["s"], m["beta"])


@rule(
    "skip-rms-norm",
    pattern=(op.RMSNormalization | op.SimplifiedLayerNormalization)(
        op.Add(var("a"), var("b"), name="sum"), const("s"), name="norm"
    ),
    target="onnxruntime",
    emits={"com.microsoft": 1},
)
def skip_rms_norm(m: Match, b: Builder):
    """Add -> RMS normalization  =>  SkipSimplifiedLayerNormalization (the sum as its fourth output)."""
    _residual(m)
    return _fused(m, b, "SkipSimplifiedLayerNormalization", m["s"])
