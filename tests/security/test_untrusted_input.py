"""What a job's user writes is opened by that user, never by the root agent: the deploy check (model, shapes,
input_data) runs in a child process with the user's uid and the job's memory limit, while the agent keeps
answering everyone; output directories are made by the user, never by root. A real agent, real unprivileged
users, the real socket."""
from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from reamer.api.client import ApiClient
from reamer.host.access import identity_of
from reamer.serve.deploy_check import DeployCheck, DeployRequest
from tests.conftest import wait_for
from tests.security import conftest as security
from tests.security.conftest import needs_root_for_users
from tests.security.test_held_attacks import as_other, other  # noqa: F401 - fixtures

pytestmark = [needs_root_for_users, pytest.mark.root]

MIB = 1 << 20
CHECKER = "reamer.serve.deploy_check"


def _interpreter_dirs() -> list[Path]:
    dirs = []
    for target in {os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix), sys.prefix}:
        dirs += [p for p in [Path(target), *Path(target).parents] if p.is_dir()]
    return dirs


def _let_others_traverse(changed: dict[Path, int]) -> None:
    for parent in _interpreter_dirs():
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            changed.setdefault(parent, stat.S_IMODE(mode))
            os.chmod(parent, stat.S_IMODE(mode) | stat.S_IXOTH)


@pytest.fixture(scope="module")
def traversable() -> Iterator[dict[Path, int]]:
    """This machine's python lives under /root (mode 0700): the user's deploy check and job could not exec it.
    Let others traverse the directories above it for the module, as a system-wide install would."""
    changed: dict[Path, int] = {}
    _let_others_traverse(changed)
    yield changed
    for parent, mode in sorted(changed.items(), key=lambda item: -len(item[0].parts)):
        os.chmod(parent, mode)


@pytest.fixture(autouse=True)
def interpreter_reachable(traversable: dict[Path, int]) -> None:
    _let_others_traverse(traversable)  # again: another module's teardown on this machine may have undone it


@pytest.fixture(scope="module")
def place(user: security.TestUser) -> Iterator[dict[str, Path]]:
    """A readable directory with the tiny model, the user's own private home, and a root-owned directory."""
    from reamer.serve import models

    base = Path(tempfile.mkdtemp(prefix="rmr-untrusted-", dir="/tmp"))
    os.chmod(base, 0o755)
    model = models.build_model("tiny", base / "tiny.onnx").path  # one input: "input" FP32 [-1, 16]
    os.chmod(model, 0o644)
    home = base / "home"
    home.mkdir(mode=0o700)
    os.chown(home, user.uid, user.gid)
    root_owned = base / "root-owned"
    root_owned.mkdir(mode=0o755)
    (base / "inputs").mkdir(mode=0o755)
    yield {"base": base, "model": Path(model), "home": home, "root_owned": root_owned, "inputs": base / "inputs"}
    shutil.rmtree(base, ignore_errors=True)


def users_file(user: security.TestUser, path: Path, data: bytes | None = None, mode: int = 0o600) -> str:
    if data is not None:
        path.write_bytes(data)
    os.chown(path, user.uid, user.gid)
    os.chmod(path, mode)
    return str(path)


def online(name: str, model: str, **extra: Any) -> dict:
    return {"name": name, "model": model, "kind": "online", "slo_ms": 500, "layout": "1x1:b1", **extra}


