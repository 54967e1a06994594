"""reamer's own GPU code (reamer.gpu.nvml / mps / manager, and the agent API) against the real driver and MPS."""
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = sys.executable
BASE = Path("/tmp/rm")
PROCS = []


def log(*a):
    print(*a, flush=True)


def stage(name):
    log(f"\n================ {name} ({time.strftime('%H:%M:%S')})")


def launch(name, argv, env, extra=None):
    e = {**os.environ, **env, **(extra or {})}
    errf = open(BASE / f"{name}.err", "w")
    p = subprocess.Popen([PY, *argv], env=e, stdout=errf, stderr=errf)
    p.name = name
    PROCS.append(p)
    return p


def client(name, env, *cargs):
    res = BASE / f"{name}.jsonl"
    res.unlink(missing_ok=True)
    p = launch(name, [str(HERE / "client.py"), str(res), *cargs], env)
    p.res = res
    return p


def lines(p):
    try:
        return [json.loads(l) for l in p.res.read_text().splitlines() if l.strip()]
    except OSError:
        return []


def wait_ready(p, timeout=90):
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        ls = lines(p)
        if any(l.get("ready") for l in ls) or any("error" in l for l in ls) or p.poll() is not None:
            break
        time.sleep(0.2)
    log(f"CLIENT {p.name} -> {json.dumps(lines(p))}")
    err = (BASE / f"{p.name}.err").read_text()[-600:]
    if err.strip():
        log(f"  stderr {err!r}")


def view(v):
    keys = ("name", "state", "pids", "desired", "applied", "limits_state", "pending_restart", "note", "message")
    return json.dumps({k: v.get(k) for k in keys})


def r1_nvml():
    stage("R1 reamer.gpu.nvml.Nvml on the real driver")
    from reamer.gpu.nvml import Nvml
    nv = Nvml()
    nv.open()
    log("gpus", [g.to_dict() for g in nv.gpus()])
    log("xid_supported", nv.xid_supported)
    for s in nv.sample():
        log("sample", json.dumps(s.to_dict()))
    nv.close()


def r2_daemon(uuid):
    stage("R2 reamer.gpu.mps.MpsDaemon with the real binary")
    from reamer.gpu.errors import GpuError
    from reamer.gpu.mps import MpsDaemon
    d = MpsDaemon(uuid, BASE / "d" / "pipe", BASE / "d" / "log", timeout_s=10)
    log("running before start", d.is_running())
    for what, fn in [("command before start", lambda: d.command("get_server_list")),
                     ("health before start", d.check_health)]:
        try:
            log(what, "->", repr(fn()))
        except GpuError as exc:
            log(what, "RAISES", type(exc).__name__, str(exc))
    t = time.monotonic()
    pid = d.start(100)
    log(f"start -> pid {pid} in {time.monotonic() - t:.2f}s; health {d.check_health()}; servers {d.servers()}")
    t = time.monotonic()
    for _ in range(10):
        d.check_health()
    log(f"one health check: {(time.monotonic() - t) / 10 * 1000:.1f} ms")
    for what, fn in [("server_status(999999)", lambda: d.server_status(999999)),
                     ("client_pids(999999)", lambda: d.client_pids(999999)),
                     ("terminate_client(999999, 1)", lambda: d.terminate_client(999999, 1)),
                     ("set_active_thread_percentage(999999, 50)", lambda: d.set_active_thread_percentage(999999, 50)),
                     ("set_default_active_thread_percentage(0)", lambda: d.set_default_active_thread_percentage(0)),
                     ("set_default_active_thread_percentage(101)", lambda: d.set_default_active_thread_percentage(101)),
                     ("set_default_device_pinned_mem_limit(0, 2048)",
                      lambda: d.set_default_device_pinned_mem_limit(0, 2048)),
                     ("command('bogus')", lambda: d.command("bogus")),
                     ("get_default_active_thread_percentage", d.get_default_active_thread_percentage)]:
        try:
            log(what, "->", repr(fn()))
        except GpuError as exc:
            log(what, "RAISES", type(exc).__name__, str(exc))
    c = client("r2c", d.env(), "--hold", str(BASE / "stop_r2c"))
    wait_ready(c)
    log("servers with a client", d.servers())
    log("stop() with a client connected ...")
    t = time.monotonic()
    try:
        log("stop ->", d.stop(timeout_s=8), f"after {time.monotonic() - t:.1f}s")
    except GpuError as exc:
        log(f"stop RAISES after {time.monotonic() - t:.1f}s:", str(exc))
    log("is_running", d.is_running(), "pid", d.pid())
    (BASE / "stop_r2c").touch()
    c.wait(timeout=20)
    log(f"client exited rc={c.returncode}; {lines(c)[-1:]}")
    time.sleep(1)
    log("after client exit: is_running", d.is_running())
    try:
        log("stop again ->", d.stop(timeout_s=8))
    except GpuError as exc:
        log("stop again RAISES", str(exc))
    log("is_running", d.is_running(), "log tail", d.log_tail(8))


