"""Why the lab could not run: a skip (the host cannot emulate or build) is never reported as a pass."""
from __future__ import annotations


class LabSkip(Exception):
    def __init__(self, reason: str, fix: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.fix = fix
