"""GPU sharing end to end: Agent + GpuManager (fake NVML with 2 GPUs, fake `nvidia-cuda-mps-control`)
behind the real FastAPI app on a real Unix socket, driven through reamer.api.client.ApiClient and the
`reamer gpu status` CLI. The agent builds its GpuManager from its config exactly as `reamer daemon`
does; only `pynvml` is swapped for the fake while it opens NVML."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from reamer.agent.config import config_from_dict
from reamer.api.client import ApiClient, ApiError
from tests.agent.conftest import TEST_RT_RUNTIME_US, cleanup_cgroups, needs_rt_host
from tests.conftest import unique_name, wait_for
from tests.gpu.fakes import fake_mps
from tests.gpu.fakes.fake_pynvml import FakeGpu, FakeNvml

pytestmark = [needs_rt_host, pytest.mark.root]

FAKES_DIR = Path(__file__).resolve().parents[1] / "gpu" / "fakes"
U0 = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
U1 = "GPU-bbbbbbbb-1111-2222-3333-444444444444"


def boot_clock() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def write_fake_control(directory: Path) -> str:
    """The fake control binary, run by this interpreter without site (-SE): the manager runs it per command."""
    body = (FAKES_DIR / "nvidia-cuda-mps-control").read_text().split("\n", 1)[1]
    path = directory / "nvidia-cuda-mps-control"
    path.write_text(f"#!{sys.executable} -SE\nFAKES_DIR = {str(FAKES_DIR)!r}\n{body}")
    path.chmod(0o755)
    return str(path)


class ServedAgent:
    """An in-process Agent with its API served by uvicorn (in a thread) on a real Unix socket."""

    def __init__(self, nvml: FakeNvml | None = None, gpu: dict[str, Any] | None = None,
                 gpu_manager: Any = None) -> None:
        # Unix socket paths are limited to ~108 bytes: keep the base dir short.
        self.base = Path(tempfile.mkdtemp(prefix="rmr-gpu-", dir="/tmp"))
        self.cgroup_name = unique_name("reamer-test")
        self.socket = str(self.base / "r.sock")
        self.config = config_from_dict({
            "socket": self.socket, "state_dir": str(self.base / "state"), "run_dir": str(self.base / "run"),
            "cgroup_name": self.cgroup_name, "reserved_cpus": [], "reconcile_interval_s": 0.3,
            "training": {"priority": 20, "rt_runtime_us": TEST_RT_RUNTIME_US}, "log_level": "warning",
            "gpu": gpu or {}})
        self.nvml = nvml
        self.gpu_manager = gpu_manager
        self.agent = None
        self.server = None
        self.thread: threading.Thread | None = None
        self.client: ApiClient | None = None
        self.procs: list[subprocess.Popen] = []

    def start(self) -> "ServedAgent":
        from reamer.api.app import build_app
        from reamer.api.server import bind_unix_socket, make_server
        from reamer.node import build_agent

        self.agent = build_agent(self.config, gpu_manager=self.gpu_manager)
        with pytest.MonkeyPatch.context() as mp:
            if self.nvml is not None:  # the manager imports pynvml when it opens NVML (during start)
                mp.setitem(sys.modules, "pynvml", self.nvml)
            self.agent.start()
        sock = bind_unix_socket(self.socket)
        self.server = make_server(build_app(self.agent), log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), timeout=60, what="uvicorn to start")
        assert self.server.started, "uvicorn stopped while starting"
        self.client = ApiClient(self.socket, timeout=60)
        return self

    def raw(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=self.socket), base_url="http://reamer", timeout=60)

    def spawn(self) -> subprocess.Popen:
        """A stand-in for a GPU job's process (sleeps; killed at cleanup)."""
        proc = subprocess.Popen([sys.executable, "-c", "import time\nprint('ready', flush=True)\ntime.sleep(300)"],
                                stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        assert proc.stdout.readline().strip() == "ready"
        return proc

    def reset(self) -> None:
        for job in self.client.request("GET", "/v1/gpu-jobs")["jobs"]:
            self.client.request("DELETE", f"/v1/gpu-jobs/{job['name']}")
        for proc in self.procs:
            self._kill(proc)
        for pipe in self.base.rglob(fake_mps.STATE_FILE):  # every fake client/server goes with its process
            with fake_mps.locked_state(pipe.parent) as state:
                state["servers"] = {}

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if proc.stdout:
            proc.stdout.close()

    def cleanup(self) -> None:
        try:
            if self.server is not None:
                self.server.should_exit = True
                self.thread.join(timeout=30)
            if self.client is not None:
                self.client.close()
            if self.agent is not None:
                self.agent.stop()  # gpu.stop_daemons_on_exit: quits the fake MPS daemons
        finally:
            for proc in self.procs:
                self._kill(proc)
            for pid_file in self.base.rglob(fake_mps.PID_FILE):
                fake_mps.kill_daemon(pid_file.parent)
            cleanup_cgroups(self.cgroup_name)
            shutil.rmtree(self.base, ignore_errors=True)


def fake_gpu_config(control: str) -> dict[str, Any]:
    return {"mps_control_path": control, "command_timeout_s": 30, "stop_daemons_on_exit": True}


@pytest.fixture(scope="module")
def node() -> Iterator[ServedAgent]:
    """One served agent on two fake GPUs for the module (starting one costs seconds on a loaded machine)."""
    nvml = FakeNvml([FakeGpu(U0, memory_total_mb=16000), FakeGpu(U1, name="NVIDIA A100-SXM4-40GB",
                                                                  memory_total_mb=40000)])
    served = None
    control_dir = Path(tempfile.mkdtemp(prefix="rmr-fakebin-", dir="/tmp"))
    try:
        served = ServedAgent(nvml, gpu=fake_gpu_config(write_fake_control(control_dir)))
        yield served.start()
    finally:
        if served is not None:
            served.cleanup()
        shutil.rmtree(control_dir, ignore_errors=True)


@pytest.fixture
def gpu_node(node: ServedAgent) -> Iterator[ServedAgent]:
    node.reset()
    for g in node.nvml.gpus:
        g.util, g.memory_used_mb, g.processes = 0, 0, {}
    yield node
    node.reset()


def job(client: ApiClient, name: str) -> dict:
    return client.request("GET", f"/v1/gpu-jobs/{name}")


def patch(client: ApiClient, name: str, **body: Any) -> dict:
    return client.request("PATCH", f"/v1/gpu-jobs/{name}", json=body)


def gpu_entry(client: ApiClient, uuid: str) -> dict:
    return next(g for g in client.gpus().model_dump()["gpus"] if g["uuid"] == uuid)


def wait_limits_state(client: ApiClient, name: str, state: str) -> dict:
    """The reconcile loop refreshes MPS servers/clients every pass: poll the API until it shows `state`."""
    return wait_for(lambda: (lambda v: v if v["limits_state"] == state else None)(job(client, name)),
                    timeout=30, what=f"GPU job {name} to be {state}")


def start_after(issued_at: float) -> None:
    """Process start times have clock-tick resolution and a start in the tick of a change counts as
    older (never claim a change took effect): let that tick pass before starting the job."""
    wait_for(lambda: boot_clock() > issued_at + 0.05, timeout=5, interval=0.01, what="the next clock tick")


# --------------------------------------------------------------------------------- status


def test_status_shows_gpus_daemons_and_telemetry(gpu_node):
    gpu_node.nvml.gpu(U0).util = 37
    gpu_node.nvml.gpu(U0).memory_used_mb = 4000
    status = wait_for(lambda: (lambda s: s if (s["gpus"][0]["latest"] or {}).get("util_pct") == 37 else None)(
        gpu_node.client.gpus().model_dump()), timeout=30, what="the reconcile loop to sample NVML")
    assert status["enabled"] and status["available"] and status["mps_available"] and status["message"] == ""
    assert [(g["index"], g["uuid"]) for g in status["gpus"]] == [(0, U0), (1, U1)]
    assert status["gpus"][1]["name"] == "NVIDIA A100-SXM4-40GB" and status["gpus"][1]["memory_total_mb"] == 40000
    latest = status["gpus"][0]["latest"]
    assert latest["memory_used_mb"] == 4000 and latest["memory_pct"] == pytest.approx(25.0)
    for g in status["gpus"]:  # one running control daemon per GPU, each with its own pipe directory
        assert g["daemon"]["running"] and g["daemon"]["error"] == ""
        assert fake_mps.daemon_pid(g["daemon"]["pipe_dir"]) == g["daemon"]["pid"]
        assert g["servers"] == [] and g["jobs"] == []
    assert status["gpus"][0]["daemon"]["pipe_dir"] != status["gpus"][1]["daemon"]["pipe_dir"]
    telemetry = gpu_node.client.request("GET", "/v1/gpus/telemetry", params={"gpu": "0"})
    assert list(telemetry["gpus"]) == [U0] and telemetry["gpus"][U0]["samples"][-1]["util_pct"] == 37
    with pytest.raises(ApiError) as err:
        gpu_node.client.request("GET", "/v1/gpus/telemetry", params={"gpu": "7"})
    assert err.value.status == 404 and err.value.code == "unknown_gpu"


# --------------------------------------------------------------------------------- job lifecycle


def test_register_launch_update_restart_remove(gpu_node):
    client = gpu_node.client
    since = client.events(since=0).last_id
    created = client.register_gpu_job({"name": "train-a", "gpu": "0", "sm_percent": 60, "mem_limit_mb": 4000})
    issued = boot_clock()
    pipe_dir = gpu_entry(client, U0)["daemon"]["pipe_dir"]
    env = created["env"]
    assert env == {"CUDA_VISIBLE_DEVICES": U0, "CUDA_MPS_PIPE_DIRECTORY": pipe_dir,
                   "CUDA_MPS_LOG_DIRECTORY": env["CUDA_MPS_LOG_DIRECTORY"],
                   "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4000M"}
    assert created["gpu_index"] == 0 and created["desired"] == {"sm_percent": 60, "mem_limit_mb": 4000}
    # Registered, nothing running: not applied, nothing pending.
    assert created["applied"] is None and created["limits_state"] == "not_running" and not created["pending_restart"]

    # The job starts with the env, reamer is told its pid; CUDA has not connected yet: still not applied.
    start_after(issued)
    proc = gpu_node.spawn()
    view = patch(client, "train-a", pids=[proc.pid])
    assert view["pids"] == [proc.pid] and view["state"] == "running"
    assert view["applied"] is None and view["limits_state"] == "not_connected" and not view["pending_restart"]

    # It connects to its GPU's MPS server: MPS fixed its limits from the env -> applied.
    client_rec = fake_mps.connect_client(env["CUDA_MPS_PIPE_DIRECTORY"], proc.pid, env=env)
    assert client_rec["active_thread_percentage"] == 60 and client_rec["pinned_mem_limit"] == {"0": "4000M"}
    view = wait_limits_state(client, "train-a", "applied")
    assert view["applied"] == {"sm_percent": 60, "mem_limit_mb": 4000} and not view["pending_restart"]
    g0 = gpu_entry(client, U0)
    assert [s["clients"] for s in g0["servers"]] == [[proc.pid]] and g0["servers"][0]["status"] == "ACTIVE"
    assert g0["jobs"] == ["train-a"] and g0["sm_percent_desired_total"] == 60
    assert g0["mem_limit_mb_desired_total"] == 4000

    # An update changes the desired limits only: the running process keeps what MPS gave it.
    view = patch(client, "train-a", sm_percent=40)
    updated = boot_clock()
    assert view["desired"]["sm_percent"] == 40 and view["applied"]["sm_percent"] == 60
    assert view["pending_restart"] and view["limits_state"] == "pending_restart" and "restart" in view["note"]
    assert view["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert gpu_entry(client, U0)["sm_percent_desired_total"] == 40

    # Restart with the new env: applied again, at 40 %.
    fake_mps.disconnect_client(pipe_dir, proc.pid)
    gpu_node._kill(proc)
    start_after(updated)
    proc2 = gpu_node.spawn()
    patch(client, "train-a", pids=[proc2.pid])
    fake_mps.connect_client(pipe_dir, proc2.pid, env=view["env"])
    view = wait_limits_state(client, "train-a", "applied")
    assert view["applied"] == {"sm_percent": 40, "mem_limit_mb": 4000} and view["pids"] == [proc2.pid]

    listed = client.request("GET", "/v1/gpu-jobs")["jobs"]
    assert [j["name"] for j in listed] == ["train-a"]
    removed = client.remove_gpu_job("train-a")
    assert removed["name"] == "train-a"
    with pytest.raises(ApiError) as err:
        job(client, "train-a")
    assert err.value.status == 404 and err.value.code == "not_found" and "train-a" in err.value.message
    with pytest.raises(ApiError) as err:
        client.remove_gpu_job("train-a")
    assert err.value.status == 404
    status = client.gpus().model_dump()
    assert status["jobs"] == [] and status["gpus"][0]["jobs"] == [] and status["gpus"][0]["sm_percent_desired_total"] == 0
    kinds = [(e.kind, e.job) for e in client.events(since=since).events]
    assert ("gpu_job_registered", "train-a") in kinds and ("gpu_job_removed", "train-a") in kinds


def test_oversubscription_is_refused_with_the_fix_and_nothing_half_applied(gpu_node):
    client = gpu_node.client
    client.register_gpu_job({"name": "train-a", "gpu": "0", "sm_percent": 60, "mem_limit_mb": 10000})
    before_doc = gpu_node.agent.store.get_document("gpu")  # the registrations, in the agent's store
    since = client.events(since=0).last_id

    with pytest.raises(ApiError) as err:
        client.register_gpu_job({"name": "serve-b", "gpu": U0, "sm_percent": 50, "kind": "inference"})
    e = err.value
    assert e.status == 409 and e.code == "gpu_limits"
    assert "110%" in e.message and "train-a=60%" in e.message and "40% is free" in e.message
    assert "lower sm_percent" in e.fix and "allow_oversubscription" in e.fix
    with pytest.raises(ApiError) as err:  # pinned memory is budgeted too
        client.register_gpu_job({"name": "serve-b", "gpu": "0", "sm_percent": 30, "mem_limit_mb": 8000})
    assert err.value.status == 409 and "18000 MB" in err.value.message and "at most 6000 MB" in err.value.fix
    with pytest.raises(ApiError) as err:  # out of range: the schema refuses it
        patch(client, "train-a", sm_percent=101)
    assert err.value.status == 422
    client.register_gpu_job({"name": "other", "gpu": "0", "sm_percent": 40})
    with pytest.raises(ApiError) as err:
        patch(client, "train-a", sm_percent=70)
    assert err.value.status == 409 and "110%" in err.value.message
    assert job(client, "train-a")["desired"] == {"sm_percent": 60, "mem_limit_mb": 10000}
    client.remove_gpu_job("other")

    # Nothing of the refused requests was applied: no job, no budget, no stored change, no event.
    status = client.gpus().model_dump()
    assert [j["name"] for j in status["jobs"]] == ["train-a"]
    assert status["gpus"][0]["sm_percent_desired_total"] == 60 and status["gpus"][0]["jobs"] == ["train-a"]
    assert gpu_node.agent.store.get_document("gpu")["jobs"] == before_doc["jobs"]
    registered = [ev.job for ev in client.events(since=since).events if ev.kind == "gpu_job_registered"]
    assert registered == ["other"]

    # The same job fits on the other GPU, and exactly 100 % fits on GPU 0.
    assert client.register_gpu_job({"name": "serve-b", "gpu": "1", "sm_percent": 50})["gpu"] == U1
    assert client.register_gpu_job({"name": "serve-c", "gpu": "0", "sm_percent": 40})["gpu_index"] == 0

    for request, status_code, code in [
        ({"name": "train-a", "gpu": "1", "sm_percent": 10}, 409, "gpu_limits"),  # name taken
        ({"name": "x", "gpu": "7", "sm_percent": 10}, 404, "unknown_gpu"),
        ({"name": "x", "gpu": "1", "sm_percent": 0}, 422, "invalid_request"),
        ({"name": "x", "gpu": "1", "sm_percent": 10, "mem_limit_mb": 50000}, 409, "gpu_limits"),
        ({"name": "bad name", "gpu": "1", "sm_percent": 10}, 422, "invalid_request"),
    ]:
        with pytest.raises(ApiError) as err:
            client.register_gpu_job(request)
        assert (err.value.status, err.value.code) == (status_code, code), request
        assert err.value.message and "Traceback" not in err.value.message
    with pytest.raises(ApiError) as err:
        patch(client, "train-a")
    assert err.value.status == 422 and "at least one of" in err.value.message
    with pytest.raises(ApiError) as err:
        patch(client, "ghost", sm_percent=10)
    assert err.value.status == 404
    assert sorted(j["name"] for j in client.request("GET", "/v1/gpu-jobs")["jobs"]) == ["serve-b", "serve-c",
                                                                                        "train-a"]


# --------------------------------------------------------------------------------- metrics and CLI


def test_metrics_include_gpu_telemetry(gpu_node):
    gpu_node.nvml.gpu(U1).util = 64
    gpu_node.client.register_gpu_job({"name": "train-m", "gpu": "1", "sm_percent": 30})
    wait_for(lambda: (gpu_entry(gpu_node.client, U1)["latest"] or {}).get("util_pct") == 64, timeout=30,
             what="a new NVML sample")
    with gpu_node.raw() as http:
        response = http.get("/metrics")
    assert response.status_code == 200
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(response.text) for s in family.samples}

    def value(name: str, **labels: str) -> float | None:
        return samples.get((name, tuple(sorted(labels.items()))))

    assert value("reamer_gpu_available") == 1
    assert value("reamer_gpu_utilization_percent", gpu="1", uuid=U1) == 64
    assert value("reamer_gpu_memory_total_bytes", gpu="1", uuid=U1) == 40000 * 1024 * 1024
    assert value("reamer_gpu_power_watts", gpu="0", uuid=U0) == 70
    assert value("reamer_gpu_mps_daemon_up", gpu="0") == 1 and value("reamer_gpu_mps_daemon_up", gpu="1") == 1
    assert value("reamer_gpu_job_sm_percent", gpu="1", job="train-m", kind="training", which="desired") == 30
    assert value("reamer_gpu_job_pending_restart", gpu="1", job="train-m") == 0
    text = response.text
    assert "reamer_training_jobs" in text  # the agent's own metrics are still there


def test_gpu_status_cli_shows_the_gpus(gpu_node):
    from reamer.cli.main import cli

    gpu_node.client.register_gpu_job({"name": "train-cli", "gpu": "1", "sm_percent": 25})
    result = CliRunner().invoke(cli, ["--socket", gpu_node.socket, "gpu", "status"])
    assert result.exit_code == 0, result.output
    pids = [g["daemon"]["pid"] for g in gpu_node.client.gpus().model_dump()["gpus"]]
    assert "NVIDIA H100 80GB HBM3" in result.output and "NVIDIA A100-SXM4-40GB" in result.output
    assert all(f"running (pid {pid})" in result.output for pid in pids)
    assert "train-cli" in result.output and "not_running" in result.output
    as_json = CliRunner().invoke(cli, ["--socket", gpu_node.socket, "-o", "json", "gpu", "status"])
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.output)
    assert [g["uuid"] for g in data["gpus"]] == [U0, U1] and data["jobs"][0]["name"] == "train-cli"


