"""The API's HTTP server: uvicorn on the agent's Unix socket, with the peer's credentials in every request.

uvicorn puts no socket in the ASGI scope, so the HTTP protocol is subclassed: on each connection it
reads SO_PEERCRED once (the kernel records it at connect()) and hands it to the app as
scope["reamer.peer"]. A connection that is not over a Unix socket carries None and the app refuses it.
"""
from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http import h11_impl
from uvicorn.protocols.http.h11_impl import H11Protocol

from reamer.host.identity import PeerCredentials, peer_credentials

PEER_SCOPE_KEY = "reamer.peer"

try:  # httptools is uvicorn's fast parser; h11 is its pure-Python fallback
    from uvicorn.protocols.http import httptools_impl
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _BaseProtocol
except ImportError:  # pragma: no cover - httptools is a dependency
    httptools_impl = None  # type: ignore[assignment]
    _BaseProtocol = H11Protocol  # type: ignore[misc,assignment]


class _WithPeer:
    """The app, with this connection's peer credentials added to each request's scope."""

    def __init__(self, app: Any, peer: PeerCredentials | None) -> None:
        self.app = app
        self.peer = peer

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        scope[PEER_SCOPE_KEY] = self.peer
        await self.app(scope, receive, send)


class PeerCredProtocol(_BaseProtocol):  # type: ignore[misc,valid-type]
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        peer = None
        if sock is not None and sock.family == socket.AF_UNIX:
            peer = peer_credentials(sock)  # asyncio's TransportSocket offers getsockopt
        self.app = _WithPeer(self.app, peer)


async def _over_capacity(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The answer beyond max_connections, in the API's error shape (uvicorn's own is a plain-text 503)."""
    body = json.dumps({"error": {
        "code": "over_capacity",
        "message": "the agent is serving as many connections and requests as security.max_connections allows",
        "fix": "retry shortly; close idle connections to the agent's socket, or raise security.max_connections"}})
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body.encode(), "more_body": False})


def make_server(app: Any, log_level: str = "info", timeout_graceful_shutdown: int = 3,
                max_connections: int | None = None) -> uvicorn.Server:
    """A uvicorn server for `app` that tells it who is calling; run it with server.run(sockets=[sock]).
    Beyond `max_connections` connections or requests in progress it answers 503 in the API's error shape."""
    # uvicorn's protocols answer their concurrency limit with their module's `service_unavailable`; the agent's
    # process serves only this API, so that answer becomes ours (tests/api/test_socket_gate.py checks it holds)
    for module in (h11_impl, httptools_impl):
        if module is not None:
            module.service_unavailable = _over_capacity  # type: ignore[attr-defined]
    return uvicorn.Server(uvicorn.Config(app, http=PeerCredProtocol, log_level=log_level, access_log=False,
                                         lifespan="off", timeout_graceful_shutdown=timeout_graceful_shutdown,
                                         limit_concurrency=max_connections))
