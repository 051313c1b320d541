"""Gemm -> activation  =>  com.microsoft FusedGemm(activation) (onnxruntime target).

FusedGemm keeps Gemm's alpha, beta, transA and transB and applies the activation in the
same kernel; LeakyRelu's alpha and HardSigmoid's alpha and beta become activation_alpha
and activation_beta.
"""

from __future__ import annotations

from fuser.rules._activations import activation_params, fusable_dtype

from fuser import Builder, Match, op, rule, var


@rule(
    "fused-gemm",
    pattern=(op.Relu | op.LeakyRelu | op.Sigmoid | op.Tanh | op.HardSigmoid)(
        op.Gemm(var("a"), var("b"), var("c", optional=True), name="gemm"), name="act"
    ),
    target="onnxruntime",
    emits={"com.microsoft": 1},
    opsets=(7, None),  # Gemm before 7 has a `broadcast` attribute FusedGemm does not know
)
def fused_gemm(m: Match, b: Builder):
    """Gemm -> Relu/LeakyRelu/Sigmoid/Tanh/HardSigmoid  =>  FusedGemm(activation)."""
    fusable_dtype(m, m["a"])
    kind, params = activation_params(m)
    extra = dict(zip(("activation_alpha", "activation_beta"), params))
    return b.op(
        "FusedGemm",
        m["a"],
        m["b"],
        m["c"],
        domain="com.microsoft",
        activation=kind,
        **extra,
        **m.attrs("gemm"),
    )
