"""Errors of the host layer a user can cause or fix: each carries the problem and the fix.

ReamerError, the base of every user-facing error, and the table of their codes live in reamer.errors;
it is imported from here too, as every layer always has.
"""
from __future__ import annotations

from reamer.errors import ErrorKind, ReamerError

__all__ = ["HostError", "PermissionProblem", "ReamerError"]


class HostError(ReamerError):
    """The kernel refused or lacks something reamer needs."""

    kind = ErrorKind.HOST_REFUSED


class PermissionProblem(HostError):
    """An operation needs a privilege or a kernel setting this process does not have."""
