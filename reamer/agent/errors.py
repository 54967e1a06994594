"""Errors the agent returns to API callers; the API maps each to an HTTP status and an error code."""
from __future__ import annotations

from typing import Any

from reamer.host.errors import ReamerError


class NotFound(ReamerError):
    code = "not_found"


class Conflict(ReamerError):
    code = "conflict"


class InvalidRequest(ReamerError):
    code = "invalid_request"


class AdmissionRefused(ReamerError):
    """An online job's rate cannot be served within its SLO on the free cores."""

    code = "admission_refused"

    def __init__(self, message: str, fix: str = "", achievable_rps: float | None = None,
                 layout: str | None = None) -> None:
        super().__init__(message, fix)
        self.achievable_rps = achievable_rps
        self.layout = layout

    @property
    def data(self) -> dict[str, Any]:
        return {"achievable_rps": self.achievable_rps, "layout": self.layout}
