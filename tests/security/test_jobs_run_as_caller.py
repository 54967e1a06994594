"""Inference jobs run with the deploying caller's rights: files are checked as that user (one answer
whether a path is unreadable or missing), output directories are made by that user, and the job's
processes get its uid. A real agent, a real unprivileged user made for the test."""
from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from reamer.api.client import ApiError
from tests.agent.conftest import daemon_factory  # noqa: F401
from tests.conftest import wait_for
from tests.security.conftest import needs_root_for_users

pytestmark = [needs_root_for_users, pytest.mark.root]


@pytest.fixture(scope="module", autouse=True)
def interpreter_reachable_by_other_users():
    """This machine's python lives under /root (mode 0700): a job started as another user could not even
    exec it. Let others traverse the directories above the interpreter for the module's duration, as a
    system-wide install would, so the tests below see the job really run as the user."""
    changed = []
    for target in {os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix), sys.prefix}:
        path = Path(target)
        for parent in [path, *path.parents]:
            mode = parent.stat().st_mode
            if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
                os.chmod(parent, stat.S_IMODE(mode) | stat.S_IXOTH)
                changed.append((parent, stat.S_IMODE(mode)))
    yield
    for parent, mode in reversed(changed):
        os.chmod(parent, mode)


@pytest.fixture(scope="module")
def files():
    """A directory the user can read (with the tiny model) and one only root can enter."""
    from reamer.serve import models

    base = Path(tempfile.mkdtemp(prefix="rmr-files-", dir="/tmp"))
    os.chmod(base, 0o755)
    model = models.build_model("tiny", base / "tiny.onnx").path
    os.chmod(model, 0o644)
    secret = base / "root-only"
    secret.mkdir(mode=0o700)
    shutil.copy(model, secret / "tiny.onnx")
    (base / "inputs").mkdir(mode=0o755)
    yield {"base": base, "model": str(model), "secret_model": str(secret / "tiny.onnx"), "secret": secret}
    shutil.rmtree(base, ignore_errors=True)


def online(name: str, model: str) -> dict:
    return {"name": name, "model": model, "kind": "online", "slo_ms": 500, "layout": "1x1:b1"}


def test_an_unreadable_path_and_a_missing_one_get_the_same_answer(as_user, user, files):
    status, unreadable = as_user.call("POST", "/v1/inference-jobs", online("peek", files["secret_model"]))
    assert status == 400, unreadable
    missing_path = str(files["secret"] / "no-such.onnx")
    status, missing = as_user.call("POST", "/v1/inference-jobs", online("peek", missing_path))
    assert status == 400, missing
    assert unreadable["error"]["message"].replace(files["secret_model"], "P") == \
        missing["error"]["message"].replace(missing_path, "P")
    assert f"uid {user.uid}" in unreadable["error"]["message"]


def test_an_output_directory_is_made_by_the_user_or_refused(as_user, user, files, secure_daemon):
    inputs = str(files["base"] / "inputs")
    status, body = as_user.call("POST", "/v1/inference-jobs", {
        "name": "out-root", "model": files["model"], "kind": "offline", "input_dir": inputs,
        "output_dir": str(files["secret"] / "out")})
    assert status == 400 and "output_dir" in body["error"]["message"], body
    assert not (files["secret"] / "out").exists()  # root made nothing on the user's behalf

    home = files["base"] / f"home-{user.uid}"
    home.mkdir()
    os.chown(home, user.uid, user.gid)
    out = home / "a" / "b"
    status, body = as_user.call("POST", "/v1/inference-jobs", {
        "name": "out-mine", "model": files["model"], "kind": "offline", "input_dir": inputs, "output_dir": str(out)})
    try:
        assert status == 201, body
        assert out.stat().st_uid == user.uid and (home / "a").stat().st_uid == user.uid
        assert body["run_uid"] == user.uid and body["owner_uid"] == user.uid
    finally:
        if status == 201:
            assert as_user.call("DELETE", "/v1/inference-jobs/out-mine")[0] == 200


def test_the_jobs_processes_run_as_the_user(as_user, user, files, secure_daemon):
    status, job = as_user.call("POST", "/v1/inference-jobs", online("mine", files["model"]))
    assert status == 201, job
    try:
        def settled():
            found = secure_daemon.client.get_inference_job("mine")
            return found if found.pid or found.state == "failed" else None

        found = wait_for(settled, timeout=60, what="the job to start or fail")
        assert found.state != "failed", found.message
        assert psutil.Process(found.pid).uids().real == user.uid
        # root's view shows who owns it and whom it runs as; the user cannot remove root's jobs
        assert found.owner_uid == user.uid
    finally:
        assert as_user.call("DELETE", "/v1/inference-jobs/mine")[0] == 200


def test_roots_jobs_run_as_the_configured_user(user, files, daemon_factory):
    daemon = daemon_factory(inference={"run_as": user.name})
    with pytest.raises(ApiError) as info:  # root's job is checked with run_as's rights too
        daemon.client.deploy_inference(online("theirs", files["secret_model"]))
    assert info.value.status == 400 and f"uid {user.uid}" in info.value.message
    job = daemon.client.deploy_inference(online("theirs", files["model"]))
    assert job.owner_uid == 0 and job.run_uid == user.uid
    found = wait_for(lambda: (lambda j: j if j.pid or j.state == "failed" else None)(
        daemon.client.get_inference_job("theirs")), timeout=60, what="the job to start or fail")
    assert found.state != "failed", found.message
    assert psutil.Process(found.pid).uids().real == user.uid
    daemon.client.remove_inference("theirs")


def test_an_unknown_run_as_user_is_named(daemon_factory, files):
    daemon = daemon_factory(inference={"run_as": "no-such-user-reamer"})
    with pytest.raises(ApiError) as info:
        daemon.client.deploy_inference(online("x", files["model"]))
    assert 400 <= info.value.status < 500 and "no-such-user-reamer" in info.value.message and "useradd" in info.value.fix
