"""The online front door: Open Inference Protocol (KServe v2) REST over the dynamic batcher.

Endpoints: GET /v2, /v2/health/live, /v2/health/ready, /v2/models/{name}[/versions/{v}],
/v2/models/{name}[/versions/{v}]/ready, POST /v2/models/{name}[/versions/{v}]/infer, and Triton's
GET /v2/models/{name}[/versions/{v}]/config (model_config.py) and /v2/models[/{name}[/versions/{v}]]/stats
(model_stats.py).
Infer takes JSON tensors and the binary tensor data extension: when the request has the header
`Inference-Header-Content-Length: N`, the first N body bytes are the JSON header and the raw tensors
follow, in input order, for every input with `parameters.binary_data_size`. Outputs go back binary
when the requested output says `parameters.binary_data: true`, or the request says
`parameters.binary_data_output: true`; the response then carries the same header.
BYTES (string) tensors come as JSON strings in `data`, or binary in Triton's layout (each element a 4-byte
little-endian length and its bytes, `binary_data_size` their total); elements must be UTF-8 text (the runtime
holds strings). Outputs go back the same two ways.
An infer request whose outputs all go binary and that runs in a batch of its own is answered by its
instance on the client's socket (reply-through, see `V2App.handle` and `v2wire`); the rest by this process.
Errors are `{"error": "message"}`: 400 bad input (the message names the field), 404 unknown model or
path, 405 wrong method, 408 headers or body too slow, 413 request too large, 414 URL too long, 431 headers
too large, 500 a model fault (its answer could not be handed back), 503 overloaded / not ready / too many connections or buffered bodies. Every infer response carries a W3C `Server-Timing`
header: queue wait, backend compute and the whole time in the job (ms).

The HTTP/1.1 layer is a small asyncio protocol over httptools (the C parser uvicorn uses), not an
ASGI stack: uvicorn + FastAPI cost about 1.6 ms of CPU per request on the job's core, which is more than
the whole ≤ 1 ms overhead budget of the front door (bench/RESULTS.md). It keeps connections alive,
answers pipelined requests in order, takes chunked bodies and `Expect: 100-continue`, and refuses a
body over the size limit with 413.

Hostile clients are bounded (DoorLimits, set from the agent config's `inference:` section through the job
spec): header, body, idle and send timeouts, a connection cap, URL and header size limits, pipelining
bounded by count and bytes, a cap on request bytes held by all connections, and back-pressure on a client
that does not read its answers. JSON is parsed and written with orjson, off the event loop above a size; a
large body is read with simdjson, whose flat float `data` lists go into numpy without a Python float per value
(`json_body`), with the same arrays and messages as the general path.
A malformed request is a 4xx whose message names the field, logged in one line (rate-limited).
"""
from __future__ import annotations

import asyncio
import math
import os
import socket
import sys
import time
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from typing import Any
from urllib.parse import unquote

import httptools
import numpy as np
import orjson

from reamer.host.errors import ReamerError
from reamer.serve.runtime.batcher import DynamicBatcher, ModelFault, NotReady, Overloaded, RequestTiming
from reamer.serve.protocol.json_body import FloatData, read_large_request
from reamer.serve.protocol.model_config import model_config
from reamer.serve.protocol.tensors import (BadBytesTensor, TensorInfo, UnsupportedDatatype, numpy_to_v2, split_length_prefixed,
                                   text_tensor, text_values, v2_to_numpy)
from reamer.serve.protocol.v2wire import (HEADER_LENGTH, SERVER_NAME, SERVER_VERSION, ReplyPlan, binary_body, http_head,
                                  le_bytes, server_timing)
from reamer.serve.runtime.worker import InferenceFailed, Replied, ReplyBroken, WorkerError

DEFAULT_MAX_REQUEST_BYTES = 64 << 20


class BadRequest(ReamerError):
    """The client sent a request the model cannot take (400)."""


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


def describe_tensors(tensors: list[TensorInfo]) -> str:
    return ", ".join(f"{t.name} ({t.datatype} {list(t.shape)})" for t in tensors)


def _kind(value: Any) -> str:
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


