"""The online front door: Open Inference Protocol (KServe v2) REST over the dynamic batcher.

Endpoints: GET /v2, /v2/health/live, /v2/health/ready, /v2/models/{name}[/versions/{v}],
/v2/models/{name}[/versions/{v}]/ready, POST /v2/models/{name}[/versions/{v}]/infer.
Infer takes JSON tensors and the binary tensor data extension: when the request has the header
`Inference-Header-Content-Length: N`, the first N body bytes are the JSON header and the raw tensors
follow, in input order, for every input with `parameters.binary_data_size`. Outputs go back binary
when the requested output says `parameters.binary_data: true`, or the request says
`parameters.binary_data_output: true`; the response then carries the same header.
An infer request whose outputs all go binary and that runs in a batch of its own is answered by its
instance on the client's socket (reply-through, see `V2App.handle` and `v2wire`); the rest by this process.
Errors are `{"error": "message"}`: 400 bad input, 404 unknown model or path, 405 wrong method,
413 request too large, 503 overloaded / not ready. Every infer response carries a W3C `Server-Timing`
header: queue wait, backend compute and the whole time in the job (ms).

The HTTP/1.1 layer is a small asyncio protocol over httptools (the C parser uvicorn uses), not an
ASGI stack: uvicorn + FastAPI cost about 1.6 ms of CPU per request on the job's core, which is more than
the whole ≤ 1 ms overhead budget of the front door (bench/RESULTS.md). It keeps connections alive,
answers pipelined requests in order, takes chunked bodies and `Expect: 100-continue`, and refuses a
body over the size limit with 413.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import httptools
import numpy as np

from reamer.host.errors import ReamerError
from reamer.serve.batcher import DynamicBatcher, NotReady, Overloaded, RequestTiming
from reamer.serve.tensors import TensorInfo, UnsupportedDatatype, numpy_to_v2, v2_to_numpy
from reamer.serve.v2wire import (HEADER_LENGTH, SERVER_NAME, ReplyPlan, binary_body, http_head, le_bytes,
                                  server_timing)
from reamer.serve.worker import InferenceFailed, Replied, ReplyBroken, WorkerError

SERVER_VERSION = "0.1.0"
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


def _describe(tensors: list[TensorInfo]) -> str:
    return ", ".join(f"{t.name} ({t.datatype} {list(t.shape)})" for t in tensors)


def decode_request(body: bytes, header_length: int | None, model_inputs: list[TensorInfo],
                   model_outputs: list[TensorInfo], plans: dict[bytes, RequestPlan] | None = None) -> DecodedRequest:
    """Parse and validate a v2 infer request (JSON or binary extension) against the model's signature.

    `plans`, when given, caches the checked headers of all-binary requests (see RequestPlan); it
    belongs to one model signature.
    """
    if header_length is not None:
        if header_length < 0 or header_length > len(body):
            raise BadRequest(f"{HEADER_LENGTH} is {header_length} but the body has {len(body)} bytes",
                             "set the header to the byte length of the JSON part")
        head, blob = body[:header_length], memoryview(body)[header_length:]
    else:
        head, blob = body, memoryview(b"")
    if plans is not None:
        plan = plans.get(head)
        if plan is not None and plan.blob_size == len(blob):
            return plan.decode(blob)
    try:
        req = json.loads(head)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON ({exc})",
                         f"send a JSON object, or set {HEADER_LENGTH} when binary tensors follow") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list):
        raise BadRequest('request has no "inputs" list', 'send {"inputs": [{"name", "shape", "datatype", "data"}]}')
    by_name = {t.name: t for t in model_inputs}
    inputs: dict[str, np.ndarray] = {}
    binary: list[_BinaryInput] = []
    offset = 0
    for item in req["inputs"]:
        if not isinstance(item, dict) or "name" not in item:
            raise BadRequest("an input has no name", 'give every input a "name"')
        name = item["name"]
        meta = by_name.get(name)
        if meta is None:
            raise BadRequest(f"unknown input {name!r}; the model expects inputs: {_describe(model_inputs)}",
                             "use the input names from GET /v2/models/<name>")
        if name in inputs:
            raise BadRequest(f"input {name!r} is given twice", "send each input once")
        datatype = str(item.get("datatype", "")).upper()
        if datatype != meta.datatype:
            raise BadRequest(f"input {name!r} has datatype {datatype or 'none'!r} but the model expects {meta.datatype}",
                             f"send {name} as {meta.datatype}")
        shape = item.get("shape")
        if (not isinstance(shape, list) or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape)
                or len(shape) != len(meta.shape)
                or any(m >= 0 and d != m for d, m in zip(shape, meta.shape))):
            raise BadRequest(f"input {name!r} has shape {shape} but the model expects {list(meta.shape)} (-1 = any size)",
                             f"reshape {name} to match; the first axis is the batch")
        try:
            dtype = v2_to_numpy(datatype)
        except UnsupportedDatatype as exc:
            raise BadRequest(exc.message, exc.fix) from None
        if dtype == np.object_:
            raise BadRequest(f"input {name!r} is BYTES, which reamer does not serve", "use a numeric input")
        count = math.prod(shape)
        params = item.get("parameters") or {}
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            want = count * dtype.itemsize
            if not isinstance(size, int) or size != want:
                raise BadRequest(f"input {name!r}: binary_data_size is {size} but shape {shape} of {datatype} needs {want} bytes",
                                 "send exactly shape × element size bytes")
            if offset + size > len(blob):
                raise BadRequest(f"input {name!r}: the body ends before its {size} binary bytes",
                                 "append every binary input after the JSON header, in input order")
            # a view of the body (it lives as long as the request); a copy only to swap the byte order
            arr = np.frombuffer(blob[offset:offset + size], dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)
            binary.append(_BinaryInput(name, dtype.newbyteorder("<"), dtype, tuple(shape), offset, size))
            offset += size
        else:
            if "data" not in item:
                raise BadRequest(f"input {name!r} has neither data nor binary_data_size",
                                 'add "data" (flat or nested list) or send it binary')
            try:
                arr = np.asarray(item["data"], dtype=dtype).reshape(-1)
            except (TypeError, ValueError) as exc:
                raise BadRequest(f"input {name!r}: data cannot be read as {datatype} ({exc})",
                                 f"send a list of {datatype} numbers") from None
            if arr.size != count:
                raise BadRequest(f"input {name!r}: {arr.size} values do not fill shape {shape} ({count} values)",
                                 "send as many values as the shape holds")
        inputs[name] = arr.reshape(shape)
    if offset != len(blob):
        raise BadRequest(f"the body has {len(blob) - offset} binary bytes that no input claims",
                         "set binary_data_size on every binary input")
    missing = [t.name for t in model_inputs if t.name not in inputs]
    if missing:
        raise BadRequest(f"missing input(s) {missing}; the model expects inputs: {_describe(model_inputs)}",
                         "send every model input")
    batches = {a.shape[0] for a in inputs.values() if a.ndim}
    if len(batches) > 1:
        raise BadRequest(f"inputs disagree on the batch size (first axis): {sorted(batches)}",
                         "give every input the same first dimension")
    params = req.get("parameters") or {}
    binary_default = bool(params.get("binary_data_output", False))
    outputs = None
    if req.get("outputs") is not None:
        known = {t.name for t in model_outputs}
        outputs = []
        for out in req["outputs"]:
            oname = out.get("name") if isinstance(out, dict) else None
            if oname not in known:
                raise BadRequest(f"unknown output {oname!r}; the model has outputs: {_describe(model_outputs)}",
                                 "ask only for outputs from GET /v2/models/<name>")
            oparams = out.get("parameters") or {}
            outputs.append((oname, bool(oparams.get("binary_data", binary_default))))
    req_id = req.get("id")
    if plans is not None and req_id is None and len(binary) == len(inputs):
        if len(plans) >= PLAN_CACHE_SIZE:
            plans.clear()
        plans[bytes(head)] = RequestPlan(tuple(binary), len(blob), outputs, binary_default)
    return DecodedRequest(id=str(req_id) if req_id is not None else None, inputs=inputs,
                          outputs=outputs, binary_default=binary_default)


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
            entry["data"] = arr.reshape(-1).tolist()
        items.append(entry)
    resp: dict[str, Any] = {"model_name": model_name, "model_version": "1", "outputs": items}
    if decoded.id is not None:
        resp["id"] = decoded.id
    head = json.dumps(resp).encode()
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
    return Reply(status, json.dumps(doc).encode())


def _error(status: int, message: str, **headers: str) -> Reply:
    return Reply(status, json.dumps({"error": message}).encode(), headers=headers)


class V2App:
    """The v2 endpoints of one model served by `batcher`: (method, path, headers, body) -> Reply."""

    def __init__(self, model_name: str, batcher: DynamicBatcher, platform: str = "onnxruntime_onnx") -> None:
        self.model_name = model_name
        self.batcher = batcher
        self.platform = platform
        self._plans: dict[bytes, RequestPlan] = {}
        self._heads: dict[tuple, bytes] = {}
        self._plans_for: object = None  # the signature the cached plans and heads were made for

    def _signature(self) -> tuple[list[TensorInfo], list[TensorInfo]] | None:
        for w in self.batcher.workers:
            if w.inputs:
                return w.inputs, w.outputs
        return None

    def _all_ready(self) -> bool:
        workers = self.batcher.workers
        return bool(workers) and all(w.ready and w.alive for w in workers)

    async def handle(self, method: str, path: str, headers: dict[str, str], body: bytes,
                     client: ClientSocket | None = None) -> Reply:
        """Answer one request. With `client`, an infer request whose outputs all go binary and that runs in
        a batch of its own is answered by the instance on the client's socket (reply-through): the answer
        then leaves from the core where the model ran, without a hop back through this process."""
        parts = [p for p in path.split("?", 1)[0].split("/") if p]
        if parts[:1] != ["v2"]:
            return _error(404, f"no endpoint {path}; this server speaks the Open Inference Protocol under /v2")
        route, name = parts[1:], None
        if route[:1] == ["models"] and len(route) >= 2:
            name, rest = unquote(route[1]), route[2:]
            if rest[:1] == ["versions"] and len(rest) >= 2:
                rest = rest[2:]
            route = ["models", *rest]
        want = "POST" if route == ["models", "infer"] else "GET"
        if route not in (["health", "live"], ["health", "ready"], [], ["models"], ["models", "ready"],
                         ["models", "infer"]):
            return _error(404, f"no endpoint {path}; see GET /v2/models/{self.model_name} for this model")
        if method != want:
            return _error(405, f"{path} takes {want}, not {method}", allow=want)
        if name is not None and name != self.model_name:
            return _error(404, f"unknown model {name!r}; this endpoint serves {self.model_name!r}")
        if route == ["health", "live"]:
            return _json(200, {"live": True})
        if route == ["health", "ready"]:
            if self._all_ready():
                return _json(200, {"ready": True})
            return _error(503, f"{self.batcher.ready_count()} of {len(self.batcher.workers)} instances are ready")
        if not route:
            return _json(200, {"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": ["binary_tensor_data"]})
        if route == ["models", "ready"]:
            if self._all_ready():
                return _json(200, {"name": name, "ready": True})
            return _error(503, f"model {name!r} is not ready: {self.batcher.ready_count()} of "
                               f"{len(self.batcher.workers)} instances ready")
        sig = self._signature()
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
        try:
            header_length = int(raw_len) if raw_len is not None else None
        except ValueError:
            return _error(400, f"{HEADER_LENGTH} {raw_len!r} is not a number")
        if self._plans_for != sig:  # a restarted instance may bring another model
            self._plans, self._heads, self._plans_for = {}, {}, sig
        try:
            decoded = decode_request(body, header_length, *sig, plans=self._plans)
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
        except (Overloaded, NotReady, WorkerError) as exc:
            return _error(500 if isinstance(exc, InferenceFailed) else 503, str(exc))
        finally:
            if reply_to is not None:
                os.close(reply_to[0])
        if isinstance(outputs, Replied):
            return Reply(200, outputs.tail, sent=True)  # the job sends what the client's socket did not take
        content, out_headers = encode_response(self.model_name, decoded, outputs, sig[1], self._heads)
        out_headers["server-timing"] = server_timing(timing.queue_s, timing.compute_s, time.perf_counter() - started)
        return Reply(200, content, out_headers.pop("content-type"), out_headers)


@dataclass
class _Incoming:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool
    refused: Reply | None = None  # answered without running the app (bad request, too large)


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 client connection: parse with httptools, answer requests in arrival order."""

    MAX_PIPELINED = 16  # stop reading from a client that queues more unanswered requests than this

    def __init__(self, door: "FrontDoor") -> None:
        self.door = door
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.fd: int | None = None  # the TCP socket, for instances that answer on it directly
        self.pending: deque[_Incoming] = deque()
        self._owe_continue = False  # a `100 Continue` held back while an earlier request is answered
        self.busy = False
        self._task: asyncio.Task | None = None
        self._paused = False
        self._broken = False  # stop parsing: the connection closes after the queued answers
        self._new_message()

    def _new_message(self) -> None:
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._too_large = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Nagle would hold the body of a response until the client acknowledged its head: up to
            # 40 ms per request with a client in delayed-ACK mode.
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            self.fd = sock.fileno()
        self.transport = transport  # type: ignore[assignment]
        self.door.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.door.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        if self._broken:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(_error(400, "protocol upgrades are not supported", connection="close"))
        except httptools.HttpParserError as exc:
            self._refuse(_error(400, f"malformed HTTP request ({exc})", connection="close"))

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self._new_message()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        length = self._headers.get("content-length", "")
        if length.isdigit() and int(length) > self.door.max_request_bytes:
            self._too_large = True
            if self._headers.get("expect", "").lower() == "100-continue":
                self._refuse(self._too_large_reply())  # the client waits: it never sends the body
        elif self._headers.get("expect", "").lower() == "100-continue" and self.transport is not None:
            if self.busy or self.pending:  # after the answers due before it (an instance may be writing one)
                self._owe_continue = True
            else:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._size > self.door.max_request_bytes:
            self._too_large, self._body = True, []
        if not self._too_large:
            self._body.append(chunk)

    def on_message_complete(self) -> None:
        if self._broken:
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        incoming = _Incoming(self.parser.get_method().decode("latin-1"), self._url.decode("latin-1"),
                             self._headers, body, self.parser.should_keep_alive(),
                             self._too_large_reply() if self._too_large else None)
        self._new_message()
        self._queue(incoming)

    # -- answering
    def _too_large_reply(self) -> Reply:
        limit = self.door.max_request_bytes
        return _error(413, f"request body is over this job's limit of {limit} bytes ({limit / 2**20:g} MiB); "
                           "send fewer samples per request, or raise the job's max_request_mb")

    def _refuse(self, reply: Reply) -> None:
        self._broken = True
        self._queue(_Incoming("", "", {}, b"", keep_alive=False, refused=reply))

    def _queue(self, incoming: _Incoming) -> None:
        self.pending.append(incoming)
        if len(self.pending) >= self.MAX_PIPELINED and self.transport is not None and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._answer_all())

    async def _answer_all(self) -> None:
        while self.pending:
            incoming = self.pending.popleft()
            if self._paused and len(self.pending) < self.MAX_PIPELINED // 2 and self.transport is not None:
                self._paused = False
                self.transport.resume_reading()
            self.busy = True
            keep_alive = incoming.keep_alive and not self.door.stopping
            client = None
            if self.fd is not None and self.transport is not None and not self.transport.get_write_buffer_size():
                client = ClientSocket(self.fd, keep_alive)
            try:
                reply = incoming.refused or await self.door.app.handle(incoming.method, incoming.path,
                                                                       incoming.headers, incoming.body, client)
            except Exception as exc:  # noqa: BLE001 - one bad request must not take the connection down
                traceback.print_exc(file=sys.stderr)
                reply = _error(500, f"internal error while serving {incoming.path}: {exc}")
            finally:
                self.busy = False
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
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            if not keep_alive:
                self.transport.close()
                return

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
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
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
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self.max_request_bytes = max_request_bytes
        self.connections: set[_Connection] = set()
        self.started = False
        self.stopping = False
        self._stop: asyncio.Event | None = None

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

    def request_stop(self) -> None:
        """Stop serving (call from the event loop's thread)."""
        self.stopping = True
        if self._stop is not None:
            self._stop.set()