def r3_manager():
    stage("R3 GpuManager: jobs, real clients, ticks, eviction, fault")
    from reamer.gpu.manager import GpuManager
    events = []

    def on_event(ev):
        events.append(ev)
        log(f"EVENT {ev['kind']}: {ev['message']}")

    m = GpuManager({"command_timeout_s": 10, "stop_daemons_on_exit": True,
                    "policies": {"fault_handling": True, "eviction_grace_s": 5, "eviction_kill_after_s": 3}},
                   BASE / "gpu", on_event=on_event)
    m.start()
    st = m.status()
    log("status", json.dumps({k: st[k] for k in ("available", "mps_available", "reason", "mps_control")}),
        json.dumps(st["gpus"][0]["daemon"]))
    inf = m.register_job("infer", "0", 50, 2048, kind="inference")
    log("env", inf["env"])
    ic = client("infer", inf["env"], "--hold", str(BASE / "stop_infer"), "--matmul", "8192", "--alloc", "4000")
    wait_ready(ic)
    log("update pids", view(m.update_job("infer", pids=[ic.pid])))
    tr = m.register_job("train", "0", 40, 8192, kind="training")
    ready = BASE / "train.ready"
    tp = launch("train", [str(REPO / "bench" / "train_gpu_pytorch.py"), "--duration", "60", "--model", "resnet18",
                          "--batch", "64", "--loader-workers", "4", "--report", str(BASE / "train_mps.json"),
                          "--ready-file", str(ready)], tr["env"])
    t = time.monotonic()
    while not ready.exists() and tp.poll() is None and time.monotonic() - t < 90:
        time.sleep(0.2)
    log(f"training ready after {time.monotonic() - t:.1f}s (rc {tp.poll()})")
    log("update pids", view(m.update_job("train", pids=[tp.pid])))
    for _ in range(3):
        log("tick", m.tick())
        time.sleep(1)
    st = m.status()
    g = st["gpus"][0]
    log("servers", g["servers"], "daemon", g["daemon"])
    log("latest", json.dumps(g["latest"]))
    for j in st["jobs"]:
        log("job", view(j))
    text = m.prometheus_text()
    log("metrics:\n" + "\n".join(l for l in text.splitlines() if l.startswith("reamer_gpu") and "bucket" not in l))
    log("change infer to 30%", view(m.update_job("infer", sm_percent=30)))
    t = time.monotonic()
    ev = m.evict_job("train", reason="probe", wait=True)
    log(f"evict train ({time.monotonic() - t:.1f}s)", view(ev))
    log(f"train rc={tp.wait(timeout=30)}; stderr tail {(BASE / 'train.err').read_text()[-400:]!r}")
    try:
        rep = json.loads((BASE / "train_mps.json").read_text())
        ms = rep["iteration_ms"][1:]
        log(f"training under MPS 40%: {len(rep['iteration_ms'])} iterations, median "
            f"{sorted(ms)[len(ms) // 2]:.1f} ms, stopped_by {rep['stopped_by']}")
    except (OSError, ValueError, KeyError, IndexError) as exc:
        log("no training report", exc)

    stage("R3b fault: a client faults while an offline job and an online job are connected")
    t2j = m.register_job("train2", "0", 20, kind="training")
    t2 = client("train2", t2j["env"], "--hold", str(BASE / "stop_train2"))
    wait_ready(t2)
    m.update_job("train2", pids=[t2.pid])
    m.tick()
    log("servers", m.status()["gpus"][0]["servers"])
    f = client("fault", inf["env"], "--fault")
    f.wait(timeout=60)
    log("fault client", lines(f))
    t = time.monotonic()
    while time.monotonic() - t < 25:
        m.tick()
        kinds = [e["kind"] for e in events]
        if "gpu_fault_recovered" in kinds or "gpu_fault_recovery_failed" in kinds or "gpu_fault_handled" in kinds:
            break
        time.sleep(1)
    st = m.status()
    log("after fault: servers", st["gpus"][0]["servers"], "daemon", st["gpus"][0]["daemon"],
        "last_fault", st["gpus"][0]["last_fault"])
    for j in st["jobs"]:
        log("job", view(j))
    log("infer client", lines(ic)[-3:], "alive", ic.poll() is None)
    (BASE / "stop_infer").touch()
    (BASE / "stop_train2").touch()
    time.sleep(3)
    for _ in range(3):
        m.tick()
        time.sleep(1)
    st = m.status()
    log("after clients gone: servers", st["gpus"][0]["servers"], "daemon", st["gpus"][0]["daemon"])
    ok = client("after", m.job_env("infer"))
    ok.wait(timeout=60)
    log("new client after recovery", lines(ok))
    m.close()
    log("after close: daemon running", [rt.daemon.is_running() for rt in m._gpus.values()])


