"""Tests for the batchnorm-affine-fold rule (rules/batchnorm_affine_fold.py).

Every positive test builds a small BatchNormalization -> Mul/Add(constant) model, folds it with
`fuser.optimize(model, rules=[batchnorm_affine_fold])`, checks the op sequence, the folded scale
and shift values, runs the full ONNX checker and compares outputs in onnxruntime (graph
optimizations disabled) with the tolerances stated below. Scales, shifts, means, variances and
the constants are random and seeded (constants include negative values), so folding along the
wrong axis, forgetting to scale the shift or scaling it for an Add shows up as a numerics failure.

Inference BatchNormalization is y = scale * (x - mean) / sqrt(var + eps) + shift, so
    Mul(y, c) = (scale * c) * (x - mean) / sqrt(var + eps) + shift * c
    Add(y, c) = scale * (x - mean) / sqrt(var + eps) + (shift + c)
when c is one value per channel (channels are axis 1 of x).

Runtime facts this file relies on (onnxruntime 1.32, CPUExecutionProvider):
* float16 and float64 BatchNormalization, Mul and Add all have CPU kernels, so every dtype is
  checked in onnxruntime (no onnx.reference needed, unlike Conv's float64).
* BatchNormalization-15 with scale/shift (T1) of another float type than x (T) runs.
* A Mul whose operands have different dtypes is an invalid model (the checker rejects it); the
  dtype-mismatch tests build it without the checker and optimize it with check=False.
* A [C] constant broadcasts against the LAST axis of x: it is one value per channel only for a
  2-D [N, C] input. For a 4-D [N, C, H, W] input with W == C it is valid, but varies along W.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.rules.batchnorm_affine_fold import batchnorm_affine_fold
from onnx import helper, numpy_helper

import fuser
from tests.helpers import (
    assert_declined,
    assert_rewritten,
    assert_same_outputs,
    attrs_of,
    initializer_value,
    make_model,
    nodes_of,
    op_types,
    run,
)

RULE = "batchnorm-affine-fold"
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
FP16_TOL = dict(rtol=1e-2, atol=1e-2)
FP64_TOL = dict(rtol=1e-10, atol=1e-10)
C = 6


# --------------------------------------------------------------------------- builders


def bn_affine_model(
    *,
    ops: tuple = ("Mul",),
    shapes: tuple | None = None,
    spatial: tuple = (4, 5),
    batch: int = 2,
    dtype=np.float32,
    param_dtype=None,
    const_dtype=None,
    opset: int = 17,
    const_first: bool = False,
    source: str = "initializer",
    bn_attrs: dict | None = None,
    bn_outputs: int = 1,
    output: str = "y",
    seed: int = 0,
    checked: bool = True,
):
    """x -> BatchNormalization -> ops[0](c0) -> ops[1](c1) ... -> `output`.

    Returns (model, feeds, constants) with constants scale, shift, mean, var, c0, c1, ...
    shapes: one constant shape per op, default [C, 1, ...] (one value per channel).
    param_dtype: the dtype of scale/shift/mean/var (default: dtype; BatchNormalization-15
    allows another). const_dtype: the dtype of the constants (default: dtype).
    source: "initializer", "constant" (op Constant nodes) or "input" (graph inputs: not
    constants). bn_outputs: 3 for training mode (Y, running_mean, running_var).
    checked=False skips the ONNX checker (deliberately invalid models).
    """
    rng = np.random.default_rng(seed)
    x_shape = [batch, C, *spatial]
    param_dtype = dtype if param_dtype is None else param_dtype
    const_dtype = dtype if const_dtype is None else const_dtype
    if shapes is None:
        shapes = [(C,) + (1,) * len(spatial)] * len(ops)
    constants = {
        "scale": (rng.uniform(0.5, 1.5, C) * rng.choice([-1, 1], C)).astype(param_dtype),
        "shift": rng.normal(0.0, 1.0, C).astype(param_dtype),
        "mean": rng.normal(0.0, 1.0, C).astype(param_dtype),
        "var": rng.uniform(0.5, 1.5, C).astype(param_dtype),
    }
    for index, shape in enumerate(shapes):
        signs = rng.choice([-1, 1], shape)
        constants[f"c{index}"] = np.asarray(rng.uniform(0.5, 1.5, shape) * signs).astype(const_dtype)

    inputs = [("x", dtype, x_shape)]
    inits = {k: constants[k] for k in ("scale", "shift", "mean", "var")}
    nodes = []
    bn_out = ["bn_out"] + [f"bn_extra{i}" for i in range(1, bn_outputs)]
    nodes.append(
        helper.make_node(
            "BatchNormalization", ["x", "scale", "shift", "mean", "var"], bn_out, name="bn", **(bn_attrs or {})
        )
    )
    previous = "bn_out"
    for index, op_type in enumerate(ops):
        name = f"c{index}"
        if source == "initializer":
            inits[name] = constants[name]
        elif source == "constant":
            value = numpy_helper.from_array(constants[name], name)
            nodes.append(helper.make_node("Constant", [], [name], name=f"{name}_const", value=value))
        elif source == "input":
            inputs.append((name, const_dtype, list(shapes[index])))
        else:
            raise ValueError(source)
        out = output if index == len(ops) - 1 else f"t{index}"
        operands = [name, previous] if const_first else [previous, name]
        nodes.append(helper.make_node(op_type, operands, [out], name=f"{op_type.lower()}{index}"))
        previous = out
    rank = max([len(x_shape)] + [len(s) for s in shapes])
    model = make_model(nodes, inputs, [(output, dtype, [None] * rank)], inits, opset=opset, check=checked)
    feeds = {"x": rng.standard_normal(x_shape).astype(dtype)}
    if source == "input":
        feeds.update({f"c{i}": constants[f"c{i}"] for i in range(len(ops))})
    return model, feeds, constants


def folded(constants: dict, ops: tuple, round_to=None):
    """(scale, shift) after folding `ops` in order, in float64 (rounded to `round_to` after
    each fold when given, as one rewrite after another does)."""
    scale = constants["scale"].astype(np.float64)
    shift = constants["shift"].astype(np.float64)
    for index, op_type in enumerate(ops):
        c = constants[f"c{index}"].astype(np.float64).reshape(-1)
        c = np.broadcast_to(c, (C,))
        if op_type == "Mul":
            scale, shift = scale * c, shift * c
        else:
            shift = shift + c
        if round_to is not None:
            scale = scale.astype(round_to).astype(np.float64)
            shift = shift.astype(round_to).astype(np.float64)
    return scale, shift


def np_batchnorm(x: np.ndarray, constants: dict, epsilon: float = 1e-5) -> np.ndarray:
    """Inference BatchNormalization in float64, channels on axis 1."""
    shape = (1, -1) + (1,) * (x.ndim - 2)
    scale, shift, mean, var = (
        constants[k].astype(np.float64).reshape(shape) for k in ("scale", "shift", "mean", "var")
    )
    return scale * (x - mean) / np.sqrt(var + epsilon) + shift


def fold(model, feeds, *, counts=None, tol=FP32_TOL, **kwargs):
    """Optimize with batchnorm-affine-fold alone; expect one BatchNormalization reading x."""
    after, report = assert_rewritten(
        model,
        [batchnorm_affine_fold],
        counts=counts or {RULE: 1},
        expected_ops=["BatchNormalization"],
        feeds=feeds,
        **tol,
        **kwargs,
    )
    (bn,) = nodes_of(after, "BatchNormalization")
    assert bn.input[0] == "x" and list(bn.input[3:]) == ["mean", "var"]
    assert list(bn.output) == [model.graph.output[0].name]
    return after, report, bn


def assert_params(after, bn, expected, *, rtol=1e-6, atol=1e-7, dtype=np.float32):
    scale, shift = initializer_value(after, bn.input[1]), initializer_value(after, bn.input[2])
    assert scale.dtype == shift.dtype == dtype
    assert scale.shape == shift.shape == (C,)
    np.testing.assert_allclose(scale.astype(np.float64), expected[0], rtol=rtol, atol=atol)
    np.testing.assert_allclose(shift.astype(np.float64), expected[1], rtol=rtol, atol=atol)


def assert_not_folded(model, reason, *, node="mul0", check=True, **kwargs):
    """The rule must not fire; a decline (if `reason`) is made at `node`, in the main graph."""
    return assert_declined(model, batchnorm_affine_fold, reason, node=node, scope="main", check=check, **kwargs)


# --------------------------------------------------------------------------- positives


@pytest.mark.parametrize("const_first", [False, True], ids=["bn*c", "c*bn"])
@pytest.mark.parametrize("op_type", ["Mul", "Add"])
def test_mul_or_add_folds(op_type, const_first):
    model, feeds, consts = bn_affine_model(ops=(op_type,), const_first=const_first)
    after, report, bn = fold(model, feeds)
    assert_params(after, bn, folded(consts, (op_type,)))
    # The old scale and shift and the constant are gone; mean and var are reused as they are.
    assert {t.name for t in after.graph.initializer} == {bn.input[1], bn.input[2], "mean", "var"}
    np.testing.assert_array_equal(initializer_value(after, "mean"), consts["mean"])
    assert report.rewrites[0].matched == [f"{op_type.lower()}0", "bn"]


@pytest.mark.parametrize(
    "ops", [("Mul", "Add"), ("Add", "Mul"), ("Mul", "Mul"), ("Add", "Add")], ids=lambda ops: "-".join(ops)
)
def test_two_affine_ops_both_fold(ops):
    model, feeds, consts = bn_affine_model(ops=ops)
    after, _, bn = fold(model, feeds, counts={RULE: 2})
    assert_params(after, bn, folded(consts, ops))


@pytest.mark.parametrize(
    "shape", [(C, 1, 1), (1, C, 1, 1), (), (1,), (1, 1, 1, 1), (1, 1)], ids=["C11", "1C11", "scalar", "1", "1111", "11"]
)
@pytest.mark.parametrize("op_type", ["Mul", "Add"])
def test_constant_shapes_that_are_per_channel_fold(op_type, shape):
    model, feeds, consts = bn_affine_model(ops=(op_type,), shapes=[shape])
    after, _, bn = fold(model, feeds)
    assert_params(after, bn, folded(consts, (op_type,)))


def test_c_constant_on_4d_input_whose_last_axis_is_not_c_is_invalid_anyway():
    """Sanity for the next test: [C] against [N, C, H, W] only broadcasts when W == C (or 1)."""
    with pytest.raises(onnx.shape_inference.InferenceError, match="Incompatible dimensions"):
        bn_affine_model(shapes=[(C,)], spatial=(4, 5))


@pytest.mark.parametrize("op_type", ["Mul", "Add"])
def test_c_constant_on_4d_input_varies_along_width_not_folded(op_type):
    """x is [N, C, H, C]: a [C] constant is one value per *column*, not per channel. Folding it
    into the per-channel scale/shift would be wrong; the original multiplies along W."""
    model, feeds, consts = bn_affine_model(ops=(op_type,), shapes=[(C,)], spatial=(4, C))
    assert_not_folded(model, "is not one value per channel", node=f"{op_type.lower()}0")
    # The decline matters: the model applies c along W, and a per-channel fold would not.
    x, c = feeds["x"].astype(np.float64), consts["c0"].astype(np.float64)
    normalized = np_batchnorm(x, consts)
    along_w, along_c = c.reshape(1, 1, 1, C), c.reshape(1, C, 1, 1)
    combine = np.multiply if op_type == "Mul" else np.add
    actual = run(model, feeds)[0]
    np.testing.assert_allclose(actual, combine(normalized, along_w), rtol=1e-5, atol=1e-5)
    assert not np.allclose(actual, combine(normalized, along_c), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("shape", [(C,), (1, C), ()], ids=["C", "1C", "scalar"])
@pytest.mark.parametrize("op_type", ["Mul", "Add"])
def test_2d_input_folds(op_type, shape):
    """[N, C] (BatchNormalization after Gemm): a [C] constant is per channel here."""
    model, feeds, consts = bn_affine_model(ops=(op_type,), shapes=[shape], spatial=(), batch=5)
    after, _, bn = fold(model, feeds)
    assert_params(after, bn, folded(consts, (op_type,)))


@pytest.mark.parametrize("shape", [(C, 1), (1, C, 1), (), (1,)], ids=["C1", "1C1", "scalar", "1"])
def test_3d_input_folds(shape):
    model, feeds, consts = bn_affine_model(ops=("Mul", "Add"), shapes=[shape, shape], spatial=(7,))
    after, _, bn = fold(model, feeds, counts={RULE: 2})
    assert_params(after, bn, folded(consts, ("Mul", "Add")))


def test_5d_input_folds():
    model, feeds, consts = bn_affine_model(ops=("Mul",), shapes=[(1, C, 1, 1, 1)], spatial=(2, 3, 2))
    after, _, bn = fold(model, feeds)
    assert_params(after, bn, folded(consts, ("Mul",)))


def test_zero_and_negative_scale_fold():
    model, feeds, consts = bn_affine_model(ops=("Mul",))
    c = consts["c0"].copy()
    c[2] = 0.0
    c[3] = -abs(c[3])
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "c0"))
    model.graph.initializer.append(numpy_helper.from_array(c, "c0"))
    after, _, bn = fold(model, feeds)
    scale, shift = initializer_value(after, bn.input[1]), initializer_value(after, bn.input[2])
    assert scale[2] == 0.0 and shift[2] == 0.0
    np.testing.assert_allclose(scale[3], consts["scale"][3] * c[3, 0, 0], rtol=1e-6)


@pytest.mark.parametrize("opset", [9, 14, 15, 17])
def test_opsets(opset):
    model, feeds, consts = bn_affine_model(ops=("Mul", "Add"), opset=opset)
    after, _, bn = fold(model, feeds, counts={RULE: 2})
    assert_params(after, bn, folded(consts, ("Mul", "Add")))


def test_attributes_are_kept():
    attrs = {"epsilon": 1e-3, "momentum": 0.8}
    model, feeds, _ = bn_affine_model(ops=("Mul", "Add"), bn_attrs=attrs)
    _, _, bn = fold(model, feeds, counts={RULE: 2})
    assert attrs_of(bn) == pytest.approx(attrs)


def test_explicit_inference_mode_opset_14_folds():
    model, feeds, _ = bn_affine_model(ops=("Add",), opset=14, bn_attrs={"training_mode": 0})
    fold(model, feeds)


def test_float16():
    model, feeds, consts = bn_affine_model(ops=("Mul", "Add"), dtype=np.float16, shapes=[(1, C, 1, 1), (C, 1, 1)])
    after, _, bn = fold(model, feeds, counts={RULE: 2}, tol=FP16_TOL)
    # Each fold computes in float64 and rounds once, to float16.
    assert_params(after, bn, folded(consts, ("Mul", "Add"), round_to=np.float16), rtol=0, atol=0, dtype=np.float16)


def test_float64():
    """float64 BatchNormalization runs in onnxruntime: fuser's own check runs, and the outputs
    agree to float64 precision."""
    model, feeds, consts = bn_affine_model(ops=("Mul", "Add"), dtype=np.float64)
    after, report, bn = fold(model, feeds, counts={RULE: 2}, tol=FP64_TOL)
    assert report.checked and report.verdict.passed
    assert_params(after, bn, folded(consts, ("Mul", "Add")), rtol=1e-15, atol=1e-15, dtype=np.float64)
    assert run(after, feeds)[0].dtype == np.float64


def test_opset15_float16_input_float32_parameters():
    """BatchNormalization-15: x float16, scale/shift/mean/var float32. The constant has x's type;
    the new scale and shift keep the parameters' float32."""
    model, feeds, consts = bn_affine_model(ops=("Mul", "Add"), dtype=np.float16, param_dtype=np.float32, opset=15)
    after, _, bn = fold(model, feeds, counts={RULE: 2}, tol=FP16_TOL)
    assert_params(after, bn, folded(consts, ("Mul", "Add")), dtype=np.float32)
    assert initializer_value(after, "mean").dtype == np.float32


