"""NRI's connection multiplexing (containerd/nri pkg/net/multiplex): several byte streams over one socket.

Every frame on the trunk is an 8-byte header — the connection id and the payload length, both big-endian
uint32 — followed by the payload. Id 0 is reserved; the plugin serves ttRPC on PLUGIN_SERVICE_CONN (the
runtime calls Configure, Synchronize, CreateContainer... there) and calls the runtime on RUNTIME_SERVICE_CONN
(RegisterPlugin, UpdateContainers).
"""
from __future__ import annotations

import socket
import struct
import threading
from collections import deque

HEADER = struct.Struct(">II")
RESERVED_CONN = 0
PLUGIN_SERVICE_CONN = 1
RUNTIME_SERVICE_CONN = 2
MAX_PAYLOAD = 1 << 24  # the Go side refuses larger writes (maxPayloadSize = 16 MiB)


class MuxClosed(ConnectionError):
    """The trunk closed (the runtime went away, or the plugin closed it)."""


def encode_frame(conn_id: int, payload: bytes) -> bytes:
    if conn_id == RESERVED_CONN:
        raise ValueError("connection id 0 is reserved")
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"mux payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(conn_id, len(payload)) + payload


def recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise MuxClosed("the trunk closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class MuxConn:
    """One logical connection: a byte stream (what ttRPC reads and writes)."""

    def __init__(self, mux: "Mux", conn_id: int) -> None:
        self.mux, self.conn_id = mux, conn_id
        self._buf = bytearray()
        self._chunks: deque[bytes] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def feed(self, payload: bytes) -> None:
        with self._cond:
            self._chunks.append(payload)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def recv_exact(self, n: int) -> bytes:
        with self._cond:
            while len(self._buf) < n:
                while not self._chunks and not self._closed:
                    self._cond.wait()
                if not self._chunks:
                    raise MuxClosed(f"connection {self.conn_id} closed")
                self._buf += self._chunks.popleft()
            data = bytes(self._buf[:n])
            del self._buf[:n]
            return data

    def sendall(self, data: bytes) -> None:
        self.mux.write(self.conn_id, data)


class Mux:
    """The trunk: one reader thread demultiplexes frames to the connections opened on it."""

    def __init__(self, trunk: socket.socket) -> None:
        self.trunk = trunk
        self._conns: dict[int, MuxConn] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="nri-mux", daemon=True)

    def open(self, conn_id: int) -> MuxConn:
        if conn_id == RESERVED_CONN:
            raise ValueError("connection id 0 is reserved")
        with self._lock:
            return self._conns.setdefault(conn_id, MuxConn(self, conn_id))

    def start(self) -> None:
        self._reader.start()

    def write(self, conn_id: int, data: bytes) -> None:
        if self._closed.is_set():
            raise MuxClosed("the trunk is closed")
        frame = encode_frame(conn_id, data)
        with self._write_lock:
            try:
                self.trunk.sendall(frame)
            except OSError as error:
                self.close()
                raise MuxClosed(f"writing to the trunk failed: {error}") from None

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def wait_closed(self, timeout: float | None = None) -> bool:
        return self._closed.wait(timeout)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self.trunk.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.trunk.close()
        with self._lock:
            for conn in self._conns.values():
                conn.close()

    def _read(self) -> None:
        try:
            while not self._closed.is_set():
                conn_id, length = HEADER.unpack(recv_exact(self.trunk, HEADER.size))
                payload = recv_exact(self.trunk, length) if length else b""
                with self._lock:
                    conn = self._conns.get(conn_id)
                if conn is not None:  # frames for connections nobody opened are dropped, as the Go side does
                    conn.feed(payload)
        except (MuxClosed, OSError):
            pass
        finally:
            self.close()
