"""The online front door: Open Inference Protocol (KServe v2) REST over the dynamic batcher.

Endpoints: GET /v2, /v2/health/live, /v2/health/ready, /v2/models/{name}[/versions/{v}],
/v2/models/{name}[/versions/{v}]/ready, POST /v2/models/{name}[/versions/{v}]/infer.
Infer takes JSON tensors and the binary tensor data extension: when the request has the header
`Inference-Header-Content-Length: N`, the first N body bytes are the JSON header and the raw tensors
follow, in input order, for every input with `parameters.binary_data_size`. Outputs go back binary
when the requested output says `parameters.binary_data: true`, or the request says
`parameters.binary_data_output: true`; the response then carries the same header.
Errors are `{"error": "message"}`: 400 bad input, 404 unknown model, 503 overloaded / not ready.
"""
from __future__ import annotations

import contextlib
import json
import math
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from reamer.host.errors import ReamerError
from reamer.serve.batcher import DynamicBatcher, NotReady, Overloaded
from reamer.serve.tensors import TensorInfo, UnsupportedDatatype, numpy_to_v2, v2_to_numpy
from reamer.serve.worker import InferenceFailed, WorkerError

HEADER_LENGTH = "Inference-Header-Content-Length"
SERVER_NAME = "reamer"
SERVER_VERSION = "0.1.0"


class BadRequest(ReamerError):
    """The client sent a request the model cannot take (400)."""


@dataclass
class DecodedRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    # (name, binary) per requested output; None = all outputs
    outputs: list[tuple[str, bool]] | None
    binary_default: bool


def _describe(tensors: list[TensorInfo]) -> str:
    return ", ".join(f"{t.name} ({t.datatype} {list(t.shape)})" for t in tensors)


def decode_request(body: bytes, header_length: int | None, model_inputs: list[TensorInfo],
                   model_outputs: list[TensorInfo]) -> DecodedRequest:
    """Parse and validate a v2 infer request (JSON or binary extension) against the model's signature."""
    if header_length is not None:
        if header_length < 0 or header_length > len(body):
            raise BadRequest(f"{HEADER_LENGTH} is {header_length} but the body has {len(body)} bytes",
                             "set the header to the byte length of the JSON part")
        head, blob = body[:header_length], memoryview(body)[header_length:]
    else:
        head, blob = body, memoryview(b"")
    try:
        req = json.loads(head)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON ({exc})",
                         f"send a JSON object, or set {HEADER_LENGTH} when binary tensors follow") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list):
        raise BadRequest('request has no "inputs" list', 'send {"inputs": [{"name", "shape", "datatype", "data"}]}')
    by_name = {t.name: t for t in model_inputs}
    inputs: dict[str, np.ndarray] = {}
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
            arr = np.frombuffer(blob[offset:offset + size], dtype=dtype.newbyteorder("<")).astype(dtype, copy=True)
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
    return DecodedRequest(id=str(req_id) if req_id is not None else None, inputs=inputs,
                          outputs=outputs, binary_default=binary_default)


