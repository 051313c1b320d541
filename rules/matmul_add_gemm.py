"""MatMul(A, B) -> Add(C)  =>  Gemm(A, B, C) for 2-D A and B.

Gemm computes A @ B + C with C broadcast one way to [M, N]. The rewrite holds only
when A and B are both 2-D (MatMul also accepts 1-D and N-D operands, Gemm does not) and
C broadcasts to [M, N] without enlarging it: [N], [1, N], [M, 1], [M, N] or a scalar.

N-D MatMul (transformer MLPs, [batch, seq, hidden]) is left as MatMul + Add on both
targets: measured with onnxruntime 1.32 on [8, 128, 768] x [768, 3072] + bias + Relu,
Reshape -> FusedGemm -> Reshape ran no faster than MatMul + Add + Relu (40.2 ms vs
39.0 ms median, optimizations off, 2 threads), and onnxruntime fuses MatMul + Add itself.
"""

from __future__ import annotations

import numpy as np

from fuser import Builder, Match, op, rule, var

GEMM_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def broadcasts_into(c_shape: tuple, m: int | str, n: int | str) -> bool:
    """True when a tensor of `c_shape` broadcasts to [m, n] without growing it."""
    if len(c_shape) > 2:
        return False
    padded = (1,) * (2 - len(c_shape)) + tuple(c_shape)
    return all(d == 1 or (d == target and isinstance(d, int)) for d, target in zip(padded, (m, n)))


@rule(
    "matmul-add-gemm",
    pattern=op.Add(op.MatMul(var("a"), var("w"), name="matmul"), var("c"), name="add"),
    opsets=(11, None),
)
def matmul_add_gemm(m: Match, b: Builder):
    """MatMul -> Add(bias)  =>  Gemm, for 2-D operands and a bias Gemm can broadcast."""
    a_shape, w_shape, c_shape = m.shape("a"), m.shape("w"), m.shape("c")
    m.require(a_shape is not None and len(a_shape) == 2, "A has shape %s, Gemm needs 2-D", a_shape)
    m.require(w_shape is not None and len(w_shape) == 2, "B has shape %s, Gemm needs 2-D", w_shape)
    m.require(c_shape is not None, "the bias's shape is unknown")
    m.require(
        broadcasts_into(c_shape, a_shape[0], w_shape[1]),
        "a bias of shape %s does not broadcast into [%s, %s]",
        c_shape,
        a_shape[0],
        w_shape[1],
    )
    dtype = m.dtype("a")
    m.require(dtype in GEMM_DTYPES, "Gemm on onnxruntime's CPU takes float32/float64, not %s", dtype)
    m.require(m.dtype("w") == dtype and m.dtype("c") == dtype, "the operands' dtypes differ")
    return b.Gemm(m["a"], m["w"], m["c"])
