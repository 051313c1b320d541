"""0.5 * x * (1 + erf(x / sqrt(2)))  =>  Gelu;  0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))
=>  Gelu(approximate="tanh").

The two GELU forms as exports write them (BERT/ViT: erf; GPT-2's "new GELU": tanh). The
products associate three ways — (x * inner) * 0.5, (x * 0.5) * inner, x * (inner * 0.5) —
x / sqrt(2) is also written x * (1 / sqrt(2)), and x^3 is Pow(x, 3) or, from torch's legacy
exporter, x * (x * x). Bloom factors the tanh argument instead: (x * sqrt(2/pi)) *
(1 + 0.044715 * x * x), the square term as (x * 0.044715) * x or (x * x) * 0.044715. Each
spelling is a pattern. The standard Gelu is opset 20; the onnxruntime target writes
com.microsoft Gelu / FastGelu, which its CPU kernels run at any opset (bias-gelu then absorbs
a bias Add in front).
"""

from __future__ import annotations

import functools
import math

from fuser.rules._common import require_float, require_scalar

from fuser import Builder, Match, const, op, rule, var

TANH_SCALE = math.sqrt(2 / math.pi)
CUBIC = 0.044715


def _erf_inner(x):
    return op.Add(op.Erf((op.Div | op.Mul)(x, const("root_two"), name="scaled"), name="erf"), const("one"), name="plus")


def _power_cube(x):
    return op.Pow(x, const("three"), name="cube")


def _product_cube(x):
    return op.Mul(x, op.Mul(x, x, name="square"), name="cube")


def _tanh_inner(x, cube_of):
    cube = cube_of(x)
    polynomial = op.Add(x, op.Mul(cube, const("cubic"), name="cubic_term"), name="polynomial")
    tanh = op.Tanh(op.Mul(polynomial, const("tanh_scale"), name="scaled"), name="tanh")
    return op.Add(tanh, const("one"), name="plus")


def _factored_tanh_inner(x, square_term_of):
    polynomial = op.Add(square_term_of(x), const("one_inner"), name="polynomial")
    scaled = op.Mul(op.Mul(x, const("tanh_scale"), name="scaled_x"), polynomial, name="scaled")
    return op.Add(op.Tanh(scaled, name="tanh"), const("one"), name="plus")


def _scaled_then_squared(x):
    return op.Mul(op.Mul(x, const("cubic"), name="scaled_square"), x, name="square_term")


def _squared_then_scaled(x):
    return op.Mul(op.Mul(x, x, name="square"), const("cubic"), name="square_term")


def _products(inner_of):
    x = var("x")
    yield op.Mul(op.Mul(x, inner_of(x), name="product"), const("half"), name="gelu")
    yield op.Mul(op.Mul(x, const("half"), name="product"), inner_of(x), name="gelu")
    yield op.Mul(x, op.Mul(inner_of(x), const("half"), name="product"), name="gelu")


ERF_FORMS = tuple(_products(_erf_inner))
TANH_FORMS = tuple(
    form
    for inner_of in (
        *(functools.partial(_tanh_inner, cube_of=cube_of) for cube_of in (_power_cube, _product_cube)),
        *(
            functools.partial(_factored_tanh_inner, square_term_of=square_term_of)
            for square_term_of in (_scaled_then_squared, _squared_then_scaled)
        ),
    )
    for form in _products(inner_of)
)


def _approximation(m: Match) -> str:
    """'none' (erf) or 'tanh', once every constant of the matched form is checked."""
    require_scalar(m, "half", 0.5, "the outer factor")
    require_scalar(m, "one", 1.0, "the added constant")
    if m.has("root_two"):
        dividing = m.node("scaled").op_type == "Div"
        require_scalar(m, "root_two", math.sqrt(2) if dividing else 1 / math.sqrt(2), "the erf argument's scale")
        return "none"
    if m.has("three"):
        require_scalar(m, "three", 3.0, "the exponent")
    if m.has("one_inner"):
        require_scalar(m, "one_inner", 1.0, "the constant term of the factored polynomial")
    require_scalar(m, "cubic", CUBIC, "the cubic coefficient")
    require_scalar(m, "tanh_scale", TANH_SCALE, "the tanh argument's scale")
    return "tanh"


@rule("gelu", pattern=ERF_FORMS + TANH_FORMS, opsets=(20, None))
def gelu(m: Match, b: Builder):
    """Written-out GELU (erf or tanh form)  =>  Gelu."""
    # Gelu's function body holds its constants as float32 (onnxruntime's float64 Gelu is off by
    # ~1e-8 relative, beyond float64's tolerance), so float64 stays written out.
    require_float(m, "x", ("float16", "float32", "bfloat16"))
    approximate = _approximation(m)
    return b.Gelu(m["x"], approximate=None if approximate == "none" else approximate)


@rule("gelu-ort", pattern=ERF_FORMS + TANH_FORMS, target="onnxruntime", emits={"com.microsoft": 1})
def gelu_ort(m: Match, b: Builder):
    """Written-out GELU  =>  com.microsoft Gelu (erf form) or FastGelu (tanh form)."""
    # Gelu has no float64 kernel; FastGelu's float64 one is off by ~1e-7 relative.
    require_float(m, "x", ("float16", "float32"))
    if _approximation(m) == "tanh":
        return b.op("FastGelu", m["x"], domain="com.microsoft")
    return b.op("Gelu", m["x"], domain="com.microsoft")