def test_opset15_float32_input_float16_parameters():
    """BatchNormalization-15: x float32, scale/shift/mean/var float16, float32 constants. The
    original multiplies in float32; a correct fold keeps float32 precision (it may emit the new
    scale/shift as float32, which T1 allows independently of mean/var's T2) or declines."""
    model, feeds, _ = bn_affine_model(ops=("Mul", "Add"), param_dtype=np.float16, opset=15)
    after, report = fuser.optimize(model, rules=[batchnorm_affine_fold])
    assert report.verdict is None or report.verdict.passed
    assert_same_outputs(model, after, feeds, rtol=1e-4, atol=1e-5)


def test_constant_from_constant_node():
    model, feeds, consts = bn_affine_model(ops=("Mul", "Add"), source="constant")
    after, _, bn = fold(model, feeds, counts={RULE: 2})
    assert_params(after, bn, folded(consts, ("Mul", "Add")))
    assert op_types(after) == ["BatchNormalization"]


def test_graph_output_name_survives():
    model, feeds, _ = bn_affine_model(ops=("Mul",), output="block1/scale:0")
    after, _, _ = fold(model, feeds)
    assert [o.name for o in after.graph.output] == ["block1/scale:0"]


def test_followed_by_relu():
    """The DenseNet shape: BatchNormalization -> Mul -> Add -> Relu becomes BatchNormalization -> Relu."""
    model, feeds, _ = bn_affine_model(ops=("Mul", "Add"), output="pre")
    model.graph.node.append(helper.make_node("Relu", ["pre"], ["y"], name="relu"))
    model.graph.output[0].name = "y"
    onnx.checker.check_model(model, full_check=True)
    assert_rewritten(
        model,
        [batchnorm_affine_fold],
        counts={RULE: 2},
        expected_ops=["BatchNormalization", "Relu"],
        feeds=feeds,
        **FP32_TOL,
    )