def encode_response(model_name: str, decoded: DecodedRequest, outputs: dict[str, np.ndarray],
                    model_outputs: list[TensorInfo]) -> tuple[bytes, dict[str, str]]:
    """Build the v2 response body and headers (binary extension when any output goes binary)."""
    wanted = decoded.outputs if decoded.outputs is not None else [(t.name, decoded.binary_default) for t in model_outputs]
    types = {t.name: t.datatype for t in model_outputs}
    items, blobs = [], []
    for name, binary in wanted:
        arr = np.asarray(outputs[name])
        entry: dict[str, Any] = {"name": name, "datatype": types.get(name) or numpy_to_v2(arr.dtype),
                                 "shape": list(arr.shape)}
        if binary:
            raw = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
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


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def create_app(model_name: str, batcher: DynamicBatcher, platform: str = "onnxruntime_onnx") -> FastAPI:
    """The v2 REST app of one model served by `batcher`."""
    app = FastAPI(title=f"reamer job {model_name}", docs_url=None, redoc_url=None)

    def signature() -> tuple[list[TensorInfo], list[TensorInfo]] | None:
        for w in batcher.workers:
            if w.inputs:
                return w.inputs, w.outputs
        return None

    def all_ready() -> bool:
        workers = batcher.workers
        return bool(workers) and all(w.ready and w.alive for w in workers)

    def unknown_model(name: str) -> JSONResponse:
        return _error(404, f"unknown model {name!r}; this endpoint serves {model_name!r}")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, f"bad request: {exc.errors()}")

    @app.get("/v2/health/live")
    async def live() -> dict:
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        if all_ready():
            return JSONResponse({"ready": True})
        return _error(503, f"{batcher.ready_count()} of {len(batcher.workers)} instances are ready")

    @app.get("/v2")
    async def server_metadata() -> dict:
        return {"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": ["binary_tensor_data"]}

    async def model_metadata(name: str) -> Response:
        if name != model_name:
            return unknown_model(name)
        sig = signature()
        if sig is None:
            return _error(503, f"model {name!r} is still loading; retry in a few seconds")
        ins, outs = sig
        return JSONResponse({"name": model_name, "versions": ["1"], "platform": platform,
                             "inputs": [t.to_dict() for t in ins], "outputs": [t.to_dict() for t in outs]})

    async def model_ready(name: str) -> Response:
        if name != model_name:
            return unknown_model(name)
        if all_ready():
            return JSONResponse({"name": name, "ready": True})
        return _error(503, f"model {name!r} is not ready: {batcher.ready_count()} of {len(batcher.workers)} instances ready")

    async def infer(name: str, request: Request) -> Response:
        if name != model_name:
            return unknown_model(name)
        sig = signature()
        if sig is None:
            return _error(503, f"model {name!r} is still loading; retry in a few seconds")
        body = await request.body()
        raw_len = request.headers.get(HEADER_LENGTH)
        try:
            header_length = int(raw_len) if raw_len is not None else None
        except ValueError:
            return _error(400, f"{HEADER_LENGTH} {raw_len!r} is not a number")
        try:
            decoded = decode_request(body, header_length, *sig)
        except BadRequest as exc:
            return _error(400, str(exc))
        try:
            outputs = await batcher.infer(decoded.inputs)
        except (Overloaded, NotReady, WorkerError) as exc:
            status = 500 if isinstance(exc, InferenceFailed) else 503
            return _error(status, str(exc))
        content, headers = encode_response(model_name, decoded, outputs, sig[1])
        media = headers.pop("content-type")
        return Response(content=content, media_type=media, headers=headers)

    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        app.add_api_route(prefix, model_metadata, methods=["GET"])
        app.add_api_route(prefix + "/ready", model_ready, methods=["GET"])
        app.add_api_route(prefix + "/infer", infer, methods=["POST"])
    return app


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the job handles SIGTERM/SIGINT/SIGHUP itself."""

    def capture_signals(self):  # type: ignore[override]
        return contextlib.nullcontext()

    def install_signal_handlers(self) -> None:  # older uvicorn
        return None


def _http_protocol_base() -> type:
    """uvicorn's httptools protocol when httptools is installed (its C parser takes a 600 KB body in a
    fraction of h11's time), else the pure-Python h11 one."""
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return H11Protocol
    return HttpToolsProtocol


class _NoDelayHTTP(_http_protocol_base()):  # type: ignore[misc]
    """uvicorn's HTTP/1.1 protocol with TCP_NODELAY on every connection.

    asyncio turns Nagle off only for sockets created with proto IPPROTO_TCP; a socket accepted from a
    listener made with proto 0 keeps it on. The response head and body go out in two writes, so Nagle
    held the body until the client acknowledged the head — and a client in delayed-ACK mode (steady
    keep-alive traffic) waits up to 40 ms to do so: a 40 ms stall per request above a few req/s.
    """

    def connection_made(self, transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        super().connection_made(transport)


class FrontDoor:
    """A bound listening socket (so port 0 resolves at once) and the uvicorn server for `app`."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
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
        self._sock.set_inheritable(True)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=10, http=_NoDelayHTTP)
        self._server = _Server(config)

    async def serve(self) -> None:
        try:
            await self._server.serve(sockets=[self._sock])
        finally:
            self._sock.close()

    @property
    def started(self) -> bool:
        return bool(self._server.started)

    def request_stop(self) -> None:
        self._server.should_exit = True
