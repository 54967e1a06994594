"""The agent never executes from, or trusts, what a job's user can write.

A real agent (with a secret in its environment), a real unprivileged user in its socket group. Each deploy
runs in a directory root makes for it and removes with it; the job starts in Python's isolated mode from
that directory, with an allowlisted environment; the agent reads the job's log only as a regular file of
the job's user; a removed job leaves no directory and no cgroup, also when it hung."""
from __future__ import annotations

import json
import os
import secrets
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from reamer.agent.job_dir import ENV_NAMES, ENV_PREFIXES
from tests.agent.conftest import Daemon, _new_daemon
from tests.conftest import wait_for
from tests.security import conftest as security
from tests.security.conftest import USER_PYTHON, UserClient, needs_root_for_users
from tests.security.test_jobs_run_as_caller import files, interpreter_reachable_by_other_users  # noqa: F401

pytestmark = [needs_root_for_users, pytest.mark.root]

AGENT_SECRET = f"agent-only-{secrets.token_hex(8)}"
CGROUP_ROOT = Path("/sys/fs/cgroup")

# Runs as the user: tries to write each (path, text) of argv[1] (JSON); prints the paths it could write.
PLANTER = r"""
import json, os, sys
done = []
for path, text in json.loads(sys.argv[1]):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
        done.append(path)
    except OSError:
        pass
print(json.dumps(done), flush=True)
"""

# Runs as the user: tries the given file operation; prints "ok" or the errno name.
TRY_AS_USER = r"""
import errno, os, sys
op, a, b = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""
try:
    if op == "create":
        open(a, "w").close()
    elif op == "symlink-over":
        tmp = a + ".planted"
        os.symlink(b, tmp)
        os.rename(tmp, a)
    elif op == "unlink":
        os.unlink(a)
    elif op == "listdir":
        os.listdir(a)
    print("ok")
except OSError as exc:
    print(errno.errorcode.get(exc.errno, str(exc.errno)))
"""


@pytest.fixture(scope="module")
def user() -> Iterator[security.TestUser]:
    made = security.TestUser()
    try:
        yield made
    finally:
        made.cleanup()


@pytest.fixture(scope="module")
def agent(user: "security.TestUser") -> Iterator[Daemon]:
    """An agent whose own environment holds a secret and variables that would steer a Python child."""
    daemon = _new_daemon(socket_group=user.group, security={"max_rt_priority": 30, "max_long_polls": 64})
    os.chmod(daemon.base, 0o711)
    empty = daemon.base / "empty-pythonpath"
    empty.mkdir()
    try:
        daemon.start(env={"AGENT_ONLY_SECRET": AGENT_SECRET, "PYTHONPATH": str(empty),
                          "PYTHONINSPECT": "", "REAMER_SOCKET": daemon.socket})
        yield daemon
    finally:
        daemon.cleanup()


@pytest.fixture
def as_user(user: "security.TestUser", agent: Daemon) -> Iterator[UserClient]:
    agent.reset()
    client = UserClient(user, agent.socket)
    try:
        yield client
    finally:
        client.close()
        agent.reset()


def as_user_run(user: "security.TestUser", script: str, *args: str) -> str:
    proc = user.popen([USER_PYTHON, "-c", script, *args], stdout=subprocess.PIPE, text=True,
                      env={"PATH": "/usr/bin:/bin"})
    out, _ = proc.communicate(timeout=60)
    return out.strip()


def online(name: str, model: str, **extra) -> dict:
    return {"name": name, "model": model, "kind": "online", "slo_ms": 500, "layout": "1x1:b1", **extra}


def running(agent: Daemon, name: str):
    def settled():
        job = agent.client.get_inference_job(name)
        return job if (job.pid and job.status.rate_rps is not None) or job.state == "failed" else None

    job = wait_for(settled, timeout=90, what=f"job {name} to serve or fail")
    assert job.state == "running", job.message
    return job


def deploy_dirs(agent: Daemon, name: str) -> list[Path]:
    jobs = agent.run_dir / "jobs"
    return sorted(p for p in jobs.iterdir() if p.name == name or p.name.startswith(f"{name}@")) \
        if jobs.is_dir() else []


