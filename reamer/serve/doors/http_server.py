"""The REST door's HTTP/1.1 server: a small asyncio protocol over httptools (the C parser uvicorn uses), not an
ASGI stack: uvicorn + FastAPI cost about 1.6 ms of CPU per request on the job's core, which is more than
the whole ≤ 1 ms overhead budget of the front door (bench/RESULTS.md). It keeps connections alive,
answers pipelined requests in order, takes chunked bodies and `Expect: 100-continue`, and refuses a
body over the size limit with 413. What a request means is the router's (doors/rest.V2App).

Hostile clients are bounded (DoorLimits, doors/limits.py): header, body, idle and send timeouts, a connection
cap, URL and header size limits, pipelining bounded by count and bytes, a cap on request bytes held by all
connections, and back-pressure on a client that does not read its answers. Errors are `{"error": "message"}`:
408 headers or body too slow, 413 request too large, 414 URL too long, 431 headers too large, 503 too many
connections or buffered bodies, 500 a fault of ours (the connection keeps serving). A refused request is
logged in one line (rate-limited, ClientErrorLog).
"""
from __future__ import annotations

import asyncio
import socket
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import httptools
import orjson

from reamer.host.errors import ReamerError
from reamer.serve.doors.http_framing import CONTINUE, ClientSocket, Reply, error_reply, http_head
from reamer.serve.doors.limits import DoorLimits
from reamer.serve.protocol.errors import Fault

if TYPE_CHECKING:
    from reamer.serve.doors.rest import V2App


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


@dataclass
class _Incoming:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes | bytearray  # a bytearray when read straight into its buffer
    keep_alive: bool
    refused: Reply | None = None  # answered without running the app (bad request, too large)
    held: int = 0  # body bytes counted against the connection's and the door's budgets


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
            reply = error_reply(Fault.BUSY.http, f"this job already has {self.limits.max_connections} open connections "
                                "(its max_connections); retry shortly, or reuse a keep-alive connection",
                           **{"retry-after": "1"})
            transport.write(http_head(reply.status, reply.content_type, len(reply.body), reply.headers, False) + reply.body)
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
            self._refuse(error_reply(Fault.BAD_INPUT.http, "protocol upgrades are not supported", connection="close"))
            return
        except httptools.HttpParserError as exc:
            self._refuse(error_reply(Fault.BAD_INPUT.http, f"malformed HTTP request ({exc})", connection="close"))
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
            self._refuse(error_reply(414, f"the URL is over {self.limits.max_url_bytes} bytes (the job's max_url_bytes); "
                                     "put data in the request body", connection="close"))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._broken:
            return
        self._header_bytes += len(name) + len(value) + 4
        if self._header_bytes > self.limits.max_header_bytes:
            self._refuse(error_reply(431, f"the request headers are over {self.limits.max_header_bytes} bytes "
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
                self.transport.write(CONTINUE)

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
            self._refuse(error_reply(Fault.BUSY.http, "this job is receiving too many request bodies at once (its max_buffered_mb); "
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
            self._refuse(error_reply(Fault.TOO_SLOW.http, f"the request headers did not arrive within {self.limits.header_timeout_s:g} s "
                                     "(the job's header_timeout_s)", connection="close"))
        elif self._state == _BODY and not self._owe_continue and now - self._since > self.limits.body_timeout_s:
            self._refuse(error_reply(Fault.TOO_SLOW.http, f"the request body stalled for {self.limits.body_timeout_s:g} s "
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
        return error_reply(Fault.TOO_LARGE.http, f"request body is over this job's limit of {limit} bytes ({limit / 2**20:g} MiB); "
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
                reply = error_reply(Fault.INTERNAL.http, f"internal error while serving {incoming.path}: {exc}")
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
                self.transport.write(CONTINUE)
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
