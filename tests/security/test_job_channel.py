"""A job's user attacks the root agent through the files its job talks to the agent with (status.json,
events.jsonl): a real agent, a real unprivileged user in the socket group, a real job deployed over the real
socket, and the attacks made by a process of that user. Each test asserts what the agent does now."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from reamer.api.client import ApiClient
from tests.agent.conftest import daemon_factory  # noqa: F401
from tests.conftest import IS_ROOT, wait_for
from tests.security.conftest import USER_PYTHON, needs_root_for_users
from tests.security.test_jobs_run_as_caller import files  # noqa: F401

pytestmark = [needs_root_for_users, pytest.mark.root]

# Generous: a frozen agent never answers; a loaded test machine answers in well under this.
ANSWER_TIMEOUT_S = 30


def _interpreter_dirs() -> list[Path]:
    dirs = []
    for target in {os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix), sys.prefix}:
        dirs += [p for p in [Path(target), *Path(target).parents] if p.is_dir()]
    return dirs


def let_users_reach_the_interpreter() -> None:
    """This machine's python lives under /root (mode 0700): a job started as another user could not exec it.
    Let others traverse the directories above it, as a system-wide install would. Done again before each
    deploy: other test modules running beside this one put the modes back when they end."""
    for directory in _interpreter_dirs():
        mode = directory.stat().st_mode
        if not mode & stat.S_IXOTH:
            os.chmod(directory, stat.S_IMODE(mode) | stat.S_IXOTH)


@pytest.fixture(scope="module", autouse=True)
def interpreter_reachable():
    before = {d: stat.S_IMODE(d.stat().st_mode) for d in _interpreter_dirs()}
    let_users_reach_the_interpreter()
    yield
    for directory, mode in before.items():
        os.chmod(directory, mode)


def online(name: str, model: str) -> dict:
    return {"name": name, "model": model, "kind": "online", "slo_ms": 500, "layout": "1x1:b1"}


def channel_dir(daemon, name: str) -> Path:
    """Where the job writes its status and events: its spec's run_dir (the agent writes the spec)."""
    def find():
        for spec in sorted(Path(daemon.run_dir, "jobs").glob(f"{name}*/spec.json")):
            return Path(json.loads(spec.read_text())["run_dir"])
        return None
    return wait_for(find, timeout=60, what=f"the spec of job {name}")


