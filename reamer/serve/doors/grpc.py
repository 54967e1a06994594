"""The online front door's gRPC form: the Open Inference Protocol's `inference.GRPCInferenceService`.

Serves KServe's grpc_predict_v2.proto (ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata,
ModelInfer) and Triton's ModelConfig (model_config.py: name, platform, backend, max_batch_size from the model's
batchability, inputs, outputs, dynamic_batching, instance_group) and ModelStatistics (model_stats.py), under the one service name both KServe-v2 clients and tritonclient.grpc call. Requests go to the
same DynamicBatcher as the REST front door, so batching, load shedding and the job's request stats are shared.

It only translates: messages are read and filled by the gRPC codec (protocol/grpc_codec.py, with the validator
the REST door uses too), and each error's status is its protocol fault's (protocol/errors.Fault, mapped once
in STATUS): INVALID_ARGUMENT for what the client sent (the message names the field), NOT_FOUND for another
model, UNAVAILABLE for a shed request, an instance that crashed or a job not ready, RESOURCE_EXHAUSTED for
a message over the job's max_request_mb (gRPC's own check) or past its max_buffered_mb. Every infer answer
carries a `server-timing` trailing metadata entry, as the REST answer carries the header.

It runs on grpc.aio in the job's event loop (uvloop): a request awaits the batcher directly, with no hop
between threads (bench/RESULTS.md compares it with a thread-pool server).
"""
from __future__ import annotations

import asyncio
import sys
import time
import traceback
from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError

from reamer.host.errors import ReamerError
from reamer.serve.doors.grpc_v2 import messages as pb
from reamer.serve.doors.limits import DoorLimits
from reamer.serve.protocol.errors import BadRequest, Fault
from reamer.serve.protocol.grpc_codec import decode_infer_request, fill_infer_response
from reamer.serve.protocol.model_config import fill_grpc_config, model_config
from reamer.serve.protocol.tensors import TensorInfo
from reamer.serve.protocol.v2wire import SERVER_NAME, SERVER_VERSION, server_timing
from reamer.serve.runtime.batcher import DynamicBatcher, ModelFault, NotReady, Overloaded, RequestTiming
from reamer.serve.runtime.instances import InferenceFailed, WorkerError

GRACE_S = 10.0  # a stop waits this long for requests in flight

# Each protocol fault's gRPC status, looked up once (protocol/errors.Fault is the one table).
STATUS = {fault: grpc.StatusCode[fault.grpc] for fault in Fault}


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class GrpcV2Service:
    """The RPCs of one model served by `batcher`."""

    def __init__(self, model_name: str, batcher: DynamicBatcher, platform: str = "onnxruntime_onnx",
                 max_request_bytes: int = DoorLimits().max_request_bytes) -> None:
        self.model_name = model_name
        self.batcher = batcher
        self.platform = platform
        self.max_request_bytes = max_request_bytes  # bounds the rows a request can carry (ModelConfig)

    def _check_model(self, name: str, field: str = "name") -> None:
        if name != self.model_name:
            raise _Abort(STATUS[Fault.UNKNOWN_MODEL], f"{field} {name!r} is not served here; this endpoint serves "
                                                    f"{self.model_name!r}")

    def _loaded(self) -> tuple[list[TensorInfo], list[TensorInfo]]:
        sig = self.batcher.signature()
        if sig is None:
            raise _Abort(STATUS[Fault.NOT_READY], f"model {self.model_name!r} is still loading; retry in a few seconds")
        return sig

    # -- RPCs: (request, context) -> response; _Abort for an error status
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.batcher.all_ready())

    async def ModelReady(self, request: Any, context: Any) -> Any:
        self._check_model(request.name)
        return pb.ModelReadyResponse(ready=self.batcher.all_ready())

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION,
                                         extensions=["model_configuration", "statistics"])

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        self._check_model(request.name)
        ins, outs = self._loaded()
        resp = pb.ModelMetadataResponse(name=self.model_name, versions=["1"], platform=self.platform)
        for t in ins:
            resp.inputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        for t in outs:
            resp.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        return resp

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        self._check_model(request.name)
        doc = model_config(self.model_name, self.platform, self.batcher, self.max_request_bytes)  # REST's facts
        if doc is None:
            raise _Abort(STATUS[Fault.NOT_READY], f"model {self.model_name!r} is still loading; retry in a few seconds")
        resp = pb.ModelConfigResponse()
        fill_grpc_config(resp.config, doc, pb.DATA_TYPES)
        return resp

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        if request.name:  # empty: every model (this one)
            self._check_model(request.name)
        if request.version not in ("", "1"):
            raise _Abort(STATUS[Fault.UNKNOWN_MODEL], f"model {self.model_name!r} has no version {request.version!r}; "
                                                    "it serves version 1")
        resp = pb.ModelStatisticsResponse()
        self.batcher.model_stats.fill(resp.model_stats.add(), self.model_name)
        return resp

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        started = time.perf_counter()
        self._check_model(request.model_name, "model_name")
        sig = self._loaded()
        try:
            decoded = decode_infer_request(request, *sig)
        except BadRequest as exc:
            raise _Abort(STATUS[exc.fault], str(exc)) from None
        timing = RequestTiming()
        try:
            outputs = await self.batcher.infer(decoded.inputs, timing)
        except (InferenceFailed, ModelFault, Overloaded, NotReady, WorkerError) as exc:  # each names its fault
            raise _Abort(STATUS[exc.fault], str(exc)) from None
        resp = fill_infer_response(pb.ModelInferResponse(model_name=self.model_name, model_version="1", id=request.id),
                                   decoded, outputs, sig[1])
        context.set_trailing_metadata((("server-timing", server_timing(
            timing.queue_s, timing.compute_s, time.perf_counter() - started)),))
        return resp


