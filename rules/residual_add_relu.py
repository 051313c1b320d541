"""Conv -> Add(residual) -> Relu that no rule absorbed: said in the report, left as is.

Standard ONNX has no operator that adds a residual inside a convolution, so on the
portable target this pattern cannot be fused without inventing a non-standard op.
The onnxruntime target fuses it into FusedConv (fused-conv-residual) when the residual
has the convolution's shape; whatever is still here afterwards is reported.
"""

from __future__ import annotations

from fuser import Match, op, rule, var


@rule(
    "residual-add-relu",
    pattern=op.Relu(
        (op.Add | op.Sum)(op.Conv(var("x"), var("w"), var("b", optional=True), name="conv"), var("z"), name="add"),
        name="relu",
    ),
    advisory=True,
)
def residual_add_relu(m: Match, _):
    """Reports Conv -> Add(residual) -> Relu left unfused (no standard fused op exists)."""
    return (
        "a residual Add + Relu after Conv stays unfused: standard ONNX has no op for it "
        "(--target onnxruntime fuses it into FusedConv when shapes allow)"
    )
