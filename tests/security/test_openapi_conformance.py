"""The agent's /openapi.json tells the truth: schemathesis against a running agent, over its Unix socket.

Requests come from a connection made with the test user's uid/gid (an unprivileged member of the
socket group): fuzzed pids and cgroups can then touch nothing but that user's own processes, never
the machine's. Every answer must be no 5xx and agree with the document: a documented status, content
type, headers and body schema; and a request the document calls invalid must not be accepted.
"""
from __future__ import annotations

import datetime
import http.client
import os
import time
import socket
import threading
from typing import Any, Iterator

import httpx
import pytest

from tests.security.conftest import needs_root_for_users

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extra: pip install -e '.[test]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,  # noqa: E402
                                               response_headers_conformance, response_schema_conformance,
                                               status_code_conformance)

pytestmark = [needs_root_for_users, pytest.mark.root]

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]
EXAMPLES_PER_OPERATION = 20  # per generation mode (valid and invalid requests)
_EUID_LOCK = threading.Lock()


def connect_as(path: str, uid: int, gid: int) -> socket.socket:
    """A Unix socket connected with `uid`/`gid` as effective ids: SO_PEERCRED reports those to the agent.
    The test process (root) switches back at once."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    with _EUID_LOCK:
        groups = os.getgroups()
        os.setgroups([gid])
        os.setegid(gid)
        os.seteuid(uid)
        try:
            sock.connect(path)
        finally:
            os.seteuid(0)
            os.setegid(0)
            os.setgroups(groups)
    return sock


def send_as(socket_path: str, uid: int, gid: int, kwargs: dict[str, Any]) -> httpx.Response:
    """Send the request schemathesis made (requests-style kwargs) as `uid`; the answer as an httpx.Response."""
    content = kwargs.get("data")
    request = httpx.Request(kwargs["method"], kwargs["url"], params=kwargs.get("params"),
                            headers=kwargs.get("headers"), cookies=kwargs.get("cookies"), json=kwargs.get("json"),
                            content=content.encode() if isinstance(content, str) else content)
    conn = http.client.HTTPConnection("reamer", timeout=60)
    started = time.monotonic()
    conn.sock = connect_as(socket_path, uid, gid)
    try:
        body = request.read()
        conn.request(request.method, request.url.raw_path.decode("ascii"), body=body or None,
                     headers=dict(request.headers))
        answer = conn.getresponse()
        response = httpx.Response(answer.status, headers=answer.getheaders(), content=answer.read(), request=request)
        response.elapsed = datetime.timedelta(seconds=time.monotonic() - started)
        return response
    finally:
        conn.close()


@pytest.fixture(scope="module")
def agent_schema(secure_daemon) -> Iterator[Any]:
    with httpx.Client(transport=httpx.HTTPTransport(uds=secure_daemon.socket), base_url="http://reamer",
                      timeout=60) as http_client:
        document = http_client.get("/openapi.json").json()
    yield schemathesis.openapi.from_dict(document)


def test_agent_answers_agree_with_its_openapi_document(agent_schema, secure_daemon, user):
    # schemathesis's pytest loader does not run under this pytest (it sets a removed Node attribute),
    # so each operation gets its own hypothesis run here; every failure is collected and reported.
    failures: list[str] = []
    operations = [result.ok() for result in agent_schema.get_all_operations()]
    assert len(operations) >= 15, [op.label for op in operations]
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck),
                      derandomize=True, database=None, report_multiple_bugs=False)
            def run(case: Any) -> None:
                if case.path == "/v1/events" and isinstance(case.query, dict) and "wait" in case.query:
                    try:
                        if float(case.query["wait"]) > 0.2:  # a valid long-poll: keep the run short
                            case.query["wait"] = 0.2
                    except (TypeError, ValueError):
                        pass
                kwargs = case.as_transport_kwargs(base_url="http://reamer")
                response = send_as(secure_daemon.socket, user.uid, user.gid, kwargs)
                # 413 (body over the limit) rejects a request too; schemathesis's list of rejections lacks it.
                checks = [c for c in CHECKS if response.status_code != 413 or c is not negative_data_rejection]
                case.validate_response(response, checks=checks)

            try:
                run()
            except Unsatisfiable:  # nothing to negate (no parameters, or only free-form strings)
                continue
            except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - collect them all, then fail once
                failures.append(f"{operation.label} ({mode.value}): {str(exc)[:1500]}")
    assert not failures, "\n\n".join(failures)


def test_the_document_states_the_rules_the_server_enforces(agent_schema):
    """The fixes schemathesis asked for, checked directly (they stay true when the fuzzer misses them)."""
    doc = agent_schema.raw_schema
    schemas = doc["components"]["schemas"]
    assert len(schemas["TrainingJobRequest"]["oneOf"]) == 5  # one of pids, cgroup, container, slurm_job, k8s_container
    online, offline = schemas["InferenceJobRequest"]["oneOf"]
    assert online["required"] == ["slo_ms"] and offline["required"] == ["input_dir", "output_dir"]
    assert schemas["GpuJobUpdate"]["not"]["required"] == ["mem_limit_mb", "clear_mem_limit"]
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    for path in ("/v1/training-jobs", "/v1/inference-jobs", "/v1/gpu-jobs"):
        assert {"403", "413", "422"} <= set(doc["paths"][path]["post"]["responses"])
