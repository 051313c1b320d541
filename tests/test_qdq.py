"""Quantized models (fuser/qdq.py): no rewrite turns the float operator of a DequantizeLinear ->
operator -> QuantizeLinear group into another, nor changes the rounding of what a
DynamicQuantizeLinear reads; constant folding keeps a weight's DequantizeLinear.

Each declining case has a float twin (the same graph without the quantization) that the same
rule rewrites, so a decline here is the quantization's doing. The last tests quantize a small
network with onnxruntime's own `quantize_static` and `quantize_dynamic`.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import fuser
from fuser import Builder, Match, op, rule, var
from fuser.verify import index_ranges
from tests.helpers import assert_declined, assert_rewritten, make_model, op_types, run

RNG = np.random.default_rng(7)
C = 16  # a multiple of both NCHWc block sizes
SHAPE = [1, C, 8, 8]
X = {"x": RNG.normal(size=SHAPE).astype(np.float32)}


def quantize(tensor: str, scale: float = 0.05) -> list:
    """tensor -> QuantizeLinear -> DequantizeLinear -> tensor_dq, with uint8 zero point 128."""
    return [
        helper.make_node("QuantizeLinear", [tensor, "act_scale", "act_zero"], [f"{tensor}_q"]),
        helper.make_node("DequantizeLinear", [f"{tensor}_q", "act_scale", "act_zero"], [f"{tensor}_dq"]),
    ]


ACT = {"act_scale": np.array(0.05, np.float32), "act_zero": np.array(128, np.uint8)}


def conv_weights() -> dict:
    weight = RNG.integers(-127, 128, size=(C, C, 3, 3)).astype(np.int8)
    return {
        "w_q": weight,
        "w_scale": np.full(C, 0.002, np.float32),
        "w_zero": np.zeros(C, np.int8),
        "b_q": RNG.integers(-1000, 1000, size=C).astype(np.int32),
        "b_scale": np.full(C, 0.0001, np.float32),
    }


def qdq_convs(quantized: bool = True) -> onnx.ModelProto:
    """x -> Q/DQ -> Conv(DQ weight, DQ bias) -> Relu -> Conv -> Q/DQ -> y: the first Conv reads
    dequantized tensors, the second feeds a QuantizeLinear. With quantized=False the same
    network in float (the dequantized weights as float initializers)."""
    weights = conv_weights()
    second = {"w2": RNG.normal(size=(C, C, 3, 3)).astype(np.float32) * 0.1, "b2": np.zeros(C, np.float32)}
    convs = [
        helper.make_node("Conv", ["x_dq" if quantized else "x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Conv", ["r", "w2", "b2"], ["c2" if quantized else "y"], pads=[1, 1, 1, 1]),
    ]
    if quantized:
        nodes = [
            *quantize("x"),
            helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w"], axis=0),
            helper.make_node("DequantizeLinear", ["b_q", "b_scale"], ["b"], axis=0),
            *convs,
            *quantize("c2"),
            helper.make_node("Identity", ["c2_dq"], ["y"]),
        ]
        inits = {**weights, **ACT, **second}
    else:
        nodes = convs
        inits = {
            "w": weights["w_q"].astype(np.float32) * 0.002,
            "b": weights["b_q"].astype(np.float32) * 0.0001,
            **second,
        }
    return make_model(nodes, [("x", np.float32, SHAPE)], [("y", np.float32, SHAPE)], inits, opset=13)


def test_quantized_convolutions_are_neither_fused_nor_made_nchwc():
    model = qdq_convs()
    after, report = fuser.optimize(model, target="onnxruntime", trace=True)
    reasons = {(d.rule, d.node): d.reason for d in report.engine.declined}
    assert "reads 'x_dq' from a DequantizeLinear" in reasons["fused-conv", "Relu->r"]  # rooted at the Relu
    assert "feeds a QuantizeLinear" in reasons["nchwc-conv", "Conv->c2"]
    assert not any(n.domain.startswith("com.microsoft") for n in after.graph.node)
    for op_type in ("QuantizeLinear", "DequantizeLinear", "Conv", "Relu"):
        assert op_types(after).count(op_type) == op_types(model).count(op_type)
    assert report.verdict.passed


def test_the_float_twin_of_those_convolutions_is_fused_and_made_nchwc():
    after, report = fuser.optimize(qdq_convs(quantized=False), target="onnxruntime")
    assert report.counts["fused-conv"] == 1 and report.counts["nchwc-conv"] == 1
    assert any(n.domain == "com.microsoft.nchwc" for n in after.graph.node) and report.verdict.passed


def quantized_max_pool(quantized: bool = True) -> onnx.ModelProto:
    """onnxruntime runs DequantizeLinear -> MaxPool -> QuantizeLinear as an int8 MaxPool. A
    convolution reads the pool too (a pool nothing blocked reads stays plain anyway)."""
    source = "x_dq" if quantized else "x"
    nodes = [
        *(quantize("x") if quantized else []),
        helper.make_node("MaxPool", [source], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        *(quantize("p") if quantized else []),
        helper.make_node("Relu", ["p_dq" if quantized else "p"], ["y"]),
        helper.make_node("Conv", ["p", "w_pool"], ["z"]),
    ]
    pooled = [1, C, 4, 4]
    weights = {"w_pool": (RNG.normal(size=(C, C, 1, 1)) / C).astype(np.float32)}
    outputs = [("y", np.float32, pooled), ("z", np.float32, pooled)]
    return make_model(nodes, [("x", np.float32, SHAPE)], outputs, {**(ACT if quantized else {}), **weights}, opset=13)


def test_a_quantized_max_pool_stays_plain():
    assert_declined(quantized_max_pool(), "nchwc-pool-input", "from a DequantizeLinear", target="onnxruntime")


def test_the_float_twin_of_that_max_pool_goes_into_the_nchwc_layout():
    assert_rewritten(quantized_max_pool(False), "nchwc-pool-input", target="onnxruntime")


def matmul_add(quantized_weight: bool) -> onnx.ModelProto:
    """y = MatMul(x, W) + bias, W stored as int8 and dequantized (weight-only quantization)."""
    weight = RNG.integers(-127, 128, size=(8, 8)).astype(np.int8)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "bias"], ["y"])]
    inits = {"bias": RNG.normal(size=8).astype(np.float32)}
    if quantized_weight:
        nodes.insert(0, helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"]))
        inits.update(w_q=weight, w_scale=np.array(0.01, np.float32))
    else:
        inits["w"] = weight.astype(np.float32) * 0.01
    return make_model(nodes, [("x", np.float32, [4, 8])], [("y", np.float32, [4, 8])], inits, opset=13)


def test_a_dequantized_weight_is_neither_folded_nor_fused_into_a_gemm():
    model = matmul_add(quantized_weight=True)
    assert_declined(model, "matmul-add-gemm", "reads 'w' from a DequantizeLinear")
    assert_declined(model, "constant-fold", None)  # DequantizeLinear is not among the ops it folds


def test_the_float_twin_becomes_a_gemm():
    assert_rewritten(matmul_add(quantized_weight=False), "matmul-add-gemm", counts={"matmul-add-gemm": 1})


def test_a_quantize_linear_of_a_constant_still_folds_to_the_integer_weight():
    nodes = [
        helper.make_node("QuantizeLinear", ["w", "w_scale"], ["w_q"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w_dq"]),
        helper.make_node("MatMul", ["x", "w_dq"], ["y"]),
    ]
    inits = {"w": RNG.normal(size=(8, 8)).astype(np.float32), "w_scale": np.array(0.02, np.float32)}
    model = make_model(nodes, [("x", np.float32, [4, 8])], [("y", np.float32, [4, 8])], inits, opset=13)
    feeds = {"x": RNG.normal(size=(4, 8)).astype(np.float32)}
    after, _ = assert_rewritten(
        model, "constant-fold", counts={"constant-fold": 1}, expected_ops=["DequantizeLinear", "MatMul"], feeds=feeds
    )
    # Without a zero point, QuantizeLinear's result is uint8.
    assert [t.data_type for t in after.graph.initializer if t.name == after.graph.node[0].input[0]] == [
        TensorProto.UINT8
    ]


def quantized_reshape() -> onnx.ModelProto:
    """DequantizeLinear -> Reshape(target computed from the input's own dims) -> QuantizeLinear."""
    nodes = [
        *quantize("x"),
        helper.make_node("Shape", ["x_dq"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Unsqueeze", ["batch", "zero_axis"], ["batch_1d"]),
        helper.make_node("Concat", ["batch_1d", "rest"], ["target"], axis=0),
        helper.make_node("Reshape", ["x_dq", "target"], ["r"]),
        *quantize("r"),
        helper.make_node("Relu", ["r_dq"], ["y"]),
    ]
    inits = {
        **ACT,
        "zero": np.array(0, np.int64),
        "zero_axis": np.array([0], np.int64),
        "rest": np.array([C, 64], np.int64),
    }
    return make_model(
        nodes, [("x", np.float32, ["batch", C, 8, 8])], [("y", np.float32, ["batch", C, 64])], inits, opset=13
    )


def test_a_quantized_reshape_takes_a_constant_target_and_stays_a_reshape():
    """reshape-dims-fold is exact (bit-identical results) and keeps the Reshape reading x_dq: the
    group stays whole, and the Shape reading x_dq goes."""
    feeds = {"x": RNG.normal(size=(3, C, 8, 8)).astype(np.float32)}
    after, _ = assert_rewritten(quantized_reshape(), "reshape-dims-fold", counts={"reshape-dims-fold": 1}, feeds=feeds)
    (reshape,) = [n for n in after.graph.node if n.op_type == "Reshape"]
    assert reshape.input[0] == "x_dq" and "Shape" not in op_types(after)


@rule(
    "quantized-relu",
    pattern=op.QuantizeLinear(
        op.Relu(op.DequantizeLinear(var("x"), var("scale"), var("zero"), name="dq"), name="relu"),
        var("scale"),
        var("zero"),
        name="q",
    ),
)
def quantized_relu(m: Match, b: Builder):
    """Q(Relu(DQ(x, s, z)), s, z)  =>  Max(x, z): the whole group, written as its integer kernel."""
    return b.Max(m["x"], m["zero"])


def test_a_rule_matching_the_whole_quantized_group_rewrites_it():
    nodes = [*quantize("x"), helper.make_node("Relu", ["x_dq"], ["r"]), *quantize("r")]
    nodes.append(helper.make_node("Identity", ["r_dq"], ["y"]))
    model = make_model(nodes, [("x", np.float32, SHAPE)], [("y", np.float32, SHAPE)], ACT, opset=13)
    after, _ = assert_rewritten(model, quantized_relu, counts={"quantized-relu": 1}, feeds=X)
    assert op_types(after) == ["QuantizeLinear", "Max", "DequantizeLinear", "Identity"]


@rule("shape-known", pattern=op.Shape(var("x"), name="shape"))
def shape_known(m: Match, b: Builder):
    """Shape(x) of a fixed shape  =>  that shape (as shape-fold, but a rule not marked exact)."""
    return b.constant(np.array(m.shape("x"), np.int64), "shape")


def test_the_shape_of_a_dequantized_tensor_folds():
    """Shape reads only the shape of what it reads: no quantized group holds it, and even a rule
    that is not exact may fold it."""
    nodes = [*quantize("x"), helper.make_node("Shape", ["x_dq"], ["y"])]
    model = make_model(nodes, [("x", np.float32, SHAPE)], [("y", np.int64, [4])], ACT, opset=13)
    for rule_ in ("shape-fold", shape_known):
        after, _ = assert_rewritten(model, rule_, feeds=X)
        assert "Shape" not in op_types(after)


@rule("zero-pads-dropped", pattern=op.Conv(var("x"), var("w"), name="conv"))
def zero_pads_dropped(m: Match, b: Builder):
    """Conv with pads all zero  =>  the same Conv without the attribute (a rule not marked exact)."""
    m.require(m.attr("conv", "pads") == [0, 0, 0, 0], "pads are not all zero")
    attrs = {k: v for k, v in m.attrs("conv").items() if k != "pads"}
    return b.Conv(m["x"], m["w"], **attrs)


@rule("relu-as-max", pattern=op.Relu(var("x"), name="relu"))
def relu_as_max(m: Match, b: Builder):
    """Relu(x)  =>  Max(x, 0) (a rule not marked exact)."""
    return b.Max(m["x"], b.constant(np.zeros((), np.float32), "zero"))


def quantized_conv_with_zero_pads() -> onnx.ModelProto:
    weights = conv_weights()
    nodes = [
        *quantize("x"),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w"], axis=0),
        helper.make_node("Conv", ["x_dq", "w"], ["c"], pads=[0, 0, 0, 0]),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    inits = {**ACT, **{k: weights[k] for k in ("w_q", "w_scale", "w_zero")}}
    return make_model(nodes, [("x", np.float32, SHAPE)], [("y", np.float32, [1, C, 6, 6])], inits, opset=13)


def test_a_rewrite_keeping_the_operator_on_the_same_dequantized_inputs_goes():
    after, _ = assert_rewritten(quantized_conv_with_zero_pads(), zero_pads_dropped, counts={"zero-pads-dropped": 1})
    (conv,) = [n for n in after.graph.node if n.op_type == "Conv"]
    assert list(conv.input) == ["x_dq", "w"] and not conv.attribute


def test_a_hardswish_regrouped_before_a_quantizer_is_left_as_it_is():
    """x * Clip(x + 3, 0, 6) * (1/6) becomes x * HardSigmoid(x): the same value, rounded otherwise.
    The replacement ends in a Mul as the original does, which must not pass for the same operator."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Add", ["r", "three"], ["a"]),
        helper.make_node("Clip", ["a", "zero", "six"], ["c"]),
        helper.make_node("Mul", ["r", "c"], ["m"]),
        helper.make_node("Mul", ["m", "sixth"], ["h"]),
        *quantize("h"),
        helper.make_node("Identity", ["h_dq"], ["y"]),
    ]
    constants = (("three", 3), ("zero", 0), ("six", 6), ("sixth", 1 / 6))
    inits = {**ACT, **{k: np.array(v, np.float32) for k, v in constants}}
    model = make_model(nodes, [("x", np.float32, SHAPE)], [("y", np.float32, SHAPE)], inits, opset=13)
    assert_declined(model, "hardswish-clip-regroup", "Mul->h feeds a QuantizeLinear")


def test_exact_rewrites_go_through_quantized_groups():
    """An Identity between a DequantizeLinear and a Conv, and a Mul by one before a
    QuantizeLinear, go: exact rules change no value, and the group is whole afterwards."""
    weights = conv_weights()
    nodes = [
        *quantize("x"),
        helper.make_node("Identity", ["x_dq"], ["x_copy"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w"], axis=0),
        helper.make_node("Conv", ["x_copy", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["c", "one"], ["c1"]),
        *quantize("c1"),
        helper.make_node("Relu", ["c1_dq"], ["y"]),
    ]
    inits = {**ACT, **{k: weights[k] for k in ("w_q", "w_scale", "w_zero")}, "one": np.array(1, np.float32)}
    model = make_model(nodes, [("x", np.float32, SHAPE)], [("y", np.float32, SHAPE)], inits, opset=13)
    after, _ = assert_rewritten(
        model, ["identity-elimination", "neutral-element"], counts={"identity-elimination": 1, "neutral-element": 1}
    )
    (conv,) = [n for n in after.graph.node if n.op_type == "Conv"]
    assert conv.input[0] == "x_dq" and "Mul" not in op_types(after)


@pytest.mark.parametrize("domain", ["", "com.microsoft"])
def test_an_operator_reading_a_dequantize_linear_of_either_domain_stays(domain):
    nodes = [
        helper.make_node("DequantizeLinear", ["x_q", "scale"], ["x"], domain=domain),
        helper.make_node("Relu", ["x"], ["y"]),
    ]
    opsets = {"com.microsoft": 1} if domain else None
    inits = {"scale": np.array(0.1, np.float32)}
    model = make_model(
        nodes,
        [("x_q", np.int8, [4, 8])],
        [("y", np.float32, [4, 8])],
        inits,
        opset=13,
        extra_opsets=opsets,
        check=False,
    )
    assert_declined(model, relu_as_max, "Relu->y reads 'x' from a DequantizeLinear")


def test_relu_as_max_rewrites_a_float_relu():
    model = make_model(
        [helper.make_node("Relu", ["x"], ["y"])], [("x", np.float32, [4, 8])], [("y", np.float32, [4, 8])]
    )
    assert_rewritten(model, relu_as_max, counts={"relu-as-max": 1})


def gelu_then(reader: str) -> onnx.ModelProto:
    """Erf GELU of x, read by a DynamicQuantizeLinear feeding MatMulInteger (onnxruntime's
    quantize_dynamic), or by a float MatMul."""
    nodes = [
        helper.make_node("Div", ["x", "sqrt2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["a"]),
        helper.make_node("Mul", ["x", "a"], ["m"]),
        helper.make_node("Mul", ["m", "half"], ["g"]),
    ]
    inits = {
        "sqrt2": np.array(np.sqrt(2), np.float32),
        "one": np.array(1, np.float32),
        "half": np.array(0.5, np.float32),
    }
    if reader == "dynamic":
        nodes += [
            helper.make_node("DynamicQuantizeLinear", ["g"], ["g_q", "g_scale", "g_zero"]),
            helper.make_node("MatMulInteger", ["g_q", "w_q", "g_zero"], ["mi"]),
            helper.make_node("Cast", ["mi"], ["mf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["mf", "g_scale"], ["y"]),
        ]
        inits["w_q"] = RNG.integers(0, 255, size=(8, 8)).astype(np.uint8)
    else:
        nodes.append(helper.make_node("MatMul", ["g", "w"], ["y"]))
        inits["w"] = RNG.normal(size=(8, 8)).astype(np.float32)
    return make_model(nodes, [("x", np.float32, [4, 8])], [("y", np.float32, [4, 8])], inits, opset=13)


def test_a_gelu_read_by_a_dynamic_quantizer_is_left_decomposed():
    assert_declined(gelu_then("dynamic"), "gelu-ort", "feeds a DynamicQuantizeLinear", target="onnxruntime")


def test_a_gelu_read_through_a_dropout_by_a_dynamic_quantizer_is_left_decomposed():
    model = gelu_then("dynamic")
    quantizer = next(n for n in model.graph.node if n.op_type == "DynamicQuantizeLinear")
    quantizer.input[0] = "g_kept"
    model.graph.node.insert(5, helper.make_node("Dropout", ["g"], ["g_kept"]))
    assert_declined(model, "gelu-ort", "feeds a DynamicQuantizeLinear", target="onnxruntime")


def test_a_gelu_quantized_inside_an_if_branch_is_left_decomposed():
    """The GELU is in the main graph; the DynamicQuantizeLinear reading it is in a branch."""
    model = gelu_then("float")
    quantized = helper.make_graph(
        [helper.make_node("DynamicQuantizeLinear", ["g"], ["q", "scale", "zero"]),
         helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["t"])],
        "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, [4, 8])],
    )  # fmt: skip
    plain = helper.make_graph(
        [helper.make_node("Identity", ["g"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [4, 8])],
    )
    model.graph.node.append(helper.make_node("If", ["flag"], ["z"], then_branch=quantized, else_branch=plain))
    model.graph.input.append(helper.make_tensor_value_info("flag", TensorProto.BOOL, []))
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 8]))
    assert_declined(model, "gelu-ort", "feeds a DynamicQuantizeLinear", target="onnxruntime")


def test_the_same_gelu_read_by_a_float_matmul_is_fused():
    assert_rewritten(gelu_then("float"), "gelu-ort", counts={"gelu-ort": 1}, target="onnxruntime")


def gelu_nodes(x: str, out: str) -> list:
    """Erf GELU of `x` into `out` (its constants: gelu_constants)."""
    return [
        helper.make_node("Div", [x, "sqrt2"], [f"{out}_d"]),
        helper.make_node("Erf", [f"{out}_d"], [f"{out}_e"]),
        helper.make_node("Add", [f"{out}_e", "one"], [f"{out}_a"]),
        helper.make_node("Mul", [x, f"{out}_a"], [f"{out}_m"]),
        helper.make_node("Mul", [f"{out}_m", "half"], [out]),
    ]


def gelu_constants() -> dict:
    return {
        "sqrt2": np.array(np.sqrt(2), np.float32),
        "one": np.array(1, np.float32),
        "half": np.array(0.5, np.float32),
    }


def dynamically_quantized(tensor: str, out: str) -> list:
    return [
        helper.make_node("DynamicQuantizeLinear", [tensor], [f"{tensor}_q", f"{tensor}_scale", f"{tensor}_zero"]),
        helper.make_node("DequantizeLinear", [f"{tensor}_q", f"{tensor}_scale", f"{tensor}_zero"], [out]),
    ]


def gelu_branch_then(quantized: bool) -> onnx.ModelProto:
    """An If whose then-branch returns a GELU of x; after the If, a DynamicQuantizeLinear reads
    its result (quantized=True) or a float Relu does."""
    value = helper.make_tensor_value_info
    then_branch = helper.make_graph(gelu_nodes("x", "g"), "then", [], [value("g", TensorProto.FLOAT, [4, 8])])
    else_branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"])], "else", [], [value("e", TensorProto.FLOAT, [4, 8])]
    )
    after = dynamically_quantized("z", "y") if quantized else [helper.make_node("Relu", ["z"], ["y"])]
    nodes = [helper.make_node("If", ["flag"], ["z"], then_branch=then_branch, else_branch=else_branch), *after]
    inputs = [("x", np.float32, [4, 8]), ("flag", np.bool_, [])]
    return make_model(nodes, inputs, [("y", np.float32, [4, 8])], gelu_constants(), opset=13)


def test_a_gelu_a_branch_returns_to_a_quantizer_after_the_if_is_left_decomposed():
    assert_declined(gelu_branch_then(True), "gelu-ort", "feeds a DynamicQuantizeLinear", target="onnxruntime")


def test_the_same_branch_returning_to_a_float_relu_is_fused():
    assert_rewritten(gelu_branch_then(False), "gelu-ort", counts={"gelu-ort": 1}, target="onnxruntime")


def gelu_loop_state(quantized: bool) -> onnx.ModelProto:
    """A Loop whose state goes through a GELU each iteration; the body also scans out the state
    it starts the iteration with, through a DynamicQuantizeLinear (quantized=True) or a Relu."""
    value = helper.make_tensor_value_info
    scanned = dynamically_quantized("state", "seen") if quantized else [helper.make_node("Relu", ["state"], ["seen"])]
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]), *gelu_nodes("state", "next"), *scanned],
        "body",
        [value("i", TensorProto.INT64, []), value("cond", TensorProto.BOOL, []), value("state", TensorProto.FLOAT, [4, 8])],
        [value("cond_out", TensorProto.BOOL, []), value("next", TensorProto.FLOAT, [4, 8]), value("seen", TensorProto.FLOAT, [4, 8])],
    )  # fmt: skip
    loop = helper.make_node("Loop", ["trips", "", "x"], ["y", "history"], body=body)
    inits = {**gelu_constants(), "trips": np.array(3, np.int64)}
    outputs = [("y", np.float32, [4, 8]), ("history", np.float32, [3, 4, 8])]
    return make_model([loop], [("x", np.float32, [4, 8])], outputs, inits, opset=13)


def test_a_gelu_whose_loop_state_is_quantized_in_the_next_iteration_is_left_decomposed():
    assert_declined(gelu_loop_state(True), "gelu-ort", "feeds a DynamicQuantizeLinear", target="onnxruntime")


def test_the_same_loop_state_read_by_a_float_relu_is_fused():
    assert_rewritten(gelu_loop_state(False), "gelu-ort", counts={"gelu-ort": 1}, target="onnxruntime")


def gelu_scan_state(quantized: bool) -> onnx.ModelProto:
    """gelu_loop_state as a Scan over the rows of `xs`, whose row is added to the state first."""
    value = helper.make_tensor_value_info
    scanned = dynamically_quantized("state", "seen") if quantized else [helper.make_node("Relu", ["state"], ["seen"])]
    body = helper.make_graph(
        [helper.make_node("Add", ["state", "row"], ["summed"]), *gelu_nodes("summed", "next"), *scanned],
        "body",
        [value("state", TensorProto.FLOAT, [8]), value("row", TensorProto.FLOAT, [8])],
        [value("next", TensorProto.FLOAT, [8]), value("seen", TensorProto.FLOAT, [8])],
    )
    scan = helper.make_node("Scan", ["x", "xs"], ["y", "history"], body=body, num_scan_inputs=1)
    inputs = [("x", np.float32, [8]), ("xs", np.float32, [3, 8])]
    outputs = [("y", np.float32, [8]), ("history", np.float32, [3, 8])]
    return make_model([scan], inputs, outputs, gelu_constants(), opset=13)


def test_a_gelu_whose_scan_state_is_quantized_in_the_next_iteration_is_left_decomposed():
    assert_declined(gelu_scan_state(True), "gelu-ort", "feeds a DynamicQuantizeLinear", target="onnxruntime")


def test_the_same_scan_state_read_by_a_float_relu_is_fused():
    assert_rewritten(gelu_scan_state(False), "gelu-ort", counts={"gelu-ort": 1}, target="onnxruntime")


def test_a_branch_reading_an_outer_dequantized_weight_declines():
    """The DequantizeLinear is in the main graph, the MatMul + Add inside an If branch."""
    then_branch = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "bias"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [4, 8])],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [4, 8])],
    )
    nodes = [
        helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"]),
        helper.make_node("If", ["flag"], ["y"], then_branch=then_branch, else_branch=else_branch),
    ]
    inits = {
        "w_q": RNG.integers(-127, 128, size=(8, 8)).astype(np.int8),
        "w_scale": np.array(0.01, np.float32),
        "bias": RNG.normal(size=8).astype(np.float32),
    }
    model = make_model(
        nodes, [("x", np.float32, [4, 8]), ("flag", np.bool_, [])], [("y", np.float32, [4, 8])], inits, opset=13
    )
    assert_declined(model, "matmul-add-gemm", "from a DequantizeLinear")


def test_the_checks_inputs_index_an_embedding_stored_quantized():
    """A quantized embedding table is DequantizeLinear(int8 table): token ids stay below its rows."""
    nodes = [
        helper.make_node("DequantizeLinear", ["table_q", "scale"], ["table"]),
        helper.make_node("Gather", ["table", "ids"], ["y"]),
    ]
    inits = {"table_q": np.zeros((30, 4), np.int8), "scale": np.array(0.1, np.float32)}
    model = make_model(nodes, [("ids", np.int64, [1, "seq"])], [("y", np.float32, [1, "seq", 4])], inits, opset=13)
    assert index_ranges(model) == {"ids": (0, 30)}


# ------------------------------------------------------------------ onnxruntime's own quantizers


def small_network() -> onnx.ModelProto:
    """Conv-Relu-MaxPool-Conv-Add(residual)-Relu-GlobalAveragePool-Flatten-Gemm in float."""

    def w(*shape):
        return (RNG.normal(size=shape) * 0.2).astype(np.float32)

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "p"], ["s"]),
        helper.make_node("Relu", ["s"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "w3", "b3"], ["y"], transB=1),
    ]
    inits = {"w1": w(C, C, 3, 3), "b1": w(C), "w2": w(C, C, 3, 3), "b2": w(C), "w3": w(10, C), "b3": w(10)}
    return make_model(nodes, [("x", np.float32, SHAPE)], [("y", np.float32, [1, 10])], inits, opset=13)


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
def test_a_network_quantized_by_onnxruntime_keeps_every_quantized_group(tmp_path, target):
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Calibration(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([{"x": RNG.normal(size=SHAPE).astype(np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.feeds, None)

    source, quantized = tmp_path / "float.onnx", tmp_path / "qdq.onnx"
    onnx.save(small_network(), source)
    quantize_static(
        str(source), str(quantized), Calibration(), quant_format=QuantFormat.QDQ, per_channel=True,
        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
    )  # fmt: skip
    model = onnx.load(quantized)
    assert "QuantizeLinear" in op_types(model)  # the quantizer did quantize
    after, report = fuser.optimize(model, target=target)
    assert report.verdict is None or report.verdict.passed
    untouched = {"QuantizeLinear", "DequantizeLinear", "Conv", "MaxPool", "Add", "GlobalAveragePool", "Gemm"}
    for op_type in untouched:
        assert op_types(after).count(op_type) == op_types(model).count(op_type), op_type
    assert not any(n.domain.startswith("com.microsoft") for n in after.graph.node)
    np.testing.assert_array_equal(run(model, X)[0], run(after, X)[0])


def test_a_gelu_whose_result_reaches_a_dynamic_quantizer_through_arithmetic_is_left_decomposed():
    """GELU -> Mul by a scale -> DynamicQuantizeLinear: the quantizer's scale is the values'
    largest magnitude, so a GELU rounded differently moves every element it quantizes."""
    model = gelu_then("dynamic")
    quantizer = next(n for n in model.graph.node if n.op_type == "DynamicQuantizeLinear")
    quantizer.input[0] = "g_scaled"
    model.graph.node.insert(5, helper.make_node("Mul", ["g", "layer_scale"], ["g_scaled"]))
    model.graph.initializer.append(numpy_helper.from_array(np.full(8, 1.5, np.float32), "layer_scale"))
    assert_declined(
        model, "gelu-ort", "feeds a DynamicQuantizeLinear by way of the operators after it", target="onnxruntime"
    )


def test_a_shape_computed_for_a_reshape_before_a_dynamic_quantizer_still_folds():
    """A Reshape reads its shape input for the shape, not as values: folding the shape's constant
    Concat moves nothing the quantizer rounds."""
    model = make_model(
        [
            helper.make_node("Concat", ["rows", "columns"], ["shape"], axis=0),
            helper.make_node("Reshape", ["x", "shape"], ["flat"]),
            helper.make_node("DynamicQuantizeLinear", ["flat"], ["q", "scale", "zero"]),
            helper.make_node("MatMulInteger", ["q", "w_q", "zero"], ["y"]),
        ],
        [("x", np.float32, [4, 8])],
        [("y", np.int32, [4, 8])],
        {
            "rows": np.array([4], np.int64),
            "columns": np.array([8], np.int64),
            "w_q": RNG.integers(0, 255, size=(8, 8)).astype(np.uint8),
        },
        opset=13,
    )
    assert_rewritten(model, "constant-fold", counts={"constant-fold": 1}, check=False)


def test_a_dynamic_quantizer_far_beyond_the_rewrite_does_not_hold_it_back():
    """Only a quantizer among the next QUANTIZER_REACH tensors counts: a model quantized at its
    end alone keeps its fusions, and the search stays short on a large graph."""
    from fuser.qdq import QUANTIZER_REACH

    model = gelu_then("dynamic")
    quantizer = next(n for n in model.graph.node if n.op_type == "DynamicQuantizeLinear")
    previous = "g"
    for index in range(QUANTIZER_REACH + 8):
        model.graph.node.insert(5 + index, helper.make_node("Relu", [previous], [f"r{index}"]))
        previous = f"r{index}"
    quantizer.input[0] = previous
    assert_rewritten(model, "gelu-ort", counts={"gelu-ort": 1}, target="onnxruntime", check=False)


def test_a_dynamic_quantizer_near_a_rewrite_read_by_many_is_found():
    """The GELU's result is read by 70 Adds; one of them goes on to a DynamicQuantizeLinear two
    operators away. The search is bounded by operators on the way, not by the readers it meets."""
    model = gelu_then("dynamic")
    quantizer = next(n for n in model.graph.node if n.op_type == "DynamicQuantizeLinear")
    readers = [helper.make_node("Add", ["g", "one"], [f"a{index}"]) for index in range(70)]
    model.graph.node.extend(readers)
    model.graph.node.append(helper.make_node("Relu", ["a69"], ["near"]))
    quantizer.input[0] = "near"
    for index in range(69):
        model.graph.output.append(helper.make_tensor_value_info(f"a{index}", TensorProto.FLOAT, [4, 8]))
    onnx.checker.check_model(onnx.shape_inference.infer_shapes(_sorted(model)))
    assert_declined(
        _sorted(model),
        "gelu-ort",
        "feeds a DynamicQuantizeLinear by way of the operators after it",
        target="onnxruntime",
    )


def _sorted(model: onnx.ModelProto) -> onnx.ModelProto:
    from fuser.graph import topological_positions

    nodes = [model.graph.node[i] for i in topological_positions(model.graph)]
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    return copy