def test_shared_parameters_other_batchnorm_unchanged():
    """Two BatchNormalizations share scale and shift; only one is followed by a Mul. The other
    keeps reading the original parameters."""
    model, feeds, consts = bn_affine_model(ops=("Mul",))
    model.graph.node.append(
        helper.make_node("BatchNormalization", ["x", "scale", "shift", "mean", "var"], ["y2"], name="plain_bn")
    )
    model.graph.output.append(helper.make_tensor_value_info("y2", onnx.TensorProto.FLOAT, [None] * 4))
    onnx.checker.check_model(model, full_check=True)
    after, _ = assert_rewritten(
        model,
        [batchnorm_affine_fold],
        counts={RULE: 1},
        expected_ops=["BatchNormalization", "BatchNormalization"],
        feeds=feeds,
        **FP32_TOL,
    )
    (plain,) = [n for n in after.graph.node if n.name == "plain_bn"]
    assert list(plain.input) == ["x", "scale", "shift", "mean", "var"]
    np.testing.assert_array_equal(initializer_value(after, "scale"), consts["scale"])
    np.testing.assert_array_equal(initializer_value(after, "shift"), consts["shift"])
    np.testing.assert_array_equal(run(after, feeds)[1], run(model, feeds)[1])


def test_all_builtin_rules_onnx_target():
    """With the default rule set (target onnx) a lone BatchNormalization -> Mul -> Add folds."""
    model, feeds, _ = bn_affine_model(ops=("Mul", "Add"))
    after, report = fuser.optimize(model)
    assert op_types(after) == ["BatchNormalization"]
    assert report.counts == {RULE: 2}
    assert_same_outputs(model, after, feeds, **FP32_TOL)