def job_cgroups(agent: Daemon, name: str) -> list[Path]:
    """Every cgroup of the job, in any hierarchy (v1 trees and the unified one)."""
    found = []
    for tree in CGROUP_ROOT.iterdir():
        base = tree / agent.cgroup_name
        if base.is_dir():
            found += [p for p in base.rglob(f"*{name}*") if p.is_dir()]
    return found


def memory_cgroup(agent: Daemon, name: str) -> Path:
    return CGROUP_ROOT / "memory" / agent.cgroup_name / f"infer-{name}"


def procs_of(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def job_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


# --- planted code ------------------------------------------------------------------------------

def plants(where: Path, marker: Path) -> list[tuple[str, str]]:
    """Files that make Python run code at start-up if `where` were on sys.path (or a site directory)."""
    code = f"open({str(marker)!r}, 'a').write('planted code ran as uid %d\\n' % __import__('os').getuid())\n"
    return [(str(where / "reamer" / "__init__.py"), code), (str(where / "reamer" / "serve" / "__init__.py"), code),
            (str(where / "reamer" / "serve" / "job.py"), code), (str(where / "sitecustomize.py"), code),
            (str(where / "usercustomize.py"), code), (str(where / "zz-planted.pth"), f"import os; {code}")]


def test_the_planted_files_would_run_code_where_python_looks(tmp_path):
    """The detector works: the same plants in a cwd that `python -m` (without -I) puts on sys.path run."""
    marker = tmp_path / "marker"
    for path, text in plants(tmp_path / "cwd", marker):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    subprocess.run([sys.executable, "-m", "reamer.serve.runtime.job", "--spec", "/nonexistent"], cwd=tmp_path / "cwd",
                   capture_output=True, timeout=60)
    assert marker.exists() and "planted code ran" in marker.read_text()


def test_code_planted_by_a_user_never_runs_when_root_deploys_the_same_name(as_user, user, agent, files, tmp_path):
    marker = Path("/tmp") / f"rmr-planted-{secrets.token_hex(6)}"
    try:
        # The user deploys `shared` and keeps another job running (its io/ directory is theirs).
        status, body = as_user.call("POST", "/v1/inference-jobs", online("shared", files["model"]))
        assert status == 201, body
        status, body = as_user.call("POST", "/v1/inference-jobs", online("keeper", files["model"]))
        assert status == 201, body
        first = running(agent, "shared")
        running(agent, "keeper")
        [old_dir] = deploy_dirs(agent, "shared")
        [keeper_dir] = deploy_dirs(agent, "keeper")
        assert "@" in old_dir.name

        # Everything the user can reach: the deploy dirs (root's), their io/ (the user's), the jobs root,
        # the legacy per-name path.
        targets = [*plants(old_dir, marker), *plants(old_dir / "io", marker), *plants(keeper_dir, marker),
                   *plants(keeper_dir / "io", marker), *plants(agent.run_dir / "jobs" / "shared", marker),
                   *plants(agent.run_dir / "jobs", marker)]
        written = json.loads(as_user_run(user, PLANTER, json.dumps(targets)))
        assert not [p for p in written if not p.startswith((str(old_dir / "io"), str(keeper_dir / "io")))], \
            f"the user wrote outside its io/ directories: {written}"
        assert any(p.startswith(str(keeper_dir / "io")) for p in written)  # io/ is theirs: the plants are there
        assert as_user_run(user, TRY_AS_USER, "listdir", str(agent.run_dir / "jobs")) == "EACCES"

        assert as_user.call("DELETE", "/v1/inference-jobs/shared")[0] == 200
        assert not old_dir.exists(), "the removed deploy's directory is left"

        # An older agent's per-name directory, handed to the user, full of plants (what an upgrade leaves).
        legacy = agent.run_dir / "jobs" / "shared"
        for path, text in plants(legacy, marker):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        for path in [legacy, *legacy.rglob("*")]:
            os.chown(path, user.uid, user.gid)

        roots = agent.client.deploy_inference(online("shared", files["model"]))
        job = running(agent, "shared")
        assert job.run_uid == 0 and job.owner_uid == 0 and roots.name == "shared"
        [new_dir] = deploy_dirs(agent, "shared")
        assert new_dir != old_dir and new_dir != legacy and not legacy.exists()
        cmdline = psutil.Process(job.pid).cmdline()
        assert "-I" in cmdline[:3], cmdline
        assert not marker.exists(), f"planted code ran: {marker.read_text()}"

        # The job's cwd: root's own directory for this deploy, that the user cannot write.
        for proc in job_tree(job.pid):
            cwd = Path(proc.cwd())
            assert cwd == new_dir, (proc.pid, cwd)
        st = new_dir.stat()
        assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o755
        assert as_user_run(user, TRY_AS_USER, "create", str(new_dir / "sitecustomize.py")) == "EACCES"
        assert first.pid != job.pid
    finally:
        if marker.exists():
            marker.unlink()


def test_a_user_job_cwd_is_roots_and_its_own_writes_go_to_io(as_user, user, agent, files):
    status, body = as_user.call("POST", "/v1/inference-jobs", online("mine", files["model"]))
    assert status == 201, body
    job = running(agent, "mine")
    [base] = deploy_dirs(agent, "mine")
    assert Path(psutil.Process(job.pid).cwd()) == base
    st = base.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755)
    spec = base / "spec.json"
    assert spec.stat().st_uid == 0 and not spec.stat().st_mode & 0o022
    log = base / "job.log"
    assert log.stat().st_uid == user.uid and stat.S_ISREG(log.lstat().st_mode)
    io = base / "io"
    assert io.stat().st_uid == user.uid
    assert (io / "status.json").stat().st_uid == user.uid  # the job writes its status there, as its user
    assert json.loads(spec.read_text())["run_dir"] == str(io)
    for what in ("sitecustomize.py", "reamer"):
        assert as_user_run(user, TRY_AS_USER, "create", str(base / what)) == "EACCES"
    assert as_user_run(user, TRY_AS_USER, "unlink", str(log)) == "EACCES"
    assert as_user_run(user, TRY_AS_USER, "unlink", str(spec)) == "EACCES"


