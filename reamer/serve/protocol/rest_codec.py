"""The REST codec of the Open Inference Protocol (KServe v2): infer requests and responses as JSON, with
the binary tensor data extension.

When the request has the header `Inference-Header-Content-Length: N`, the first N body bytes are the JSON header
and the raw tensors follow, in input order, for every input with `parameters.binary_data_size`. Outputs go back
binary when the requested output says `parameters.binary_data: true`, or the request says
`parameters.binary_data_output: true`; the response then carries the same header.
BYTES (string) tensors come as JSON strings in `data`, or binary in Triton's layout (each element a 4-byte
little-endian length and its bytes, `binary_data_size` their total); elements must be UTF-8 text (the runtime
holds strings). Outputs go back the same two ways.

JSON is parsed and written with orjson; a large body is read with simdjson, whose flat float `data` lists go
into numpy without a Python float per value (`json_body`), with the same arrays and messages as the general
path. What the request holds is checked against the model's signature by the validator both doors share
(`validate`); a refusal is a BadRequest whose message names the field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from reamer.serve.protocol.errors import BadRequest
from reamer.serve.protocol.json_body import FloatData, read_large_request
from reamer.serve.protocol.tensors import (BadBytesTensor, TensorInfo, numpy_to_v2, split_length_prefixed, text_tensor,
                                           text_values)
from reamer.serve.protocol.validate import check_all_given, check_input, check_output, json_kind
from reamer.serve.protocol.v2wire import HEADER_LENGTH, binary_body, le_bytes

SIGNATURE_AT = "GET /v2/models/<name>"  # where a REST client reads the model's inputs and outputs


@dataclass
class DecodedRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    # (name, binary) per requested output; None = all outputs
    outputs: list[tuple[str, bool]] | None
    binary_default: bool

    def wanted(self, model_outputs: list[TensorInfo]) -> list[tuple[str, bool]]:
        """(name, binary) of every output to answer with, in answer order."""
        if self.outputs is not None:
            return self.outputs
        return [(t.name, self.binary_default) for t in model_outputs]


@dataclass(frozen=True)
class _BinaryInput:
    name: str
    wire_dtype: np.dtype  # little-endian, as the bytes arrive
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    size: int


@dataclass(frozen=True)
class RequestPlan:
    """A validated JSON header whose inputs are all binary: requests with the byte-identical header
    (a client sending one shape over and over) skip the JSON parse and the checks."""

    inputs: tuple[_BinaryInput, ...]
    blob_size: int
    outputs: list[tuple[str, bool]] | None
    binary_default: bool

    def decode(self, blob: memoryview) -> DecodedRequest:
        inputs = {b.name: np.frombuffer(blob, b.wire_dtype, count=b.size // b.wire_dtype.itemsize, offset=b.offset)
                  .astype(b.dtype, copy=False).reshape(b.shape) for b in self.inputs}
        return DecodedRequest(id=None, inputs=inputs, outputs=self.outputs, binary_default=self.binary_default)


PLAN_CACHE_SIZE = 256
LARGE_JSON_BYTES = 1 << 16  # JSON bodies larger than this are read with simdjson (`json_body`)


def _object(value: Any, where: str) -> dict:
    """`value` when it is a JSON object or absent (null), else a 400 naming the field."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{where} is {json_kind(value)}, not an object", f'send {where} as {{"key": value}}, or leave it out')
    return value


