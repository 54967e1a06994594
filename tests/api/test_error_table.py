"""Every error's code and HTTP status come from one table (reamer.errors.ErrorKind), and the API answers each
error class with the code and status it always has (clients and scripts match on them); the CLI's exit status
comes from the same table. The app runs on a real server and Unix socket; the agent behind it only raises."""
from __future__ import annotations

import socket
import threading
from types import SimpleNamespace
from typing import Iterator

import pytest

from reamer.agent.config import ConfigError, SecurityConfig
from reamer.agent.errors import AdmissionRefused, Conflict, InvalidRequest, NotFound
from reamer.agent.policy import Forbidden
from reamer.agent.store import StoreError
from reamer.agent.training import RtThrottlingDisabled
from reamer.api.app import build_app
from reamer.api.client import ApiClient, ApiError, AgentUnreachable
from reamer.api.server import make_server
from reamer.cli.common import BadInput, exit_code_for
from reamer.errors import EXIT_BAD_INPUT, EXIT_FAILURE, ErrorKind, ReamerError
from reamer.gpu.errors import (GpuConfigError, GpuError, LatencyModelError, LimitError, MpsError, NoGpuDriver,
                               UnknownGpu, UnknownJob)
from reamer.host.container import ContainerNotFound
from reamer.host.errors import HostError, PermissionProblem
from reamer.plan.coretable import AllocationError
from reamer.serve.models import UnknownModelFamily
from reamer.serve.samples import SampleError
from reamer.serve.spec import SpecError
from tests.conftest import wait_for

# What the API answered for each error before the table (the isinstance ladder of reamer/api/app.py):
# (error, HTTP status, code). Changing a row changes what clients see.
AGENT_ROUTE_ANSWERS = [
    (Forbidden("some_rule", "not yours", "ask root"), 403, "forbidden"),
    (NotFound("no such job", "see list"), 404, "not_found"),
    (AdmissionRefused("too slow", "lower --rate", achievable_rps=12.5, layout="1x1:b1"), 409, "admission_refused"),
    (Conflict("taken", "pick another name"), 409, "conflict"),
    (AllocationError("3 cores asked, 2 free", "detach one"), 409, "insufficient_cores"),
    (RtThrottlingDisabled(), 409, "rt_throttling_disabled"),
    (StoreError("disk full", "free space"), 503, "store_unavailable"),
    (InvalidRequest("bad pid", "give a pid"), 400, "invalid_request"),
    (ContainerNotFound("no container abc", "check the id"), 404, "container_not_found"),
    (HostError("EPERM", "run as root"), 400, "host_refused"),
    (PermissionProblem("no CAP_SYS_NICE", "run as root"), 400, "host_refused"),
    (ReamerError("anything else", "fix it"), 400, "rejected"),
    (SpecError("bad spec", "fix the spec"), 400, "rejected"),
    (ConfigError("bad key", "fix the config"), 400, "rejected"),
]
# The GPU routes answered GPU-layer errors with GPU-specific statuses and codes.
GPU_ROUTE_ANSWERS = [
    (UnknownJob("no GPU job x", "see list"), 404, "not_found"),
    (UnknownGpu("no GPU 7", "see reamer gpu status"), 404, "unknown_gpu"),
    (NoGpuDriver("no driver", "install it"), 409, "gpu_unavailable"),
    (LimitError("110%", "lower sm_percent"), 409, "gpu_limits"),
    (MpsError("MPS does not answer", "restart it"), 503, "mps_unavailable"),
    (GpuError("refused", "see status"), 409, "gpu_refused"),
    (GpuConfigError("bad gpu section", "fix it"), 409, "gpu_refused"),
    (LatencyModelError("cannot fit", "more samples"), 409, "gpu_refused"),
    (NotFound("GPU manager not running", "see status"), 404, "not_found"),
]