def checkers_of(agent_pid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.Process(agent_pid).children(recursive=True):
        try:
            argv = proc.cmdline()
            if CHECKER in argv and "prlimit" not in argv[0]:  # exec'd into python: its limits are set
                found.append(proc)
        except psutil.Error:
            continue
    return found


def data_limit(pid: int) -> list[str]:
    """[soft, hard] of a process's RLIMIT_DATA, as /proc shows them."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max data size"):
            return line.split()[3:5]
    return []


class RssWatch:
    """The agent's largest RSS while a block runs (sampled on a thread)."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.before = self.peak = self.proc.memory_info().rss
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> "RssWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    @property
    def grew(self) -> int:
        return self.peak - self.before


def write_json_values(path: Path, values: int) -> None:
    """perf_analyzer JSON with one sample of `values` zeros: slow to read, and a list that no [16] fits."""
    with open(path, "w") as fh:
        fh.write('{"data": [{"input": [' + "0," * values + "0]}]}")


# --------------------------------------------------------------------------- memory: bombs

def test_a_decompression_bomb_is_refused_naming_the_memory_limit(as_user, user, secure_daemon, place):
    import numpy as np

    bomb = place["home"] / "bomb.npz"
    np.savez_compressed(bomb, input=np.zeros((2**25, 16), np.float32))  # 2 GiB of zeros
    assert bomb.stat().st_size < 8 * MIB
    users_file(user, bomb)
    with RssWatch(secure_daemon.proc.pid) as rss:
        status, body = as_user.call("POST", "/v1/inference-jobs",
                                    online("bomb", str(place["model"]), input_data=str(bomb), memory_limit_mb=1024))
        assert as_user.call("GET", "/v1/node")[0] == 200
    assert status == 400, body
    message, fix = body["error"]["message"], body["error"]["fix"]
    assert f"input_data {bomb} needs more than 1024 MiB to check" in message, message
    assert "2,048 MiB" in message and "memory_limit_mb" in fix and "1024 MiB" in fix, body
    assert rss.grew < 200 * MIB, rss.grew  # nothing of that size was made in the agent
    assert "bomb" not in {j.name for j in secure_daemon.client.list_inference_jobs()}


def test_sample_data_past_the_memory_limit_is_stopped_by_the_limit_not_by_the_agent(as_user, user, secure_daemon,
                                                                                     place):
    data = place["home"] / "huge.json"
    write_json_values(data, 100_000_000)  # 200 MB of text: 800 MB once parsed into a list
    users_file(user, data)
    with RssWatch(secure_daemon.proc.pid) as rss:
        status, body = as_user.call("POST", "/v1/inference-jobs",
                                    online("huge", str(place["model"]), input_data=str(data), memory_limit_mb=600))
    assert status == 400, body
    assert f"input_data {data} needs more than 600 MiB to check" in body["error"]["message"], body
    assert "600 MiB" in body["error"]["fix"], body
    assert rss.grew < 200 * MIB, rss.grew


# --------------------------------------------------------------------------- the API answers meanwhile

def test_other_callers_are_answered_while_a_users_check_runs_as_that_user(as_user, user, other, secure_daemon,
                                                                          place):
    data = place["home"] / "slow.json"
    write_json_values(data, 6_000_000)
    users_file(user, data)
    answer: dict[str, Any] = {}

    def deploy() -> None:
        answer["got"] = as_user.call("POST", "/v1/inference-jobs",
                                     online("slow", str(place["model"]), input_data=str(data), memory_limit_mb=2048))

    deploying = threading.Thread(target=deploy)
    deploying.start()
    other_client = security.UserClient(other, secure_daemon.socket)
    try:
        checker = wait_for(lambda: next(iter(checkers_of(secure_daemon.proc.pid)), None), timeout=120,
                           what="the deploy check to start")
        # the check is the user's process, with the job's memory limit
        assert checker.uids().real == user.uid and checker.uids().effective == user.uid, checker.uids()
        assert checker.gids().real == user.gid
        assert data_limit(checker.pid) == [str(2048 * MIB)] * 2
        assert checker.cwd() == "/"
        assert "-I" in checker.cmdline()
        answered_meanwhile = 0
        with ApiClient(secure_daemon.socket) as root:
            while checker.is_running() and checker.status() != psutil.STATUS_ZOMBIE:
                status, node = other_client.call("GET", "/v1/node")
                assert status == 200, node
                assert root.demote_all().threads_demoted == 0
                if checker.is_running() and checker.status() != psutil.STATUS_ZOMBIE:
                    answered_meanwhile += 1  # both answers came back while the check still ran
        assert answered_meanwhile >= 1
    finally:
        deploying.join(timeout=300)
        other_client.close()
    status, body = answer["got"]
    assert status == 400 and "do not fill the shape [16]" in body["error"]["message"], body


def test_a_check_past_its_time_is_stopped_and_says_which_setting(user, place):
    model = users_file(user, place["home"] / "timed.onnx", place["model"].read_bytes())
    check = DeployCheck(runner=identity_of(user.uid, user.gid), timeout_s=0.05)
    answer = check.run(DeployRequest(model, "onnxruntime"))
    assert answer.exceeded == "time" and answer.problem is not None
    assert "took longer than 0.05 s" in answer.problem.message and "check_timeout_s" in answer.problem.fix
    left = [p.pid for p in psutil.process_iter(["uids", "cmdline"])
            if p.info["uids"] and p.info["uids"].real == user.uid and CHECKER in " ".join(p.info["cmdline"] or [])]
    assert left == []  # the stopped check left no process behind


# --------------------------------------------------------------------------- models

@pytest.mark.parametrize("kind", ["text", "truncated"])
def test_a_model_that_is_not_onnx_or_is_truncated_is_refused_with_the_runtimes_reason(as_user, user, secure_daemon,
                                                                                     place, kind):
    content = b"not a model at all\n" if kind == "text" else place["model"].read_bytes()[:100]
    model = users_file(user, place["home"] / f"{kind}.onnx", content)
    status, body = as_user.call("POST", "/v1/inference-jobs", online(f"bad-{kind}", model))
    assert status == 400, body
    assert "cannot load" in body["error"]["message"] and model in body["error"]["message"], body
    assert "backend" in body["error"]["fix"], body
    # with traffic to check, the inputs are read first: the samples module's own words
    status, body = as_user.call("POST", "/v1/inference-jobs", online(f"bad-{kind}", model, shapes={"input": [1, 16]}))
    assert status == 400, body
    assert f"cannot read the inputs of {model}" in body["error"]["message"], body
    assert body["error"]["fix"] == "check that it is an ONNX file"
    assert f"bad-{kind}" not in {j.name for j in secure_daemon.client.list_inference_jobs()}


def test_a_model_the_user_cannot_read_is_refused(as_user, user, place):
    secret = place["base"] / "roots.onnx"
    shutil.copy(place["model"], secret)
    os.chmod(secret, 0o600)
    status, body = as_user.call("POST", "/v1/inference-jobs", online("peek", str(secret)))
    assert status == 400, body
    assert f"model {secret} does not exist or" in body["error"]["message"] and f"uid {user.uid}" in \
        body["error"]["message"], body


def test_the_check_has_the_users_rights_not_roots(as_user, as_other, user, secure_daemon, place):
    mine = users_file(user, place["home"] / "mine.onnx", place["model"].read_bytes())  # home is the user's, 0700
    status, body = as_other.call("POST", "/v1/inference-jobs", online("theirs", mine))
    assert status == 400 and "does not exist or" in body["error"]["message"], body
    status, body = as_user.call("POST", "/v1/inference-jobs", online("mine", mine, shapes={"input": [1, 16]}))
    try:
        assert status == 201, body
    finally:
        if status == 201:
            secure_daemon.client.remove_inference("mine")
    # the same check run directly: a file only root can read opens for root, not for the user
    secret = place["base"] / "roots-too.onnx"
    shutil.copy(place["model"], secret)
    os.chmod(secret, 0o600)
    assert DeployCheck().run(DeployRequest(str(secret), "onnxruntime")).problem is None
    refused = DeployCheck(runner=identity_of(user.uid, user.gid)).run(DeployRequest(str(secret), "onnxruntime"))
    assert refused.problem is not None and str(secret) in refused.problem.message, refused


# --------------------------------------------------------------------------- output directories

def test_an_output_dir_through_a_link_to_a_root_owned_place_makes_nothing(as_user, user, secure_daemon, place):
    link = place["home"] / "to-root"
    os.symlink(place["root_owned"], link)
    os.lchown(link, user.uid, user.gid)
    for out in (link / "results", link / "a" / "b"):
        status, body = as_user.call("POST", "/v1/inference-jobs", {
            "name": "linked", "model": str(place["model"]), "kind": "offline", "input_dir": str(place["inputs"]),
            "output_dir": str(out)})
        assert status == 400 and "output_dir" in body["error"]["message"], body
    assert list(place["root_owned"].iterdir()) == []


def test_a_link_swapped_in_during_the_deploy_makes_root_create_nothing(as_user, user, secure_daemon, place):
    import numpy as np

    data = place["home"] / "rows.npz"
    np.savez_compressed(data, input=np.zeros((400_000, 16), np.float32))  # valid, and slow to check
    users_file(user, data)
    parent = place["home"] / "swap"
    parent.mkdir()
    os.chown(parent, user.uid, user.gid)
    out = parent / "results"  # made by the user's own access check; then the user swaps `swap` for a link
    answer: dict[str, Any] = {}

    def deploy() -> None:
        answer["got"] = as_user.call("POST", "/v1/inference-jobs", {
            "name": "swapped", "model": str(place["model"]), "kind": "offline", "input_dir": str(place["inputs"]),
            "output_dir": str(out), "input_data": str(data), "memory_limit_mb": 2048})

    deploying = threading.Thread(target=deploy)
    deploying.start()
    try:
        wait_for(lambda: checkers_of(secure_daemon.proc.pid) or answer, timeout=120, what="the deploy check")
        swap = user.popen(["/bin/sh", "-c", f'mv "{parent}" "{parent}.old" && ln -s "{place["root_owned"]}" '
                                            f'"{parent}"'])
        assert swap.wait(timeout=30) == 0
    finally:
        deploying.join(timeout=300)
    status, body = answer["got"]
    try:
        assert status == 201, body

        def ended():
            job = secure_daemon.client.get_inference_job("swapped")
            return job if job.state in ("failed", "done") else None

        job = wait_for(ended, timeout=180, what="the job to give up on its output directory")
        assert job.state == "failed" and "cannot be created" in job.message, job.message
    finally:
        if status == 201:
            secure_daemon.client.remove_inference("swapped")
    assert list(place["root_owned"].iterdir()) == []  # neither the agent nor the job made anything there


# --------------------------------------------------------------------------- the layout search on deploy

def test_the_layout_search_on_deploy_runs_the_users_model_as_the_user(as_user, user, secure_daemon, place):
    model = users_file(user, place["home"] / "searched.onnx", place["model"].read_bytes())
    answer: dict[str, Any] = {}

    def deploy() -> None:  # no layout: the agent measures one on the free cpus
        answer["got"] = as_user.call("POST", "/v1/inference-jobs", {
            "name": "searched", "model": model, "kind": "online", "slo_ms": 500, "memory_limit_mb": 3072})

    def a_worker() -> psutil.Process | None:
        for proc in psutil.Process(secure_daemon.proc.pid).children(recursive=True):
            try:
                argv = proc.cmdline()
                if "reamer.serve.measure.profile_worker" in argv and "prlimit" not in argv[0]:
                    return proc
            except psutil.Error:
                continue
        return None

    deploying = threading.Thread(target=deploy)
    deploying.start()
    try:
        worker = wait_for(lambda: a_worker() or ("ended" if "got" in answer else None), timeout=300,
                          what="a layout search worker")
        assert worker != "ended", f"the deploy ended before a search worker was seen: {answer}"
        assert worker.uids().real == user.uid and worker.uids().effective == user.uid, worker.uids()
        assert worker.cwd() == "/" and "-I" in worker.cmdline()
        assert data_limit(worker.pid) == [str(3072 * MIB)] * 2
    finally:
        deploying.join(timeout=600)
    status, body = answer["got"]
    try:
        assert status == 201, body
        assert body["layout"], body  # the search, run as the user, measured the model
    finally:
        if status == 201:
            secure_daemon.client.remove_inference("searched")