def test_all_builtin_rules_conv_batchnorm_mul_becomes_one_conv():
    """Conv -> BatchNormalization -> Mul: whichever rule goes first, one Conv remains."""
    rng = np.random.default_rng(3)
    model, feeds, _ = bn_affine_model(ops=("Mul",))
    conv = helper.make_node("Conv", ["img", "w"], ["x"], name="conv", pads=[1, 1, 1, 1])
    nodes = [conv] + list(model.graph.node)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    inits["w"] = (rng.standard_normal((C, 3, 3, 3)) / 5).astype(np.float32)
    model = make_model(nodes, [("img", np.float32, [2, 3, 4, 5])], [("y", np.float32, [None] * 4)], inits)
    feeds = {"img": rng.standard_normal((2, 3, 4, 5)).astype(np.float32)}
    after, report = fuser.optimize(model)
    assert op_types(after) == ["Conv"]
    assert report.verdict.passed
    assert_same_outputs(model, after, feeds, **FP32_TOL)


# ------------------------------------------------------------------------ negatives


@pytest.mark.parametrize(
    "shape",
    [(C, 4, 1), (1, C, 4, 5), (1, 1, 4, 5), (1, 1, 1, 5), (2, C, 1, 1)],
    ids=["CH1", "1CHW", "11HW", "111W", "batch"],
)
@pytest.mark.parametrize("op_type", ["Mul", "Add"])
def test_constant_not_per_channel_not_folded(op_type, shape):
    model, _, _ = bn_affine_model(ops=(op_type,), shapes=[shape])
    assert_not_folded(model, "is not one value per channel", node=f"{op_type.lower()}0")


