import numpy as np
import pytest
from onnx import TensorProto

from reamer.host.errors import ReamerError
from reamer.serve.protocol import tensors


@pytest.mark.parametrize(
    "v2,np_dtype,onnx_type",
    [("BOOL", np.bool_, TensorProto.BOOL), ("UINT8", np.uint8, TensorProto.UINT8), ("INT8", np.int8, TensorProto.INT8),
     ("INT32", np.int32, TensorProto.INT32), ("INT64", np.int64, TensorProto.INT64), ("FP16", np.float16, TensorProto.FLOAT16),
     ("FP32", np.float32, TensorProto.FLOAT), ("FP64", np.float64, TensorProto.DOUBLE), ("UINT64", np.uint64, TensorProto.UINT64)],
)
def test_round_trips(v2, np_dtype, onnx_type):
    assert tensors.v2_to_numpy(v2) == np.dtype(np_dtype)
    assert tensors.numpy_to_v2(np_dtype) == v2
    assert tensors.onnx_to_v2(onnx_type) == v2
    assert tensors.v2_to_onnx(v2) == onnx_type
    assert tensors.onnx_to_numpy(onnx_type) == np.dtype(np_dtype)
    assert tensors.numpy_to_onnx(np_dtype) == onnx_type


def test_bytes_and_strings():
    assert tensors.numpy_to_v2(np.dtype("U5")) == "BYTES"
    assert tensors.numpy_to_v2(object) == "BYTES"
    assert tensors.v2_to_onnx("BYTES") == TensorProto.STRING


def test_v2_names_are_case_insensitive_on_input():
    assert tensors.v2_to_numpy("fp32") == np.float32


def test_ort_type_strings():
    assert tensors.ort_type_to_v2("tensor(float)") == "FP32"
    assert tensors.ort_type_to_v2("tensor(int64)") == "INT64"


def test_unknown_types_raise_reamer_error_naming_choices():
    with pytest.raises(ReamerError) as exc:
        tensors.v2_to_numpy("FP8")
    assert "FP8" in str(exc.value) and "FP32" in exc.value.fix
    with pytest.raises(ReamerError):
        tensors.numpy_to_v2(np.complex64)
    with pytest.raises(ReamerError):
        tensors.onnx_to_v2(TensorProto.COMPLEX64)
    with pytest.raises(ReamerError):
        tensors.ort_type_to_v2("seq(tensor(float))")


def test_tensor_info():
    info = tensors.TensorInfo("x", "INT64", [-1, 4])
    assert info.numpy_dtype == np.int64
    assert info.to_dict() == {"name": "x", "datatype": "INT64", "shape": [-1, 4]}