# --------------------------------------------------------------------------------- wiring variants


def test_an_injected_manager_is_started_and_served():
    from reamer.gpu.manager import GpuManager

    served = None
    control_dir = Path(tempfile.mkdtemp(prefix="rmr-fakebin-", dir="/tmp"))
    try:
        manager_dir = control_dir / "gpu"
        manager = GpuManager(fake_gpu_config(write_fake_control(control_dir)), manager_dir,
                             nvml=FakeNvml([FakeGpu(U0)]))
        served = ServedAgent(gpu_manager=manager).start()
        status = served.client.gpus().model_dump()
        assert status["available"] and [g["uuid"] for g in status["gpus"]] == [U0]
        assert status["gpus"][0]["daemon"]["running"]
        view = served.client.register_gpu_job({"name": "t", "gpu": "0", "sm_percent": 20})
        assert view["env"]["CUDA_MPS_PIPE_DIRECTORY"].startswith(str(manager_dir))
    finally:
        if served is not None:
            served.cleanup()
        for pid_file in control_dir.rglob(fake_mps.PID_FILE):
            fake_mps.kill_daemon(pid_file.parent)
        shutil.rmtree(control_dir, ignore_errors=True)


def _has_nvidia_driver() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # noqa: BLE001 - not installed, or no driver
        return False


