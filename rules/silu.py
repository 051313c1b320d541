"""x * Sigmoid(x)  =>  Swish(x) (opset 24), or com.microsoft QuickGelu(x, alpha=1) on the
onnxruntime target.

SiLU (Swish with beta 1), the activation of Llama's gated MLP and of EfficientNet/YOLO
convnets, as every exporter writes it. Swish(alpha) and QuickGelu(alpha) both compute
x * sigmoid(alpha * x); alpha = 1 is SiLU.

`silu` is off by default: onnxruntime 1.32's CPU Swish kernel is slower than the Sigmoid + Mul
it replaces, which onnxruntime fuses into QuickGelu itself (`python bench/swish_kernel.py`:
1.45x to 3.0x at optimization level all, 1.4x to 3.3x with it off; EfficientNet at opset 24
ran 1.33x slower). `--enable silu` for a runtime where Swish pays.
"""

from __future__ import annotations

from fuser.rules._common import require_float

from fuser import Builder, Match, op, rule, var

PATTERN = op.Mul(var("x"), op.Sigmoid(var("x"), name="sigmoid"), name="mul")


@rule("silu", pattern=PATTERN, opsets=(24, None), enabled=False)  # slower on onnxruntime: see above
def silu(m: Match, b: Builder):
    """Mul(x, Sigmoid(x))  =>  Swish(x)."""
    require_float(m, "x", ("float16", "float32", "float64", "bfloat16"))
    return b.Swish(m["x"], alpha=1.0)


@rule("silu-ort", pattern=PATTERN, target="onnxruntime", emits={"com.microsoft": 1})
def silu_ort(m: Match, b: Builder):
    """Mul(x, Sigmoid(x))  =>  com.microsoft QuickGelu(x, alpha=1)."""
    require_float(m, "x", ("float16", "float32", "float64"))
    return b.op("QuickGelu", m["x"], domain="com.microsoft", alpha=1.0)
