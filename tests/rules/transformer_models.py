"""Written-out transformer blocks, as exporters spell them, for the normalization and
activation rule tests: layer norm, RMS norm and GELU nodes, seeded inputs, tolerances.

Every builder returns (nodes, initializers) reading tensor `x` and writing tensor `y`, so a
test composes them with `tests.helpers.make_model`. Constants take the dtype of the model.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import helper

# |after - before| <= atol + rtol * |before|, per dtype, for the rewritten models against the
# written-out originals in onnxruntime (graph optimizations off). float16: the written-out
# forms round every intermediate to float16 while the fused kernels accumulate in float32, so
# a few float16 ulps of an O(1) result apart.
TOL = {
    np.float32: dict(rtol=1e-4, atol=1e-5),
    np.float16: dict(rtol=1e-2, atol=1e-2),
    np.float64: dict(rtol=1e-9, atol=1e-12),
}


def feeds_for(shape, dtype=np.float32, seed=0, name="x", scale=1.0):
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape) * scale).astype(dtype)}


def reduce_mean(inp, out, axes, opset, *, keepdims=1, name, dtype=None):
    """ReduceMean with axes as an attribute before opset 18 and as an input from 18."""
    attrs = {} if keepdims is None else {"keepdims": keepdims}
    if opset >= 18:
        inits = {f"{name}_axes": np.array(axes, np.int64)}
        return [helper.make_node("ReduceMean", [inp, f"{name}_axes"], [out], name=name, **attrs)], inits
    return [helper.make_node("ReduceMean", [inp], [out], name=name, axes=axes, **attrs)], {}


def layer_norm_nodes(
    *,
    x="x",
    y="y",
    square="pow",
    division="div",
    axes=(-1,),
    var_axes=None,
    keepdims=1,
    var_keepdims=None,
    eps=1e-5,
    two=2.0,
    opset=17,
    dtype=np.float32,
    prefix="",
):
    """(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps); square "pow" or "mul", division
    "div" or "reciprocal" (Mul by Reciprocal)."""
    p = prefix
    nodes, inits = reduce_mean(x, f"{p}mean", list(axes), opset, keepdims=keepdims, name=f"{p}mean")
    nodes.append(helper.make_node("Sub", [x, f"{p}mean"], [f"{p}centered"], name=f"{p}sub"))
    if square == "pow":
        inits[f"{p}two"] = np.array(two, dtype)
        nodes.append(helper.make_node("Pow", [f"{p}centered", f"{p}two"], [f"{p}sq"], name=f"{p}square"))
    else:
        nodes.append(helper.make_node("Mul", [f"{p}centered", f"{p}centered"], [f"{p}sq"], name=f"{p}square"))
    more, more_inits = reduce_mean(
        f"{p}sq",
        f"{p}var",
        list(var_axes if var_axes is not None else axes),
        opset,
        keepdims=keepdims if var_keepdims is None else var_keepdims,
        name=f"{p}var",
    )
    nodes += more
    inits.update(more_inits)
    inits[f"{p}eps"] = np.asarray(eps, dtype)
    nodes += [
        helper.make_node("Add", [f"{p}var", f"{p}eps"], [f"{p}var_eps"], name=f"{p}add_eps"),
        helper.make_node("Sqrt", [f"{p}var_eps"], [f"{p}std"], name=f"{p}sqrt"),
    ]
    if division == "div":
        nodes.append(helper.make_node("Div", [f"{p}centered", f"{p}std"], [y], name=f"{p}div"))
    else:
        nodes += [
            helper.make_node("Reciprocal", [f"{p}std"], [f"{p}inv_std"], name=f"{p}reciprocal"),
            helper.make_node("Mul", [f"{p}centered", f"{p}inv_std"], [y], name=f"{p}div"),
        ]
    return nodes, inits


def rms_norm_nodes(
    *,
    x="x",
    y="y",
    square="pow",
    division="div",
    axes=(-1,),
    keepdims=1,
    eps=1e-6,
    two=2.0,
    one=1.0,
    opset=23,
    dtype=np.float32,
    prefix="",
):
    """x / sqrt(mean(x^2) + eps); square "pow" or "mul"; division "div", "reciprocal" (Mul by
    Reciprocal) or "one_div" (Mul by 1 / sqrt, torch's rsqrt)."""
    p = prefix
    nodes, inits = [], {}
    if square == "pow":
        inits[f"{p}two"] = np.array(two, dtype)
        nodes.append(helper.make_node("Pow", [x, f"{p}two"], [f"{p}sq"], name=f"{p}square"))
    else:
        nodes.append(helper.make_node("Mul", [x, x], [f"{p}sq"], name=f"{p}square"))
    more, more_inits = reduce_mean(f"{p}sq", f"{p}ms", list(axes), opset, keepdims=keepdims, name=f"{p}mean")
    nodes += more
    inits.update(more_inits)
    inits[f"{p}eps"] = np.asarray(eps, dtype)
    nodes += [
        helper.make_node("Add", [f"{p}ms", f"{p}eps"], [f"{p}ms_eps"], name=f"{p}add_eps"),
        helper.make_node("Sqrt", [f"{p}ms_eps"], [f"{p}rms"], name=f"{p}sqrt"),
    ]
    if division == "div":
        nodes.append(helper.make_node("Div", [x, f"{p}rms"], [y], name=f"{p}div"))
    elif division == "reciprocal":
        nodes += [
            helper.make_node("Reciprocal", [f"{p}rms"], [f"{p}inv"], name=f"{p}reciprocal"),
            helper.make_node("Mul", [x, f"{p}inv"], [y], name=f"{p}div"),
        ]
    else:
        inits[f"{p}one"] = np.array(one, dtype)
        nodes += [
            helper.make_node("Div", [f"{p}one", f"{p}rms"], [f"{p}inv"], name=f"{p}reciprocal"),
            helper.make_node("Mul", [x, f"{p}inv"], [y], name=f"{p}div"),
        ]
    return nodes, inits


# tanh-products: x^3 as x * (x * x); tanh-factored (Bloom): (x * sqrt(2/pi)) * (1 + (x * 0.044715) * x),
# tanh-factored-square: the same with (x * x) * 0.044715
GELU_KINDS = ("erf-div", "erf-mul", "tanh", "tanh-products", "tanh-factored", "tanh-factored-square")
GELU_FORMS = (0, 1, 2)  # (x * inner) * 0.5, (x * 0.5) * inner, x * (inner * 0.5)


def gelu_nodes(*, x="x", y="y", kind="erf-div", form=0, dtype=np.float32, prefix="", **constants):
    """A written-out GELU; `constants` override half, one, root_two, three, cubic, tanh_scale, one_inner."""
    p = prefix
    values = {
        "half": 0.5,
        "one": 1.0,
        "root_two": math.sqrt(2) if kind == "erf-div" else 1 / math.sqrt(2),
        "three": 3.0,
        "cubic": 0.044715,
        "tanh_scale": math.sqrt(2 / math.pi),
        "one_inner": 1.0,
    }
    values.update(constants)
    inits = {f"{p}{k}": np.asarray(v, dtype) for k, v in values.items()}
    if kind.startswith("erf"):
        nodes = [
            helper.make_node(
                "Div" if kind == "erf-div" else "Mul", [x, f"{p}root_two"], [f"{p}scaled"], name=f"{p}scaled"
            ),
            helper.make_node("Erf", [f"{p}scaled"], [f"{p}erf"], name=f"{p}erf"),
        ]
        for k in ("three", "cubic", "tanh_scale", "one_inner"):
            del inits[f"{p}{k}"]
        activation = f"{p}erf"
    elif kind.startswith("tanh-factored"):  # Bloom
        if kind == "tanh-factored":
            nodes = [
                helper.make_node("Mul", [x, f"{p}cubic"], [f"{p}scaled_square"], name=f"{p}scaled_square"),
                helper.make_node("Mul", [f"{p}scaled_square", x], [f"{p}square_term"], name=f"{p}square_term"),
            ]
        else:
            nodes = [
                helper.make_node("Mul", [x, x], [f"{p}square"], name=f"{p}square"),
                helper.make_node("Mul", [f"{p}square", f"{p}cubic"], [f"{p}square_term"], name=f"{p}square_term"),
            ]
        nodes += [
            helper.make_node("Add", [f"{p}square_term", f"{p}one_inner"], [f"{p}polynomial"], name=f"{p}polynomial"),
            helper.make_node("Mul", [x, f"{p}tanh_scale"], [f"{p}scaled_x"], name=f"{p}scaled_x"),
            helper.make_node("Mul", [f"{p}scaled_x", f"{p}polynomial"], [f"{p}scaled"], name=f"{p}scaled"),
            helper.make_node("Tanh", [f"{p}scaled"], [f"{p}tanh"], name=f"{p}tanh"),
        ]
        for k in ("root_two", "three"):
            del inits[f"{p}{k}"]
        activation = f"{p}tanh"
    else:
        if kind == "tanh-products":  # torch's legacy exporter
            nodes = [
                helper.make_node("Mul", [x, x], [f"{p}square"], name=f"{p}square"),
                helper.make_node("Mul", [x, f"{p}square"], [f"{p}cube"], name=f"{p}cube"),
            ]
            del inits[f"{p}three"]
        else:
            nodes = [helper.make_node("Pow", [x, f"{p}three"], [f"{p}cube"], name=f"{p}cube")]
        nodes += [
            helper.make_node("Mul", [f"{p}cube", f"{p}cubic"], [f"{p}cubic_term"], name=f"{p}cubic_term"),
            helper.make_node("Add", [x, f"{p}cubic_term"], [f"{p}polynomial"], name=f"{p}polynomial"),
            helper.make_node("Mul", [f"{p}polynomial", f"{p}tanh_scale"], [f"{p}scaled"], name=f"{p}scaled"),
            helper.make_node("Tanh", [f"{p}scaled"], [f"{p}tanh"], name=f"{p}tanh"),
        ]
        for k in ("root_two", "one_inner"):
            del inits[f"{p}{k}"]
        activation = f"{p}tanh"
    nodes.append(helper.make_node("Add", [activation, f"{p}one"], [f"{p}plus"], name=f"{p}plus"))
    if form == 0:
        nodes += [
            helper.make_node("Mul", [x, f"{p}plus"], [f"{p}product"], name=f"{p}product"),
            helper.make_node("Mul", [f"{p}product", f"{p}half"], [y], name=f"{p}gelu"),
        ]
    elif form == 1:
        nodes += [
            helper.make_node("Mul", [x, f"{p}half"], [f"{p}product"], name=f"{p}product"),
            helper.make_node("Mul", [f"{p}product", f"{p}plus"], [y], name=f"{p}gelu"),
        ]
    else:
        nodes += [
            helper.make_node("Mul", [f"{p}plus", f"{p}half"], [f"{p}product"], name=f"{p}product"),
            helper.make_node("Mul", [x, f"{p}product"], [y], name=f"{p}gelu"),
        ]
    return nodes, inits


def np_gelu(x, approximate="none"):
    x = x.astype(np.float64)
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    from math import erf

    return 0.5 * x * (1 + np.vectorize(erf)(x / math.sqrt(2)))


def np_layer_norm(x, axis=-1, eps=1e-5):
    x = x.astype(np.float64)
    axes = tuple(range(axis % x.ndim, x.ndim))
    centered = x - x.mean(axis=axes, keepdims=True)
    return centered / np.sqrt((centered**2).mean(axis=axes, keepdims=True) + eps)


def np_rms_norm(x, axis=-1, eps=1e-6):
    x = x.astype(np.float64)
    axes = tuple(range(axis % x.ndim, x.ndim))
    return x / np.sqrt((x**2).mean(axis=axes, keepdims=True) + eps)
