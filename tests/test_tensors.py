"""TensorStore's decode and check: what a rule reads of a weight, and what it is refused."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuser.errors import InputError
from fuser.tensors import TensorStore

PLAIN = [
    "FLOAT",
    "DOUBLE",
    "FLOAT16",
    "BFLOAT16",
    "INT8",
    "UINT8",
    "INT16",
    "UINT16",
    "INT32",
    "UINT32",
    "INT64",
    "UINT64",
    "BOOL",
]
OTHERS = ["INT4", "UINT4", "FLOAT8E4M3FN", "FLOAT8E5M2", "COMPLEX64"]


def _values(data_type: int, shape: tuple) -> np.ndarray:
    dtype = helper.tensor_dtype_to_np_dtype(data_type)
    rng = np.random.default_rng(data_type)
    if dtype == np.bool_:
        return rng.random(shape) > 0.5
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.random(shape) + 1j * rng.random(shape)).astype(dtype)
    return (rng.random(shape) * 7).astype(dtype)


@pytest.mark.parametrize("name", PLAIN + OTHERS)
@pytest.mark.parametrize("shape", [(2, 3), (), (0, 4), (5,)])
def test_a_decoded_weight_is_what_onnx_decodes(tmp_path, name, shape):
    data_type = getattr(TensorProto, name)
    tensor = numpy_helper.from_array(_values(data_type, shape), "w")
    expected = numpy_helper.to_array(tensor)
    value = TensorStore(tmp_path).value(tensor)
    assert value.dtype == expected.dtype and value.shape == expected.shape
    assert value.tobytes() == expected.tobytes()


def test_a_weight_stored_as_typed_values_decodes_as_well(tmp_path):
    tensor = helper.make_tensor("w", TensorProto.FLOAT, [2, 2], [1.0, 2.0, 3.0, 4.0])
    assert not tensor.HasField("raw_data")
    np.testing.assert_array_equal(TensorStore(tmp_path).value(tensor), [[1, 2], [3, 4]])


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
