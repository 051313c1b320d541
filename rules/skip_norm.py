"""Norm(a + b)  =>  com.microsoft SkipLayerNormalization / SkipSimplifiedLayerNormalization(a, b).

The residual Add in front of a transformer block's normalization. The fused kernels add,
normalize and (through their fourth output) return the sum, which stands in for the Add
where the residual also feeds the next block (pre-norm GPT-2/Llama). onnxruntime's CPU
kernels normalize the last axis of 2-D or 3-D float32/float16 inputs with a 1-D scale and
take the skip (second addend) with the input's shape, or [1, S, H] / [S, H] against a
[B, S, H] input. With a skip of batch B and an input of batch 1 the kernel returns a batch-1
result where Add broadcasts, so every dimension must be provably equal (the same size or the
same symbolic name, see same_dim); where that cannot be shown, the rule declines. A constant
1-D bias added to one addend first (the projection's bias: MatMul -> Add(bias) -> residual
Add) goes into the kernel's bias input.

Both rules run in phase 1, once norm-scale-fold / norm-bias-fold are done, so a written-out
norm with its learned weight and bias becomes a single Skip* node in every block.

Both are off by default (--enable skip-layer-norm): onnxruntime 1.32's CPU kernels are slower
than the Add and norm they replace. `python bench/skip_norm_kernels.py` (2 threads, medians):
SkipLayerNormalization 597 us against 102 us for Add + LayerNormalization at 128 x 768, 921
against 188 at 197 x 768; SkipSimplifiedLayerNormalization 71 against 45 us at 128 x 512.
Enable them for a runtime whose kernels are faster (measure with --measure).
"""

from __future__ import annotations

from fuser.rules._common import require_float, same_shape

from fuser import Builder, Decline, Match, const, op, rule, var

SKIP_DTYPES = ("float16", "float32")


def _skip_fits(input_shape: tuple, skip: tuple) -> bool:
    """Whether the kernel computes input + skip exactly as Add would broadcast it."""
    if len(input_shape) not in (2, 3):
        return False
    if same_shape(skip, input_shape):
        return True
    return len(input_shape) == 3 and (same_shape(skip, (1, *input_shape[1:])) or same_shape(skip, input_shape[1:]))


def _sums(norm, *params):
    """norm((a + bias) + b, params), then norm(a + b, params): the bias goes in where it can."""
    biased = op.Add(var("a"), const("skip_bias"), name="bias_add")
    yield norm(op.Add(biased, var("b"), name="sum"), *params, name="norm")
    yield norm(op.Add(var("a"), var("b"), name="sum"), *params, name="norm")


def _skip_bias(m: Match) -> str | None:
    """The constant bias added to the input first, when there is one the kernel can take."""
    if not m.has("skip_bias"):
        return None
    bias, shape = m.value("skip_bias"), m.shape("a")
    m.require(bias.ndim == 1 and shape is not None and shape[-1] == bias.shape[0], "the bias is not one value per channel")
    m.require(m.dtype("skip_bias") == m.dtype("a"), "the bias and the input have different dtypes")
    return m["skip_bias"]


def _operands(m: Match) -> tuple[str, str]:
    """(input, skip): the addends in the order the kernel takes them; declines if neither fits."""
    require_float(m, "a", SKIP_DTYPES)
    m.require(m.dtype("s") == m.dtype("a"), f"the norm's scale is {m.dtype('s')}, its input {m.dtype('a')}")
    shape_a, shape_b = m.shape("a"), m.shape("b")
    m.require(shape_a is not None and shape_b is not None, "the addends' shapes are unknown")
    axis = int(m.attr("norm", "axis", -1))
    m.require(axis in (-1, len(shape_a) - 1), "the normalization is not over the last axis only")
    m.require(m.value("s").ndim == 1, "the scale is not one-dimensional")
    if _skip_fits(shape_a, shape_b):
        return m["a"], m["b"]
    if _skip_fits(shape_b, shape_a):
        return m["b"], m["a"]
    raise Decline(
        f"the addends' shapes {list(shape_a)} and {list(shape_b)} are not provably the same "
        "[B, S, H] (or a [1, S, H] / [S, H] skip); the kernel takes 2-D or 3-D inputs"
    )


def _fused(m: Match, b: Builder, op_type: str, *params):
    outputs = b.op(op_type, *_operands(m), *params, domain="com.microsoft", outputs=4,
                   epsilon=float(m.attr("norm", "epsilon", 1e-5)))
    if m.consumers("sum") > 1 or m.is_graph_output("sum"):
        b.replaces(m["sum"], outputs[3])
    return outputs[0]


@rule(
    "skip-layer-norm",
    pattern=tuple(_sums(op.LayerNormalization, const("s"), const("beta", optional=True))),
    target="onnxruntime",
    emits={"com.microsoft": 1},
    phase=1,
    enabled=False,  # slower than Add + norm on onnxruntime's CPU: see the module docstring
)
def skip_layer_norm(m: Match, b: Builder):
    """Add -> LayerNormalization  =>  SkipLayerNormalization (the sum as its fourth output)."""
    m.require(not m.has("beta") or m.value("beta").ndim == 1, "the bias is not one-dimensional")
    return _fused(m, b, "SkipLayerNormalization", m["s"], m["beta"], _skip_bias(m))


@rule(
    "skip-rms-norm",
    pattern=tuple(_sums(op.RMSNormalization | op.SimplifiedLayerNormalization, const("s"))),
    target="onnxruntime",
    emits={"com.microsoft": 1},
    phase=1,
    enabled=False,  # slower than Add + norm on onnxruntime's CPU: see the module docstring
)
def skip_rms_norm(m: Match, b: Builder):
    """Add -> RMS normalization  =>  SkipSimplifiedLayerNormalization (the sum as its fourth output)."""
    return _fused(m, b, "SkipSimplifiedLayerNormalization", m["s"], _skip_bias(m))
