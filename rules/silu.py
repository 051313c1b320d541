"""x * Sigmoid(x)  =>  Swish(x) (opset 24), or com.microsoft QuickGelu(x, alpha=1) on the
onnxruntime target; x * Sigmoid(alpha * x)  =>  the same with that alpha.

SiLU (Swish with alpha 1), the activation of Llama's gated MLP and of EfficientNet/YOLO
convnets, as every exporter writes it; CLIP's "quick GELU" is alpha = 1.702. Swish(alpha) and
QuickGelu(alpha) both compute x * sigmoid(alpha * x). Their alpha is a float attribute, so
a float64 alpha that float32 does not hold exactly stays written out.

`silu` is off by default: onnxruntime 1.32's CPU Swish kernel is slower than the Sigmoid + Mul
it replaces, which onnxruntime fuses into QuickGelu itself (`python bench/swish_kernel.py`:
1.45x to 3.0x at optimization level all, 1.4x to 3.3x with it off; EfficientNet at opset 24
ran 1.33x slower). `--enable silu` for a runtime where Swish pays.
"""

from __future__ import annotations

from fuser.rules._common import require_float, require_float_attribute, require_no_broadcast, scalar

from fuser import Builder, Match, const, op, rule, var

PATTERNS = (
    op.Mul(var("x"), op.Sigmoid(var("x"), name="sigmoid"), name="mul"),
    op.Mul(var("x"), op.Sigmoid(op.Mul(var("x"), const("alpha"), name="scale"), name="sigmoid"), name="mul"),
)


def _alpha(m: Match) -> float:
    """1 for x * Sigmoid(x), else the scale's single value, which a float attribute must hold."""
    if not m.has("alpha"):
        return 1.0
    alpha = scalar(m, "alpha")
    m.require(alpha is not None, "the sigmoid's scale is not a single constant")
    require_no_broadcast(m, "alpha", "x", "the sigmoid's scale")
    require_float_attribute(m, alpha, "the scale")
    return alpha


@rule("silu", pattern=PATTERNS, opsets=(24, None), enabled=False)  # slower on onnxruntime: see above
def silu(m: Match, b: Builder):
    """Mul(x, Sigmoid(alpha * x))  =>  Swish(x, alpha)."""
    require_float(m, "x", ("float16", "float32", "float64", "bfloat16"))
    return b.Swish(m["x"], alpha=_alpha(m))


@rule("silu-ort", pattern=PATTERNS, target="onnxruntime", emits={"com.microsoft": 1})
def silu_ort(m: Match, b: Builder):
    """Mul(x, Sigmoid(alpha * x))  =>  com.microsoft QuickGelu(x, alpha)."""
    require_float(m, "x", ("float16", "float32", "float64"))
    return b.op("QuickGelu", m["x"], domain="com.microsoft", alpha=_alpha(m))
