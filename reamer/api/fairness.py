"""Who may hold the control socket's connections: caps per uid and overall, and a share kept for admins.

Admins are root and the members of security.admin_group (by the user database, never by what a caller
says). Other callers together hold at most `max_connections` connections and one uid at most
`max_connections_per_uid`; admins get in while fewer than `max_connections + admin_reserved_connections`
are open, so no number of other callers' connections, idle or busy, locks root or an admin out.

The refusals are JSON answers in the API's error shape, written the moment the connection is made.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from reamer.errors import ErrorKind
from reamer.host.access import in_group
from reamer.host.identity import PeerCredentials

if TYPE_CHECKING:
    from reamer.agent.config import SecurityConfig

ADMIN_CACHE_S = 5.0  # group membership is read from the user database (NSS: maybe LDAP) at most this often per uid


@dataclass(frozen=True)
class SocketLimits:
    """What one caller may cost the agent's HTTP server (security.* in the agent config)."""

    max_connections: int = 256  # non-admin connections open at once
    max_connections_per_uid: int = 32  # per non-admin uid
    admin_reserved_connections: int = 32  # admins get in while fewer than max_connections + this are open
    admin_group: Optional[str] = None
    header_timeout_s: float = 10.0  # request line + headers within this of the first byte; the body, of the headers
    idle_timeout_s: float = 30.0  # no request in progress this long: closed
    max_header_bytes: int = 32 << 10  # request line + headers
    # after a refusal, what the client still sends is read and dropped this long (or until it closes) before the
    # connection closes, so the refusal reaches it instead of a reset
    linger_s: float = 1.0
    # refused connections lingering at once; past this a refused connection is closed without the linger
    max_lingering: int = 256

    @classmethod
    def from_security(cls, security: "SecurityConfig") -> "SocketLimits":
        return cls(max_connections=security.max_connections,
                   max_connections_per_uid=security.max_connections_per_uid,
                   admin_reserved_connections=security.admin_reserved_connections,
                   admin_group=security.admin_group,
                   header_timeout_s=security.header_timeout_s,
                   idle_timeout_s=security.idle_timeout_s,
                   max_header_bytes=security.max_header_kb << 10)


@dataclass(frozen=True)
class Refusal:
    """A connection turned away: its kind (code and HTTP status, reamer.errors) and the JSON error body."""

    kind: ErrorKind
    message: str
    fix: str

    @property
    def status(self) -> int:
        return self.kind.status

    @property
    def code(self) -> str:
        return self.kind.code

    def response(self) -> bytes:
        """A whole HTTP/1.1 answer that closes the connection."""
        body = json.dumps({"error": {"code": self.code, "message": self.message, "fix": self.fix, "data": {}}}).encode()
        reason = {408: "Request Timeout", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
                  503: "Service Unavailable"}.get(self.status, "Error")
        extra = b"retry-after: 1\r\n" if self.status in (429, 503) else b""
        return (f"HTTP/1.1 {self.status} {reason}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n").encode() + extra + b"\r\n" + body


@dataclass(frozen=True)
class Slot:
    """A connection the book let in (release it once, when the connection is lost)."""

    uid: Optional[int]  # None: not a Unix socket (the app refuses every request on it)
    admin: bool


class ConnectionBook:
    """The connections open on one server, by uid, and the rule that admits a new one (event loop only)."""

    def __init__(self, limits: SocketLimits) -> None:
        self.limits = limits
        self.by_uid: Counter[Optional[int]] = Counter()  # non-admin connections per uid
        self.others = 0  # non-admin connections
        self.admins = 0
        self.lingering = 0  # refused connections still being closed
        self._admin_cache: dict[int, tuple[bool, float]] = {}

    @property
    def total(self) -> int:
        return self.others + self.admins

    def is_admin(self, peer: PeerCredentials | None) -> bool:
        if peer is None:
            return False
        if peer.uid == 0:
            return True
        if not self.limits.admin_group:
            return False
        now = time.monotonic()
        cached = self._admin_cache.get(peer.uid)
        if cached is not None and cached[1] > now:
            return cached[0]
        admin = in_group(peer.uid, peer.gid, self.limits.admin_group)
        if len(self._admin_cache) > 4096:  # bounded whatever the number of uids that connect
            self._admin_cache.clear()
        self._admin_cache[peer.uid] = (admin, now + ADMIN_CACHE_S)
        return admin

    def admit(self, peer: PeerCredentials | None) -> Slot | Refusal:
        """Let the connection of `peer` in (a Slot) or say why not (a Refusal)."""
        limits = self.limits
        admin = self.is_admin(peer)
        uid = None if peer is None else peer.uid
        if admin:
            ceiling = limits.max_connections + limits.admin_reserved_connections
            if self.total >= ceiling:
                return Refusal(ErrorKind.OVER_CAPACITY,
                               f"the agent already has {self.total} connections open, admins' included "
                               "(security.max_connections + security.admin_reserved_connections)",
                               "close idle connections to the agent's socket, or raise "
                               "security.max_connections or security.admin_reserved_connections")
            self.admins += 1
            return Slot(uid, True)
        if self.by_uid[uid] >= limits.max_connections_per_uid:
            return Refusal(ErrorKind.TOO_MANY_CONNECTIONS,
                           f"uid {uid} already has {self.by_uid[uid]} connections open to the agent "
                           "(security.max_connections_per_uid)",
                           "close idle connections (one keep-alive connection is enough), or ask an admin to "
                           "raise security.max_connections_per_uid")
        if self.others >= limits.max_connections:
            return Refusal(ErrorKind.OVER_CAPACITY,
                           f"the agent is serving as many connections as security.max_connections allows "
                           f"({limits.max_connections}, admins aside)",
                           "retry shortly; close idle connections to the agent's socket, or raise "
                           "security.max_connections")
        self.others += 1
        self.by_uid[uid] += 1
        return Slot(uid, False)

    def release(self, slot: Slot) -> None:
        if slot.admin:
            self.admins -= 1
            return
        self.others -= 1
        self.by_uid[slot.uid] -= 1
        if self.by_uid[slot.uid] <= 0:
            del self.by_uid[slot.uid]


def header_too_large(limit: int) -> Refusal:
    return Refusal(ErrorKind.HEADERS_TOO_LARGE,
                   f"the request line and headers are larger than {limit // 1024} KiB (security.max_header_kb)",
                   "send fewer or shorter headers (or raise security.max_header_kb in the agent's config)")


def request_timeout(seconds: float, what: str) -> Refusal:
    return Refusal(ErrorKind.REQUEST_TIMEOUT,
                   f"the request's {what} did not arrive within {seconds:g} s (security.header_timeout_s)",
                   "send each request whole and at once; a client on a slow link may raise "
                   "security.header_timeout_s")