def _flag(params: dict, key: str, where: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{where}.{key} is {json_kind(value)}, not a boolean", f"send {key} as true or false")
    return value


_FLOAT_MAX = {np.dtype(t): float(np.finfo(t).max) for t in (np.float16, np.float32, np.float64)}
_INT_RANGES = {np.dtype(t): np.iinfo(t) for t in (np.int8, np.int16, np.int32, np.int64,
                                                 np.uint8, np.uint16, np.uint32, np.uint64)}


def _json_tensor(data: Any, dtype: np.dtype, where: str, datatype: str) -> np.ndarray:
    """The flat array of a JSON `data` list (or of its numbers already read, FloatData), checked: numbers
    only, integers in range, floats finite."""
    try:
        raw = data.values if isinstance(data, FloatData) else np.asarray(data)
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadRequest(f"{where}.data cannot be read as {datatype} ({exc})",
                         f"send a flat or evenly nested list of {datatype} numbers") from None
    kind = raw.dtype.kind
    if kind not in "biuf":
        raise BadRequest(f"{where}.data holds {'nested lists of uneven length or ' if kind == 'O' else ''}"
                         f"values that are not numbers", f"send a flat or evenly nested list of {datatype} numbers")
    raw = raw.reshape(-1)
    if not raw.size:
        return raw.astype(dtype)  # "data": [] parses as float64: the empty tensor takes the declared type
    if raw.dtype == dtype:
        return raw  # JSON integers that all fit int64 for INT64, the common case: nothing can be out of range
    if dtype.kind in "iu":
        if kind == "f" and not np.array_equal(raw, np.trunc(raw)):
            raise BadRequest(f"{where}.data has a value that is not a whole number "
                             f"({float(raw[raw != np.trunc(raw)][0]):g})", f"send whole numbers for {datatype}")
        info = _INT_RANGES[dtype]
        low, high = raw.min(), raw.max()
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise BadRequest(f"{where}.data has {bad:.6g}, outside the range of {datatype} ({info.min}..{info.max})",
                             f"send {datatype} values within its range")
    elif dtype.kind == "f" and (dtype.itemsize < raw.dtype.itemsize or dtype.itemsize == 2):
        if np.abs(raw).max() > _FLOAT_MAX[dtype]:  # checked before the cast, which would only warn
            raise BadRequest(f"{where}.data has a value too large for {datatype}", f"send finite {datatype} values")
    return raw.astype(dtype, copy=False)


def _json_text(data: Any, where: str) -> np.ndarray:
    """The flat object array of str of a BYTES input's JSON `data` (a flat or evenly nested list of strings)."""
    fix = 'send BYTES data as a flat or evenly nested list of strings, e.g. "data": ["first", "second"]'
    if not isinstance(data, list):
        raise BadRequest(f"{where}.data is {json_kind(data)}, not a list", fix)
    try:
        flat = np.array(data, dtype=object).reshape(-1)
    except ValueError:
        raise BadRequest(f"{where}.data holds nested lists of uneven length", fix) from None
    for value in flat.tolist():
        if not isinstance(value, str):  # a number, or a list where uneven nesting left one
            raise BadRequest(f"{where}.data holds {json_kind(value)} where a string belongs", fix)
    return flat


def _binary_text(raw: memoryview, count: int, shape: list[int], where: str) -> np.ndarray:
    """A BYTES input sent binary (Triton's layout: a 4-byte little-endian length before each element)."""
    try:
        return text_tensor(split_length_prefixed(raw, count, where), shape, where)
    except BadBytesTensor as exc:
        raise BadRequest(exc.message, exc.fix) from None


def decode_request(body: bytes, header_length: int | None, model_inputs: list[TensorInfo],
                   model_outputs: list[TensorInfo], plans: dict[bytes, RequestPlan] | None = None,
                   max_elements: int | None = None) -> DecodedRequest:
    """Parse and validate a v2 infer request (JSON or binary extension) against the model's signature.

    `plans`, when given, caches the checked headers of all-binary requests (see RequestPlan); it
    belongs to one model signature. `max_elements` bounds every dimension and every input's element
    count (a dynamic dimension of 10^12 is refused before anything is allocated for it).
    Every refusal is a BadRequest that names the field.
    """
    if header_length is not None:
        if header_length < 0 or header_length > len(body):
            raise BadRequest(f"{HEADER_LENGTH} is {header_length} but the body has {len(body)} bytes",
                             "set the header to the byte length of the JSON part")
        head, blob = bytes(memoryview(body)[:header_length]), memoryview(body)[header_length:]
    else:
        head, blob = body, memoryview(b"")
    if plans is not None and (header_length is not None or len(head) <= LARGE_JSON_BYTES):
        # (a large JSON body is never a cached plan's header: hashing it would cost a pass over its bytes)
        plan = plans.get(head)
        if plan is not None and plan.blob_size == len(blob):
            return plan.decode(blob)
    req = None
    if len(head) > LARGE_JSON_BYTES:
        req = read_large_request(head, {t.name for t in model_inputs if t.datatype.startswith("FP")})
    if req is None:
        try:
            req = orjson.loads(head)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"request body is not valid JSON ({exc})",
                             f"send a JSON object, or set {HEADER_LENGTH} when binary tensors follow") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list):
        raise BadRequest('request has no "inputs" list', 'send {"inputs": [{"name", "shape", "datatype", "data"}]}')
    req_id = req.get("id")
    if req_id is not None and (isinstance(req_id, bool) or not isinstance(req_id, (str, int))):
        raise BadRequest(f"id is {json_kind(req_id)}, not a string", 'send the request id as a string, e.g. "id": "42"')
    by_name = {t.name: t for t in model_inputs}
    inputs: dict[str, np.ndarray] = {}
    binary: list[_BinaryInput | None] = []  # None: a BYTES input
    offset = 0
    for i, item in enumerate(req["inputs"]):
        where = f"inputs[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} is {json_kind(item)}, not an object", 'send each input as {"name", "shape", "datatype", "data"}')
        name = item.get("name")
        if not isinstance(name, str):
            raise BadRequest(f"{where}.name is {json_kind(name)}, not a string", 'give every input its "name" as a string')
        meta, dtype, shape, count = check_input(name, item.get("datatype"), item.get("shape"), by_name, model_inputs,
                                                inputs, SIGNATURE_AT, max_elements)
        datatype = meta.datatype
        where = f"input {name!r}"
        params = _object(item.get("parameters"), f"{where}.parameters")
        if "binary_data_size" in params and dtype == np.object_:  # BYTES: a length before each element
            size = params["binary_data_size"]
            if not isinstance(size, int) or isinstance(size, bool) or not 4 * count <= size <= len(blob) - offset:
                raise BadRequest(f"{where}: binary_data_size is {size!r}, but the body has {len(blob) - offset} "
                                 f"binary bytes left and {count} BYTES element(s) need at least {4 * count}",
                                 "send each element as a 4-byte little-endian length and its bytes, and set "
                                 "binary_data_size to their total")
            arr = _binary_text(blob[offset:offset + size], count, shape, where)
            offset += size
            binary.append(None)  # not cacheable as a RequestPlan: element sizes vary
        elif "binary_data_size" in params:
            size = params["binary_data_size"]
            want = count * dtype.itemsize
            if not isinstance(size, int) or isinstance(size, bool) or size != want:
                raise BadRequest(f"{where}: binary_data_size is {size!r} but shape {shape} of {datatype} needs {want} bytes",
                                 "send exactly shape × element size bytes")
            if offset + size > len(blob):
                raise BadRequest(f"{where}: the body ends before its {size} binary bytes",
                                 "append every binary input after the JSON header, in input order")
            # a view of the body (it lives as long as the request); a copy only to swap the byte order
            arr = np.frombuffer(blob[offset:offset + size], dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)
            binary.append(_BinaryInput(name, dtype.newbyteorder("<"), dtype, tuple(shape), offset, size))
            offset += size
        else:
            if "data" not in item:
                raise BadRequest(f"{where} has neither data nor binary_data_size",
                                 'add "data" (flat or nested list) or send it binary')
            arr = (_json_text(item["data"], where) if dtype == np.object_
                   else _json_tensor(item["data"], dtype, where, datatype))
            if arr.size != count:
                raise BadRequest(f"{where}: {arr.size} values do not fill shape {shape} ({count} values)",
                                 "send as many values as the shape holds")
        inputs[name] = arr.reshape(shape)
    if offset != len(blob):
        raise BadRequest(f"the body has {len(blob) - offset} binary bytes that no input claims",
                         "set binary_data_size on every binary input")
    check_all_given(inputs, model_inputs)
    params = _object(req.get("parameters"), "parameters")
    binary_default = _flag(params, "binary_data_output", "parameters", False)
    outputs = None
    if req.get("outputs") is not None:
        if not isinstance(req["outputs"], list):
            raise BadRequest(f"outputs is {json_kind(req['outputs'])}, not a list", 'send "outputs": [{"name": ...}]')
        known = {t.name for t in model_outputs}
        outputs = []
        for i, out in enumerate(req["outputs"]):
            if not isinstance(out, dict):
                raise BadRequest(f"outputs[{i}] is {json_kind(out)}, not an object", 'ask for an output as {"name": ...}')
            oname = check_output(i, out.get("name"), known, model_outputs, SIGNATURE_AT)
            oparams = _object(out.get("parameters"), f"outputs[{i}].parameters")
            outputs.append((oname, _flag(oparams, "binary_data", f"outputs[{i}].parameters", binary_default)))
    if plans is not None and req_id is None and len(binary) == len(inputs) and None not in binary:
        if len(plans) >= PLAN_CACHE_SIZE:
            plans.clear()
        plans[bytes(head)] = RequestPlan(tuple(binary), len(blob), outputs, binary_default)
    return DecodedRequest(id=str(req_id) if req_id is not None else None, inputs=inputs,
                          outputs=outputs, binary_default=binary_default)