def test_constant_of_larger_rank_not_folded():
    """[1, 1, C, 1] against a 3-D [N, C, L] x is one value per channel, but makes the output 4-D."""
    model, _, _ = bn_affine_model(ops=("Mul",), shapes=[(1, 1, C, 1)], spatial=(7,))
    assert_not_folded(model, "is not one value per channel")


def test_c11_constant_on_2d_input_not_folded():
    """[C, 1] against [N, C] broadcasts to [C, C]... per row, not per channel."""
    model, _, _ = bn_affine_model(ops=("Mul",), shapes=[(C, 1)], spatial=(), batch=C)
    assert_not_folded(model, "is not one value per channel")


def test_non_constant_operand_not_folded():
    model, _, _ = bn_affine_model(ops=("Mul",), source="input")
    assert_not_folded(model, None)


def test_bn_output_used_elsewhere_not_folded():
    model, _, _ = bn_affine_model(ops=("Mul",))
    model.graph.node.append(helper.make_node("Relu", ["bn_out"], ["r"], name="relu"))
    model.graph.output.append(helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, [None] * 4))
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, "used outside the match")


def test_bn_output_is_graph_output_not_folded():
    model, _, _ = bn_affine_model(ops=("Mul",))
    model.graph.output.append(helper.make_tensor_value_info("bn_out", onnx.TensorProto.FLOAT, [None] * 4))
    assert_not_folded(model, "a graph output")


