"""The online front door's gRPC form: the Open Inference Protocol's `inference.GRPCInferenceService`.

Serves KServe's grpc_predict_v2.proto (ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata,
ModelInfer) and Triton's ModelConfig (model_config.py: name, platform, backend, max_batch_size from the model's
batchability, inputs, outputs, dynamic_batching, instance_group) and ModelStatistics (model_stats.py), under the one service name both KServe-v2 clients and tritonclient.grpc call. Requests go to the
same DynamicBatcher as the REST front door, so batching, load shedding and the job's request stats are shared.

Tensors come as `raw_input_contents` (what tritonclient sends) or as typed `contents`; the answer uses the
same form as the request (raw when any output is FP16, which has no typed field). BYTES tensors travel in
`bytes_contents`, or raw in Triton's layout (each element a 4-byte little-endian length and its bytes). Errors map as Triton
maps them: INVALID_ARGUMENT for what the client sent (the message names the field), NOT_FOUND for another
model, UNAVAILABLE for a shed request, an instance that crashed or a job not ready, RESOURCE_EXHAUSTED for
a message over the job's max_request_mb (gRPC's own check). Every infer answer carries a `server-timing`
trailing metadata entry, as the REST answer carries the header.

It runs on grpc.aio in the job's event loop (uvloop): a request awaits the batcher directly, with no hop
between threads (bench/RESULTS.md compares it with a thread-pool server).
"""
from __future__ import annotations

import asyncio
import math
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from reamer.host.errors import ReamerError
from reamer.serve.runtime.batcher import DynamicBatcher, ModelFault, NotReady, Overloaded, RequestTiming
from reamer.serve.doors.rest import DoorLimits, describe_tensors
from reamer.serve.doors.grpc_v2 import messages as pb
from reamer.serve.protocol.model_config import fill_grpc_config, model_config
from reamer.serve.protocol.tensors import (BadBytesTensor, TensorInfo, UnsupportedDatatype, split_length_prefixed, text_tensor,
                                   v2_to_numpy)
from reamer.serve.protocol.v2wire import SERVER_NAME, SERVER_VERSION, le_bytes, server_timing
from reamer.serve.runtime.worker import InferenceFailed, WorkerError

GRACE_S = 10.0  # a stop waits this long for requests in flight

# The typed-contents field of each numeric datatype (FP16 has none: it travels raw; BYTES uses bytes_contents).
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                  "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                  "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
                  "FP32": "fp32_contents", "FP64": "fp64_contents"}


class GrpcBadRequest(ReamerError):
    """The client sent an infer request the model cannot take (INVALID_ARGUMENT)."""


@dataclass
class DecodedGrpcRequest:
    inputs: dict[str, np.ndarray]
    outputs: list[str]  # names to answer with, in answer order
    raw: bool  # answer with raw_output_contents (the request's form)


