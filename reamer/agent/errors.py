"""Errors the agent returns to API callers; each names its row of reamer.errors.ErrorKind (code and HTTP status)."""
from __future__ import annotations

from typing import Any

from reamer.errors import ErrorKind, ReamerError


class NotFound(ReamerError):
    kind = ErrorKind.NOT_FOUND


class Conflict(ReamerError):
    kind = ErrorKind.CONFLICT


class InvalidRequest(ReamerError):
    kind = ErrorKind.INVALID_REQUEST


class AdmissionRefused(ReamerError):
    """An online job's rate cannot be served within its SLO on the free cores."""

    kind = ErrorKind.ADMISSION_REFUSED

    def __init__(self, message: str, fix: str = "", achievable_rps: float | None = None,
                 layout: str | None = None) -> None:
        super().__init__(message, fix)
        self.achievable_rps = achievable_rps
        self.layout = layout

    @property
    def data(self) -> dict[str, Any]:
        return {"achievable_rps": self.achievable_rps, "layout": self.layout}