# --- the log tail ------------------------------------------------------------------------------

def test_a_log_swapped_for_a_link_to_a_root_only_file_never_leaks(as_user, user, agent, files, tmp_path):
    secret_text = f"TOP-SECRET-{secrets.token_hex(8)}"
    secret = agent.base / "root-only-secret"
    secret.write_text(f"{secret_text}\n" * 20)
    os.chmod(secret, 0o600)
    status, body = as_user.call("POST", "/v1/inference-jobs", online("crashy", files["model"]))
    assert status == 201, body
    job = running(agent, "crashy")
    [base] = deploy_dirs(agent, "crashy")
    log = base / "job.log"

    # The user cannot swap its log for a link (the directory is root's) ...
    assert as_user_run(user, TRY_AS_USER, "symlink-over", str(log), str(secret)) == "EACCES"
    assert stat.S_ISREG(log.lstat().st_mode)
    # ... and should a link get there anyway, the agent does not follow it when the job crashes.
    log.unlink()
    log.symlink_to(secret)
    since = agent.client.events(since=0).last_id
    os.kill(job.pid, signal.SIGKILL)

    crashed = wait_for(lambda: [e for e in agent.client.events(since=since).events
                                if e.kind == "inference_crashed" and e.job == "crashy"],
                       timeout=60, what="the crash to be reported")
    assert "symbolic link" in json.dumps(crashed[0].data)
    again = running(agent, "crashy")  # restarted with a fresh, regular log
    assert stat.S_ISREG(log.lstat().st_mode) and log.stat().st_uid == user.uid
    assert secret.read_text().startswith(secret_text)  # the target was never written to

    every_event = json.dumps([[e.kind, e.message, e.data] for e in agent.client.events(since=0).events])
    assert secret_text not in every_event
    status, shown = as_user.call("GET", "/v1/inference-jobs/crashy")
    assert status == 200 and secret_text not in json.dumps(shown)
    status, listed = as_user.call("GET", "/v1/events", params={"since": 0})
    assert status == 200 and secret_text not in json.dumps(listed)
    assert again.pid != job.pid


