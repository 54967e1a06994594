"""The API's HTTP server: uvicorn on the agent's Unix socket, with the peer's credentials in every request,
and no caller able to take the socket from the others.

uvicorn puts no socket in the ASGI scope, so the HTTP protocol is subclassed: on each connection it
reads SO_PEERCRED once (the kernel records it at connect()) and hands it to the app as
scope["reamer.peer"]. A connection that is not over a Unix socket carries None and the app refuses it.

The same subclass keeps the socket fair (reamer.api.fairness has the rules):
- connections are counted per uid and overall, at connect(); beyond a cap the caller gets its JSON 429/503
  at once and the connection closes. Root and security.admin_group have a reserved share above the cap, so
  they always get in on the one socket (the CLI needs no other path).
- a connection with nothing in progress is closed after idle_timeout_s (uvicorn's keep-alive timer, armed
  at connect() too: uvicorn arms it only after a first answer); a request's line and headers must arrive
  within header_timeout_s of its first byte (of connect(), for a connection's first request) and its body
  within header_timeout_s of its headers (slowloris). A request being answered (a long-poll) has no clock.
- the request line and headers are counted as they are fed to httptools, which has no limit of its own:
  past max_header_bytes the answer is 431 and the rest is never read.
uvicorn's own limit_concurrency is off: it counts every connection alike, so idle ones locked root out.
"""
from __future__ import annotations

import asyncio
import grp
import os
import socket
import stat
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # httptools is a dependency of reamer

from reamer.api.fairness import (ConnectionBook, Refusal, Slot, SocketLimits, header_too_large,
                                 request_timeout)
from reamer.host.errors import ReamerError
from reamer.host.identity import PeerCredentials, peer_credentials

PEER_SCOPE_KEY = "reamer.peer"

SOCKET_MODE = 0o660


class SocketInUse(ReamerError):
    pass


def bind_unix_socket(path: str | Path, group: str | None = None) -> socket.socket:
    """Listen on `path`, created 0660 from the start (umask), replacing a stale socket file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReamerError(f"cannot create the socket directory {path.parent}: {exc.strerror}",
                          "pick a writable place with --socket, or run as root") from None
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise SocketInUse(f"{path} exists and is not a socket", "remove it or choose another --socket path")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale: nobody listens
        else:
            raise SocketInUse(f"another process (an agent?) already listens on {path}",
                              "stop it first (systemctl stop reamer), or give this one another --socket")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o117)  # the socket is never group-/world-accessible beyond 0660, not even briefly
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise ReamerError(f"cannot listen on {path}: {exc.strerror}", "check the directory's permissions") from None
    finally:
        os.umask(old_umask)
    os.chmod(path, SOCKET_MODE)
    if group is not None:
        try:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        except KeyError:
            sock.close()
            path.unlink()
            raise ReamerError(f"socket_group {group!r} is not a group on this host",
                              f"create it (groupadd {group}) or change socket_group in the config") from None
    sock.listen(128)
    return sock


class _WithPeer:
    """The app, with this connection's peer credentials added to each request's scope."""

    def __init__(self, app: Any, peer: PeerCredentials | None) -> None:
        self.app = app
        self.peer = peer

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        scope[PEER_SCOPE_KEY] = self.peer
        await self.app(scope, receive, send)


class PeerCredProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the caller's credentials, connection caps, timeouts and a header cap.
    make_server() makes a subclass per server that sets `limits` and `book`."""

    limits: SocketLimits = SocketLimits()
    book: ConnectionBook | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slot: Slot | None = None
        self._refused = False  # answered with a refusal: input is dropped until the close
        self._lingering = False
        self._deadline: asyncio.TimerHandle | None = None  # the header or body clock
        self._in_head = True  # the next bytes belong to a request line or headers
        self._head_bytes = 0
        self._heads = 0  # header sections completed on this connection

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        peer = None
        if sock is not None and sock.family == socket.AF_UNIX:
            peer = peer_credentials(sock)  # asyncio's TransportSocket offers getsockopt
        self.app = _WithPeer(self.app, peer)
        if self.book is not None:
            admitted = self.book.admit(peer)
            if isinstance(admitted, Refusal):
                self._refuse(admitted)
                return
            self._slot = admitted
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
        self._arm(self.limits.header_timeout_s, "request line and headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._slot is not None and self.book is not None:
            self.book.release(self._slot)
            self._slot = None
        if self._lingering and self.book is not None:
            self.book.lingering -= 1
            self._lingering = False
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            room = self.limits.max_header_bytes - self._head_bytes
            if len(data) > room:
                heads = self._heads
                if room > 0:
                    self._head_bytes += room
                    super().data_received(data[:room])
                if self._refused or self.transport.is_closing():
                    return
                if self._heads == heads:  # that many bytes and the header section is still not complete
                    self._refuse(header_too_large(self.limits.max_header_bytes))
                    return
                self.data_received(data[room:])  # the headers ended within it: the rest is body or a next request
                return
            self._head_bytes += len(data)
        super().data_received(data)

    def eof_received(self) -> bool | None:
        if self._refused and not self.transport.is_closing():
            self.transport.close()  # the client has read the refusal and closed its side
        return None

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:
            self._arm(self.limits.header_timeout_s, "request line and headers")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._heads += 1
        self._head_bytes = 0
        self._disarm()
        super().on_headers_complete()
        if not self.pipeline:  # a request queued behind another is not read until its turn: no clock then
            self._arm(self.limits.header_timeout_s, "body")

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head = True
        super().on_message_complete()

    # -- clocks and refusals
    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired, seconds, what)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, seconds: float, what: str) -> None:
        self._deadline = None
        if self.transport.is_closing() or self._refused:
            return
        self._refuse(request_timeout(seconds, what))

    def _refuse(self, refusal: Refusal) -> None:
        """Answer `refusal` (unless an answer is already being written on this connection) and close: after
        what the client still sends has been dropped for linger_s, or at once when too many linger."""
        self._refused = True
        self._disarm()
        self._unset_keepalive_if_required()
        transport = self.transport
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:
                transport.close()  # an answer is being written: it cannot be followed by another
                return
            cycle.disconnected = True  # the app waiting for this body hears that the client is gone, and is mute
            cycle.message_event.set()
        transport.write(refusal.response())
        if self.book is None or self.book.lingering >= self.limits.max_lingering or not transport.can_write_eof():
            transport.close()
            return
        self.book.lingering += 1
        self._lingering = True
        transport.write_eof()  # the answer, then EOF; reading goes on (and drops) until the client closes
        self.loop.call_later(self.limits.linger_s, transport.close)


def make_server(app: Any, log_level: str = "info", timeout_graceful_shutdown: int = 3,
                limits: SocketLimits | None = None) -> uvicorn.Server:
    """A uvicorn server for `app` that tells it who is calling and keeps the socket fair (see the module's
    doc); run it with server.run(sockets=[sock])."""
    limits = limits or SocketLimits()
    protocol = type("FairPeerCredProtocol", (PeerCredProtocol,), {"limits": limits, "book": ConnectionBook(limits)})
    return uvicorn.Server(uvicorn.Config(app, http=protocol, log_level=log_level, access_log=False,
                                         lifespan="off", timeout_graceful_shutdown=timeout_graceful_shutdown,
                                         timeout_keep_alive=limits.idle_timeout_s))  # type: ignore[arg-type]