def decode_infer_request(req: Any, model_inputs: list[TensorInfo], model_outputs: list[TensorInfo]) -> DecodedGrpcRequest:
    """Validate a ModelInferRequest against the model's signature and read its tensors."""
    raw = list(req.raw_input_contents)
    if raw and len(raw) != len(req.inputs):
        raise GrpcBadRequest(f"raw_input_contents has {len(raw)} entries for {len(req.inputs)} inputs",
                             "send one raw_input_contents entry per input, in input order")
    by_name = {t.name: t for t in model_inputs}
    inputs: dict[str, np.ndarray] = {}
    for i, item in enumerate(req.inputs):
        name = item.name
        where = f"inputs[{i}] ({name!r})"
        meta = by_name.get(name)
        if meta is None:
            raise GrpcBadRequest(f"inputs[{i}].name {name!r} is not an input of the model; it expects "
                                 f"{describe_tensors(model_inputs)}", "use the input names from ModelMetadata")
        if name in inputs:
            raise GrpcBadRequest(f"{where} is given twice", "send each input once")
        datatype = item.datatype.upper()
        if datatype != meta.datatype:
            raise GrpcBadRequest(f"{where}.datatype is {item.datatype or 'empty'!r} but the model expects "
                                 f"{meta.datatype}", f"send {name} as {meta.datatype}")
        shape = list(item.shape)
        if not meta.accepts_shape(shape):
            raise GrpcBadRequest(f"{where}.shape is {shape} but the model expects {list(meta.shape)} (-1 = any size)",
                                 f"reshape {name} to match; the first axis is the batch")
        try:
            dtype = v2_to_numpy(datatype)
        except UnsupportedDatatype as exc:
            raise GrpcBadRequest(exc.message, exc.fix) from None
        count = math.prod(shape)
        has_contents = item.HasField("contents")
        if dtype == np.object_:  # BYTES: raw in Triton's layout (a length before each element), or bytes_contents
            if raw and has_contents:
                raise GrpcBadRequest(f"{where}.contents is set beside raw_input_contents",
                                     "send every input raw, or every input in contents, not both")
            values = (list(item.contents.bytes_contents) if not raw
                      else _split_raw(raw[i], count, f"raw_input_contents[{i}] ({name!r})"))
            if len(values) != count:
                raise GrpcBadRequest(f"{where}.contents.bytes_contents has {len(values)} values but shape {shape} "
                                     f"holds {count}", "send as many values as the shape holds")
            try:
                inputs[name] = text_tensor(values, shape, where)
            except BadBytesTensor as exc:
                raise GrpcBadRequest(exc.message, exc.fix) from None
            continue
        if raw:
            if has_contents:
                raise GrpcBadRequest(f"{where}.contents is set beside raw_input_contents",
                                     "send every input raw, or every input in contents, not both")
            want = count * dtype.itemsize
            if len(raw[i]) != want:
                raise GrpcBadRequest(f"raw_input_contents[{i}] ({name!r}) has {len(raw[i])} bytes but shape {shape} "
                                     f"of {datatype} needs {want}", "send exactly shape × element size bytes")
            arr = np.frombuffer(raw[i], dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)
        else:
            field = CONTENTS_FIELD.get(datatype)
            if field is None:
                raise GrpcBadRequest(f"{where} is {datatype}, which has no typed contents field",
                                     f"send {datatype} tensors in raw_input_contents")
            values = getattr(item.contents, field)
            if len(values) != count:
                raise GrpcBadRequest(f"{where}.contents.{field} has {len(values)} values but shape {shape} holds {count}"
                                     + ("" if has_contents else "; the request has no raw_input_contents either"),
                                     "send as many values as the shape holds")
            try:
                arr = np.array(values, dtype=dtype)
            except (OverflowError, ValueError) as exc:
                raise GrpcBadRequest(f"{where}.contents.{field} does not fit {datatype} ({exc})",
                                     f"send values in the range of {datatype}") from None
        inputs[name] = arr.reshape(shape)
    missing = [t.name for t in model_inputs if t.name not in inputs]
    if missing:
        raise GrpcBadRequest(f"inputs lack {missing}; the model expects {describe_tensors(model_inputs)}",
                             "send every model input")
    # the batch size's agreement is the batcher's to check: only a batchable model's first dims are its batch
    known = [t.name for t in model_outputs]
    outputs = []
    for i, out in enumerate(req.outputs):
        if out.name not in known:
            raise GrpcBadRequest(f"outputs[{i}].name {out.name!r} is not an output of the model; it has "
                                 f"{describe_tensors(model_outputs)}", "ask only for outputs from ModelMetadata")
        outputs.append(out.name)
    types = {t.name: t.datatype for t in model_outputs}
    wanted = outputs or known
    answer_raw = bool(raw) or not inputs or any(CONTENTS_FIELD.get(types[n]) is None and types[n] != "BYTES"
                                                for n in wanted)
    return DecodedGrpcRequest(inputs, wanted, answer_raw)


def _split_raw(raw: bytes, count: int, where: str) -> list[bytes]:
    try:
        return split_length_prefixed(raw, count, where)
    except BadBytesTensor as exc:
        raise GrpcBadRequest(exc.message, exc.fix) from None


def encode_infer_response(model_name: str, request_id: str, decoded: DecodedGrpcRequest,
                          outputs: dict[str, np.ndarray], model_outputs: list[TensorInfo]) -> Any:
    types = {t.name: t.datatype for t in model_outputs}
    resp = pb.ModelInferResponse(model_name=model_name, model_version="1", id=request_id)
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
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"{field} {name!r} is not served here; this endpoint serves "
                                                    f"{self.model_name!r}")

    def _loaded(self) -> tuple[list[TensorInfo], list[TensorInfo]]:
        sig = self.batcher.signature()
        if sig is None:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, f"model {self.model_name!r} is still loading; retry in a few seconds")
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
            raise _Abort(grpc.StatusCode.UNAVAILABLE, f"model {self.model_name!r} is still loading; retry in a few seconds")
        resp = pb.ModelConfigResponse()
        fill_grpc_config(resp.config, doc, pb.DATA_TYPES)
        return resp

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        if request.name:  # empty: every model (this one)
            self._check_model(request.name)
        if request.version not in ("", "1"):
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"model {self.model_name!r} has no version {request.version!r}; "
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
        except GrpcBadRequest as exc:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        timing = RequestTiming()
        try:
            outputs = await self.batcher.infer(decoded.inputs, timing)
        except InferenceFailed as exc:  # the runtime refused these inputs: the client's to fix
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except ModelFault as exc:  # the model's answer could not be handed back: not the client's fault
            raise _Abort(grpc.StatusCode.INTERNAL, str(exc)) from None
        except (Overloaded, NotReady, WorkerError) as exc:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        resp = encode_infer_response(self.model_name, request.id, decoded, outputs, sig[1])
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
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}: {exc}")

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
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
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
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
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
            raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"the request message did not arrive within {self.read_timeout_s:g} s (the job's "
                         "body_timeout_s)") from None
        if message is grpc.aio.EOF:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request message")
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
