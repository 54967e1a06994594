"""The API answers only callers whose credentials it knows (the Unix socket); bodies are size-limited."""
from __future__ import annotations

import asyncio
import socket
import threading
from types import SimpleNamespace

import httpx

from reamer.agent.config import SecurityConfig
from reamer.api.app import build_app
from reamer.api.fairness import SocketLimits
from reamer.api.server import make_server
from tests.conftest import wait_for


class _Untouchable:
    """An agent the gate must never reach: any use fails the test."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(security=SecurityConfig(max_body_kb=1))
        self.on_reconcile: list = []  # the metrics collector hooks in when the app is built
        self.gpu = None  # ... and registers the GPU's collector, when there is one

    def __getattr__(self, name: str):
        raise AssertionError(f"the request reached the agent ({name})")


def test_a_request_without_peer_credentials_is_refused_before_the_agent():
    app = build_app(_Untouchable())  # type: ignore[arg-type]

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
            return await client.post("/v1/demote-all")

    response = asyncio.run(call())
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "forbidden" and "unix_socket_only" in error["message"] and error["fix"]


def test_over_tcp_the_server_refuses_every_request():
    """The same server on a TCP socket (SO_PEERCRED has nothing to say there): 403, the agent untouched."""
    server = make_server(build_app(_Untouchable()), log_level="warning")  # type: ignore[arg-type]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=60, what="the server to start")
        response = httpx.get(f"http://127.0.0.1:{port}/v1/node", timeout=30)
        assert response.status_code == 403 and "unix_socket_only" in response.json()["error"]["message"]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def test_beyond_max_connections_the_answer_is_a_503_in_the_api_error_shape(tmp_path):
    """Two idle connections fill max_connections 1 and the admins' share of 1 (whether this test runs as root, an
    admin, or not): the next connection is refused before the app, in the API's shape (JSON error with a fix)."""
    limits = SocketLimits(max_connections=1, admin_reserved_connections=1, max_connections_per_uid=5)
    server = make_server(build_app(_Untouchable()), log_level="critical", limits=limits)  # type: ignore[arg-type]
    path = str(tmp_path / "api.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(8)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    idle = []
    try:
        wait_for(lambda: server.started, timeout=60, what="the server to start")
        book = server.config.http_protocol_class.book
        for _ in range(2):
            idle.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            idle[-1].connect(path)
        wait_for(lambda: book.total == (2 if book.admins else 1), timeout=60, what="the idle connections")
        with httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://reamer") as client:
            response = client.get("/v1/node", timeout=30)
        assert response.status_code == 503 and response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert error["code"] == "over_capacity" and "max_connections" in error["message"]
        assert "raise security.max_connections" in error["fix"]
    finally:
        for conn in idle:
            conn.close()
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
