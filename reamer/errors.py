"""Errors a user can cause or fix, and the one table of what each kind means on the wire and on the command line.

Every user-facing error is a ReamerError: a message and, where known, the fix. Each error class names its
`kind`, a row of ErrorKind: the error code and HTTP status the API answers with, and the exit status of a
`reamer` command that fails with it in its own process. The API (reamer.api.app) and the CLI
(reamer.cli.common) look both up here, and nowhere else; the layers that raise errors only pick a row.

An error the CLI reads from the agent's answer (reamer.api.client.ApiError) carries the code and status the
agent sent; its exit status follows from that status (exit_code_for_status), so an agent of another version
still gets the right one.

This module is the bottom of the house: it imports nothing of reamer.
"""
from __future__ import annotations

from enum import Enum
from typing import ClassVar

EXIT_FAILURE = 1  # something failed (the agent, the host, a job)
EXIT_BAD_INPUT = 2  # what the user typed or wrote is wrong; fix it and run the command again
# HTTP statuses that say "not now" or "not like this" rather than "your input is wrong": a command that
# gets one exits EXIT_FAILURE, any other 4xx EXIT_BAD_INPUT.
NOT_INPUT_MISTAKES = frozenset({408, 409, 423, 429})


class ErrorKind(Enum):
    """code (the API's error.code), HTTP status, the CLI's exit status for an error raised in its process."""

    # --- the request or the input is wrong ---
    REJECTED = ("rejected", 400, EXIT_FAILURE)  # any other ReamerError the agent raises
    BAD_INPUT = ("rejected", 400, EXIT_BAD_INPUT)  # a config, spec, sample or value the user gave is wrong
    INVALID_REQUEST = ("invalid_request", 400, EXIT_FAILURE)  # the agent refused a request's content
    INVALID_FIELDS = ("invalid_request", 422, EXIT_BAD_INPUT)  # the request does not match the schema
    HOST_REFUSED = ("host_refused", 400, EXIT_FAILURE)  # the kernel refused or lacks something
    # --- who may do what ---
    FORBIDDEN = ("forbidden", 403, EXIT_FAILURE)  # the access policy refused (error.data.rule names the rule)
    # --- what was asked for does not exist ---
    NOT_FOUND = ("not_found", 404, EXIT_FAILURE)
    CONTAINER_NOT_FOUND = ("container_not_found", 404, EXIT_FAILURE)
    UNKNOWN_GPU = ("unknown_gpu", 404, EXIT_FAILURE)
    METHOD_NOT_ALLOWED = ("method_not_allowed", 405, EXIT_FAILURE)
    HTTP_ERROR = ("http_error", 400, EXIT_FAILURE)  # any other HTTP error of the framework (its own status)
    # --- the node's state does not allow it now ---
    CONFLICT = ("conflict", 409, EXIT_FAILURE)
    ADMISSION_REFUSED = ("admission_refused", 409, EXIT_FAILURE)  # error.data: achievable_rps, layout
    INSUFFICIENT_CORES = ("insufficient_cores", 409, EXIT_FAILURE)
    RT_THROTTLING_DISABLED = ("rt_throttling_disabled", 409, EXIT_FAILURE)
    GPU_UNAVAILABLE = ("gpu_unavailable", 409, EXIT_FAILURE)
    GPU_LIMITS = ("gpu_limits", 409, EXIT_FAILURE)
    GPU_REFUSED = ("gpu_refused", 409, EXIT_FAILURE)
    GPU_BAD_CONFIG = ("gpu_refused", 409, EXIT_BAD_INPUT)  # the gpu section of the config is invalid
    # --- the socket's limits (reamer.api.app, reamer.api.fairness) ---
    REQUEST_TIMEOUT = ("request_timeout", 408, EXIT_FAILURE)
    BODY_TOO_LARGE = ("body_too_large", 413, EXIT_FAILURE)
    TOO_MANY_LONG_POLLS = ("too_many_long_polls", 429, EXIT_FAILURE)
    TOO_MANY_CONNECTIONS = ("too_many_connections", 429, EXIT_FAILURE)
    HEADERS_TOO_LARGE = ("headers_too_large", 431, EXIT_FAILURE)
    # --- the agent cannot serve it ---
    INTERNAL = ("internal", 500, EXIT_FAILURE)  # a bug: the agent log has the traceback
    STORE_UNAVAILABLE = ("store_unavailable", 503, EXIT_FAILURE)
    MPS_UNAVAILABLE = ("mps_unavailable", 503, EXIT_FAILURE)
    OVER_CAPACITY = ("over_capacity", 503, EXIT_FAILURE)

    def __init__(self, code: str, status: int, exit_code: int) -> None:
        self.code = code
        self.status = status
        self.exit_code = exit_code


def exit_code_for_status(status: int) -> int:
    """The exit status of a command the agent answered with an HTTP error `status`."""
    return EXIT_BAD_INPUT if 400 <= status < 500 and status not in NOT_INPUT_MISTAKES else EXIT_FAILURE


class ReamerError(Exception):
    """Base of every error reamer shows to a user: a message and, where known, the fix."""

    kind: ClassVar[ErrorKind] = ErrorKind.REJECTED

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.message} — fix: {self.fix}" if self.fix else self.message

    @property
    def code(self) -> str:
        return self.kind.code

    @property
    def status(self) -> int:
        return self.kind.status