@pytest.mark.parametrize("opset", [14, 15])
def test_training_mode_not_folded(opset):
    model, _, _ = bn_affine_model(ops=("Mul",), opset=opset, bn_attrs={"training_mode": 1}, bn_outputs=3)
    assert_not_folded(model, "training mode")


def test_not_spatial_not_folded():
    """Opset 7's spatial=0 normalizes per activation, not per channel."""
    model, _, _ = bn_affine_model(ops=("Mul",), opset=7, bn_attrs={"spatial": 0}, checked=False)
    assert_not_folded(model, "not spatial", check=False)


def test_dtype_mismatch_not_folded():
    """Invalid model (float32 BatchNormalization times a float64 constant): declined, never run."""
    model, _, _ = bn_affine_model(ops=("Mul",), const_dtype=np.float64, checked=False)
    assert_not_folded(model, "the constant is float64, the normalized tensor float32", check=False)


def test_opset15_constant_of_the_parameters_dtype_not_folded():
    """x float16, parameters float32, Mul constant float32: the Mul mixes float16 and float32
    (invalid); the constant must have x's dtype, not the parameters'."""
    model, _, _ = bn_affine_model(
        ops=("Mul",), dtype=np.float16, param_dtype=np.float32, const_dtype=np.float32, opset=15, checked=False
    )
    assert_not_folded(model, "the constant is float32, the normalized tensor float16", check=False)


def test_mul_after_another_normalization_not_matched():
    """Only BatchNormalization feeds the pattern: Mul after InstanceNormalization stays."""
    model, _, _ = bn_affine_model(ops=("Mul",))
    bn = model.graph.node[0]
    del bn.input[3:]
    bn.op_type = "InstanceNormalization"
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "mean"))
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "var"))
    onnx.checker.check_model(model, full_check=True)
    assert_not_folded(model, None)