def test_the_log_tail_is_read_capped(as_user, user, agent, files):
    """A crash reads only the end of a huge log (a few KiB), and that is what the event carries."""
    status, body = as_user.call("POST", "/v1/inference-jobs", online("noisy", files["model"]))
    assert status == 201, body
    job = running(agent, "noisy")
    [base] = deploy_dirs(agent, "noisy")
    with open(base / "job.log", "ab") as fh:  # 8 MiB of one line, then a last line
        fh.write(b"x" * (8 << 20) + b"\nthe last line\n")
    since = agent.client.events(since=0).last_id
    os.killpg(job.pid, signal.SIGKILL)  # its whole session: no worker writes to the log after the last line
    crashed = wait_for(lambda: [e for e in agent.client.events(since=since).events
                                if e.kind == "inference_crashed" and e.job == "noisy"],
                       timeout=60, what="the crash to be reported")
    tail = crashed[0].data["log_tail"]
    assert "the last line" in tail and len(tail) < 4096 + 100  # 4 KiB read, joined with " | "


# --- the environment ---------------------------------------------------------------------------

def _allowed(key: str) -> bool:
    return key in ENV_NAMES or key.startswith(ENV_PREFIXES) or key in ("HOME", "USER", "LOGNAME")


def test_a_job_gets_an_allowlisted_environment_not_the_agents(as_user, user, agent, files):
    agent_env = Path(f"/proc/{agent.proc.pid}/environ").read_bytes()
    assert AGENT_SECRET.encode() in agent_env  # the agent does hold the secret
    status, body = as_user.call("POST", "/v1/inference-jobs", online("envy", files["model"]))
    assert status == 201, body
    job = running(agent, "envy")
    import pwd

    home = pwd.getpwuid(user.uid).pw_dir
    for proc in job_tree(job.pid):  # the job and its instance workers
        raw = Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert AGENT_SECRET.encode() not in raw
        env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        env = {k.decode(): v.decode() for k, v in env.items()}
        assert [k for k in env if not _allowed(k)] == [], env
        assert env["HOME"] == home and env.get("USER") == user.name
        assert "PYTHONPATH" not in env and "AGENT_ONLY_SECRET" not in env


# --- removal -----------------------------------------------------------------------------------

def test_remove_leaves_no_directory_and_no_cgroup(as_user, user, agent, files):
    status, body = as_user.call("POST", "/v1/inference-jobs", online("gone", files["model"], memory_limit_mb=2048))
    assert status == 201, body
    job = running(agent, "gone")
    memory = memory_cgroup(agent, "gone")
    wait_for(lambda: job.pid in procs_of(memory), timeout=30, what="the job in its memory cgroup")
    [base] = deploy_dirs(agent, "gone")
    # The user filled io/ with a tree and a link out of it: removal neither follows nor stops at it.
    outside = agent.base / "outside-target"
    outside.mkdir()
    (outside / "keep").write_text("root's")
    planted = json.loads(as_user_run(user, PLANTER, json.dumps([(str(base / "io" / "a" / "b" / "c"), "x")])))
    assert planted
    os.symlink(outside, base / "io" / "a" / "link")  # (root made it: the user could make the same)
    pids = [p.pid for p in job_tree(job.pid)]

    assert as_user.call("DELETE", "/v1/inference-jobs/gone")[0] == 200
    assert deploy_dirs(agent, "gone") == []
    assert (outside / "keep").read_text() == "root's"
    assert job_cgroups(agent, "gone") == [], job_cgroups(agent, "gone")
    assert not memory.exists()
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_removing_a_hung_job_leaves_no_cgroup_and_no_process(as_user, user, agent, files):
    status, body = as_user.call("POST", "/v1/inference-jobs", online("hung", files["model"], memory_limit_mb=2048))
    assert status == 201, body
    job = running(agent, "hung")
    memory = memory_cgroup(agent, "hung")
    wait_for(lambda: job.pid in procs_of(memory), timeout=30, what="the job in its memory cgroup")
    # A process of the job outside its session (a daemonized helper): only its cgroup still names it.
    stray = user.sleeper()
    (memory / "cgroup.procs").write_text(str(stray.pid))
    pids = [p.pid for p in job_tree(job.pid)] + [stray.pid]
    os.kill(job.pid, signal.SIGSTOP)  # hung: SIGTERM is never handled

    assert as_user.call("DELETE", "/v1/inference-jobs/hung")[0] == 200
    assert not memory.exists(), procs_of(memory)
    assert job_cgroups(agent, "hung") == []
    assert deploy_dirs(agent, "hung") == []
    stray.wait(timeout=30)
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