def as_job_user(user, code: str) -> None:
    """Run `code` (Python) as the job's user, as an attacker would in a shell."""
    proc = user.popen([USER_PYTHON, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err


def deployed(as_user, daemon, name: str, model: str):
    """The user's online job, started (its status read by the agent at least once)."""
    let_users_reach_the_interpreter()
    status, body = as_user.call("POST", "/v1/inference-jobs", online(name, model))
    assert status == 201, body
    def started():
        job = daemon.client.get_inference_job(name)
        assert job.state != "failed", job.message
        return job if job.pid and job.status.rate_rps is not None else None
    return wait_for(started, timeout=120, interval=0.2, what=f"job {name} to run and report its status")


def passes(daemon) -> int:
    """Reconcile passes the agent has finished (its metrics)."""
    text = daemon.client.metrics()
    return int(float(re.search(r"^reamer_reconcile_duration_seconds_count (\S+)$", text, re.M).group(1)))


def wait_passes(daemon, n: int = 5) -> None:
    start = passes(daemon)
    wait_for(lambda: passes(daemon) >= start + n, timeout=60, interval=0.1, what=f"{n} more reconcile passes")


def events_of(daemon, job: str | None = None, kind: str | None = None) -> list:
    return [e for e in daemon.events() if (job is None or e.job == job) and (kind is None or e.kind == kind)]


def stop(user, pid: int) -> None:
    as_job_user(user, f"import os, signal; os.kill({pid}, signal.SIGSTOP)")


def remove(as_user, name: str, pid: int | None = None) -> None:
    if pid:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    status, body = as_user.call("DELETE", f"/v1/inference-jobs/{name}")
    assert status == 200, body


def test_fifos_never_freeze_the_agent(as_user, user, files, secure_daemon):
    job = deployed(as_user, secure_daemon, "fifo", files["model"])
    where = channel_dir(secure_daemon, "fifo")
    try:
        stop(user, job.pid)  # its own process would replace status.json within 0.5 s
        as_job_user(user, f"""
import os
d = {str(where)!r}
for name in ("status.json", "events.jsonl"):
    tmp = os.path.join(d, name + ".fifo")
    os.mkfifo(tmp)
    os.replace(tmp, os.path.join(d, name))
""")
        assert all(os.path.exists(where / n) and not os.path.isfile(where / n) for n in ("status.json", "events.jsonl"))
        wait_passes(secure_daemon)  # reconcile goes on
        with ApiClient(secure_daemon.socket, timeout=ANSWER_TIMEOUT_S) as root:
            assert root.demote_all().threads_demoted >= 0
            assert root.node().inference_jobs >= 1
            assert root.health()["status"] == "ok"
        note = wait_for(lambda: events_of(secure_daemon, "fifo", "job_events_dropped"), what="the refusal note")[0]
        assert "not_regular" in note.message
    finally:
        remove(as_user, "fifo", job.pid)


def test_links_to_root_only_files_never_show(as_user, user, files, secure_daemon, tmp_path):
    secret = Path(tempfile.mkdtemp(prefix="rmr-secret-", dir="/tmp")) / "secret"
    secret.write_text('{"kind": "failed", "message": "TOPSECRET"}\n' * 3)
    status_secret = secret.with_name("status")
    status_secret.write_text(json.dumps({"name": "link", "pid": 1, "state": "failed", "message": "TOPSECRET"}))
    for path in (secret, status_secret):
        os.chmod(path, 0o600)
    os.chmod(secret.parent, 0o755)
    job = deployed(as_user, secure_daemon, "link", files["model"])
    where = channel_dir(secure_daemon, "link")
    try:
        stop(user, job.pid)
        as_job_user(user, f"""
import os
d = {str(where)!r}
for name, target in (("events.jsonl", {str(secret)!r}), ("status.json", {str(status_secret)!r})):
    os.symlink(target, os.path.join(d, name + ".lnk"))
    os.replace(os.path.join(d, name + ".lnk"), os.path.join(d, name))
""")
        wait_passes(secure_daemon)
        note = wait_for(lambda: events_of(secure_daemon, "link", "job_events_dropped"), what="the refusal note")[0]
        assert "link" in note.message
        shown = json.dumps([e.model_dump() for e in secure_daemon.client.events(since=0).events])
        shown += secure_daemon.client.get_inference_job("link").model_dump_json()
        status, listed = as_user.call("GET", "/v1/inference-jobs")
        assert status == 200
        assert "TOPSECRET" not in shown + json.dumps(listed)
        assert secure_daemon.client.get_inference_job("link").state == "running"  # the forged "failed" was not taken
    finally:
        remove(as_user, "link", job.pid)
        shutil.rmtree(secret.parent, ignore_errors=True)


def test_deeply_nested_lines_leave_the_agent_healthy_and_crashed_jobs_restarted(as_user, user, files, secure_daemon):
    job = deployed(as_user, secure_daemon, "deep", files["model"])
    where = channel_dir(secure_daemon, "deep")
    try:
        as_job_user(user, f"""
with open({str(where / "events.jsonl")!r}, "ab") as fh:
    fh.write(b"[" * 100000 + b"\\n")   # past the line cap
    fh.write(b"[" * 3000 + b"\\n")     # under it, past Python's recursion limit
    fh.write(b'{{"kind": "overload", "message": "after the deep ones"}}\\n')
""")
        wait_for(lambda: events_of(secure_daemon, "deep", "overload"), what="the line after the deep ones")
        wait_passes(secure_daemon, 10)
        assert secure_daemon.client.health()["status"] == "ok"
        note = wait_for(lambda: events_of(secure_daemon, "deep", "job_events_dropped"), what="the drop note")[0]
        assert note.data["dropped"] == {"too_long": 1, "too_deep": 1}
        let_users_reach_the_interpreter()  # the agent starts it again as the user
        as_job_user(user, f"import os, signal; os.killpg({job.pid}, signal.SIGKILL)")
        restarted = wait_for(lambda: (j := secure_daemon.client.get_inference_job("deep")).pid not in (None, job.pid)
                             and j, timeout=60, what="the agent to restart the killed job")
        assert restarted.state == "running"
        assert events_of(secure_daemon, "deep", "inference_crashed")
        assert secure_daemon.client.health()["status"] == "ok"
        job = restarted
    finally:
        remove(as_user, "deep", job.pid)


def test_a_flood_of_events_is_capped_and_keeps_others_events(as_user, user, files, secure_daemon):
    calm = deployed(as_user, secure_daemon, "calm", files["model"])
    kept = [e.id for e in events_of(secure_daemon, "calm")]
    flood = deployed(as_user, secure_daemon, "flood", files["model"])
    where = channel_dir(secure_daemon, "flood")
    try:
        as_job_user(user, f"""
line = b'{{"kind": "overload", "message": "flood"}}\\n'
with open({str(where / "events.jsonl")!r}, "ab") as fh:
    fh.write(line * 12000)
""")
        size = (where / "events.jsonl").stat().st_size
        # the API answers everyone while the agent works through it
        while secure_daemon.client.get_inference_job("flood").model_dump().get("state") and \
                _offset_of(secure_daemon, "flood") < size - 100:
            status, body = as_user.call("GET", "/v1/inference-jobs")
            assert status == 200, body
            assert secure_daemon.client.health()["status"] == "ok"
        note = wait_for(lambda: events_of(secure_daemon, "flood", "job_events_dropped"), what="the drop note")[0]
        assert note.data["dropped"]["rate"] > 0  # the first note comes at once, the next a minute later
        assert _offset_of(secure_daemon, "flood") >= size - 100  # read to its end
        forwarded = events_of(secure_daemon, "flood", "overload")
        assert 0 < len(forwarded) <= 2 * 30  # at most 30 a minute (the flood may straddle two minutes)
        assert [e.id for e in events_of(secure_daemon, "calm") if e.id in kept] == kept
    finally:
        remove(as_user, "flood", flood.pid)
        remove(as_user, "calm", calm.pid)


def _offset_of(daemon, name: str) -> int:
    """How far the agent has read the job's events (its record in the store)."""
    import sqlite3

    db = sqlite3.connect(f"file:{daemon.state_dir / 'state.db'}?mode=ro", uri=True, timeout=30)
    try:
        row = db.execute("SELECT doc FROM inference_jobs WHERE name=?", (name,)).fetchone()
    finally:
        db.close()
    return json.loads(row[0])["events_offset"] if row else 0


def test_a_40_mb_event_is_never_stored(as_user, user, files, secure_daemon):
    job = deployed(as_user, secure_daemon, "huge", files["model"])
    where = channel_dir(secure_daemon, "huge")
    db_before = sum(p.stat().st_size for p in secure_daemon.state_dir.glob("state.db*"))
    try:
        as_job_user(user, f"""
with open({str(where / "events.jsonl")!r}, "ab") as fh:
    fh.write(b'{{"kind": "failed", "message": "' + b"A" * (40 * 2**20) + b'"}}\\n')
    fh.write(b'{{"kind": "overload", "message": "after the huge one"}}\\n')
""")
        wait_for(lambda: events_of(secure_daemon, "huge", "overload"), timeout=120, what="the line after the huge one")
        assert not events_of(secure_daemon, "huge", "failed")
        assert secure_daemon.client.get_inference_job("huge").state == "running"
        assert max(len(e.message) for e in secure_daemon.client.events(since=0).events) < 10_000
        db_after = sum(p.stat().st_size for p in secure_daemon.state_dir.glob("state.db*"))
        assert db_after - db_before < 8 * 2**20  # nothing of the 40 MB (the WAL and reserve grow a little)
    finally:
        remove(as_user, "huge", job.pid)


def test_forged_event_kinds_are_not_emitted(as_user, user, files, secure_daemon):
    job = deployed(as_user, secure_daemon, "forge", files["model"])
    where = channel_dir(secure_daemon, "forge")
    try:
        as_job_user(user, f"""
import json
with open({str(where / "events.jsonl")!r}, "a") as fh:
    for kind in ("training_ended", "rt_throttling_disabled", "inference_removed", "agent_started"):
        fh.write(json.dumps({{"kind": kind, "message": "forged " + kind, "cpus": [1, 2]}}) + "\\n")
    fh.write(json.dumps({{"kind": "overload", "message": "marker", "nested": {{"a": 1}}, "rate": 5}}) + "\\n")
""")
        marker = wait_for(lambda: events_of(secure_daemon, "forge", "overload"), what="the marker event")[0]
        assert marker.data == {"rate": 5}  # data is flat: the nested field went
        found = secure_daemon.client.events(since=secure_daemon.since).events
        assert not [e for e in found if "forged" in e.message]
        assert not [e for e in found if e.kind in ("training_ended", "rt_throttling_disabled")]
        note = wait_for(lambda: events_of(secure_daemon, "forge", "job_events_dropped"), what="the drop note")[0]
        assert note.data["dropped"] == {"unknown_kind": 4}
    finally:
        remove(as_user, "forge", job.pid)


def test_a_forged_status_never_breaks_the_job_list_or_metrics(as_user, user, files, secure_daemon):
    job = deployed(as_user, secure_daemon, "forged", files["model"])
    where = channel_dir(secure_daemon, "forged")
    forged = [
        '{"name": "forged", "pid": %d, "state": "bogus", "rate_rps": "fast", "p99_ms": [1], "done": {"a": 1}, '
        '"message": {"x": 1}, "slo_attainment": NaN, "frontdoor_busy": 1e999, "port": 99999999, "total": -5, '
        '"precision": ["bf16"], "eta_s": true}' % job.pid,
        '{"name": ["x"], "pid": "me"}',
        '[' * 5000,
        '{"name": "forged", "pid": %d, "message": "\\u001b[2Jcleared \\u202e", "p50_ms": 2e308}' % job.pid,
    ]
    try:
        stop(user, job.pid)
        for text in forged:
            as_job_user(user, f"""
import os
d = {str(where)!r}
with open(os.path.join(d, "status.tmp"), "w") as fh:
    fh.write({text!r})
os.replace(os.path.join(d, "status.tmp"), os.path.join(d, "status.json"))
""")
            wait_passes(secure_daemon, 3)
            for caller in ("user", "root"):
                if caller == "user":
                    status, body = as_user.call("GET", "/v1/inference-jobs")
                    assert status == 200, body
                else:
                    listed = secure_daemon.client.list_inference_jobs()
                    assert [j.name for j in listed] == ["forged"]
            shown = secure_daemon.client.get_inference_job("forged")
            assert "\x1b" not in shown.message and "\u202e" not in shown.message
            assert shown.status.slo_attainment is None and shown.status.frontdoor_busy is None
            metrics = secure_daemon.client.metrics()
            assert 'reamer_inference_job_up{job="forged",state="running"} 1.0' in metrics
    finally:
        remove(as_user, "forged", job.pid)


@pytest.fixture
def small_state_disk():
    """A 20 MiB tmpfs for the agent's state directory."""
    if not IS_ROOT or not shutil.which("mount"):
        pytest.skip("needs root to mount a tmpfs")
    mount = Path(tempfile.mkdtemp(prefix="rmr-state-", dir="/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m,mode=0755", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
        mount.rmdir()


def test_a_full_state_disk_still_lets_root_demote_and_remove(daemon_factory, small_state_disk, files):
    daemon = daemon_factory(state_dir=str(small_state_disk))
    daemon.client.deploy_inference(online("stays", files["model"]))
    filler = small_state_disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for block in (1 << 20, 4096, 512):
            try:
                while True:
                    os.write(fd, b"\0" * block)
            except OSError:
                pass
    finally:
        os.close(fd)
    assert os.statvfs(small_state_disk).f_bavail * os.statvfs(small_state_disk).f_frsize < 64 * 1024
    assert daemon.client.demote_all().threads_demoted >= 0
    removed = daemon.client.remove_inference("stays")
    assert removed.state == "done"
    assert daemon.client.list_inference_jobs() == []
    daemon.restart()  # what was recorded on the full disk is what the agent comes back with
    assert daemon.client.list_inference_jobs() == []
    assert psutil.pid_exists(daemon.proc.pid)
