"""Raw probe of the real nvidia-cuda-mps-control, as reamer/gpu/mps.py drives it. Prints one line per step."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CTL = shutil.which("nvidia-cuda-mps-control")
PY = sys.executable
BASE = Path("/tmp/rp")
RECORDS = []
CTL_TIMEOUT = float(os.environ.get("CTL_TIMEOUT", "30"))
STARTED = []  # client Popen objects


def log(*a):
    print(*a, flush=True)


def uuid0():
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.split()[0]


UUID = uuid0()


def menv(name):
    base = BASE / name
    return {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(base / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(base / "log"),
            "CUDA_VISIBLE_DEVICES": UUID}


def ctl(env, stdin=None, args=(), tag=""):
    t = time.monotonic()
    try:
        p = subprocess.run([CTL, *args], input=stdin, capture_output=True, text=True, env=env, timeout=CTL_TIMEOUT)
        rec = {"tag": tag, "args": list(args), "stdin": stdin, "rc": p.returncode, "stdout": p.stdout,
               "stderr": p.stderr, "s": round(time.monotonic() - t, 3)}
    except subprocess.TimeoutExpired as exc:
        rec = {"tag": tag, "args": list(args), "stdin": stdin, "rc": "TIMEOUT", "stdout": str(exc.stdout),
               "stderr": str(exc.stderr), "s": 30}
    RECORDS.append(rec)
    log(f"CTL[{tag}] {' '.join(args)} stdin={stdin!r} rc={rec['rc']} out={rec['stdout']!r} err={rec['stderr']!r} "
        f"t={rec['s']}")
    return rec


def sh(cmd):
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    log(f"$ {cmd}\n{p.stdout}{p.stderr}rc={p.returncode}")
    return p.stdout


def client(env, name, *cargs, wait=True, extra_env=None):
    res = BASE / "res" / f"{name}.jsonl"
    res.parent.mkdir(parents=True, exist_ok=True)
    res.unlink(missing_ok=True)
    e = dict(env)
    e.update(extra_env or {})
    errf = open(BASE / "res" / f"{name}.err", "w")
    proc = subprocess.Popen([PY, str(HERE / "client.py"), str(res), *cargs], env=e, stdout=errf, stderr=errf)
    proc.res, proc.name = res, name
    STARTED.append(proc)
    if wait:
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            log(f"CLIENT {name} TIMEOUT")
        show(proc)
    return proc


def lines(proc):
    try:
        return [json.loads(l) for l in proc.res.read_text().splitlines() if l.strip()]
    except OSError:
        return []


def show(proc):
    ls = lines(proc)
    err = (BASE / "res" / f"{proc.name}.err").read_text()[-800:]
    log(f"CLIENT {proc.name} rc={proc.poll()} -> {json.dumps(ls)}" + (f"\n  stderr: {err!r}" if err.strip() else ""))
    return ls


def wait_ready(proc, timeout=90):
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        ls = lines(proc)
        if any(l.get("ready") for l in ls) or any("error" in l for l in ls) or proc.poll() is not None:
            break
        time.sleep(0.2)
    return show(proc)


def stop_hold(proc, stopfile, timeout=20):
    Path(stopfile).touch()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log(f"CLIENT {proc.name} did not stop in {timeout}s: killing")
        proc.kill()
        proc.wait()
    show(proc)


def pidfile_state(env):
    pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
    pf = pipe / "nvidia-cuda-mps-control.pid"
    pid = None
    alive = None
    if pf.exists():
        try:
            pid = int(pf.read_text().strip())
            os.kill(pid, 0)
            alive = True
        except (ValueError, OSError):
            alive = False
    return {"pidfile": pf.exists(), "pid": pid, "alive": alive,
            "files": sorted(p.name for p in pipe.iterdir()) if pipe.exists() else None}


def logs(env, n=15):
    for f in ("control.log", "server.log"):
        p = Path(env["CUDA_MPS_LOG_DIRECTORY"]) / f
        if p.exists():
            log(f"--- {f} (last {n})\n" + "\n".join(p.read_text(errors="replace").splitlines()[-n:]))


def servers(env, tag):
    r = ctl(env, "get_server_list\n", tag=tag)
    return [int(w) for w in r["stdout"].split() if w.isdigit()]


def nvml_probe(tag):
    try:
        import pynvml as nv
    except ImportError as exc:
        log(f"NVML[{tag}] import failed {exc}")
        return
    log(f"NVML[{tag}] module {getattr(nv, '__file__', '')} version "
        f"{getattr(nv, '__version__', '')}")
    nv.nvmlInit()
    try:
        h = nv.nvmlDeviceGetHandleByIndex(0)
        calls = {
            "count": lambda: nv.nvmlDeviceGetCount(),
            "driver": lambda: nv.nvmlSystemGetDriverVersion(),
            "uuid": lambda: nv.nvmlDeviceGetUUID(h),
            "name": lambda: nv.nvmlDeviceGetName(h),
            "mem": lambda: (lambda m: (m.total, m.used, m.free))(nv.nvmlDeviceGetMemoryInfo(h)),
            "maxclock_sm": lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM),
            "util": lambda: (lambda u: (u.gpu, u.memory))(nv.nvmlDeviceGetUtilizationRates(h)),
            "clock_sm": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
            "power_mw": lambda: nv.nvmlDeviceGetPowerUsage(h),
            "temp": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
            "compute_procs": lambda: [(p.pid, p.usedGpuMemory) for p in nv.nvmlDeviceGetComputeRunningProcesses(h)],
            "mps_procs": lambda: [(p.pid, p.usedGpuMemory) for p in nv.nvmlDeviceGetMPSComputeRunningProcesses(h)],
            "proc_util": lambda: [(s.pid, s.smUtil, s.memUtil, s.timeStamp) for s in
                                  nv.nvmlDeviceGetProcessUtilization(h, 0)],
            "compute_mode": lambda: nv.nvmlDeviceGetComputeMode(h),
        }
        for k, f in calls.items():
            try:
                log(f"NVML[{tag}] {k} = {f()!r}")
            except Exception as exc:  # noqa: BLE001
                log(f"NVML[{tag}] {k} RAISES {type(exc).__name__}: {exc} value={getattr(exc, 'value', None)}")
        try:
            es = nv.nvmlEventSetCreate()
            nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, es)
            log(f"NVML[{tag}] register XID ok")
            try:
                d = nv.nvmlEventSetWait(es, 0)
                log(f"NVML[{tag}] eventwait -> {d.eventType} {d.eventData}")
            except Exception as exc:  # noqa: BLE001
                log(f"NVML[{tag}] eventwait RAISES {type(exc).__name__}: {exc} value={getattr(exc, 'value', None)} "
                    f"isNVMLError={isinstance(exc, nv.NVMLError)}")
            nv.nvmlEventSetFree(es)
        except Exception as exc:  # noqa: BLE001
            log(f"NVML[{tag}] events RAISES {type(exc).__name__}: {exc}")
    finally:
        nv.nvmlShutdown()


def stage(name):
    log(f"\n================ {name} ({time.strftime('%H:%M:%S')})")


def main():
    shutil.rmtree(BASE, ignore_errors=True)
    BASE.mkdir()
    log(f"control binary {CTL}; uuid {UUID}")
    sh(f"ls -la {os.path.dirname(CTL)}/nvidia-cuda-mps-* ; nvidia-smi --query-gpu=name,driver_version,compute_mode,"
       "mig.mode.current --format=csv")
    stage("S1 no daemon")
    e = menv("a")
    ctl(e, "get_server_list\n", tag="nodir")
    Path(e["CUDA_MPS_PIPE_DIRECTORY"]).mkdir(parents=True)
    ctl(e, "get_server_list\n", tag="emptydir")
    ctl(e, "get_default_active_thread_percentage\n", tag="emptydir")
    ctl(e, "quit\n", tag="emptydir")

    stage("S2 start daemon (log dir missing)")
    ctl(e, None, args=("-d",), tag="start")
    time.sleep(0.5)
    if not pidfile_state(e)["alive"]:
        log("no live daemon after -d with a missing log dir: creating it and starting again")
        Path(e["CUDA_MPS_LOG_DIRECTORY"]).mkdir(parents=True, exist_ok=True)
        ctl(e, None, args=("-d",), tag="start2")
        time.sleep(0.5)
    log("pidfile", pidfile_state(e))
    sh(f"ls -la {e['CUDA_MPS_PIPE_DIRECTORY']} {e['CUDA_MPS_LOG_DIRECTORY']}; cat {e['CUDA_MPS_PIPE_DIRECTORY']}/*.pid;"
       " ps -eo pid,ppid,sid,user,args | grep -i mps | grep -v grep")
    ctl(e, None, args=("-d",), tag="start-again")

    stage("S3 commands, no server")
    for c in ["get_server_list", "get_default_active_thread_percentage", "set_default_active_thread_percentage 100",
              "set_default_active_thread_percentage 0", "set_default_active_thread_percentage 101",
              "set_default_active_thread_percentage abc", "set_default_active_thread_percentage 50.5",
              "get_default_active_thread_percentage", "set_default_active_thread_percentage 100",
              "get_server_status 999999", "get_client_list 999999", "get_active_thread_percentage 999999",
              "set_active_thread_percentage 999999 50", "set_device_pinned_mem_limit 999999 0 1024M",
              "terminate_client 999999 1", "get_device_client_list", "get_device_client_list 999999",
              "get_default_device_pinned_mem_limit 0", "set_default_device_pinned_mem_limit 0 abc",
              "set_default_device_pinned_mem_limit 7 1024M", "get_server_list extra", "foo", "",
              "get_server_list\nget_default_active_thread_percentage\nfoo\nget_server_list"]:
        ctl(e, c + "\n", tag="S3")
    ctl(e, "", tag="S3-empty-stdin")

    stage("S4 first client: server appears")
    h1 = client(e, "h1", "--hold", str(BASE / "stop_h1"), "--matmul", "8192", wait=False)
    wait_ready(h1)
    spids = servers(e, "S4")
    spid = spids[0] if spids else 0
    for c in [f"get_server_status {spid}", f"get_client_list {spid}", f"get_active_thread_percentage {spid}",
              "get_device_client_list", f"get_device_client_list {spid}", "get_default_active_thread_percentage"]:
        ctl(e, c + "\n", tag="S4")
    sh("nvidia-smi; ps -eo pid,ppid,sid,user,args | grep -i mps | grep -v grep")
    log("pidfile", pidfile_state(e))
    nvml_probe("S4 with MPS client")

    stage("S5 limits by client env (server from h1 running)")
    client(e, "pct100", "--matmul", "8192", extra_env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"})
    client(e, "pct25_mem2048M", "--matmul", "8192", "--alloc", "5000",
           extra_env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M"})
    client(e, "mem_2G", "--alloc", "5000", extra_env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"})
    client(e, "mem_uuid", "--alloc", "5000", extra_env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{UUID}=2G"})
    client(e, "mem_2048MB", "--alloc", "5000", extra_env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048MB"})
    client(e, "mem_dev1", "--alloc", "3000", extra_env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=1024M"})
    client(e, "mem_novis", "--alloc", "5000", extra_env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1536M",
                                                         "CUDA_VISIBLE_DEVICES": ""})
    client({k: v for k, v in e.items() if k != "CUDA_VISIBLE_DEVICES"}, "mem_unsetvis", "--alloc", "5000",
           extra_env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1536M"})
    client(e, "pct_bad", extra_env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "abc"})
    ctl(e, f"set_active_thread_percentage {spid} 40\n", tag="S5")
    ctl(e, f"get_active_thread_percentage {spid}\n", tag="S5")
    client(e, "srv40_noenv", "--matmul", "8192")
    client(e, "srv40_env80", "--matmul", "8192", extra_env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "80"})
    client(e, "srv40_env20", extra_env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "20"})
    ctl(e, f"set_device_pinned_mem_limit {spid} 0 1024M\n", tag="S5")
    ctl(e, f"set_device_pinned_mem_limit {spid} 0 1G\n", tag="S5")
    client(e, "srvmem1G_noenv", "--alloc", "4000")
    client(e, "srvmem1G_env3G", "--alloc", "4000", extra_env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3G"})
    ctl(e, "set_default_active_thread_percentage 60\n", tag="S5")
    client(e, "default60_noenv")
    ctl(e, f"get_active_thread_percentage {spid}\n", tag="S5")
    ctl(e, "set_default_active_thread_percentage 100\n", tag="S5")
    ctl(e, f"set_active_thread_percentage {spid} 100\n", tag="S5")

    stage("S6 terminate_client on a live client")
    ctl(e, f"get_client_list {spid}\n", tag="S6")
    ctl(e, f"terminate_client {spid} {h1.pid}\n", tag="S6")
    time.sleep(3)
    log(f"h1 alive: {h1.poll() is None}")
    ctl(e, f"get_client_list {spid}\n", tag="S6")
    ctl(e, f"terminate_client {spid} {h1.pid}\n", tag="S6-again")
    ctl(e, f"terminate_client {spid} 1\n", tag="S6-notaclient")
    stop_hold(h1, BASE / "stop_h1")
    time.sleep(1)
    servers(e, "S6-after")
    logs(e)

    stage("S7 fatal fault in one client while another is connected")
    h2 = client(e, "h2", "--hold", str(BASE / "stop_h2"), wait=False)
    wait_ready(h2)
    spids = servers(e, "S7")
    spid = spids[0] if spids else 0
    f = client(e, "fault", "--fault")
    for i in range(6):
        ctl(e, "get_server_list\n", tag=f"S7-{i}")
        ctl(e, f"get_server_status {spid}\n", tag=f"S7-{i}")
        ctl(e, f"get_client_list {spid}\n", tag=f"S7-{i}")
        time.sleep(0.5)
    show(h2)
    nvml_probe("S7 after fault")
    client(e, "after_fault")
    stop_hold(h2, BASE / "stop_h2")
    time.sleep(1)
    for i in range(3):
        ctl(e, "get_server_list\n", tag=f"S7-end-{i}")
        ctl(e, f"get_server_status {spid}\n", tag=f"S7-end-{i}")
        time.sleep(1)
    client(e, "recovered")
    logs(e, 30)

    stage("S8 quit with a client connected")
    h3 = client(e, "h3", "--hold", str(BASE / "stop_h3"), wait=False)
    wait_ready(h3)
    servers(e, "S8")
    ctl(e, "quit\n", tag="S8-quit")
    for i in range(4):
        log(f"after quit +{i}s: pidfile {pidfile_state(e)} h3 alive {h3.poll() is None}")
        sh("ps -eo pid,ppid,user,args | grep -i mps | grep -v grep")
        ctl(e, "get_server_list\n", tag=f"S8-after-quit-{i}")
        time.sleep(1)
    show(h3)
    ctl(e, None, args=("-d",), tag="S8-restart-while-old")
    time.sleep(0.5)
    servers(e, "S8-restarted")
    client(e, "s8_new_client")
    stop_hold(h3, BASE / "stop_h3")
    time.sleep(2)
    log(f"after h3 stopped: pidfile {pidfile_state(e)}")
    sh("ps -eo pid,ppid,user,args | grep -i mps | grep -v grep")
    servers(e, "S8-end")
    ctl(e, "quit\n", tag="S8-quit2")
    time.sleep(1)
    log(f"after quit2: pidfile {pidfile_state(e)}")
    sh("ps -eo pid,ppid,user,args | grep -i mps | grep -v grep")
    logs(e, 40)

    stage("S9 default pinned memory limit (fresh daemon)")
    e9 = menv("b")
    Path(e9["CUDA_MPS_PIPE_DIRECTORY"]).mkdir(parents=True)
    Path(e9["CUDA_MPS_LOG_DIRECTORY"]).mkdir(parents=True)
    ctl(e9, None, args=("-d",), tag="S9")
    time.sleep(0.3)
    for c in ["set_default_device_pinned_mem_limit 0 1536M", "get_default_device_pinned_mem_limit 0",
              "set_default_active_thread_percentage 50", "get_default_active_thread_percentage"]:
        ctl(e9, c + "\n", tag="S9")
    client(e9, "d1536_noenv", "--alloc", "4000")
    client(e9, "d1536_env3G", "--alloc", "4000", extra_env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3G",
                                                           "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"})
    servers(e9, "S9")
    ctl(e9, "quit\n", tag="S9-quit")
    time.sleep(1)
    log(f"S9 after quit (no clients): pidfile {pidfile_state(e9)}")

    stage("S10 long pipe directory")
    long = BASE / ("x" * 100)
    e10 = {**e, "CUDA_MPS_PIPE_DIRECTORY": str(long), "CUDA_MPS_LOG_DIRECTORY": str(BASE / "l10")}
    long.mkdir(parents=True)
    log(f"pipe dir length {len(str(long))}")
    ctl(e10, None, args=("-d",), tag="S10")
    time.sleep(0.5)
    ctl(e10, "get_server_list\n", tag="S10")
    client(e10, "longpipe")
    ctl(e10, "quit\n", tag="S10")
    log(f"S10 pidfile {pidfile_state(e10)}")
    logs(e10)


if __name__ == "__main__":
    try:
        main()
    finally:
        for p in STARTED:
            if p.poll() is None:
                p.kill()
        Path(os.environ.get("OUT", "/tmp")).joinpath("raw.json").write_text(json.dumps(RECORDS, indent=1))
