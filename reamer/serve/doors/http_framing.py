"""HTTP/1.1 framing of the REST door's answers: status lines and headers. Only the doors know HTTP.

An instance that answers a client on its socket itself (reply-through) gets the head of its answer from here,
as a template the door puts in the request's ReplyPlan (`binary_reply_head`): the instance fills in the
lengths and the Server-Timing value, and never learns how HTTP frames them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import orjson

from reamer.serve.protocol.v2wire import HEADER_LENGTH, SERVER_NAME

_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\nserver: {SERVER_NAME}" for s in HTTPStatus}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def http_head(status: int, content_type: str, length: int, headers: dict[str, str], keep_alive: bool) -> bytes:
    """The status line and headers of a response with a `length`-byte body."""
    lines = [_STATUS_LINES[status], f"content-type: {content_type}", f"content-length: {length}"]
    lines += [f"{k}: {v}" for k, v in headers.items() if k != "connection"]
    if not keep_alive:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _binary_reply_head(keep_alive: bool) -> bytes:
    lines = [_STATUS_LINES[200], "content-type: application/octet-stream", "content-length: %d",
             f"{HEADER_LENGTH}: %d", "server-timing: %s"]
    if not keep_alive:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# what http_head writes for a 200 binary answer, with its three values left open (see v2wire.ReplyPlan)
_BINARY_REPLY_HEADS = {keep_alive: _binary_reply_head(keep_alive) for keep_alive in (True, False)}


def binary_reply_head(keep_alive: bool) -> bytes:
    """The head of an all-binary infer answer, as a bytes %-template of (body length, JSON header length,
    Server-Timing value as bytes). Bytes, so it crosses the pipe to the instance as a plain copy."""
    return _BINARY_REPLY_HEADS[keep_alive]


@dataclass
class Reply:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    sent: bool = False  # an instance answered the client on its socket; `body` is the unsent rest
    close: bool = False  # close the connection without writing (an instance's answer was cut off)


@dataclass(frozen=True)
class ClientSocket:
    """The connection a request came on, when an instance may answer on it directly."""

    fd: int
    keep_alive: bool



def json_reply(status: int, doc: Any) -> Reply:
    return Reply(status, orjson.dumps(doc))


def error_reply(status: int, message: str, **headers: str) -> Reply:
    """`{"error": message}` with `status` (a door's Fault.http, or an HTTP-only status such as 404, 405, 414)."""
    return Reply(status, orjson.dumps({"error": message}), headers=headers)
