"""Second device call: what the first did not reach, and reamer's fixed code against the real binary."""
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe_mps as pm  # noqa: E402
import probe_reamer as pr  # noqa: E402

log, ctl, client, menv, servers, wait_ready, stop_hold, pidfile_state = (
    pm.log, pm.ctl, pm.client, pm.menv, pm.servers, pm.wait_ready, pm.stop_hold, pm.pidfile_state)


def raw():
    pm.BASE.mkdir(parents=True, exist_ok=True)
    pm.stage("T1 quit without clients; default pinned limit")
    e = menv("c")
    Path(e["CUDA_MPS_PIPE_DIRECTORY"]).mkdir(parents=True, exist_ok=True)
    Path(e["CUDA_MPS_LOG_DIRECTORY"]).mkdir(parents=True, exist_ok=True)
    ctl(e, None, args=("-d",), tag="T1")
    time.sleep(0.3)
    ctl(e, "quit\n", tag="T1-quit-noclients")
    time.sleep(0.5)
    log("after quit", pidfile_state(e))
    ctl(e, None, args=("-d",), tag="T1-restart")
    time.sleep(0.3)
    for c in ["set_default_device_pinned_mem_limit 0 1536M", "get_default_device_pinned_mem_limit 0",
              "set_default_active_thread_percentage 50", "get_default_active_thread_percentage"]:
        ctl(e, c + "\n", tag="T1")
    client(e, "d1536_noenv", "--alloc", "4000")
    client(e, "d1536_env3G_100", "--alloc", "4000",
           extra_env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3G", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"})
    client(e, "d1536_env1G_30", "--alloc", "4000",
           extra_env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1G", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"})
    pm.stage("T2 server-level commands with bad values; terminate_client of a non-client")
    h = client(e, "t2h", "--hold", str(pm.BASE / "stop_t2h"), wait=False)
    wait_ready(h)
    spid = (servers(e, "T2") or [0])[0]
    for c in [f"get_active_thread_percentage {spid}", f"set_active_thread_percentage {spid} 0",
              f"set_active_thread_percentage {spid} abc", f"set_active_thread_percentage {spid} 101",
              f"get_active_thread_percentage {spid}", f"set_device_pinned_mem_limit {spid} 0 abc",
              f"get_device_pinned_mem_limit {spid} 0", f"get_server_status {spid}"]:
        ctl(e, c + "\n", tag="T2")
    sleeper = subprocess.Popen(["sleep", "6"])
    t = time.monotonic()
    ctl(e, f"terminate_client {spid} {sleeper.pid}\n", tag="T2-nonclient-live")
    log(f"  took {time.monotonic() - t:.2f}s; sleeper alive {sleeper.poll() is None}")
    ctl(e, "get_server_list\n", tag="T2-after")
    sleeper.wait()
    ctl(e, f"terminate_client {spid} 4000000\n", tag="T2-nonclient-nopid")
    ctl(e, "get_server_list\n", tag="T2-after2")
    stop_hold(h, pm.BASE / "stop_t2h")
    time.sleep(0.5)
    ctl(e, "quit\n", tag="T2-quit")
    pm.logs(e, 25)
    pm.stage("T3 pipe directory length")
    for n in (() if os.environ.get("SKIP_T3") else (80, 100)):
        d = pm.BASE / f"p{n}"
        long = Path(str(d) + "/" + "x" * (n - len(str(d)) - 1))
        long.mkdir(parents=True)
        e3 = {**e, "CUDA_MPS_PIPE_DIRECTORY": str(long), "CUDA_MPS_LOG_DIRECTORY": str(d / "log")}
        log(f"pipe dir length {len(str(long))}")
        ctl(e3, None, args=("-d",), tag=f"T3-{n}")
        time.sleep(0.5)
        log(pidfile_state(e3))
        ctl(e3, "get_server_list\n", tag=f"T3-{n}")
        client(e3, f"pipe{n}")
        ctl(e3, "get_server_list\n", tag=f"T3-{n}")
        ctl(e3, "quit\n", tag=f"T3-{n}")
        pm.logs(e3, 8)


