"""GpuManager end to end: fake NVML module + fake MPS control binary, real processes, real files."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from reamer.gpu.errors import GpuError, LimitError, NoGpuDriver, UnknownGpu, UnknownJob
from reamer.gpu.manager import GpuManager
from reamer.host.identity import boot_clock
from reamer.gpu.policies import HealthState
from tests.conftest import wait_for
from tests.gpu.fakes import fake_mps
from tests.gpu.fakes.fake_pynvml import FakeGpu, FakeNvml

U0 = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
U1 = "GPU-bbbbbbbb-1111-2222-3333-444444444444"


@pytest.fixture
def procs():
    """Real stand-ins for GPU job processes; all killed and reaped afterwards."""
    started: list[subprocess.Popen] = []

    def spawn(ignore_term: bool = False) -> subprocess.Popen:
        code = ("import signal,time\n"
                + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
                + "print('ready', flush=True)\ntime.sleep(120)\n")
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"  # its SIGTERM disposition is in place
        started.append(p)
        return p

    yield spawn
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


@pytest.fixture
def fake():
    return FakeNvml([FakeGpu(U0, memory_total_mb=16000), FakeGpu(U1, memory_total_mb=16000)])


@pytest.fixture
def make_manager(run_dir, fake_control, fake):
    made: list[GpuManager] = []

    def make(nvml=fake, **cfg) -> GpuManager:
        policies = {"eviction_grace_s": 0.5, "eviction_kill_after_s": 0.5, **cfg.pop("policies", {})}
        config = {"mps_control_path": fake_control, "command_timeout_s": 30, "stop_daemons_on_exit": True,
                  "policies": policies, **cfg}
        m = GpuManager(config, run_dir, nvml=nvml)
        m.start()
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def pipe_dir(m: GpuManager, uuid: str):
    return [g for g in m.status()["gpus"] if g["uuid"] == uuid][0]["daemon"]["pipe_dir"]


def connect(m: GpuManager, job: str, proc: subprocess.Popen) -> dict:
    """The job's process starts CUDA: it connects to its GPU's MPS server with the env reamer gave it."""
    view = m.job(job)
    return fake_mps.connect_client(view["env"]["CUDA_MPS_PIPE_DIRECTORY"], proc.pid, env=view["env"])


# ------------------------------------------------------------------ no driver / disabled


def test_without_nvidia_driver_everything_else_keeps_working(run_dir):
    m = GpuManager({}, run_dir)  # real pynvml, real PATH: this machine has neither driver nor binary
    m.start()
    st = m.status()
    if st["available"]:
        pytest.skip("this machine has an NVIDIA driver")
    assert "no NVIDIA driver" in st["reason"]
    assert "nvidia-cuda-mps-control not found" in st["reason"]
    assert st["gpus"] == [] and st["jobs"] == []
    with pytest.raises(NoGpuDriver) as exc:
        m.register_job("train", "0", 50)
    assert "no NVIDIA driver" in exc.value.message and "NVIDIA driver" in exc.value.fix
    assert m.tick()["available"] is False
    assert m.telemetry() == {"available": False, "reason": st["reason"], "gpus": {}}
    assert "reamer_gpu_available 0.0" in m.prometheus_text()
    with pytest.raises(UnknownJob):
        m.remove_job("train")
    m.close()


def test_disabled_in_config(run_dir, fake):
    m = GpuManager({"enabled": False}, run_dir, nvml=fake)
    m.start()
    assert "disabled" in m.status()["reason"] and "nvmlInit" not in fake.calls
    with pytest.raises(NoGpuDriver, match="disabled"):
        m.register_job("a", "0", 10)
    m.close()


def test_missing_control_binary_is_reported(run_dir, fake):
    m = GpuManager({"mps_control_path": str(run_dir / "missing")}, run_dir, nvml=fake)
    m.start()
    st = m.status()
    assert st["available"] and not st["mps_available"]
    assert "nvidia-cuda-mps-control not found" in st["reason"]
    with pytest.raises(NoGpuDriver, match="cannot be enforced"):
        m.register_job("a", "0", 10)
    m.close()


# ------------------------------------------------------------------ daemons


def test_one_daemon_per_gpu_with_own_dirs_adopted_after_restart(make_manager, run_dir, fake):
    m = make_manager(stop_daemons_on_exit=False)
    st = m.status()
    assert st["available"] and st["mps_available"]
    d0, d1 = (g["daemon"] for g in st["gpus"])
    assert d0["running"] and d1["running"] and d0["pid"] != d1["pid"]
    assert d0["pipe_dir"] != d1["pipe_dir"] and d0["log_dir"] != d1["log_dir"]
    assert d0["pipe_dir"].startswith(str(run_dir))
    assert fake_mps.read_state(d0["pipe_dir"])["visible_devices"] == U0
    assert fake_mps.read_state(d1["pipe_dir"])["visible_devices"] == U1
    m.register_job("train", "1", 40)
    m.close()  # daemons keep running for the jobs
    assert fake_mps.daemon_pid(d0["pipe_dir"]) == d0["pid"]
    m2 = make_manager()
    st2 = m2.status()
    assert [g["daemon"]["pid"] for g in st2["gpus"]] == [d0["pid"], d1["pid"]]  # adopted, not restarted
    assert [j["name"] for j in st2["jobs"]] == ["train"] and st2["jobs"][0]["gpu"] == U1
    assert any(e["kind"] == "mps_daemon_adopted" for e in m2.events())
    m2.close()  # stop_daemons_on_exit
    assert fake_mps.daemon_pid(d0["pipe_dir"]) is None


def test_dead_daemon_is_restarted_on_tick(make_manager):
    m = make_manager()
    pd = pipe_dir(m, U0)
    old = fake_mps.daemon_pid(pd)
    fake_mps.kill_daemon(pd)
    wait_for(lambda: fake_mps.daemon_pid(pd) is None, what="fake daemon to die")
    m.tick()
    new = fake_mps.daemon_pid(pd)
    assert new is not None and new != old
    assert any(e["kind"] == "mps_daemon_missing" for e in m.events())


def test_exclusive_process_set_and_restored(make_manager, fake):
    m = make_manager(exclusive_process=True)
    assert [g.compute_mode for g in fake.gpus] == [3, 3]
    assert m.status()["gpus"][0]["compute_mode_to_restore"] == 0
    m.close()
    assert [g.compute_mode for g in fake.gpus] == [0, 0]


# ------------------------------------------------------------------ jobs and limits


def test_register_returns_launch_env_and_persists(make_manager, run_dir):
    m = make_manager()
    view = m.register_job("train", U1, 30, mem_limit_mb=2048, kind="training")
    env = view["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == U1
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == pipe_dir(m, U1)
    assert view["desired"] == {"sm_percent": 30, "mem_limit_mb": 2048}
    assert view["applied"] is None and view["pending_restart"] is False and "not running" in view["note"]
    saved = json.loads((run_dir / "gpu_jobs.json").read_text())
    assert [j["name"] for j in saved["jobs"]] == ["train"]
    by_index = m.register_job("serve", "0", 50, kind="inference")
    assert by_index["gpu"] == U0 and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in by_index["env"]
    assert {j["name"] for j in m.jobs()} == {"train", "serve"}
    m.remove_job("serve")
    assert [j["name"] for j in m.jobs()] == ["train"]
    assert [j["name"] for j in json.loads((run_dir / "gpu_jobs.json").read_text())["jobs"]] == ["train"]


def test_limits_never_add_up_past_100_unless_allowed(make_manager):
    m = make_manager()
    m.register_job("a", "0", 60)
    with pytest.raises(LimitError) as exc:
        m.register_job("b", "0", 50)
    assert "110%" in exc.value.message and "40% is free" in exc.value.message
    assert "allow_oversubscription" in exc.value.fix
    m.register_job("b", "0", 40)
    m.register_job("c", "1", 90, mem_limit_mb=15000)  # another GPU has its own budget
    with pytest.raises(LimitError):
        m.update_job("a", sm_percent=61)
    assert m.job("a")["desired"]["sm_percent"] == 60  # a refused update changes nothing
    with pytest.raises(LimitError, match="pinned memory limits on GPU 1 would add up to 17000 MB"):
        m.register_job("d", U1, 10, mem_limit_mb=2000)
    m.register_job("d", U1, 10, mem_limit_mb=1000)
    for bad in (0, 101, 12.5, "30", True):
        with pytest.raises(LimitError, match="sm_percent"):
            m.register_job("x", "1", bad)
    with pytest.raises(LimitError, match="more than GPU"):
        m.register_job("x", "0", 1, mem_limit_mb=20000)
    with pytest.raises(UnknownGpu):
        m.register_job("x", "9", 1)
    with pytest.raises(LimitError, match="already registered"):
        m.register_job("a", "0", 1)
    with pytest.raises(LimitError, match="kind"):
        m.register_job("y", "1", 1, kind="batch")


def test_oversubscription_allowed_by_operator(make_manager):
    m = make_manager(allow_oversubscription=True)
    m.register_job("a", "0", 80)
    m.register_job("b", "0", 80)
    assert m.status()["gpus"][0]["sm_percent_desired_total"] == 160


def test_desired_applied_pending_restart(make_manager, procs):
    m = make_manager()
    m.register_job("train", "0", 30, mem_limit_mb=1024)
    p1 = procs()
    view = m.update_job("train", pids=[p1.pid])
    assert view["state"] == "running" and view["applied"] is None
    assert view["limits_state"] == "not_connected" and view["pending_restart"] is False
    assert "not a client" in view["note"]
    client = connect(m, "train", p1)
    assert client["active_thread_percentage"] == 30.0 and client["pinned_mem_limit"] == {"0": "1024M"}
    m.tick()
    view = m.job("train")
    assert view["applied"] == {"sm_percent": 30, "mem_limit_mb": 1024}, view["note"]
    assert view["limits_state"] == "applied" and view["pending_restart"] is False
    # Change the limits: MPS cannot apply them to the running client.
    view = m.update_job("train", sm_percent=20)
    assert view["desired"]["sm_percent"] == 20 and view["applied"]["sm_percent"] == 30
    assert view["pending_restart"] is True and view["limits_state"] == "pending_restart"
    assert view["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20" and "restart" in view["note"]
    # Restart the job with the new env (a process started after the change, in the boot clock's ticks).
    issued = boot_clock()
    wait_for(lambda: boot_clock() > issued + 0.05, what="the boot clock to pass the issue time")
    p1.kill()
    p1.wait()
    fake_mps.disconnect_client(view["env"]["CUDA_MPS_PIPE_DIRECTORY"], p1.pid)
    p2 = procs()
    m.update_job("train", pids=[p2.pid])
    assert connect(m, "train", p2)["active_thread_percentage"] == 20.0
    m.tick()
    view = m.job("train")
    assert view["applied"] == {"sm_percent": 20, "mem_limit_mb": 1024} and view["pending_restart"] is False
    p2.kill()
    p2.wait()
    m.tick()
    view = m.job("train")
    assert view["state"] == "registered" and view["pids"] == [] and view["applied"] is None
    assert view["limits_state"] == "not_running"


def test_process_started_before_limits_were_issued_is_not_claimed(make_manager, procs):
    m = make_manager()
    early = procs()
    issued_after = boot_clock()
    wait_for(lambda: boot_clock() > issued_after + 0.05, what="boot clock tick")
    m.register_job("serve", "0", 40, kind="inference", pids=[early.pid])
    connect(m, "serve", early)
    m.tick()
    view = m.job("serve")
    assert view["applied"] is None and view["pending_restart"] is True
    assert "started before reamer issued" in view["note"]


# ------------------------------------------------------------------ policies in the manager


def test_fault_evicts_offline_and_waits_for_the_remaining_clients(make_manager, procs):
    """As on a real H100: every client of the faulted server holds the fault, the server stays FAULT
    until they have all exited and is then ACTIVE again by itself. `quit` would block while clients
    are connected, so the daemon is not restarted."""
    m = make_manager()
    m.register_job("serve", "0", 40, kind="inference")
    m.register_job("train", "0", 50, kind="training")
    online, offline = procs(), procs(ignore_term=True)
    m.update_job("serve", pids=[online.pid])
    m.update_job("train", pids=[offline.pid])
    c = connect(m, "serve", online)
    connect(m, "train", offline)
    pd = pipe_dir(m, U0)
    daemon = fake_mps.daemon_pid(pd)
    m.tick()
    assert not any(e["kind"] == "gpu_fault" for e in m.events())
    fake_mps.fault(pd, c["server_pid"])
    assert fake_mps.connect_client(pd, 99999)["error"] == 807  # MPS refuses new clients now
    m.tick()
    wait_for(lambda: any(e["kind"] == "gpu_fault_handled" for e in m.events()), timeout=60,
             what="fault handling")
    assert offline.poll() == -signal.SIGKILL  # it ignored SIGTERM
    assert online.poll() is None  # online work is not evicted
    assert m.job("train")["state"] == "evicted"
    kinds = [e["kind"] for e in m.events()]
    assert kinds.index("gpu_fault") < kinds.index("gpu_job_evicted") < kinds.index("gpu_fault_handled")
    assert "FAULT" in next(e for e in m.events() if e["kind"] == "gpu_fault")["message"]
    handled = next(e for e in m.events() if e["kind"] == "gpu_fault_handled")["message"]
    assert str(online.pid) in handled and "serve" in handled and str(offline.pid) not in handled
    assert fake_mps.daemon_pid(pd) == daemon  # not restarted
    # The server stays in FAULT until the online client exits: that is not a new fault.
    m.tick()
    m.tick()
    assert [e["kind"] for e in m.events()].count("gpu_fault") == 1
    [server] = m.status()["gpus"][0]["servers"]
    assert server["status"] == "FAULT" and server["clients"] == [online.pid]
    # Graceful: it ignored SIGTERM, so its MPS client work was terminated before the SIGKILL.
    assert [c["server_pid"], offline.pid] in fake_mps.read_state(pd)["terminated_clients"]
    assert online.pid not in [x[1] for x in fake_mps.read_state(pd)["terminated_clients"]]
    # The online job's process exits: the same server is ACTIVE again, and that is reported once.
    online.kill()
    online.wait(timeout=30)
    m.tick()
    m.tick()
    assert [e["kind"] for e in m.events()].count("gpu_fault_cleared") == 1
    assert m.status()["gpus"][0]["servers"] == [{"pid": c["server_pid"], "status": "ACTIVE", "clients": []}]
    assert "error" not in fake_mps.connect_client(pd, 99998, process=False)


def test_server_faulted_without_clients_gets_the_daemon_restarted(make_manager, procs):
    m = make_manager()
    m.register_job("train", "0", 50, kind="training")
    offline = procs()
    m.update_job("train", pids=[offline.pid])
    c = connect(m, "train", offline)
    pd = pipe_dir(m, U0)
    daemon = fake_mps.daemon_pid(pd)
    m.tick()
    fake_mps.fault(pd, c["server_pid"], sticky=True)
    m.tick()
    wait_for(lambda: any(e["kind"] == "gpu_fault_recovered" for e in m.events()), timeout=60,
             what="fault recovery")
    assert offline.poll() is not None
    assert "restarted" in next(e for e in m.events() if e["kind"] == "gpu_fault_recovered")["message"]
    assert fake_mps.daemon_pid(pd) not in (None, daemon)
    m.tick()
    assert "gpu_fault_cleared" not in [e["kind"] for e in m.events()]


def test_fatal_xid_triggers_fault_handling(make_manager, fake, procs):
    m = make_manager(policies={"restart_daemon_on_fault": False})
    m.register_job("train", "1", 50)
    p = procs()
    m.update_job("train", pids=[p.pid])
    connect(m, "train", p)
    fake.inject_xid(U1, 43)
    m.tick()
    wait_for(lambda: any(e["kind"] == "gpu_fault_handled" for e in m.events()), timeout=60, what="fault handling")
    assert p.poll() is not None
    assert "XID 43" in m.status()["gpus"][1]["last_fault"]
    assert m.status()["gpus"][1]["xid_events"] == 1


def test_health_overlimit_evicts_offline_and_blocks_admission(make_manager, fake, procs):
    th = {"overlimit_hold_s": 10, "overlimit_window_s": 7200}
    m = make_manager(policies={"health": True, "health_thresholds": th})
    with pytest.raises(GpuError, match="init"):
        m.register_job("early", "0", 10)  # no sample yet: not Healthy
    m.tick(now=1000)
    m.register_job("train", "0", 30)
    p = procs()
    m.update_job("train", pids=[p.pid])
    connect(m, "train", p)
    fake.gpu(U0).util = 99
    m.tick(now=1001)
    assert m.status()["gpus"][0]["health"]["state"] == HealthState.OVERLIMIT.value
    wait_for(lambda: m.job("train")["state"] == "evicted", timeout=60, what="eviction")
    assert p.poll() is not None
    with pytest.raises(GpuError, match="overlimit"):
        m.register_job("train2", "0", 10)
    m.register_job("serve", "0", 10, kind="inference")  # online work is still admitted
    fake.gpu(U0).util = 10
    m.tick(now=1002)
    m.tick(now=1005)
    assert m.status()["gpus"][0]["health"]["state"] == "overlimit"  # hold not over
    m.tick(now=1013)
    assert m.status()["gpus"][0]["health"]["state"] == "unhealthy"
    m.tick(now=1014)
    assert m.status()["gpus"][0]["health"]["state"] == "healthy"
    m.register_job("train2", "0", 10)


def test_complement_rule_sets_offline_share(make_manager, fake, procs):
    m = make_manager(policies={"complement": True})
    m.register_job("serve", "0", 60, kind="inference")
    m.register_job("train", "0", 20, kind="training")
    online = procs()
    m.update_job("serve", pids=[online.pid])
    connect(m, "serve", online)
    fake.gpu(U0).process_sm = {online.pid: 30}
    m.tick()
    serve, train = m.job("serve"), m.job("train")
    assert train["desired"]["sm_percent"] == 60  # 100 - 30 - 10 headroom
    assert serve["desired"]["sm_percent"] == 40  # 30 + 10 margin
    assert train["recommended_sm_percent"] == 60
    assert serve["pending_restart"] is True  # its running process still has what it started with
    assert any(e["kind"] == "gpu_complement" for e in m.events())
    fake.gpu(U0).process_sm = {online.pid: 32}
    m.tick()
    assert m.job("train")["desired"]["sm_percent"] == 60  # small change: no churn


# ------------------------------------------------------------------ telemetry and metrics


def test_telemetry_and_prometheus(make_manager, fake):
    m = make_manager(history_len=2)
    g = fake.gpu(U0)
    g.util, g.memory_used_mb, g.processes = 42, 4000, {321: 1500}
    m.register_job("train", "0", 25)
    for _ in range(3):
        m.tick()
    t = m.telemetry()
    assert set(t["gpus"]) == {U0, U1}
    assert len(t["gpus"][U0]["samples"]) == 2  # history_len
    assert t["gpus"][U0]["samples"][-1]["util_pct"] == 42
    assert set(m.telemetry("1")["gpus"]) == {U1}
    text = m.prometheus_text()
    assert f'reamer_gpu_utilization_percent{{gpu="0",uuid="{U0}"}} 42.0' in text
    assert 'reamer_gpu_process_memory_bytes{gpu="0",pid="321"}' in text
    assert 'reamer_gpu_job_sm_percent{gpu="0",job="train",kind="training",which="desired"} 25.0' in text
    assert 'reamer_gpu_mps_daemon_up{gpu="1"} 1.0' in text
    assert 'reamer_gpu_available 1.0' in text


def test_recommend_share_uses_latency_model(make_manager):
    m = make_manager()
    xs = [10, 20, 30, 40, 50, 60]
    ys = [100 - 2 * x if x < 40 else 20 - 0.1 * (x - 40) for x in xs]
    rec = m.recommend_share(xs, ys, slo_ms=30.5)
    assert rec["base_pct"] == 35 and rec["share_pct"] == 45


def test_corrupt_registrations_file_names_the_fix(run_dir, fake, fake_control):
    (run_dir / "gpu_jobs.json").write_text("{not json")
    m = GpuManager({"mps_control_path": fake_control}, run_dir, nvml=fake)
    with pytest.raises(GpuError) as exc:
        m.start()
    assert "gpu_jobs.json" in exc.value.message and "remove" in exc.value.fix