@pytest.mark.skipif(_has_nvidia_driver(), reason="this machine has an NVIDIA driver: the no-driver path cannot run")
def test_without_an_nvidia_driver_status_says_so_and_registration_is_refused_with_the_fix():
    from reamer.cli.main import cli

    served = ServedAgent()  # real pynvml, default gpu config: no driver, no nvidia-cuda-mps-control
    try:
        served.start()
        status = served.client.gpus().model_dump()
        assert status["enabled"] and not status["available"] and status["gpus"] == []
        assert "no NVIDIA driver" in status["message"] and "install the NVIDIA driver" in status["fix"]
        with pytest.raises(ApiError) as err:
            served.client.register_gpu_job({"name": "g", "gpu": "0", "sm_percent": 50})
        assert err.value.status == 409 and err.value.code == "gpu_unavailable"
        assert "no NVIDIA driver" in err.value.message and "install the NVIDIA driver" in err.value.fix
        assert served.client.request("GET", "/v1/gpu-jobs") == {"jobs": []}
        with served.raw() as http:
            assert "reamer_gpu_available 0.0" in http.get("/metrics").text
        result = CliRunner().invoke(cli, ["--socket", served.socket, "gpu", "status"])
        assert result.exit_code == 0 and "no NVIDIA driver" in result.output
    finally:
        served.cleanup()
