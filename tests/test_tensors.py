"""TensorStore's decode and check: what a rule reads of a weight, and what it is refused."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuser.errors import InputError
from fuser.tensors import TensorStore, from_array

# Every element type onnx stores numbers in: the decode must agree with onnx's for each.
NUMERIC = [name for name in TensorProto.DataType.keys() if name not in ("UNDEFINED", "STRING")]


def _values(data_type: int, shape: tuple) -> np.ndarray:
    dtype = helper.tensor_dtype_to_np_dtype(data_type)
    rng = np.random.default_rng(data_type)
    if dtype == np.bool_:
        return rng.random(shape) > 0.5
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.random(shape) + 1j * rng.random(shape)).astype(dtype)
    return (rng.random(shape) * 7).astype(dtype)


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("shape", [(2, 3), (), (0, 4), (5,)])
def test_a_decoded_weight_is_what_onnx_decodes(tmp_path, name, shape):
    data_type = getattr(TensorProto, name)
    tensor = numpy_helper.from_array(_values(data_type, shape), "w")
    expected = numpy_helper.to_array(tensor)
    value = TensorStore(tmp_path).value(tensor)
    assert value.dtype == expected.dtype and value.shape == expected.shape
    assert value.tobytes() == expected.tobytes()


@pytest.mark.parametrize("name", NUMERIC)
def test_a_weight_stored_as_typed_values_is_what_onnx_decodes(tmp_path, name):
    """Not raw data: sub-byte types are packed into int32 values, others one per value."""
    data_type = getattr(TensorProto, name)
    tensor = helper.make_tensor("w", data_type, [3, 3], _values(data_type, (3, 3)).flatten(), raw=False)
    assert not tensor.HasField("raw_data")
    expected = numpy_helper.to_array(tensor)
    value = TensorStore(tmp_path).value(tensor)
    assert value.dtype == expected.dtype and value.tobytes() == expected.tobytes()


def _stored(dims: list[int], **data) -> TensorProto:
    """A float tensor as a file may hold it, whether or not its data fits (onnx's helper checks)."""
    return TensorProto(name="w", data_type=TensorProto.FLOAT, dims=dims, **data)


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (_stored([2, 3], raw_data=b"\0" * 20), "holds 20 bytes"),
        (_stored([2, 3], float_data=[1.0] * 5), "holds 5 values"),
        (_stored([-1, 3], raw_data=b""), "negative dimension"),
        (_stored([2], raw_data=b"\0" * 12), "holds 12 bytes"),
    ],
)
def test_a_weight_whose_data_does_not_fit_its_dims_is_refused_before_it_is_read(tmp_path, tensor, message):
    with pytest.raises(InputError, match=message):
        TensorStore(tmp_path).value(tensor)


@pytest.mark.skipif(not hasattr(TensorProto, "UINT2"), reason="this onnx has no 2-bit types")
def test_a_model_with_two_bit_weights_loads_and_is_checked(tmp_path):
    """Two-bit weights pack four to a byte: a model holding them was refused as invalid."""
    import onnx

    import fuser

    values = np.array([1, 0, 1, 1, 0, 1, 1, 0], dtype=helper.tensor_dtype_to_np_dtype(TensorProto.UINT2))
    graph = helper.make_graph(
        [helper.make_node("Cast", ["w"], ["c"], to=TensorProto.FLOAT), helper.make_node("Add", ["x", "c"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(values.reshape(2, 4), "w")],
    )
    path = tmp_path / "uint2.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)]), path)
    optimized, report = fuser.optimize(str(path))
    assert report.rewrites and report.verdict.passed
    assert [n.op_type for n in optimized.graph.node] == ["Add"]


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("shape", [(2, 3), (), (0, 4), (5,)])
def test_a_weight_a_rule_builds_is_what_onnx_makes_of_the_array(name, shape):
    """Builder.constant's tensor, made directly for the plain dtypes, is byte for byte
    numpy_helper.from_array's; a strided array comes out in C order."""
    data_type = getattr(TensorProto, name)
    array = _values(data_type, shape)
    expected = numpy_helper.from_array(array, "w")
    assert from_array(array, "w").SerializeToString() == expected.SerializeToString()
    if array.ndim == 2:
        strided = from_array(array.T, "w")
        assert strided.SerializeToString() == numpy_helper.from_array(array.T, "w").SerializeToString()
