"""Attacks that held when the trust boundary was probed, kept as tests so that they keep holding: a second
unprivileged user in the socket group against the first user's processes and jobs, shape bombs in a deploy,
malformed bodies, and a corrupt store. A real agent over its real socket."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from tests.agent.conftest import _new_daemon, needs_rt_host, none_rt
from tests.security.conftest import GroupMember, TestUser, UserClient, needs_root_for_users

pytestmark = [needs_root_for_users, pytest.mark.root]


@pytest.fixture(scope="module")
def other(user: TestUser) -> Iterator[GroupMember]:
    made = GroupMember(user.group, user.gid)
    try:
        yield made
    finally:
        made.cleanup()


@pytest.fixture
def as_other(other: GroupMember, secure_daemon) -> Iterator[UserClient]:
    client = UserClient(other, secure_daemon.socket)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def readable_model() -> Iterator[str]:
    from reamer.serve import models

    base = Path(tempfile.mkdtemp(prefix="rmr-held-", dir="/tmp"))
    os.chmod(base, 0o755)
    model = models.build_model("tiny", base / "tiny.onnx").path
    os.chmod(model, 0o644)
    yield str(model)
    subprocess.run(["rm", "-rf", str(base)], check=False)


def forbidden(status: int, body: dict, rule: str) -> None:
    assert status == 403, body
    assert body["error"]["data"]["rule"] == rule, body


@needs_rt_host
def test_a_user_cannot_pin_or_detach_another_users_processes_and_jobs(as_user, as_other, user, other):
    theirs = user.sleeper()
    status, body = as_other.call("POST", "/v1/training-jobs", {"name": "steal", "pids": [theirs.pid]})
    forbidden(status, body, "process_owner")
    assert none_rt(theirs.pid)

    status, job = as_user.call("POST", "/v1/training-jobs", {"name": "owned", "pids": [theirs.pid]})
    assert status == 201, job
    status, body = as_other.call("DELETE", "/v1/training-jobs/owned")
    forbidden(status, body, "job_owner")
    status, body = as_other.call("POST", "/v1/demote-all")
    assert status == 200 and body["threads_demoted"] == 0 and body["jobs"] == [], body
    status, body = as_user.call("GET", "/v1/training-jobs/owned")
    assert status == 200 and body["threads_rr"] >= 1, body  # still real-time: the other user changed nothing


def test_a_user_cannot_remove_another_users_inference_job(as_user, as_other, readable_model, secure_daemon):
    status, body = as_user.call("POST", "/v1/inference-jobs", {
        "name": "mine-online", "model": readable_model, "kind": "online", "slo_ms": 500, "layout": "1x1:b1"})
    if status == 400 and "cannot read" in body["error"]["message"]:
        pytest.skip("the job's user cannot reach this python (installed under /root)")
    assert status == 201, body
    try:
        status, body = as_other.call("DELETE", "/v1/inference-jobs/mine-online")
        forbidden(status, body, "job_owner")
        status, body = as_user.call("GET", "/v1/inference-jobs/mine-online")
        assert status == 200, body
    finally:
        secure_daemon.client.remove_inference("mine-online")


@pytest.mark.parametrize("shapes", [
    {"x": [2**31, 2**31]},
    {"x": [1, 10**9]},
    {"x": [-1, 4]},
    {"x": [1] * 64},
])
def test_shape_bombs_are_refused_quickly_and_cost_the_agent_nothing(as_user, readable_model, secure_daemon, shapes):
    agent = psutil.Process(secure_daemon.proc.pid)
    before = agent.memory_info().rss
    status, body = as_user.call("POST", "/v1/inference-jobs", {
        "name": "bomb", "model": readable_model, "kind": "online", "slo_ms": 500, "layout": "1x1:b1",
        "shapes": shapes})
    assert 400 <= status < 500, body
    assert body["error"]["message"] and body["error"].get("fix") and "Traceback" not in str(body)
    assert agent.memory_info().rss - before < 200 * 2**20  # nothing of that size was made in the agent
    status, _ = as_user.call("GET", "/v1/node")
    assert status == 200


@pytest.mark.parametrize("content", [
    "", "{", "null", "[]", '"name"', '{"name": 5}', '{"name": "x", "pids": "1"}', '{"name": "x", "pids": [1.5]}',
    '{"name": "../../etc", "pids": [1]}', '{"name": "x\\u0000y", "pids": [1]}', "\xff\xfe" * 10,
    '{"name": "x", "pids": [1], "pids": [2]}',
])
def test_malformed_bodies_get_a_clear_4xx(as_user, content):
    status, answer = as_user.call("POST", "/v1/training-jobs", content=content)
    assert 400 <= status < 500, (content, status, answer)
    assert isinstance(answer, dict) and answer["error"]["message"], answer
    assert "Traceback" not in str(answer)


def test_a_corrupt_store_stops_the_agent_with_what_and_the_fix(tmp_path):
    daemon = _new_daemon()
    try:
        import yaml

        daemon.state_dir.mkdir(parents=True, exist_ok=True)
        (daemon.state_dir / "state.db").write_bytes(b"this is not a database" * 100)
        daemon.config_path.write_text(yaml.safe_dump(daemon.config))
        proc = subprocess.run([sys.executable, "-m", "reamer.node", "--config", str(daemon.config_path)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0
        said = proc.stdout + proc.stderr
        assert "state.db" in said and "Traceback" not in said, said
        assert "fix" in said.lower(), said
    finally:
        daemon.cleanup()
