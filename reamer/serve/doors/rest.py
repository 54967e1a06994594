"""The REST door: routes Open Inference Protocol (KServe v2) requests to the dynamic batcher and answers.

Endpoints: GET /v2, /v2/health/live, /v2/health/ready, /v2/models/{name}[/versions/{v}],
/v2/models/{name}[/versions/{v}]/ready, POST /v2/models/{name}[/versions/{v}]/infer, and Triton's
GET /v2/models/{name}[/versions/{v}]/config (model_config.py) and /v2/models[/{name}[/versions/{v}]]/stats
(model_stats.py). The request and response bodies are the REST codec's (protocol/rest_codec.py: JSON and the
binary tensor data extension); the HTTP server is doors/http_server.py.
An infer request whose outputs all go binary and that runs in a batch of its own is answered by its
instance on the client's socket (reply-through, see `V2App.handle` and `v2wire`); the rest by this process.
Errors are `{"error": "message"}`, with the status of the protocol's fault (protocol/errors.Fault): 400 bad
input (the message names the field), 404 unknown model or path, 405 wrong method, 500 a model fault (its answer
could not be handed back), 503 overloaded / not ready. Every infer response carries a W3C `Server-Timing`
header: queue wait, backend compute and the whole time in the job (ms).
JSON bodies (and JSON answers) over the job's offload size are coded off the event loop.
"""
from __future__ import annotations

import asyncio
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import unquote

import numpy as np

from reamer.serve.doors.http_framing import ClientSocket, Reply, binary_reply_head, error_reply, json_reply
from reamer.serve.doors.limits import DoorLimits
from reamer.serve.protocol.errors import BadRequest, Fault
from reamer.serve.protocol.tensors import TensorInfo
from reamer.serve.protocol.model_config import model_config
from reamer.serve.protocol.rest_codec import RequestPlan, decode_request, encode_response
from reamer.serve.protocol.v2wire import HEADER_LENGTH, SERVER_NAME, SERVER_VERSION, ReplyPlan, server_timing
from reamer.serve.runtime.batcher import DynamicBatcher, ModelFault, NotReady, Overloaded, RequestTiming
from reamer.serve.runtime.instances import InferenceFailed, Replied, ReplyBroken, WorkerError


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
            return error_reply(404, f"no endpoint {path}; this server speaks the Open Inference Protocol under /v2")
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
            return error_reply(404, f"no endpoint {path}; see GET /v2/models/{self.model_name} for this model")
        if method != want:
            return error_reply(405, f"{path} takes {want}, not {method}", allow=want)
        if name is not None and name != self.model_name:
            return error_reply(Fault.UNKNOWN_MODEL.http, f"unknown model {name!r}; this endpoint serves {self.model_name!r}")
        if route == ["health", "live"]:
            return json_reply(200, {"live": True})
        if route == ["health", "ready"]:
            if self.batcher.all_ready():
                return json_reply(200, {"ready": True})
            return error_reply(Fault.NOT_READY.http, self.batcher.not_ready_reason())
        if not route:
            return json_reply(200, {"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": ["binary_tensor_data", "model_configuration", "statistics"]})
        if route == ["models", "ready"]:
            if self.batcher.all_ready():
                return json_reply(200, {"name": name, "ready": True})
            return error_reply(Fault.NOT_READY.http, f"model {name!r} is not ready: {self.batcher.not_ready_reason()}")
        if route == ["models", "stats"]:  # Triton's statistics extension
            return json_reply(200, {"model_stats": [self.batcher.model_stats.to_doc(self.model_name)]})
        if route == ["models", "config"]:  # Triton's model configuration (model_config.py)
            config = model_config(self.model_name, self.platform, self.batcher, self.limits.max_request_bytes)
            if config is None:
                return error_reply(Fault.NOT_READY.http, f"model {name!r} is still loading; retry in a few seconds")
            return json_reply(200, config)
        sig = self.batcher.signature()
        if sig is None:
            return error_reply(Fault.NOT_READY.http, f"model {name!r} is still loading; retry in a few seconds")
        if route == ["models"]:
            ins, outs = sig
            return json_reply(200, {"name": self.model_name, "versions": ["1"], "platform": self.platform,
                               "inputs": [t.to_dict() for t in ins], "outputs": [t.to_dict() for t in outs]})
        return await self._infer(headers, body, sig, client)

    async def _infer(self, headers: dict[str, str], body: bytes,
                     sig: tuple[list[TensorInfo], list[TensorInfo]], client: ClientSocket | None) -> Reply:
        started = time.perf_counter()
        raw_len = headers.get(HEADER_LENGTH.lower())
        header_length = None
        if raw_len is not None:
            if not raw_len.strip().isdigit():
                return error_reply(BadRequest.fault.http, f"{HEADER_LENGTH} {raw_len!r} is not a number of bytes")
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
            return error_reply(exc.fault.http, str(exc))
        timing = RequestTiming()
        reply_to = None
        if client is not None:
            wanted = decoded.wanted(sig[1])
            types = {t.name: t.datatype for t in sig[1]}
            if wanted and all(binary and types[name] != "BYTES" for name, binary in wanted):
                # A duplicate, so the socket outlives a client that hangs up while the request waits: the
                # connection's own descriptor number could by then name another client's connection.
                reply_to = (os.dup(client.fd), ReplyPlan(self.model_name, decoded.id,
                                                         [(n, types[n]) for n, _ in wanted],
                                                         binary_reply_head(client.keep_alive), started))
        try:
            outputs = await self.batcher.infer(decoded.inputs, timing, reply_to)
        except ReplyBroken as exc:
            print(f"reamer job: {exc}", file=sys.stderr)
            return Reply(200, b"", sent=True, close=True)
        except (InferenceFailed, ModelFault, Overloaded, NotReady, WorkerError) as exc:  # each names its fault
            return error_reply(exc.fault.http, str(exc))
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