def _object(value: Any, where: str) -> dict:
    """`value` when it is a JSON object or absent (null), else a 400 naming the field."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{where} is {_kind(value)}, not an object", f'send {where} as {{"key": value}}, or leave it out')
    return value


def _flag(params: dict, key: str, where: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{where}.{key} is {_kind(value)}, not a boolean", f"send {key} as true or false")
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
        raise BadRequest(f"{where}.data is {_kind(data)}, not a list", fix)
    try:
        flat = np.array(data, dtype=object).reshape(-1)
    except ValueError:
        raise BadRequest(f"{where}.data holds nested lists of uneven length", fix) from None
    for value in flat.tolist():
        if not isinstance(value, str):  # a number, or a list where uneven nesting left one
            raise BadRequest(f"{where}.data holds {_kind(value)} where a string belongs", fix)
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
        raise BadRequest(f"id is {_kind(req_id)}, not a string", 'send the request id as a string, e.g. "id": "42"')
    by_name = {t.name: t for t in model_inputs}
    inputs: dict[str, np.ndarray] = {}
    binary: list[_BinaryInput | None] = []  # None: a BYTES input
    offset = 0
    for i, item in enumerate(req["inputs"]):
        where = f"inputs[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} is {_kind(item)}, not an object", 'send each input as {"name", "shape", "datatype", "data"}')
        name = item.get("name")
        if not isinstance(name, str):
            raise BadRequest(f"{where}.name is {_kind(name)}, not a string", 'give every input its "name" as a string')
        meta = by_name.get(name)
        if meta is None:
            raise BadRequest(f"unknown input {name!r}; the model expects inputs: {describe_tensors(model_inputs)}",
                             "use the input names from GET /v2/models/<name>")
        if name in inputs:
            raise BadRequest(f"input {name!r} is given twice", "send each input once")
        where = f"input {name!r}"
        datatype = item.get("datatype")
        if not isinstance(datatype, str) or datatype.upper() != meta.datatype:
            got = repr(datatype) if isinstance(datatype, str) else _kind(datatype)
            raise BadRequest(f"{where} has datatype {got} but the model expects {meta.datatype}",
                             f"send {name} as {meta.datatype}")
        datatype = meta.datatype
        shape = item.get("shape")
        if (not isinstance(shape, list) or any(not isinstance(d, int) or isinstance(d, bool) for d in shape)
                or not meta.accepts_shape(shape)):
            raise BadRequest(f"{where} has shape {shape if isinstance(shape, list) else _kind(shape)} but the model "
                             f"expects {list(meta.shape)} (-1 = any size)",
                             f"reshape {name} to match; the first axis is the batch")
        try:
            dtype = v2_to_numpy(datatype)
        except UnsupportedDatatype as exc:
            raise BadRequest(exc.message, exc.fix) from None
        count = math.prod(shape)
        if max_elements is not None and (count > max_elements or any(d > max_elements for d in shape)):
            raise BadRequest(f"{where} has shape {shape}, {count} values: more than this job takes in one request "
                             f"({max_elements} values, its max_request_mb)",
                             "send fewer or smaller samples per request, or raise the job's max_request_mb")
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
    missing = [t.name for t in model_inputs if t.name not in inputs]
    if missing:
        raise BadRequest(f"missing input(s) {missing}; the model expects inputs: {describe_tensors(model_inputs)}",
                         "send every model input")
    # the batch size's agreement is the batcher's to check: only a batchable model's first dims are its batch
    params = _object(req.get("parameters"), "parameters")
    binary_default = _flag(params, "binary_data_output", "parameters", False)
    outputs = None
    if req.get("outputs") is not None:
        if not isinstance(req["outputs"], list):
            raise BadRequest(f"outputs is {_kind(req['outputs'])}, not a list", 'send "outputs": [{"name": ...}]')
        known = {t.name for t in model_outputs}
        outputs = []
        for i, out in enumerate(req["outputs"]):
            if not isinstance(out, dict):
                raise BadRequest(f"outputs[{i}] is {_kind(out)}, not an object", 'ask for an output as {"name": ...}')
            oname = out.get("name")
            if not isinstance(oname, str) or oname not in known:
                what = repr(oname) if isinstance(oname, str) else _kind(oname)
                raise BadRequest(f"unknown output {what} in outputs[{i}].name; the model has outputs: "
                                 f"{describe_tensors(model_outputs)}", "ask only for outputs from GET /v2/models/<name>")
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


@dataclass
class Reply:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    sent: bool = False  # an instance answered the client on its socket; `body` is the unsent rest
    close: bool = False  # close the connection without writing (an instance's answer was cut off)


@dataclass(frozen=True)
class ClientSocket:
    """The connection a request came on, when an instance may answer on it directly."""

    fd: int
    keep_alive: bool


def _json(status: int, doc: Any) -> Reply:
    return Reply(status, orjson.dumps(doc))


def _error(status: int, message: str, **headers: str) -> Reply:
    return Reply(status, orjson.dumps({"error": message}), headers=headers)


@dataclass(frozen=True)
class DoorLimits:
    """What one client may cost the job. Defaults follow nginx's (client_header_timeout,
    client_body_timeout, keepalive_timeout, send_timeout, large_client_header_buffers)."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a larger body: 413
    max_connections: int = 1024  # more: 503 and closed at once
    header_timeout_s: float = 60.0  # the request line and headers must arrive within this: else 408
    body_timeout_s: float = 60.0  # between two reads of a body: else 408
    idle_timeout_s: float = 75.0  # a keep-alive connection with nothing to do is closed after this
    send_timeout_s: float = 60.0  # a client that takes none of its answer for this long is cut off
    max_url_bytes: int = 8192  # longer: 414
    max_header_bytes: int = 32768  # header section larger: 431
    max_pipelined: int = 16  # unanswered requests queued per connection before reading pauses
    # (also by bytes: reading pauses while the queued bodies of one connection hold more than this)
    max_pipelined_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_buffered_bytes: int = 4 * DEFAULT_MAX_REQUEST_BYTES  # bodies held by all connections: past it, 503
    write_high_water: int = 1 << 20  # unsent answer bytes over which a connection's next request waits
    offload_bytes: int = 1 << 16  # JSON bodies (and JSON answers) larger than this are coded off the loop
    # after a refusal, what the client still sends is read and dropped this long before the connection is
    # closed, so the refusal reaches it (closing with unread input sends a reset that can destroy it)
    linger_s: float = 5.0

    @property
    def buffered_budget(self) -> int:
        return max(self.max_buffered_bytes, self.max_request_bytes)

    # config keys (agent config `inference.frontdoor`, job spec `frontdoor`) whose unit differs from a field's
    _SCALED = {"max_buffered_mb": ("max_buffered_bytes", 1 << 20), "json_offload_kb": ("offload_bytes", 1 << 10)}

    @classmethod
    def from_settings(cls, max_request_mb: float, settings: dict[str, Any]) -> "DoorLimits":
        """The limits of a job spec: its max_request_mb and its `frontdoor` section (config key names)."""
        request = int(max_request_mb * 2**20)
        values: dict[str, Any] = {"max_request_bytes": request, "max_pipelined_bytes": request}
        known = {f.name for f in fields(cls)}
        for key, value in settings.items():
            name, scale = cls._SCALED.get(key, (key, None))
            if name not in known or name in ("max_request_bytes", "max_pipelined_bytes"):
                raise ReamerError(f"job spec frontdoor has unknown key {key!r}",
                                  "use the keys of the agent config's inference.frontdoor section")
            values[name] = int(value * scale) if scale else value
        return cls(**values)