def _handler(method: Callable, request_type: type, response_type: type,
             budget: "RequestBudget | None" = None) -> grpc.RpcMethodHandler:
    """The RPC `method` as a grpc handler; with a `budget`, its request message is read only once the budget
    has room for it (see RequestBudget)."""

    async def answer(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(request, context)
        except _Abort as exc:
            await context.abort(exc.code, exc.message)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the server down
            traceback.print_exc(file=sys.stderr)  # to the job's log, as the REST door does
            await context.abort(STATUS[Fault.INTERNAL], f"internal error in {method.__name__}: {exc}")

    if budget is None:
        return grpc.unary_unary_rpc_method_handler(answer, request_deserializer=request_type.FromString,
                                                   response_serializer=response_type.SerializeToString)

    async def budgeted(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        held = 0
        try:
            held = budget.reserve()
            raw = await budget.read(context)
            held = budget.settle(held, len(raw))
            request = request_type.FromString(raw)
            del raw  # the parsed message has its own copy
        except _Abort as exc:
            budget.release(held)
            await context.abort(exc.code, exc.message)
        except DecodeError:
            budget.release(held)
            await context.abort(STATUS[Fault.BAD_INPUT],
                                f"the request message is not a {request_type.__name__}")
        except BaseException:
            budget.release(held)
            raise
        try:
            return await answer(request, context)
        finally:
            budget.release(held)

    # A client's unary call is, on the wire, a client-streaming call of one message: taken as one, the handler
    # reads the message when it chooses (grpc otherwise reads it whole before the handler runs).
    return grpc.stream_unary_rpc_method_handler(budgeted, request_deserializer=None,
                                                response_serializer=response_type.SerializeToString)


class RequestBudget:
    """Bytes of request messages the gRPC door holds at once: at most the job's max_buffered_mb (the budget the
    REST door counts against too, when `ledger` is that door: anything with a `buffered` byte count).

    A call's message size is unknown until it is read, so a call reserves max_request_mb before its message is
    read (grpc refuses larger ones itself), then keeps what the message holds until it is answered. A call
    that finds no room is refused with RESOURCE_EXHAUSTED before a byte of its message is read: what waits in
    grpc's flow-control window is all it costs. A message that does not arrive within body_timeout_s is cut
    off (DEADLINE_EXCEEDED), so slow clients cannot sit on the budget."""

    def __init__(self, limit: int, max_request_bytes: int, read_timeout_s: float, ledger: Any = None) -> None:
        self.limit = limit
        self.max_request_bytes = max_request_bytes
        self.read_timeout_s = read_timeout_s
        self.buffered = 0
        self.ledger = self if ledger is None else ledger

    def reserve(self) -> int:
        held = self.ledger.buffered
        if held + self.max_request_bytes > self.limit:
            mib = 1 << 20
            raise _Abort(STATUS[Fault.BUSY],
                         f"this job holds {held / mib:.0f} MiB of requests and another may take up to "
                         f"{self.max_request_bytes / mib:g} MiB (its max_request_mb), past its max_buffered_mb of "
                         f"{self.limit / mib:g} MiB; retry shortly (room frees as requests are answered), or raise "
                         "the job's frontdoor max_buffered_mb (or lower its max_request_mb)")
        self.ledger.buffered += self.max_request_bytes
        return self.max_request_bytes

    async def read(self, context: grpc.aio.ServicerContext) -> bytes:
        try:
            message = await asyncio.wait_for(context.read(), self.read_timeout_s)
        except asyncio.TimeoutError:
            raise _Abort(STATUS[Fault.TOO_SLOW],
                         f"the request message did not arrive within {self.read_timeout_s:g} s (the job's "
                         "body_timeout_s)") from None
        if message is grpc.aio.EOF:
            raise _Abort(STATUS[Fault.BAD_INPUT], "the call carried no request message")
        return message

    def settle(self, reserved: int, size: int) -> int:
        """From the reservation to what the message holds; returns the bytes now held."""
        self.ledger.buffered += size - reserved
        return size

    def release(self, held: int) -> None:
        self.ledger.buffered -= held


def _bind_error(host: str, port: int) -> str:
    """Why the OS refuses host:port (a plain bind, as the server's)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return "grpc could not bind it"


class GrpcFrontDoor:
    """A grpc.aio server of `service` on host:port (0 = a free port, known after start()).

    `limits` (the REST door's DoorLimits, when given) bound it alike where gRPC has the same knob: calls in
    flight (max_connections; more get RESOURCE_EXHAUSTED), idle connections (idle_timeout_s), metadata
    size (max_header_bytes), request messages held (max_buffered_mb, RequestBudget; RESOURCE_EXHAUSTED), a
    message's size (max_request_mb: grpc's max_receive_message_length, RESOURCE_EXHAUSTED before it is read)."""

    MAX_CONCURRENT_RPCS = 1024

    def __init__(self, service: GrpcV2Service, host: str, port: int, max_request_bytes: int,
                 limits: DoorLimits | None = None, budget_ledger: Any = None) -> None:
        self.service = service
        self.budget_ledger = budget_ledger  # the REST door, to share its max_buffered_mb (None: a budget of its own)
        self.host = host
        self.requested_port = port
        self.max_request_bytes = max_request_bytes
        self.limits = limits
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._stop: asyncio.Event | None = None
        self.stopping = False

    async def start(self) -> int:
        """Bind and start serving (call from the event loop that runs the batcher); returns the port."""
        options = [
            ("grpc.max_receive_message_length", self.max_request_bytes),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0),  # a second job on the same port must fail, not share it
            # Without BDP probing, grpc takes a message only when the handler reads it: with it, each connection
            # buffered ~16 MiB of messages nobody had read yet (24 connections: 400 MiB), past max_buffered_mb.
            ("grpc.http2.bdp_probe", 0),
        ]
        concurrent = self.MAX_CONCURRENT_RPCS
        if self.limits is not None:
            concurrent = self.limits.max_connections
            options += [("grpc.max_connection_idle_ms", int(self.limits.idle_timeout_s * 1000)),
                        ("grpc.max_metadata_size", self.limits.max_header_bytes)]
        server = grpc.aio.server(options=options, maximum_concurrent_rpcs=concurrent)
        budget = None
        if self.limits is not None:  # ModelInfer's messages count against max_buffered_mb
            budget = RequestBudget(self.limits.buffered_budget, self.max_request_bytes, self.limits.body_timeout_s,
                                   self.budget_ledger)
        handlers = {name: _handler(getattr(self.service, name), req, resp, budget if name == "ModelInfer" else None)
                    for name, (req, resp) in pb.METHODS.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(pb.SERVICE, handlers),))
        address = f"[{self.host}]:{self.requested_port}" if ":" in self.host else f"{self.host}:{self.requested_port}"
        try:
            port = server.add_insecure_port(address)
        except RuntimeError:  # grpc's own text points at GRPC_VERBOSITY; the OS says why
            port = 0
        if not port:
            raise ReamerError(f"cannot listen for gRPC on {address}: {_bind_error(self.host, self.requested_port)}",
                              "pick a free grpc_port (0 lets the system choose) on an address of this host")
        await server.start()
        self._server, self.port = server, port
        return port

    async def serve(self) -> None:
        """Serve until request_stop(); then refuse new calls, let calls in flight finish (GRACE_S), stop."""
        if self._server is None:
            await self.start()
        self._stop = asyncio.Event()
        if self.stopping:
            self._stop.set()
        try:
            await self._stop.wait()
        finally:
            assert self._server is not None
            await self._server.stop(GRACE_S)

    def request_stop(self) -> None:
        """Stop serving (call from the event loop's thread)."""
        self.stopping = True
        if self._stop is not None:
            self._stop.set()
