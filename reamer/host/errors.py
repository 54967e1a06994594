"""Errors a user can cause or fix: each carries the problem and the fix."""
from __future__ import annotations


class ReamerError(Exception):
    """Base of every error reamer shows to a user: a message and, where known, the fix."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.message} — fix: {self.fix}" if self.fix else self.message


class HostError(ReamerError):
    """The kernel refused or lacks something reamer needs."""


class PermissionProblem(HostError):
    """An operation needs a privilege or a kernel setting this process does not have."""
