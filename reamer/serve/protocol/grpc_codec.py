"""The gRPC codec of the Open Inference Protocol: ModelInferRequest messages to tensors, tensors into
ModelInferResponse messages.

Tensors come as `raw_input_contents` (what tritonclient sends) or as typed `contents`; the answer uses the
same form as the request (raw when any output is FP16, which has no typed field). BYTES tensors travel in
`bytes_contents`, or raw in Triton's layout (each element a 4-byte little-endian length and its bytes). What
the request holds is checked against the model's signature by the validator both doors share (`validate`).
The messages are the door's (doors/grpc_v2): this module reads and fills them, it does not make them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from reamer.serve.protocol.errors import BadRequest
from reamer.serve.protocol.tensors import BadBytesTensor, TensorInfo, split_length_prefixed, text_tensor
from reamer.serve.protocol.validate import check_all_given, check_input, check_output
from reamer.serve.protocol.v2wire import le_bytes

SIGNATURE_AT = "ModelMetadata"  # where a gRPC client reads the model's inputs and outputs

# The typed-contents field of each numeric datatype (FP16 has none: it travels raw; BYTES uses bytes_contents).
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                  "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                  "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
                  "FP32": "fp32_contents", "FP64": "fp64_contents"}


@dataclass
class DecodedGrpcRequest:
    inputs: dict[str, np.ndarray]
    outputs: list[str]  # names to answer with, in answer order
    raw: bool  # answer with raw_output_contents (the request's form)


def decode_infer_request(req: Any, model_inputs: list[TensorInfo], model_outputs: list[TensorInfo]) -> DecodedGrpcRequest:
    """Validate a ModelInferRequest against the model's signature and read its tensors."""
    raw = list(req.raw_input_contents)
    if raw and len(raw) != len(req.inputs):
        raise BadRequest(f"raw_input_contents has {len(raw)} entries for {len(req.inputs)} inputs",
                         "send one raw_input_contents entry per input, in input order")
    by_name = {t.name: t for t in model_inputs}
    inputs: dict[str, np.ndarray] = {}
    for i, item in enumerate(req.inputs):
        name = item.name
        where = f"inputs[{i}] ({name!r})"
        meta, dtype, shape, count = check_input(name, item.datatype, list(item.shape), by_name, model_inputs, inputs,
                                                SIGNATURE_AT)
        datatype = meta.datatype
        has_contents = item.HasField("contents")
        if dtype == np.object_:  # BYTES: raw in Triton's layout (a length before each element), or bytes_contents
            if raw and has_contents:
                raise BadRequest(f"{where}.contents is set beside raw_input_contents",
                                 "send every input raw, or every input in contents, not both")
            values = (list(item.contents.bytes_contents) if not raw
                      else _split_raw(raw[i], count, f"raw_input_contents[{i}] ({name!r})"))
            if len(values) != count:
                raise BadRequest(f"{where}.contents.bytes_contents has {len(values)} values but shape {shape} "
                                 f"holds {count}", "send as many values as the shape holds")
            try:
                inputs[name] = text_tensor(values, shape, where)
            except BadBytesTensor as exc:
                raise BadRequest(exc.message, exc.fix) from None
            continue
        if raw:
            if has_contents:
                raise BadRequest(f"{where}.contents is set beside raw_input_contents",
                                 "send every input raw, or every input in contents, not both")
            want = count * dtype.itemsize
            if len(raw[i]) != want:
                raise BadRequest(f"raw_input_contents[{i}] ({name!r}) has {len(raw[i])} bytes but shape {shape} "
                                 f"of {datatype} needs {want}", "send exactly shape × element size bytes")
            arr = np.frombuffer(raw[i], dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)
        else:
            field = CONTENTS_FIELD.get(datatype)
            if field is None:
                raise BadRequest(f"{where} is {datatype}, which has no typed contents field",
                                 f"send {datatype} tensors in raw_input_contents")
            values = getattr(item.contents, field)
            if len(values) != count:
                raise BadRequest(f"{where}.contents.{field} has {len(values)} values but shape {shape} holds {count}"
                                 + ("" if has_contents else "; the request has no raw_input_contents either"),
                                 "send as many values as the shape holds")
            try:
                arr = _typed(values, dtype)
            except (OverflowError, ValueError) as exc:
                raise BadRequest(f"{where}.contents.{field} does not fit {datatype} ({exc})",
                                 f"send values in the range of {datatype}") from None
        inputs[name] = arr.reshape(shape)
    check_all_given(inputs, model_inputs)
    known = [t.name for t in model_outputs]
    outputs = [check_output(i, out.name, known, model_outputs, SIGNATURE_AT) for i, out in enumerate(req.outputs)]
    types = {t.name: t.datatype for t in model_outputs}
    wanted = outputs or known
    answer_raw = bool(raw) or not inputs or any(CONTENTS_FIELD.get(types[n]) is None and types[n] != "BYTES"
                                                for n in wanted)
    return DecodedGrpcRequest(inputs, wanted, answer_raw)


def _typed(values: Any, dtype: np.dtype) -> np.ndarray:
    """Typed contents as `dtype`; OverflowError for a value outside its range. (protobuf's upb containers hand
    numpy their 32- or 64-bit buffer, whose cast to a narrower type would wrap a value silently.)"""
    if dtype.kind not in "iu":
        return np.asarray(values, dtype=dtype)
    # through the widest type of the same signedness: a uint64 near 2**64 stays exact (no float on the way)
    wide = np.asarray(values, dtype=np.int64 if dtype.kind == "i" else np.uint64)
    if wide.dtype != dtype and wide.size:
        info = np.iinfo(dtype)
        low, high = wide.min(), wide.max()
        if low < info.min or high > info.max:
            raise OverflowError(f"Python integer {low if low < info.min else high} out of bounds for {dtype}")
    return wide.astype(dtype, copy=False)


def _split_raw(raw: bytes, count: int, where: str) -> list[bytes]:
    try:
        return split_length_prefixed(raw, count, where)
    except BadBytesTensor as exc:
        raise BadRequest(exc.message, exc.fix) from None


def fill_infer_response(resp: Any, decoded: DecodedGrpcRequest, outputs: dict[str, np.ndarray],
                        model_outputs: list[TensorInfo]) -> Any:
    """Fill the ModelInferResponse `resp` with the outputs the request asked for, in its form; returns it."""
    types = {t.name: t.datatype for t in model_outputs}
    for name in decoded.outputs:
        arr = np.asarray(outputs[name])
        out = resp.outputs.add(name=name, datatype=types[name], shape=arr.shape)
        if types[name] == "BYTES":  # string outputs: each element as bytes
            if decoded.raw:  # Triton's raw BYTES layout (le_bytes: a 4-byte length before each element)
                resp.raw_output_contents.append(le_bytes(arr.astype(object, copy=False)))
            else:
                out.contents.bytes_contents.extend(
                    x if isinstance(x, bytes) else str(x).encode() for x in arr.reshape(-1).tolist())
        elif decoded.raw:
            resp.raw_output_contents.append(le_bytes(arr))
        else:
            getattr(out.contents, CONTENTS_FIELD[types[name]]).extend(arr.reshape(-1).tolist())
    return resp