class ClientErrorLog:
    """One line per refused request on stderr (job.log), at most `burst` lines per `window_s`; the rest
    are counted and reported in one line, so a hostile client cannot fill the log."""

    def __init__(self, burst: int = 100, window_s: float = 10.0) -> None:
        self.burst, self.window_s = burst, window_s
        self._window_start = 0.0
        self._lines = 0
        self._suppressed = 0

    def __call__(self, line: str) -> None:
        now = time.monotonic()
        if now - self._window_start >= self.window_s:
            if self._suppressed:
                print(f"reamer job: {self._suppressed} more refused requests not logged "
                      f"(over {self.burst} per {self.window_s:g} s)", file=sys.stderr, flush=True)
            self._window_start, self._lines, self._suppressed = now, 0, 0
        if self._lines >= self.burst:
            self._suppressed += 1
            return
        self._lines += 1
        print(f"reamer job: {line}", file=sys.stderr, flush=True)


class V2App:
    """The v2 endpoints of one model served by `batcher`: (method, path, headers, body) -> Reply."""

    def __init__(self, model_name: str, batcher: DynamicBatcher, platform: str = "onnxruntime_onnx",
                 limits: DoorLimits | None = None) -> None:
        self.model_name = model_name
        self.batcher = batcher
        self.platform = platform
        self.limits = limits or DoorLimits()
        self._plans: dict[bytes, RequestPlan] = {}
        self._heads: dict[tuple, bytes] = {}
        self._plans_for: object = None  # the signature the cached plans and heads were made for
        self._coder: ThreadPoolExecutor | None = None  # large JSON is decoded and encoded here

    async def _off_loop(self, fn, *args):
        if self._coder is None:
            self._coder = ThreadPoolExecutor(max_workers=2, thread_name_prefix="json")
        return await asyncio.get_running_loop().run_in_executor(self._coder, fn, *args)

    def close(self) -> None:
        if self._coder is not None:
            self._coder.shutdown(wait=False)

    async def handle(self, method: str, path: str, headers: dict[str, str], body: bytes,
                     client: ClientSocket | None = None) -> Reply:
        """Answer one request. With `client`, an infer request whose outputs all go binary and that runs in
        a batch of its own is answered by the instance on the client's socket (reply-through): the answer
        then leaves from the core where the model ran, without a hop back through this process."""
        parts = [p for p in path.split("?", 1)[0].split("/") if p]
        if parts[:1] != ["v2"]:
            return _error(404, f"no endpoint {path}; this server speaks the Open Inference Protocol under /v2")
        route, name = parts[1:], None
        if route == ["models", "stats"]:  # Triton's statistics of every model (this one)
            route = ["models", "stats"]
        elif route[:1] == ["models"] and len(route) >= 2:
            name, rest = unquote(route[1]), route[2:]
            if rest[:1] == ["versions"] and len(rest) >= 2:
                rest = rest[2:]
            route = ["models", *rest]
        want = "POST" if route == ["models", "infer"] else "GET"
        if route not in (["health", "live"], ["health", "ready"], [], ["models"], ["models", "ready"],
                         ["models", "infer"], ["models", "config"], ["models", "stats"]):
            return _error(404, f"no endpoint {path}; see GET /v2/models/{self.model_name} for this model")
        if method != want:
            return _error(405, f"{path} takes {want}, not {method}", allow=want)
        if name is not None and name != self.model_name:
            return _error(404, f"unknown model {name!r}; this endpoint serves {self.model_name!r}")
        if route == ["health", "live"]:
            return _json(200, {"live": True})
        if route == ["health", "ready"]:
            if self.batcher.all_ready():
                return _json(200, {"ready": True})
            return _error(503, self.batcher.not_ready_reason())
        if not route:
            return _json(200, {"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": ["binary_tensor_data", "model_configuration", "statistics"]})
        if route == ["models", "ready"]:
            if self.batcher.all_ready():
                return _json(200, {"name": name, "ready": True})
            return _error(503, f"model {name!r} is not ready: {self.batcher.not_ready_reason()}")
        if route == ["models", "stats"]:  # Triton's statistics extension
            return _json(200, {"model_stats": [self.batcher.model_stats.to_doc(self.model_name)]})
        if route == ["models", "config"]:  # Triton's model configuration (model_config.py)
            config = model_config(self.model_name, self.platform, self.batcher, self.limits.max_request_bytes)
            if config is None:
                return _error(503, f"model {name!r} is still loading; retry in a few seconds")
            return _json(200, config)
        sig = self.batcher.signature()
        if sig is None:
            return _error(503, f"model {name!r} is still loading; retry in a few seconds")
        if route == ["models"]:
            ins, outs = sig
            return _json(200, {"name": self.model_name, "versions": ["1"], "platform": self.platform,
                               "inputs": [t.to_dict() for t in ins], "outputs": [t.to_dict() for t in outs]})
        return await self._infer(headers, body, sig, client)

    async def _infer(self, headers: dict[str, str], body: bytes,
                     sig: tuple[list[TensorInfo], list[TensorInfo]], client: ClientSocket | None) -> Reply:
        started = time.perf_counter()
        raw_len = headers.get(HEADER_LENGTH.lower())
        header_length = None
        if raw_len is not None:
            if not raw_len.strip().isdigit():
                return _error(400, f"{HEADER_LENGTH} {raw_len!r} is not a number of bytes")
            header_length = int(raw_len)
        if self._plans_for != sig:  # a restarted instance may bring another model
            self._plans, self._heads, self._plans_for = {}, {}, sig
        json_bytes = len(body) if header_length is None else header_length
        try:
            # the largest input is bounded by the body limit: one byte per value at the least
            args = (body, header_length, *sig, self._plans, self.limits.max_request_bytes)
            if json_bytes > self.limits.offload_bytes:
                decoded = await self._off_loop(decode_request, *args)
            else:
                decoded = decode_request(*args)
        except BadRequest as exc:
            return _error(400, str(exc))
        timing = RequestTiming()
        reply_to = None
        if client is not None:
            wanted = decoded.wanted(sig[1])
            types = {t.name: t.datatype for t in sig[1]}
            if wanted and all(binary and types[name] != "BYTES" for name, binary in wanted):
                # A duplicate, so the socket outlives a client that hangs up while the request waits: the
                # connection's own descriptor number could by then name another client's connection.
                reply_to = (os.dup(client.fd), ReplyPlan(self.model_name, decoded.id,
                                                         [(n, types[n]) for n, _ in wanted], client.keep_alive,
                                                         started))
        try:
            outputs = await self.batcher.infer(decoded.inputs, timing, reply_to)
        except ReplyBroken as exc:
            print(f"reamer job: {exc}", file=sys.stderr)
            return Reply(200, b"", sent=True, close=True)
        except InferenceFailed as exc:  # the runtime refused these inputs: the client's to fix
            return _error(400, str(exc))
        except ModelFault as exc:  # the model's answer could not be handed back: not the client's fault
            return _error(500, str(exc))
        except (Overloaded, NotReady, WorkerError) as exc:
            return _error(503, str(exc))
        finally:
            if reply_to is not None:
                os.close(reply_to[0])
        if isinstance(outputs, Replied):
            return Reply(200, outputs.tail, sent=True)  # the job sends what the client's socket did not take
        args = (self.model_name, decoded, outputs, sig[1], self._heads)
        if (not all(binary for _, binary in decoded.wanted(sig[1]))
                and sum(np.asarray(a).nbytes for a in outputs.values()) > self.limits.offload_bytes):
            content, out_headers = await self._off_loop(encode_response, *args)
        else:
            content, out_headers = encode_response(*args)
        out_headers["server-timing"] = server_timing(timing.queue_s, timing.compute_s, time.perf_counter() - started)
        return Reply(200, content, out_headers.pop("content-type"), out_headers)