class _RaisingAgent:
    """Just enough of an Agent for build_app; its reads raise whatever the test puts in `error`."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(security=SecurityConfig())
        self.on_reconcile: list = []
        self.gpu = None
        self.error: Exception = ReamerError("unset")

    def get_training(self, name: str) -> dict:
        raise self.error

    def gpu_job(self, name: str) -> dict:
        raise self.error


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[_RaisingAgent, ApiClient]]:
    agent = _RaisingAgent()
    server = make_server(build_app(agent), log_level="warning")  # type: ignore[arg-type]
    path = str(tmp_path_factory.mktemp("api") / "api.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(8)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=60, what="the server to start")
        with ApiClient(path, timeout=60) as client:
            yield agent, client
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def _answer(client: ApiClient, route: str) -> ApiError:
    with pytest.raises(ApiError) as info:
        client.request("GET", route)
    return info.value


@pytest.mark.parametrize("error,status,code", AGENT_ROUTE_ANSWERS, ids=lambda v: type(v).__name__)
def test_each_error_keeps_its_code_and_status(served, error, status, code):
    agent, client = served
    agent.error = error
    answer = _answer(client, "/v1/training-jobs/x")
    assert (answer.status, answer.code) == (status, code)
    assert (error.status, error.code) == (status, code)  # the error carries them too
    assert answer.message.startswith(error.message) and answer.fix == error.fix
    if isinstance(error, (AdmissionRefused, Forbidden)):
        assert answer.data == error.data
    else:
        assert answer.data == {}


@pytest.mark.parametrize("error,status,code", GPU_ROUTE_ANSWERS, ids=lambda v: type(v).__name__)
def test_gpu_errors_keep_their_gpu_codes(served, error, status, code):
    agent, client = served
    agent.error = error
    answer = _answer(client, "/v1/gpu-jobs/x")
    assert (answer.status, answer.code) == (status, code)
    assert answer.data == {}


def test_an_unexpected_exception_is_a_500_in_the_same_shape(served):
    agent, client = served
    agent.error = KeyError("boom")
    answer = _answer(client, "/v1/training-jobs/x")
    assert (answer.status, answer.code) == (ErrorKind.INTERNAL.status, "internal") == (500, "internal")
    assert "Traceback" not in answer.message and answer.fix


@pytest.mark.parametrize("error,exit_code", [
    (ApiError(400, "rejected", "refused"), EXIT_BAD_INPUT),
    (ApiError(422, "invalid_request", "schema"), EXIT_BAD_INPUT),
    (ApiError(404, "not_found", "gone"), EXIT_BAD_INPUT),
    (ApiError(403, "forbidden", "not yours"), EXIT_BAD_INPUT),
    (ApiError(409, "conflict", "taken"), EXIT_FAILURE),
    (ApiError(429, "too_many_long_polls", "later"), EXIT_FAILURE),
    (ApiError(503, "store_unavailable", "disk"), EXIT_FAILURE),
    (AgentUnreachable("nobody listens", "start it"), EXIT_FAILURE),
    (ReamerError("failed here", "fix"), EXIT_FAILURE),
    (HostError("EPERM here", "run as root"), EXIT_FAILURE),
    (StoreError("unreadable", "move it aside"), EXIT_FAILURE),
    (BadInput("bad value", "fix it"), EXIT_BAD_INPUT),
    (ConfigError("bad key", "fix the config"), EXIT_BAD_INPUT),
    (SpecError("bad spec", "fix it"), EXIT_BAD_INPUT),
    (SampleError("bad shape", "fix it"), EXIT_BAD_INPUT),
    (UnknownModelFamily("no such family", "see the list"), EXIT_BAD_INPUT),
    (GpuConfigError("bad gpu section", "fix it"), EXIT_BAD_INPUT),
    (ValueError("not a number"), EXIT_BAD_INPUT),
    (RuntimeError("anything"), EXIT_FAILURE),
], ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v))
def test_the_cli_exit_status_comes_from_the_same_table(error, exit_code):
    assert exit_code_for(error) == exit_code


def test_every_kind_is_one_code_and_status():
    """A code means one thing: where two kinds share a code (invalid_request 400 and 422; rejected for a bad
    input), they differ only in status or exit status, never in what a client should do with the code."""
    by_code: dict[str, set[int]] = {}
    for kind in ErrorKind:
        assert kind.code and 400 <= kind.status <= 599 and kind.exit_code in (EXIT_FAILURE, EXIT_BAD_INPUT)
        by_code.setdefault(kind.code, set()).add(kind.status)
    assert {code: statuses for code, statuses in by_code.items() if len(statuses) > 1} == {
        "invalid_request": {400, 422}}
