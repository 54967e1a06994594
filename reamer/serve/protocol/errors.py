"""The inference protocol's errors in one table: each fault, its HTTP status and its gRPC status code.

Triton keeps one error-code enum and maps it once per front end; so do we. A door answers a fault with
`fault.http` (REST) or `grpc.StatusCode[fault.grpc]` (gRPC, looked up once in the door), and the runtime's
errors carry the fault they stand for (`fault` on the exception class), so no door tests error types.
"""
from __future__ import annotations

from enum import Enum

from reamer.host.errors import ReamerError


class Fault(Enum):
    """A protocol error: (HTTP status, gRPC status code name, when)."""

    BAD_INPUT = (400, "INVALID_ARGUMENT", "what the client sent is wrong (the message names the field)")
    UNKNOWN_MODEL = (404, "NOT_FOUND", "another model, or a version this job does not serve")
    NOT_READY = (503, "UNAVAILABLE", "still loading, shed, an instance crashed or is stopping")
    MODEL_FAULT = (500, "INTERNAL", "the model's answer could not be handed back")
    INTERNAL = (500, "INTERNAL", "a bug of ours: one request fails, the door keeps serving")
    TOO_LARGE = (413, "RESOURCE_EXHAUSTED", "a request over the job's max_request_mb")
    BUSY = (503, "RESOURCE_EXHAUSTED", "the job holds too many request bytes or connections")
    TOO_SLOW = (408, "DEADLINE_EXCEEDED", "headers, body or message did not arrive in time")

    @property
    def http(self) -> int:
        return self.value[0]

    @property
    def grpc(self) -> str:
        return self.value[1]


class BadRequest(ReamerError):
    """The client sent a request the model cannot take (Fault.BAD_INPUT: 400, INVALID_ARGUMENT)."""

    fault = Fault.BAD_INPUT
