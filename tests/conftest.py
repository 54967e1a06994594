"""Shared test helpers: polling with deadlines, root checks, unique cgroup names."""
from __future__ import annotations

import os
import secrets
import time
from typing import Callable, TypeVar

import pytest

T = TypeVar("T")

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root: real cgroups and SCHED_RR")


def wait_for(predicate: Callable[[], T], timeout: float = 20.0, interval: float = 0.05, what: str = "condition") -> T:
    """Poll until predicate() is truthy; fail the test with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def unique_name(prefix: str = "reamer-test") -> str:
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"


@pytest.fixture
def cgroup_name() -> str:
    """A unique top-level cgroup name for one test (the test removes what it creates)."""
    return unique_name()
