"""Host-level tests: they run only inside a lab VM booted by `make test-hosts` (REAMER_LAB_PROFILE set by
lab/guest/job.sh), against the real kernel, systemd and container engines there. Outside a lab VM every
test here is skipped with the reason, so `make test` reports them as skipped, never as passed.

A test marked `@pytest.mark.profiles("v1", ...)` runs only on those profiles and is deselected on the
others (one VM per profile; each test says where it means something)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

LAB_PROFILE = os.environ.get("REAMER_LAB_PROFILE", "")
HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "profiles(*names): run only on these lab host profiles")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    outside = pytest.mark.skip(reason="host-level test: runs only inside a lab VM (make test-hosts boots one)")
    keep, drop = [], []
    for item in items:
        if HERE not in Path(item.path).parents:
            keep.append(item)
            continue
        if not LAB_PROFILE:
            item.add_marker(outside)
            keep.append(item)
            continue
        marker = item.get_closest_marker("profiles")
        unmarked_here = _profile_runs_unmarked_tests()
        (keep if (marker is None and unmarked_here) or (marker and LAB_PROFILE in marker.args) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _profile_runs_unmarked_tests() -> bool:
    from tests.hosts.helpers import PROFILE  # puts the checkout on sys.path for lab.profiles

    return PROFILE is None or PROFILE.runs_unmarked_tests


@pytest.fixture(scope="session")
def service():
    """reamer installed as docs/operators.md's "Operating the service" tells an operator (the virtualenv is the
    checkout's, already installed by `make test-hosts`), started with `systemctl enable --now reamer`.
    Returns how long `systemctl enable --now` took (it returns once the agent sent READY=1)."""
    import time

    from tests.hosts.helpers import REPO, sh, wait_active

    sh(["install", "-D", "-m", "0644", f"{REPO}/configs/reamer.yaml", "/etc/reamer/reamer.yaml"])
    sh(["install", "-m", "0644", f"{REPO}/systemd/reamer.service", "/etc/systemd/system/reamer.service"])
    sh(["ln", "-sf", f"{REPO}/.venv/bin/reamer", "/usr/local/bin/reamer"])
    started = time.monotonic()
    sh("systemctl daemon-reload && systemctl enable --now reamer", timeout=600)
    took = time.monotonic() - started
    wait_active()
    return took