def r4_agent():
    stage("R4 agent + FastAPI app (TestClient) with the real GPU")
    from fastapi.testclient import TestClient

    from reamer.agent.config import config_from_dict
    from reamer.agent.service import Agent
    from reamer.api.app import build_app
    base = Path("/tmp/ra")
    cfg = config_from_dict({"socket": str(base / "r.sock"), "state_dir": str(base / "state"),
                            "run_dir": str(base / "run"), "reserved_cpus": [], "log_level": "warning",
                            "gpu": {"stop_daemons_on_exit": True}})
    agent = Agent(cfg)
    try:
        agent.start(run_loop=True)
    except Exception as exc:  # noqa: BLE001
        log("agent.start RAISES", type(exc).__name__, exc)
        return
    try:
        c = TestClient(build_app(agent))
        r = c.get("/v1/gpus")
        log("GET /v1/gpus", r.status_code, json.dumps(r.json())[:1500])
        r = c.post("/v1/gpu-jobs", json={"name": "api-job", "gpu": 0, "sm_percent": 30, "mem_limit_mb": 3000,
                                         "kind": "inference"})
        log("POST /v1/gpu-jobs", r.status_code, json.dumps(r.json().get("env")))
        env = r.json()["env"]
        p = client("apijob", env, "--hold", str(base / "stop"), "--alloc", "5000")
        wait_ready(p)
        r = c.patch("/v1/gpu-jobs/api-job", json={"pids": [p.pid]})
        log("PATCH", r.status_code, view(r.json()))
        time.sleep(2.5)
        r = c.get("/v1/gpu-jobs/api-job")
        log("GET job", r.status_code, view(r.json()))
        r = c.get("/v1/gpus")
        log("GET /v1/gpus servers", json.dumps(r.json()["gpus"][0]["servers"]))
        r = c.post("/v1/gpu-jobs", json={"name": "too-big", "gpu": 0, "sm_percent": 80})
        log("POST oversubscribed", r.status_code, r.json())
        r = c.get("/v1/gpus/telemetry")
        log("telemetry", r.status_code, len(next(iter(r.json()["gpus"].values()))["samples"]), "samples")
        (base / "stop").touch()
        p.wait(timeout=20)
        r = c.delete("/v1/gpu-jobs/api-job")
        log("DELETE", r.status_code)
    finally:
        agent.stop()


def main():
    BASE.mkdir(parents=True, exist_ok=True)
    uuid = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.split()[0]
    for fn in (r1_nvml, lambda: r2_daemon(uuid), r3_manager, r4_agent):
        try:
            fn()
        except Exception:  # noqa: BLE001
            log("STAGE FAILED\n" + traceback.format_exc())


if __name__ == "__main__":
    try:
        main()
    finally:
        for p in PROCS:
            if p.poll() is None:
                p.kill()
