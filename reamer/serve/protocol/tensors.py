"""Tensor metadata and dtype names: ONNX element types, numpy dtypes, KServe v2 datatypes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
from onnx import TensorProto

from reamer.host.errors import ReamerError

# KServe v2 / Open Inference Protocol datatype names, with the numpy dtype and ONNX element type of each.
_V2_TABLE: tuple[tuple[str, np.dtype, int], ...] = (
    ("BOOL", np.dtype(np.bool_), TensorProto.BOOL),
    ("UINT8", np.dtype(np.uint8), TensorProto.UINT8),
    ("UINT16", np.dtype(np.uint16), TensorProto.UINT16),
    ("UINT32", np.dtype(np.uint32), TensorProto.UINT32),
    ("UINT64", np.dtype(np.uint64), TensorProto.UINT64),
    ("INT8", np.dtype(np.int8), TensorProto.INT8),
    ("INT16", np.dtype(np.int16), TensorProto.INT16),
    ("INT32", np.dtype(np.int32), TensorProto.INT32),
    ("INT64", np.dtype(np.int64), TensorProto.INT64),
    ("FP16", np.dtype(np.float16), TensorProto.FLOAT16),
    ("FP32", np.dtype(np.float32), TensorProto.FLOAT),
    ("FP64", np.dtype(np.float64), TensorProto.DOUBLE),
    ("BYTES", np.dtype(np.object_), TensorProto.STRING),
)

V2_DATATYPES: tuple[str, ...] = tuple(row[0] for row in _V2_TABLE)
_BY_V2 = {name: (dt, et) for name, dt, et in _V2_TABLE}
_V2_BY_NUMPY = {dt: name for name, dt, _ in _V2_TABLE}
_V2_BY_ONNX = {et: name for name, _, et in _V2_TABLE}


class UnsupportedDatatype(ReamerError):
    """A tensor element type that reamer cannot carry over the v2 protocol."""


@dataclass
class TensorInfo:
    """One model input or output: v2 datatype name and shape (-1 marks a dynamic dimension)."""

    name: str
    datatype: str
    shape: list[int] = field(default_factory=list)

    @property
    def numpy_dtype(self) -> np.dtype:
        return v2_to_numpy(self.datatype)

    def to_dict(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}

    def accepts_shape(self, dims: list[int]) -> bool:
        """Whether a request's tensor of shape `dims` (non-negative ints) fits this one (-1: any size)."""
        return (len(dims) == len(self.shape) and all(d >= 0 for d in dims)
                and all(m < 0 or d == m for d, m in zip(dims, self.shape)))


def _unsupported(what: object) -> UnsupportedDatatype:
    return UnsupportedDatatype(
        f"tensor element type {what!r} has no KServe v2 datatype",
        f"use one of {', '.join(V2_DATATYPES)} in the model's inputs and outputs",
    )


def v2_to_numpy(datatype: str) -> np.dtype:
    try:
        return _BY_V2[datatype.upper()][0]
    except KeyError:
        raise _unsupported(datatype) from None


def v2_to_onnx(datatype: str) -> int:
    try:
        return _BY_V2[datatype.upper()][1]
    except KeyError:
        raise _unsupported(datatype) from None


def numpy_to_v2(dtype: np.dtype | type | str) -> str:
    dt = np.dtype(dtype)
    if dt.kind in ("U", "S", "O"):
        return "BYTES"
    try:
        return _V2_BY_NUMPY[dt]
    except KeyError:
        raise _unsupported(str(dt)) from None


def onnx_to_v2(elem_type: int) -> str:
    try:
        return _V2_BY_ONNX[elem_type]
    except KeyError:
        raise _unsupported(TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else elem_type) from None


def onnx_to_numpy(elem_type: int) -> np.dtype:
    return v2_to_numpy(onnx_to_v2(elem_type))


def numpy_to_onnx(dtype: np.dtype | type | str) -> int:
    return v2_to_onnx(numpy_to_v2(dtype))


