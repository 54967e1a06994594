"""The one validator of inference requests, shared by the REST and the gRPC codec.

Both codecs read their wire form (JSON and binary tensors; protobuf messages) and ask here whether what they
read fits the model's signature: a known input, given once, of the model's datatype and an accepted shape, of
a size the job takes; every input given; only outputs the model has. Every refusal is a BadRequest whose
message names the field and whose fix names the place the client can look up the signature (`signature_at`:
`GET /v2/models/<name>` for REST, `ModelMetadata` for gRPC).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from reamer.serve.protocol.errors import BadRequest
from reamer.serve.protocol.tensors import TensorInfo, UnsupportedDatatype, v2_to_numpy


def describe_tensors(tensors: list[TensorInfo]) -> str:
    return ", ".join(f"{t.name} ({t.datatype} {list(t.shape)})" for t in tensors)


def json_kind(value: Any) -> str:
    """A JSON value's type in JSON words, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def check_input(name: str, datatype: Any, shape: Any, by_name: dict[str, TensorInfo],
                model_inputs: list[TensorInfo], given: dict, signature_at: str,
                max_elements: int | None = None) -> tuple[TensorInfo, np.dtype, list[int], int]:
    """The model's input `name`, its numpy dtype, its shape and element count, once the
    request's datatype and shape fit it. `given`: the inputs read so far. `max_elements` bounds every
    dimension and the element count (a dynamic dimension of 10^12 is refused before anything is allocated)."""
    meta = by_name.get(name)
    if meta is None:
        raise BadRequest(f"unknown input {name!r}; the model expects inputs: {describe_tensors(model_inputs)}",
                         f"use the input names from {signature_at}")
    if name in given:
        raise BadRequest(f"input {name!r} is given twice", "send each input once")
    where = f"input {name!r}"
    if not isinstance(datatype, str) or datatype.upper() != meta.datatype:
        got = repr(datatype) if isinstance(datatype, str) else json_kind(datatype)
        raise BadRequest(f"{where} has datatype {got} but the model expects {meta.datatype}",
                         f"send {name} as {meta.datatype}")
    if (not isinstance(shape, list) or any(not isinstance(d, int) or isinstance(d, bool) for d in shape)
            or not meta.accepts_shape(shape)):
        raise BadRequest(f"{where} has shape {shape if isinstance(shape, list) else json_kind(shape)} but the model "
                         f"expects {list(meta.shape)} (-1 = any size)",
                         f"reshape {name} to match; the first axis is the batch")
    try:
        dtype = v2_to_numpy(meta.datatype)
    except UnsupportedDatatype as exc:
        raise BadRequest(exc.message, exc.fix) from None
    count = math.prod(shape)
    if max_elements is not None and (count > max_elements or any(d > max_elements for d in shape)):
        raise BadRequest(f"{where} has shape {shape}, {count} values: more than this job takes in one request "
                         f"({max_elements} values, its max_request_mb)",
                         "send fewer or smaller samples per request, or raise the job's max_request_mb")
    return meta, dtype, shape, count


def check_all_given(given: dict, model_inputs: list[TensorInfo]) -> None:
    """Every model input is in `given`. (The batch size's agreement is the batcher's to check: only a
    batchable model's first dimensions are its batch.)"""
    missing = [t.name for t in model_inputs if t.name not in given]
    if missing:
        raise BadRequest(f"missing input(s) {missing}; the model expects inputs: {describe_tensors(model_inputs)}",
                         "send every model input")


def check_output(index: int, name: Any, known: set[str] | dict[str, Any], model_outputs: list[TensorInfo],
                 signature_at: str) -> str:
    """`name` (outputs[index].name) when the model has that output."""
    if not isinstance(name, str) or name not in known:
        what = repr(name) if isinstance(name, str) else json_kind(name)
        raise BadRequest(f"unknown output {what} in outputs[{index}].name; the model has outputs: "
                         f"{describe_tensors(model_outputs)}", f"ask only for outputs from {signature_at}")
    return name
