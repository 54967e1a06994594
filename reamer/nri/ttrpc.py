"""ttRPC (containerd/ttrpc), the small RPC protocol NRI speaks: unary calls only, which is all NRI uses.

A message is a 10-byte header — payload length (uint32), stream id (uint32), type (byte), flags (byte), all
big-endian — and a payload of at most 4 MiB. A call is a Request message (type 1: service, method, the
protobuf-encoded argument) on a new odd stream id from the caller; the answer is a Response message (type
2: a google.rpc.Status and the encoded result) on the same stream id.
"""
from __future__ import annotations

import logging
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol

from google.protobuf.message import DecodeError, Message

from reamer.nri.proto import ttrpc_pb2

log = logging.getLogger("reamer.nri.ttrpc")

HEADER = struct.Struct(">IIBB")
MESSAGE_LENGTH_MAX = 4 << 20
TYPE_REQUEST, TYPE_RESPONSE, TYPE_DATA = 0x1, 0x2, 0x3
FLAG_REMOTE_CLOSED, FLAG_REMOTE_OPEN, FLAG_NO_DATA = 0x1, 0x2, 0x4
# grpc status codes used here
OK, UNKNOWN, INVALID_ARGUMENT, UNIMPLEMENTED, RESOURCE_EXHAUSTED = 0, 2, 3, 12, 8


class Stream(Protocol):
    def recv_exact(self, n: int) -> bytes: ...
    def sendall(self, data: bytes) -> None: ...


class TtrpcError(Exception):
    """A call failed: `code` is a grpc status code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"ttrpc status {code}: {message}")
        self.code, self.message = code, message


@dataclass(frozen=True)
class Frame:
    stream_id: int
    type: int
    flags: int
    payload: bytes


def encode(frame: Frame) -> bytes:
    if len(frame.payload) > MESSAGE_LENGTH_MAX:
        raise TtrpcError(RESOURCE_EXHAUSTED, f"message length {len(frame.payload)} exceeds {MESSAGE_LENGTH_MAX}")
    return HEADER.pack(len(frame.payload), frame.stream_id, frame.type, frame.flags) + frame.payload


def read_frame(stream: Stream) -> Frame:
    length, stream_id, kind, flags = HEADER.unpack(stream.recv_exact(HEADER.size))
    if length > MESSAGE_LENGTH_MAX:
        # the Go side discards the payload and answers ResourceExhausted; a plugin has no reason to, so it stops
        raise TtrpcError(RESOURCE_EXHAUSTED, f"message length {length} exceeds {MESSAGE_LENGTH_MAX}")
    return Frame(stream_id, kind, flags, stream.recv_exact(length) if length else b"")


Handler = Callable[[bytes], Message]  # encoded request -> response message; raise TtrpcError to fail the call


class Server:
    """Serves unary calls from `stream`: handlers by (service, method). Each call runs on a worker thread,
    so a slow handler does not hold up the next event."""

    def __init__(self, stream: Stream, handlers: dict[tuple[str, str], Handler], workers: int = 4) -> None:
        self.stream, self.handlers = stream, handlers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nri-call")
        self._write_lock = threading.Lock()

    def serve(self) -> None:
        """Until the stream closes (raises the stream's error)."""
        try:
            while True:
                frame = read_frame(self.stream)
                if frame.type != TYPE_REQUEST:
                    continue  # no streaming calls in NRI
                self._pool.submit(self._call, frame)
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _call(self, frame: Frame) -> None:
        response = ttrpc_pb2.Response()
        try:
            request = ttrpc_pb2.Request.FromString(frame.payload)
            handler = self.handlers.get((request.service, request.method))
            if handler is None:
                raise TtrpcError(UNIMPLEMENTED, f"{request.service}/{request.method} is not implemented")
            response.payload = handler(request.payload).SerializeToString()
        except TtrpcError as error:
            response.status.code, response.status.message = error.code, error.message
        except DecodeError as error:
            response.status.code, response.status.message = INVALID_ARGUMENT, f"bad request: {error}"
        except Exception as error:  # noqa: BLE001 - the runtime gets the reason, the plugin keeps serving
            log.exception("ttrpc handler failed")
            response.status.code, response.status.message = UNKNOWN, str(error) or type(error).__name__
        data = encode(Frame(frame.stream_id, TYPE_RESPONSE, 0, response.SerializeToString()))
        with self._write_lock:
            try:
                self.stream.sendall(data)
            except OSError as error:
                log.info("could not answer stream %d: %s", frame.stream_id, error)


class Client:
    """Unary calls on `stream`; `run()` (a thread) reads the answers."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self._next_id = 1
        self._lock = threading.Lock()
        self._waiting: dict[int, Future[ttrpc_pb2.Response]] = {}
        self._closed: Exception | None = None

    def run(self) -> None:
        try:
            while True:
                frame = read_frame(self.stream)
                if frame.type != TYPE_RESPONSE:
                    continue
                with self._lock:
                    future = self._waiting.pop(frame.stream_id, None)
                if future is not None:
                    try:
                        future.set_result(ttrpc_pb2.Response.FromString(frame.payload))
                    except DecodeError as error:
                        future.set_exception(TtrpcError(INVALID_ARGUMENT, f"bad response: {error}"))
        except Exception as error:  # noqa: BLE001 - every waiting call learns that the stream closed
            with self._lock:
                self._closed = error
                waiting, self._waiting = self._waiting, {}
            for future in waiting.values():
                future.set_exception(ConnectionError(f"the ttrpc connection closed: {error}"))

    def call(self, service: str, method: str, request: Message, reply: type[Message], timeout: float = 10.0
             ) -> Message:
        future: Future[ttrpc_pb2.Response] = Future()
        with self._lock:
            if self._closed is not None:
                raise ConnectionError(f"the ttrpc connection closed: {self._closed}")
            stream_id = self._next_id
            self._next_id += 2  # client streams are odd
            self._waiting[stream_id] = future
            body = ttrpc_pb2.Request(service=service, method=method, payload=request.SerializeToString(),
                                     timeout_nano=int(timeout * 1e9))
            self.stream.sendall(encode(Frame(stream_id, TYPE_REQUEST, 0, body.SerializeToString())))
        response = future.result(timeout)
        if response.status.code != OK:
            raise TtrpcError(response.status.code, response.status.message)
        return reply.FromString(response.payload)