# ONNX Runtime reports types as strings like "tensor(float)".
_ORT_NAMES = {
    "tensor(bool)": "BOOL", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64", "tensor(int8)": "INT8", "tensor(int16)": "INT16", "tensor(int32)": "INT32",
    "tensor(int64)": "INT64", "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


def ort_type_to_v2(type_str: str) -> str:
    try:
        return _ORT_NAMES[type_str]
    except KeyError:
        raise _unsupported(type_str) from None


# ---------------------------------------------------------------- BYTES (string) tensors
#
# Inside reamer a BYTES tensor is a numpy object array of str: what ONNX Runtime takes and returns (it reads a
# bytes element as the text of its repr, "b'abc'", so bytes are decoded first). On the wire (Triton's binary
# tensor data, gRPC raw contents) each element is a 4-byte little-endian length and then its bytes.

class BadBytesTensor(ReamerError):
    """BYTES tensor data that cannot be read (truncated, a count that does not match, not UTF-8)."""


def decode_text(items: Iterable[bytes | str], where: str) -> list[str]:
    """Elements as str: bytes decoded as UTF-8 (the runtimes hold text), str as it is."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append(item)
            continue
        try:
            out.append(bytes(item).decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise BadBytesTensor(f"{where}: element {i} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                                 "send BYTES elements as UTF-8 text (the runtime holds strings)") from None
    return out


def split_length_prefixed(raw: bytes | memoryview, count: int, where: str) -> list[bytes]:
    """The `count` elements of a BYTES tensor in Triton's binary layout (a 4-byte little-endian length before
    each element's bytes); BadBytesTensor unless `raw` holds exactly that many elements."""
    view = memoryview(raw).cast("B")
    items: list[bytes] = []
    pos, end = 0, len(view)
    fix = "send each BYTES element as a 4-byte little-endian length followed by that many bytes"
    while pos < end:
        if len(items) == count:
            raise BadBytesTensor(f"{where}: {end - pos} bytes follow its {count} BYTES element(s)", fix)
        if end - pos < 4:
            raise BadBytesTensor(f"{where}: element {len(items)} is cut off in its 4-byte length", fix)
        size = int.from_bytes(view[pos:pos + 4], "little")
        pos += 4
        if size > end - pos:
            raise BadBytesTensor(f"{where}: element {len(items)} says {size} bytes but only {end - pos} follow", fix)
        items.append(bytes(view[pos:pos + size]))
        pos += size
    if len(items) != count:
        raise BadBytesTensor(f"{where}: holds {len(items)} BYTES element(s) but its shape holds {count}", fix)
    return items


def text_tensor(items: Sequence[bytes | str], shape: Sequence[int], where: str) -> np.ndarray:
    """An object array of str of `shape` from `items` (bytes decoded as UTF-8)."""
    arr = np.empty(len(items), dtype=object)
    arr[:] = decode_text(items, where)
    return arr.reshape(tuple(shape))


def as_text_array(arr: np.ndarray, where: str) -> np.ndarray:
    """Any string-like array (object of str or bytes, numpy 'U' or 'S') as an object array of str.
    BadBytesTensor when an element is neither text nor bytes, or bytes that are not UTF-8."""
    arr = np.asarray(arr)
    if arr.dtype == object and all(type(x) is str for x in arr.reshape(-1).tolist()):
        return arr
    if arr.dtype.kind == "U":
        return arr.astype(object)
    if arr.dtype.kind not in "SO":
        raise BadBytesTensor(f"{where} holds {arr.dtype} values, not strings",
                             "send text (str or UTF-8 bytes) for a BYTES tensor")
    flat = arr.reshape(-1).tolist()
    bad = next((x for x in flat if not isinstance(x, (str, bytes, bytearray))), None)
    if bad is not None:
        raise BadBytesTensor(f"{where} holds a {type(bad).__name__} element, not a string",
                             "send text (str or UTF-8 bytes) for a BYTES tensor")
    return text_tensor(flat, arr.shape, where)


def text_values(arr: np.ndarray) -> list[str]:
    """A BYTES tensor's elements as str for a JSON answer (bytes that are not UTF-8: replacement characters;
    the binary form carries them exactly)."""
    return [x.decode("utf-8", "replace") if isinstance(x, (bytes, bytearray)) else str(x)
            for x in np.asarray(arr).reshape(-1).tolist()]


def storable_text(arr: np.ndarray) -> np.ndarray:
    """A BYTES tensor as a numpy unicode ('<U..') array: what .npy/.npz hold without pickling."""
    values = text_values(arr)
    return np.array(values, dtype=str if values else "<U1").reshape(np.asarray(arr).shape)