@dataclass
class _Incoming:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes | bytearray  # a bytearray when read straight into its buffer
    keep_alive: bool
    refused: Reply | None = None  # answered without running the app (bad request, too large)
    held: int = 0  # body bytes counted against the connection's and the door's budgets


_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_IDLE, _HEAD, _BODY = 0, 1, 2  # where the parser is in the next message
READ_BYTES = 1 << 16  # what one read takes while parsing (headers, small bodies, the start of a large one)


class _Connection(asyncio.BufferedProtocol):
    """One HTTP/1.1 client connection: parse with httptools, answer requests in arrival order.

    Bounded for hostile clients: headers, bodies and idle keep-alive time are timed (FrontDoor's sweep
    checks the deadlines), URL and header sizes are capped, reading pauses while queued requests hold too
    many requests or bytes, and the next request waits while the client has not taken its answers.

    A large body (more than READ_BYTES still to come after the read that ended its headers, a
    Content-Length and no Transfer-Encoding) is read by the kernel straight into one buffer of its size
    (`_direct`) instead of going through the parser's chunks and a join: three user-space copies of every
    image less. The buffer's unreceived part is reserved against the job's buffered-bytes budget when it is
    allocated, so such reservations may hold at most half that budget: past it, bodies stream through the
    parser and count as they arrive, and headers alone cannot take the budget from clients that send.
    The body's stall clock still runs, so a reservation whose bytes do not come is cut off."""

    def __init__(self, door: "FrontDoor") -> None:
        self.door = door
        self.limits = door.limits
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.fd: int | None = None  # the TCP socket, for instances that answer on it directly
        self.peer = "?"
        self.pending: deque[_Incoming] = deque()
        self._owe_continue = False  # a `100 Continue` held back while an earlier request is answered
        self.busy = False
        self._task: asyncio.Task | None = None
        self._paused = False  # reading paused by us (queue full), so the client's clocks stop
        self._broken = False  # stop parsing: the connection closes after the queued answers
        self.held = 0  # body bytes of this connection's queued and partial requests
        self._write_paused = False
        self._drained: asyncio.Future | None = None
        now = time.monotonic()
        self._state, self._since = _IDLE, now  # parser state and when its clock started
        self._unsent, self._unsent_since = 0, now  # write buffer size at the last sweep, and since when stuck
        self._partial = 0  # bytes of the body being received
        self._lingering_since: float | None = None  # refused: input is dropped until the client closes
        self._scratch = bytearray(READ_BYTES)
        self._direct: bytearray | None = None  # a large body being read straight into its buffer
        self._filled = 0  # bytes of it received
        self._new_message()

    def _new_message(self) -> None:
        self._release(self._partial)
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._size = 0
        self._partial = 0
        self._too_large = False
        self._direct = None

    def _release(self, nbytes: int) -> None:
        self.held -= nbytes
        self.door.buffered -= nbytes

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer = f"{peer[0]}:{peer[1]}"
        if len(self.door.connections) >= self.limits.max_connections:
            self._broken = True
            self.door.log(f"connection from {self.peer} refused: {len(self.door.connections)} connections open, "
                          f"the job's max_connections")
            reply = _error(503, f"this job already has {self.limits.max_connections} open connections "
                                "(its max_connections); retry shortly, or reuse a keep-alive connection",
                           **{"retry-after": "1"})
            transport.write(http_head(503, reply.content_type, len(reply.body), reply.headers, False) + reply.body)
            self._linger()
            asyncio.get_running_loop().call_later(self.limits.linger_s, transport.abort)
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Nagle would hold the body of a response until the client acknowledged its head: up to
            # 40 ms per request with a client in delayed-ACK mode.
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            self.fd = sock.fileno()
        transport.set_write_buffer_limits(high=self.limits.write_high_water)  # type: ignore[attr-defined]
        self.door.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self in self.door.connections:
            self.door.connections.discard(self)
            self.door.buffered -= self.held  # what the queued and partial requests held
            self.held = 0
            self._partial = 0
            for incoming in self.pending:
                incoming.held = 0
        self._wake_writer()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writer()

    def _wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        if self._direct is not None:
            return memoryview(self._direct)[self._filled:]  # exactly what is left: a pipelined request waits
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._direct is not None:
            self._filled += nbytes
            self._since = time.monotonic()
            if self._filled == len(self._direct):
                body, self._direct = self._direct, None
                keep_alive, method = self.parser.should_keep_alive(), self.parser.get_method()
                self.parser = httptools.HttpRequestParser(self)  # the old one still waits for this body
                self._complete(method, body, keep_alive)
            return
        if self._broken:
            return
        try:
            self.parser.feed_data(memoryview(self._scratch)[:nbytes])
        except httptools.HttpParserUpgrade:
            self._refuse(_error(400, "protocol upgrades are not supported", connection="close"))
            return
        except httptools.HttpParserError as exc:
            self._refuse(_error(400, f"malformed HTTP request ({exc})", connection="close"))
            return
        if self._state == _BODY and not self._broken and not self._too_large:
            self._read_direct()

    def _read_direct(self) -> None:
        """Read the rest of a large body straight into a buffer of its size, if the budget allows."""
        length = self._headers.get("content-length", "")
        if not length.isdigit() or "transfer-encoding" in self._headers:
            return
        total = int(length)
        left = total - self._size
        if left <= READ_BYTES or self.door.buffered + left > self.limits.buffered_budget // 2:
            return
        body = bytearray(total)
        at = 0
        for chunk in self._body:
            body[at:at + len(chunk)] = chunk
            at += len(chunk)
        self._body, self._direct, self._filled = [], body, at
        self._partial += left
        self.held += left
        self.door.buffered += left
        self._update_reading()

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        if self._broken:
            return
        self._new_message()
        self._state, self._since = _HEAD, time.monotonic()

    def on_url(self, url: bytes) -> None:
        if self._broken:
            return
        self._url += url
        if len(self._url) > self.limits.max_url_bytes:
            self._refuse(_error(414, f"the URL is over {self.limits.max_url_bytes} bytes (the job's max_url_bytes); "
                                     "put data in the request body", connection="close"))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._broken:
            return
        self._header_bytes += len(name) + len(value) + 4
        if self._header_bytes > self.limits.max_header_bytes:
            self._refuse(_error(431, f"the request headers are over {self.limits.max_header_bytes} bytes "
                                     "(the job's max_header_bytes); send fewer or shorter headers",
                                connection="close"))
            return
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self._broken:
            return
        self._state, self._since = _BODY, time.monotonic()
        length = self._headers.get("content-length", "")
        if length.isdigit() and int(length) > self.door.max_request_bytes:
            self._too_large = True
            if self._headers.get("expect", "").lower() == "100-continue":
                self._refuse(self._too_large_reply())  # the client waits: it never sends the body
        elif self._headers.get("expect", "").lower() == "100-continue" and self.transport is not None:
            if self.busy or self.pending:  # after the answers due before it (an instance may be writing one)
                self._owe_continue = True
            else:
                self.transport.write(_CONTINUE)

    def on_body(self, chunk: bytes) -> None:
        if self._broken:
            return
        self._since = time.monotonic()
        self._size += len(chunk)
        if self._size > self.door.max_request_bytes and not self._too_large:
            self._too_large, self._body = True, []
            self._release(self._partial)
            self._partial = 0
        if self._too_large:
            return
        if self.door.buffered + len(chunk) > self.limits.buffered_budget:
            self.door.log(f"request from {self.peer} refused: the job holds {self.door.buffered} bytes of request "
                          "bodies, its max_buffered_mb")
            self._refuse(_error(503, "this job is receiving too many request bodies at once (its max_buffered_mb); "
                                     "retry shortly", connection="close", **{"retry-after": "1"}))
            return
        self._body.append(chunk)
        self._partial += len(chunk)
        self.held += len(chunk)
        self.door.buffered += len(chunk)
        self._update_reading()

    def on_message_complete(self) -> None:
        if self._broken:
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._complete(self.parser.get_method(), body, self.parser.should_keep_alive())

    def _complete(self, method: bytes, body: bytes | bytearray, keep_alive: bool) -> None:
        incoming = _Incoming(method.decode("latin-1"), self._url.decode("latin-1"), self._headers, body, keep_alive,
                             self._too_large_reply() if self._too_large else None, held=self._partial)
        self._partial = 0  # now held by the queued request
        self._new_message()
        self._state, self._since = _IDLE, time.monotonic()
        self._queue(incoming)

    # -- flow control
    def _update_reading(self) -> None:
        """Pause reading while queued requests hold too many requests or bytes; resume below half."""
        if self.transport is None:
            return
        queued = len(self.pending)
        if not self._paused:
            if queued >= self.limits.max_pipelined or (queued and self.held >= self.limits.max_pipelined_bytes):
                self._paused = True
                self.transport.pause_reading()
        elif queued < max(1, self.limits.max_pipelined // 2) and (
                not queued or self.held < self.limits.max_pipelined_bytes // 2):
            self._paused = False
            self._since = time.monotonic()  # the client could not send while we did not read
            self.transport.resume_reading()

    def expired(self, now: float) -> None:
        """Close the connection when a client's clock ran out (called by FrontDoor's sweep)."""
        t = self.transport
        if t is None:
            return
        unsent = t.get_write_buffer_size()
        if unsent == 0 or unsent < self._unsent:
            self._unsent_since = now
        self._unsent = unsent
        if self._lingering_since is not None and now - self._lingering_since > self.limits.linger_s:
            t.abort()
            return
        if unsent and now - self._unsent_since > self.limits.send_timeout_s:
            self.door.log(f"connection from {self.peer} cut off: it took none of its answer for "
                          f"{self.limits.send_timeout_s:g} s (the job's send_timeout_s)")
            t.abort()
            return
        if self._broken or self._paused:
            return
        if self._state == _HEAD and now - self._since > self.limits.header_timeout_s:
            self._refuse(_error(408, f"the request headers did not arrive within {self.limits.header_timeout_s:g} s "
                                     "(the job's header_timeout_s)", connection="close"))
        elif self._state == _BODY and not self._owe_continue and now - self._since > self.limits.body_timeout_s:
            self._refuse(_error(408, f"the request body stalled for {self.limits.body_timeout_s:g} s "
                                     "(the job's body_timeout_s)", connection="close"))
        elif (self._state == _IDLE and not self.busy and not self.pending
              and now - self._since > self.limits.idle_timeout_s):
            if unsent:
                t.abort()
            else:
                t.close()

    # -- answering
    def _too_large_reply(self) -> Reply:
        limit = self.door.max_request_bytes
        return _error(413, f"request body is over this job's limit of {limit} bytes ({limit / 2**20:g} MiB); "
                           "send fewer samples per request, or raise the job's max_request_mb")

    def _refuse(self, reply: Reply) -> None:
        self._broken = True
        self._new_message()  # a partial body is dropped
        if self.transport is not None and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        self._queue(_Incoming("", "", {}, b"", keep_alive=False, refused=reply))

    def _queue(self, incoming: _Incoming) -> None:
        self.pending.append(incoming)
        self._update_reading()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._answer_all())

    async def _answer_all(self) -> None:
        while self.pending:
            while self._write_paused and self.transport is not None:
                # the client has not taken its earlier answers: the next one waits (FrontDoor's sweep
                # cuts off a client that takes nothing for send_timeout_s)
                self._drained = asyncio.get_running_loop().create_future()
                await self._drained
            if self.transport is None:
                return  # the client went away; connection_lost released what its requests held
            incoming = self.pending.popleft()
            self.busy = True
            keep_alive = incoming.keep_alive and not self.door.stopping
            client = None
            if self.fd is not None and self.transport is not None and not self.transport.get_write_buffer_size():
                client = ClientSocket(self.fd, keep_alive)
            try:
                reply = incoming.refused or await self.door.app.handle(
                    incoming.method, incoming.path, incoming.headers, incoming.body, client)
            except Exception as exc:  # noqa: BLE001 - one bad request must not take the connection down
                self.door.log(f"internal error on {incoming.method} {incoming.path} from {self.peer}: "
                              f"{type(exc).__name__}: {exc}", trace=True)
                reply = _error(500, f"internal error while serving {incoming.path}: {exc}")
            finally:
                self.busy = False
                if self.transport is not None:
                    self._release(incoming.held)
                incoming.held, incoming.body = 0, b""
                if self._state == _IDLE:  # the idle clock starts when the answer is done
                    self._since = time.monotonic()
                self._update_reading()
            if 400 <= reply.status < 500 and self.transport is not None:
                message = orjson.loads(reply.body).get("error", "") if reply.body else ""
                where = f"{incoming.method} {incoming.path} " if incoming.method else ""
                self.door.log(f"{reply.status} {where}from {self.peer}: {message}")
            keep_alive = incoming.keep_alive and not self.door.stopping
            if self.transport is None:
                return  # the client went away; its answer has nowhere to go
            if reply.close:
                self.transport.close()
                return
            if not reply.sent:
                self._write(reply, keep_alive)
            elif reply.body:
                self.transport.write(reply.body)
            if self._owe_continue and not self.pending:
                self._owe_continue = False
                self._since = time.monotonic()  # the body's clock starts when the client is told to send it
                self.transport.write(_CONTINUE)
            if not keep_alive:
                if self._broken:
                    self._linger()
                else:
                    self.transport.close()
                return

    def _linger(self) -> None:
        """Half-close after a refusal and drop the client's input until it closes (FrontDoor's sweep ends
        it after linger_s): a close with unread input would reset the connection and could destroy the
        answer before the client read it (nginx's lingering close)."""
        t = self.transport
        if t is None:
            return
        self._lingering_since = time.monotonic()
        if t.can_write_eof():
            t.write_eof()
        else:
            t.close()
            return
        if self._paused:
            self._paused = False
            t.resume_reading()

    def eof_received(self) -> bool:
        return False  # the client is done sending: close (after what is left to write)

    def _write(self, reply: Reply, keep_alive: bool) -> None:
        head = http_head(reply.status, reply.content_type, len(reply.body), reply.headers, keep_alive)
        assert self.transport is not None
        if len(reply.body) < 65536:
            self.transport.write(head + reply.body)
        else:
            self.transport.writelines([head, reply.body])

    def close_if_idle(self) -> bool:
        if self.transport is not None and not self.busy and not self.pending:
            self.transport.close()
            return True
        return self.transport is None