def reamer():
    pr.BASE.mkdir(parents=True, exist_ok=True)
    uuid = pm.UUID
    pr.stage("U1 MpsDaemon refusals and stop() with a client")
    from reamer.gpu.errors import GpuError
    from reamer.gpu.mps import MpsDaemon
    d = MpsDaemon(uuid, pr.BASE / "d2" / "pipe", pr.BASE / "d2" / "log", timeout_s=10)
    d.start(100)
    for what, fn in [("server_status(999999)", lambda: d.server_status(999999)),
                     ("client_pids(999999)", lambda: d.client_pids(999999)),
                     ("terminate_client(999999, 1)", lambda: d.terminate_client(999999, 1)),
                     ("set_active_thread_percentage(999999, 50)", lambda: d.set_active_thread_percentage(999999, 50)),
                     ("set_default_active_thread_percentage(0)", lambda: d.set_default_active_thread_percentage(0)),
                     ("set_default_active_thread_percentage(70)", lambda: d.set_default_active_thread_percentage(70)),
                     ("set_default_active_thread_percentage(100)", lambda: d.set_default_active_thread_percentage(100)),
                     ("command('bogus')", lambda: d.command("bogus"))]:
        try:
            log(what, "->", repr(fn()))
        except GpuError as exc:
            log(what, "RAISES", type(exc).__name__, str(exc))
    c = pr.client("u1c", d.env(), "--hold", str(pr.BASE / "stop_u1c"))
    pr.wait_ready(c)
    t = time.monotonic()
    try:
        log("stop ->", d.stop(timeout_s=8))
    except GpuError as exc:
        log(f"stop RAISES after {time.monotonic() - t:.2f}s:", str(exc))
    log("healthy after refused stop:", d.healthy(), d.servers())
    (pr.BASE / "stop_u1c").touch()
    c.wait(timeout=20)
    time.sleep(0.3)
    t = time.monotonic()
    log("stop after the client exited ->", d.stop(timeout_s=8), f"{time.monotonic() - t:.2f}s", "running", d.is_running())

    pr.stage("U2 GpuManager: eviction of a SIGTERM-ignoring client; fault with an online client connected")
    from reamer.gpu.manager import GpuManager
    events = []

    def on_event(ev):
        events.append(ev)
        log(f"EVENT {ev['kind']}: {ev['message']}")

    m = GpuManager({"command_timeout_s": 10, "stop_daemons_on_exit": True,
                    "policies": {"fault_handling": True, "eviction_grace_s": 2, "eviction_kill_after_s": 3}},
                   pr.BASE / "gpu2", on_event=on_event)
    m.start()
    st = m.register_job("stubborn", "0", 30, 2048, kind="training")
    sc = pr.client("stubborn", st["env"], "--hold", str(pr.BASE / "stop_stubborn"), "--ignore-term")
    pr.wait_ready(sc)
    m.update_job("stubborn", pids=[sc.pid])
    m.tick()
    log("servers", m.status()["gpus"][0]["servers"], "job", pr.view(m.job("stubborn")))
    t = time.monotonic()
    v = m.evict_job("stubborn", reason="probe", wait=True)
    log(f"evicted in {time.monotonic() - t:.1f}s:", pr.view(v), "rc", sc.poll())
    log("stubborn client lines", json.dumps(pr.lines(sc)[1:])[:900])
    inf = m.register_job("infer", "0", 50, kind="inference")
    ic = pr.client("infer2", inf["env"], "--hold", str(pr.BASE / "stop_infer2"))
    pr.wait_ready(ic)
    m.update_job("infer", pids=[ic.pid])
    t2j = m.register_job("train2", "0", 20, kind="training")
    t2 = pr.client("train2b", t2j["env"], "--hold", str(pr.BASE / "stop_train2b"))
    pr.wait_ready(t2)
    m.update_job("train2", pids=[t2.pid])
    m.tick()
    log("servers", m.status()["gpus"][0]["servers"])
    f = pr.client("fault2", inf["env"], "--fault")
    f.wait(timeout=60)
    log("fault client", pr.lines(f))
    t = time.monotonic()
    while time.monotonic() - t < 30:
        tk = time.monotonic()
        m.tick()
        if time.monotonic() - tk > 1:
            log(f"slow tick {time.monotonic() - tk:.1f}s")
        if any(e["kind"] in ("gpu_fault_handled", "gpu_fault_recovered", "gpu_fault_recovery_failed") for e in events):
            break
        time.sleep(0.5)
    s = m.status()["gpus"][0]
    log("after fault: servers", s["servers"], "daemon", s["daemon"], "xids", s["xid_events"])
    for j in m.jobs():
        log("job", pr.view(j))
    (pr.BASE / "stop_infer2").touch()
    ic.wait(timeout=20)
    for _ in range(3):
        m.tick()
        time.sleep(0.5)
    s = m.status()["gpus"][0]
    log("after the online client exited: servers", s["servers"], "daemon", s["daemon"])
    ok = pr.client("after2", m.job_env("infer"))
    ok.wait(timeout=60)
    log("new client", json.dumps(pr.lines(ok))[:400])
    m.tick()
    m.close()
    log("after close: daemon running", [rt.daemon.is_running() for rt in m._gpus.values()])
    log("event kinds", [e["kind"] for e in events])


if __name__ == "__main__":
    part = sys.argv[1]
    try:
        (raw if part == "raw" else reamer)()
    except Exception:  # noqa: BLE001
        log("FAILED\n" + traceback.format_exc())
    finally:
        for p in pm.STARTED + pr.PROCS:
            if p.poll() is None:
                p.kill()