def _json_data(arr: np.ndarray) -> Any:
    """A tensor's values for a JSON `data` list; orjson writes numpy arrays itself (no Python list)."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    if flat.dtype.kind in "OSU":
        return text_values(flat)  # BYTES: strings (a bytes element decoded; binary_data carries it exactly)
    if flat.dtype.byteorder == ">" or flat.dtype.kind not in "biuf":
        return flat.tolist()
    return flat


def encode_response(model_name: str, decoded: DecodedRequest, outputs: dict[str, np.ndarray],
                    model_outputs: list[TensorInfo], heads: dict[tuple, bytes] | None = None) -> tuple[bytes, dict[str, str]]:
    """Build the v2 response body and headers (binary extension when any output goes binary).

    `heads` caches the JSON headers of all-binary responses (see `v2wire.binary_body`); it belongs to one
    model signature.
    """
    wanted = decoded.wanted(model_outputs)
    types = {t.name: t.datatype for t in model_outputs}
    if wanted and all(binary for _, binary in wanted):
        arrays = [np.asarray(outputs[name]) for name, _ in wanted]
        head, blobs = binary_body(model_name, decoded.id, [(name, types.get(name) or numpy_to_v2(a.dtype), a)
                                                           for (name, _), a in zip(wanted, arrays)], heads)
        return head + b"".join(blobs), {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(head))}
    items, blobs = [], []
    for name, binary in wanted:
        arr = np.asarray(outputs[name])
        entry: dict[str, Any] = {"name": name, "datatype": types.get(name) or numpy_to_v2(arr.dtype),
                                 "shape": list(arr.shape)}
        if binary:
            raw = le_bytes(arr)
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = _json_data(arr)
        items.append(entry)
    resp: dict[str, Any] = {"model_name": model_name, "model_version": "1", "outputs": items}
    if decoded.id is not None:
        resp["id"] = decoded.id
    head = orjson.dumps(resp, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return head, {"content-type": "application/json"}
    return head + b"".join(blobs), {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(head))}

