"""What one client may cost an inference job, for both doors (DoorLimits): set from the agent config's
`inference.frontdoor` section through the job spec. The REST door applies every field; the gRPC door those
gRPC has a knob for (see doors/grpc.GrpcFrontDoor).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from reamer.host.errors import ReamerError

DEFAULT_MAX_REQUEST_BYTES = 64 << 20


@dataclass(frozen=True)
class DoorLimits:
    """What one client may cost the job. Defaults follow nginx's (client_header_timeout,
    client_body_timeout, keepalive_timeout, send_timeout, large_client_header_buffers)."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a larger body: 413
    max_connections: int = 1024  # more: 503 and closed at once
    header_timeout_s: float = 60.0  # the request line and headers must arrive within this: else 408
    body_timeout_s: float = 60.0  # between two reads of a body: else 408
    idle_timeout_s: float = 75.0  # a keep-alive connection with nothing to do is closed after this
    send_timeout_s: float = 60.0  # a client that takes none of its answer for this long is cut off
    max_url_bytes: int = 8192  # longer: 414
    max_header_bytes: int = 32768  # header section larger: 431
    max_pipelined: int = 16  # unanswered requests queued per connection before reading pauses
    # (also by bytes: reading pauses while the queued bodies of one connection hold more than this)
    max_pipelined_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_buffered_bytes: int = 4 * DEFAULT_MAX_REQUEST_BYTES  # bodies held by all connections: past it, 503
    write_high_water: int = 1 << 20  # unsent answer bytes over which a connection's next request waits
    offload_bytes: int = 1 << 16  # JSON bodies (and JSON answers) larger than this are coded off the loop
    # after a refusal, what the client still sends is read and dropped this long before the connection is
    # closed, so the refusal reaches it (closing with unread input sends a reset that can destroy it)
    linger_s: float = 5.0

    @property
    def buffered_budget(self) -> int:
        return max(self.max_buffered_bytes, self.max_request_bytes)

    # config keys (agent config `inference.frontdoor`, job spec `frontdoor`) whose unit differs from a field's
    _SCALED = {"max_buffered_mb": ("max_buffered_bytes", 1 << 20), "json_offload_kb": ("offload_bytes", 1 << 10)}

    @classmethod
    def from_settings(cls, max_request_mb: float, settings: dict[str, Any]) -> "DoorLimits":
        """The limits of a job spec: its max_request_mb and its `frontdoor` section (config key names)."""
        request = int(max_request_mb * 2**20)
        values: dict[str, Any] = {"max_request_bytes": request, "max_pipelined_bytes": request}
        known = {f.name for f in fields(cls)}
        for key, value in settings.items():
            name, scale = cls._SCALED.get(key, (key, None))
            if name not in known or name in ("max_request_bytes", "max_pipelined_bytes"):
                raise ReamerError(f"job spec frontdoor has unknown key {key!r}",
                                  "use the keys of the agent config's inference.frontdoor section")
            values[name] = int(value * scale) if scale else value
        return cls(**values)