class FrontDoor:
    """A bound listening socket (so port 0 resolves at once) and the HTTP server of `app` on it."""

    GRACE_S = 10.0  # a stop waits this long for requests in flight

    def __init__(self, app: V2App, host: str, port: int,
                 max_request_bytes: int | None = None, limits: DoorLimits | None = None) -> None:
        limits = limits or app.limits
        if max_request_bytes is not None:
            limits = replace(limits, max_request_bytes=max_request_bytes)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise ReamerError(f"cannot listen on {host}:{port}: {exc.strerror}",
                              "pick a free port, or 0 to let the system choose") from None
        self._sock.listen(1024)
        self.app = app
        app.limits = limits
        self.limits = limits
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self.max_request_bytes = limits.max_request_bytes
        self.connections: set[_Connection] = set()
        self.buffered = 0  # request body bytes held by all connections
        self.log = _DoorLog()
        self.started = False
        self.stopping = False
        self._stop: asyncio.Event | None = None

    async def _sweep(self) -> None:
        """Check every connection's clocks; a few times per the shortest timeout."""
        lim = self.limits
        tick = min(1.0, max(0.05, min(lim.header_timeout_s, lim.body_timeout_s, lim.idle_timeout_s,
                                      lim.send_timeout_s) / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for conn in list(self.connections):
                conn.expired(now)

    async def serve(self) -> None:
        """Serve until request_stop(); then stop accepting, let requests in flight finish, close."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self.stopping:
            self._stop.set()
        try:
            server = await loop.create_server(lambda: _Connection(self), sock=self._sock)
        except BaseException:
            self._sock.close()
            raise
        self.started = True
        sweep = loop.create_task(self._sweep())
        try:
            await self._stop.wait()
        finally:
            server.close()
            deadline = time.monotonic() + self.GRACE_S
            while not all([c.close_if_idle() for c in list(self.connections)]) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            for conn in list(self.connections):
                if conn.transport is not None:
                    conn.transport.abort()
            sweep.cancel()
            self.app.close()

    def request_stop(self) -> None:
        """Stop serving (call from the event loop's thread)."""
        self.stopping = True
        if self._stop is not None:
            self._stop.set()


class _DoorLog(ClientErrorLog):
    def __call__(self, line: str, trace: bool = False) -> None:  # type: ignore[override]
        lines_before = self._lines
        super().__call__(line)
        if trace and self._lines > lines_before:
            traceback.print_exc(file=sys.stderr)
