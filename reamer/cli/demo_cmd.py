"""`reamer demo`: the whole story on this machine, then a summary.

Starts a private agent (temp state dir and socket, no reserved CPUs, a small RT budget), builds two
small models, attaches an emulated training job, deploys an online service (latency SLO) and an
offline batch job beside it, drives open-loop load at the service, prints the node status as it goes,
and ends with a summary. Ctrl-C (or SIGTERM) stops it early; either way it removes every job,
process and cgroup it made.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

from reamer.cli.common import CliContext, pass_cli, print_json, render_fields
from reamer.host.errors import ReamerError

ONLINE_JOB = "demo-online"
OFFLINE_JOB = "demo-offline"
TRAINING_JOB = "demo-train"
ONLINE_SLO_MS = 50.0
ONLINE_RATE_RPS = 20.0
OFFLINE_INPUTS = 400
AGENT_START_TIMEOUT_S = 60.0
JOB_READY_TIMEOUT_S = 120.0
DEMO_RT_RUNTIME_US = 400000  # training's RT budget per second per CPU, when the machine has it free
MIN_RT_RUNTIME_US = 50000

# A stand-in for the training emulator when it is not installed: threads that burn a little CPU and
# sleep ("the GPU computes"), recording iteration times; writes a report on SIGTERM.
FALLBACK_TRAINER = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    report, ready = sys.argv[1], sys.argv[2]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    def helper():
        while not stop.is_set():
            t = time.monotonic() + 0.003
            while time.monotonic() < t:
                pass
            time.sleep(0.02)
    for _ in range(2):
        threading.Thread(target=helper, daemon=True).start()
    iterations = []
    while not stop.is_set():
        start = time.monotonic()
        t = start + 0.015
        while time.monotonic() < t:
            pass
        time.sleep(0.035)
        iterations.append({"start": start, "end": time.monotonic()})
        if len(iterations) == 1:
            open(ready, "w").write(str(os.getpid()))
    data = {"source": "fallback", "iterations": iterations,
            "iteration_ms": [(i["end"] - i["start"]) * 1000 for i in iterations]}
    open(report + ".tmp", "w").write(json.dumps(data))
    os.replace(report + ".tmp", report)
""")


def register(cli: click.Group) -> None:
    cli.add_command(demo)


class DemoInterrupted(Exception):
    """Ctrl-C or SIGTERM during the demo."""


@dataclass
class DemoState:
    """Everything the demo made, so that cleanup can undo it whatever happened."""

    workdir: Path
    cgroup_name: str
    socket_path: Path
    agent: subprocess.Popen | None = None
    agent_log: Path | None = None
    trainer: subprocess.Popen | None = None
    trainer_report: Path | None = None
    client: object | None = None
    jobs: list[str] = field(default_factory=list)
    training_attached: bool = False
    rt_runtime_us: int = DEMO_RT_RUNTIME_US
    problems: list[str] = field(default_factory=list)


def say(message: str) -> None:
    click.echo(f"[demo] {message}", err=True)


# ---------------------------------------------------------------------------------------------- steps


def rt_budget_us(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The training RT budget for the demo: 400 ms/s, or what the machine has left when other
    cgroups hold part of the kernel's budget (cgroup v1 RT group scheduling: top-level cgroups share
    the root's cpu.rt_runtime_us)."""
    from reamer.host.cgroups import rt_budget_in_use

    cpu = Path(cgroup_root) / "cpu"
    in_use = rt_budget_in_use(cgroup_root)
    if in_use is None:
        return DEMO_RT_RUNTIME_US  # no RT group scheduling here (cgroup v2): the value is not used
    root_budget, used = in_use
    free = root_budget - used - 20000  # leave a little for whoever asks next
    if free < MIN_RT_RUNTIME_US:
        raise ReamerError(f"only {max(free, 0)} us of the machine's real-time budget ({root_budget} us per second) "
                          "is left for the demo's training job: other cgroups hold the rest",
                          f"lower cpu.rt_runtime_us of the cgroups under {cpu}, or wait until they finish")
    return min(DEMO_RT_RUNTIME_US, free)


def write_config(state: DemoState) -> Path:
    config = {
        "socket": str(state.socket_path),
        "state_dir": str(state.workdir / "state"),
        "run_dir": str(state.workdir / "run"),
        "cgroup_name": state.cgroup_name,
        "reserved_cpus": [],  # a small machine: every CPU may take a job
        "reconcile_interval_s": 1.0,
        # a modest RT budget (at most 400 ms of each second per CPU): above the emulated training's 30 %
        # duty, far below the kernel's 95 % throttling limit, so nothing else on the box can starve
        "training": {"priority": 10, "rt_runtime_us": state.rt_runtime_us},
        "inference": {"offline_sched": "rr-preempt", "default_backend": "onnxruntime",
                      "profile_dir": str(state.workdir / "profiles")},
        "gpu": {"enabled": False},
        "log_level": "info",
    }
    path = state.workdir / "reamer.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


def start_agent(state: DemoState, config_path: Path) -> None:
    import httpx

    from reamer.api.client import AgentUnreachable, ApiClient

    state.agent_log = state.workdir / "agent.log"
    with open(state.agent_log, "ab") as log:
        # own session: the terminal's Ctrl-C reaches only the demo, which then stops the agent in order
        state.agent = subprocess.Popen(
            [sys.executable, "-m", "reamer.cli.main", "daemon", "--config", str(config_path)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = ApiClient(str(state.socket_path))
    deadline = time.monotonic() + AGENT_START_TIMEOUT_S
    while True:
        if state.agent.poll() is not None:
            raise ReamerError(f"the demo agent exited with code {state.agent.returncode}: {log_tail(state.agent_log)}",
                              f"see the full log in {state.agent_log} (kept)")
        try:
            client.health()
            break
        except (AgentUnreachable, httpx.TransportError):  # not listening yet, or closed while failing to start
            if state.agent.poll() is not None:
                continue  # report its exit above
            if time.monotonic() > deadline:
                raise ReamerError(f"the demo agent did not answer on {state.socket_path} "
                                  f"within {AGENT_START_TIMEOUT_S:.0f} s: {log_tail(state.agent_log)}",
                                  "the machine may be overloaded; try again") from None
            time.sleep(0.2)
    state.client = client


def log_tail(path: Path | None, lines: int = 8) -> str:
    if path is None:
        return ""
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def build_models(state: DemoState) -> tuple[str, str, str]:
    """(online model, offline model, offline input dir): a small MobileNetV2 and a small BERT encoder."""
    import numpy as np

    from reamer.serve.backends import open_backend, sample_inputs
    from reamer.serve.models import build_model

    models = state.workdir / "models"
    online = build_model("mobilenetv2", models / "mobilenetv2-32.onnx", image_size=32, num_classes=10)
    offline = build_model("bert-base", models / "bert-mini.onnx", layers=2, hidden=128, heads=2,
                          intermediate=512, seq_len=64, vocab_size=1000)
    inputs = state.workdir / "offline-in"
    inputs.mkdir()
    backend = open_backend("onnxruntime", offline.path, threads=1)
    try:
        rng = np.random.default_rng(0)
        for i in range(OFFLINE_INPUTS):
            np.savez(inputs / f"sample-{i:04d}.npz", **sample_inputs(backend, 1, rng))
    finally:
        backend.close()
    return online.path, offline.path, str(inputs)


def start_trainer(state: DemoState, duration_s: float) -> list[int]:
    """Start the emulated training job in its own session; return its pids once it runs."""
    import importlib.util

    import psutil

    state.trainer_report = state.workdir / "training-report.json"
    ready = state.workdir / "training.ready"
    if importlib.util.find_spec("reamer.workloads.training_emulator") is not None:
        command = [sys.executable, "-m", "reamer.workloads.training_emulator", "--duty", "0.3",
                   "--gpu-step-ms", "40", "--kernel-ms", "4", "--kernels", "8", "--loader-workers", "1",
                   "--sync-every", "4", "--sync-ms", "4", "--duration", str(duration_s + 600),
                   "--ready-file", str(ready), "--report", str(state.trainer_report)]
    else:
        command = [sys.executable, "-c", FALLBACK_TRAINER, str(state.trainer_report), str(ready)]
    # Start it on one CPU, as many as it will be given: the emulator sizes its work for the CPUs it
    # sees at start (duty 0.3 of one core), and the agent moves it to its own core when attached.
    from reamer.host.sched import pin_self
    from reamer.host.topology import read_topology

    first_cpu = read_topology().physical_cores()[0][0]
    with open(state.workdir / "training.log", "ab") as log:
        state.trainer = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         preexec_fn=lambda: pin_self([first_cpu]))
    deadline = time.monotonic() + JOB_READY_TIMEOUT_S
    while not ready.exists():
        if state.trainer.poll() is not None:
            raise ReamerError(f"the demo training job exited with code {state.trainer.returncode}: "
                              f"{log_tail(state.workdir / 'training.log')}", "see the log above")
        if time.monotonic() > deadline:
            raise ReamerError("the demo training job did not start its first iteration in time",
                              "the machine may be overloaded; try again")
        time.sleep(0.1)
    process = psutil.Process(state.trainer.pid)
    return [state.trainer.pid] + [child.pid for child in process.children(recursive=True)]


def wait_online_ready(state: DemoState, name: str) -> tuple[str, int]:
    """Wait until the online job answers /v2/health/ready; return (host, port)."""
    import httpx

    deadline = time.monotonic() + JOB_READY_TIMEOUT_S
    while True:
        job = state.client.get_inference_job(name)
        if job.state == "failed":
            raise ReamerError(f"the online demo job failed: {job.message}", "see `reamer events` in the log above")
        if job.port:
            try:
                if httpx.get(f"http://127.0.0.1:{job.port}/v2/models/{name}/ready", timeout=2.0).status_code == 200:
                    return "127.0.0.1", job.port
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise ReamerError(f"the online demo job was not ready within {JOB_READY_TIMEOUT_S:.0f} s "
                              f"(state {job.state}: {job.message})", "the machine may be overloaded; try again")
        time.sleep(0.3)


@dataclass
class LoadThread:
    url: str
    body: dict
    rate_rps: float
    duration_s: float
    result: object | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def start(self) -> None:
        def run() -> None:
            from reamer.serve.measure.loadgen import run_load

            try:
                self.result = run_load(self.url, self.body, self.rate_rps, self.duration_s, timeout_s=10.0)
            except BaseException as error:  # noqa: BLE001 — reported in the summary
                self.error = error

        self.thread = threading.Thread(target=run, name="demo-load", daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


def online_request_body(model_path: str) -> dict:
    import numpy as np

    from reamer.serve.backends import open_backend, sample_inputs
    from reamer.serve.measure.loadgen import v2_request_body

    backend = open_backend("onnxruntime", model_path, threads=1)
    try:
        return v2_request_body(sample_inputs(backend, 1, np.random.default_rng(1)))
    finally:
        backend.close()


# the span of the job's own figures (reamer.serve.measure.stats.RequestStats' window) that the live tables show
JOB_WINDOW_S = 10.0


@dataclass(frozen=True)
class LiveSample:
    """The online job's own figures as one live table showed them (over its last JOB_WINDOW_S)."""

    elapsed_s: float  # since the load started
    p99_ms: float | None
    slo_attainment: float | None


def print_status(state: DemoState, elapsed_s: float) -> LiveSample | None:
    """Print the node's tables; return the online job's figures they showed (None: no figures yet)."""
    from reamer.cli.node_cmd import render_inference_table, render_training_table

    node = state.client.node()
    click.echo(f"\n--- t+{elapsed_s:.0f}s: training on cpus {node.training_cpus or '-'}, idle cpus "
               f"{node.idle_cpus or '-'} ---")
    click.echo(render_training_table(state.client.list_training_jobs()))
    jobs = state.client.list_inference_jobs()
    click.echo(render_inference_table(jobs))
    online = next((j for j in jobs if j.name == ONLINE_JOB), None)
    if online is None or online.status.slo_attainment is None:
        return None
    click.echo(f"({ONLINE_JOB}'s latency figures are the job's own: requests of the last {JOB_WINDOW_S:g} s, from "
               "arrival at the job to its answer)")
    return LiveSample(elapsed_s, online.status.p99_ms, online.status.slo_attainment)


# ---------------------------------------------------------------------------------------------- summary


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    from reamer.plan import statistics

    return statistics.percentile(values, q)


def training_summary(report_path: Path | None, phase_start: float | None) -> dict:
    if report_path is None or not report_path.exists():
        return {"iterations": 0, "note": "no training report"}
    data = json.loads(report_path.read_text())
    records = data.get("iterations", [])
    all_ms = [(r["end"] - r["start"]) * 1000 for r in records]
    during = [(r["end"] - r["start"]) * 1000 for r in records if phase_start is None or r["start"] >= phase_start]
    before = [(r["end"] - r["start"]) * 1000 for r in records if phase_start is not None and r["start"] < phase_start]
    return {
        "source": data.get("source", "emulator"),
        "iterations": len(all_ms),
        "iterations_colocated": len(during),
        "median_ms_colocated": percentile(during, 50),
        "p99_ms_colocated": percentile(during, 99),
        "median_ms_before": percentile(before, 50),
        "duty_measured": data.get("duty_measured"),
    }


def client_windows(records, samples: list[LiveSample], slo_ms: float) -> list[float]:
    """The clients' share within `slo_ms` of the requests sent in the JOB_WINDOW_S before each live table: the
    span the job's own figure in that table covers."""
    shares = []
    for sample in samples:
        sent = [r for r in records if sample.elapsed_s - JOB_WINDOW_S <= r.scheduled_s <= sample.elapsed_s]
        if sent:
            shares.append(sum(r.status == "ok" and r.latency_ms <= slo_ms for r in sent) / len(sent))
    return shares


def _span(values: list) -> list | None:
    values = [v for v in values if v is not None]
    return [min(values), max(values)] if values else None


def online_summary(load: LoadThread | None, job, samples: list[LiveSample] | None = None) -> dict:
    """The clients' figures over the whole run and, for the tables shown during it, the job's own figures and the
    clients' over the same windows."""
    samples = samples or []
    summary: dict = {"slo_ms": ONLINE_SLO_MS, "rate_rps": ONLINE_RATE_RPS,
                     "job_windows": {"window_s": JOB_WINDOW_S, "tables": len(samples),
                                     "p99_ms": _span([s.p99_ms for s in samples]),
                                     "slo_attainment": _span([s.slo_attainment for s in samples]),
                                     "measured_by": "the job (arrival at the job to answer), as the live tables show"}}
    if load is not None and load.result is not None:
        result = load.result
        summary.update({"sent": len(result.records), "ok": result.ok, "shed": result.shed, "errors": result.errors,
                        "p50_ms": result.p50_ms, "p99_ms": result.p99_ms,
                        "slo_attainment": result.slo_attainment(ONLINE_SLO_MS),
                        "achieved_rps": result.achieved_rps,
                        "measured_by": "the clients over the whole run (open-loop Poisson load: scheduled send to "
                                       "answer, the clients' own queueing and connections included)"})
        summary["job_windows"]["client_slo_attainment"] = _span(client_windows(result.records, samples,
                                                                               ONLINE_SLO_MS))
    elif load is not None and load.error is not None:
        summary["error"] = str(load.error)
    if job is not None:
        summary["layout"] = job.layout
        summary["cpus"] = sorted({c for i in job.instances for c in i.cpus})
    return summary


def offline_summary(job) -> dict:
    if job is None:
        return {}
    status = job.status
    return {"state": job.state, "done": status.done, "total": status.total, "throughput": status.throughput,
            "cpus": sorted({c for i in job.instances for c in i.cpus}),
            "on_training_cores": any(i.on_training for i in job.instances)}


def _job_windows_text(online: dict) -> str:
    """The job's own figures of the live tables, and the clients' over the same windows (the two may differ:
    the clients count their own queueing and connections, and the start of the run)."""
    windows = online.get("job_windows") or {}
    if not windows.get("tables") or windows.get("slo_attainment") is None:
        return "no live table showed the job's figures"

    def pct(span) -> str:
        low, high = span
        return f"{low * 100:.1f}%" if abs(high - low) < 5e-4 else f"{low * 100:.1f}–{high * 100:.1f}%"

    p99 = windows.get("p99_ms")
    text = (f"the {windows['tables']} live table(s) above, each over its last {windows['window_s']:g} s, from arrival "
            f"at the job to its answer: {pct(windows['slo_attainment'])} within the SLO"
            + (f", p99 {p99[0]:.1f}–{p99[1]:.1f} ms" if p99 else ""))
    if windows.get("client_slo_attainment"):
        text += f" (the clients over those windows: {pct(windows['client_slo_attainment'])})"
    return text


def render_summary(summary: dict) -> str:
    def ms(value) -> str:
        return "-" if value is None else f"{value:.1f} ms"

    train, online, offline = summary["training"], summary["online"], summary["offline"]
    lines = ["", "=== reamer demo summary ==="]
    lines.append(render_fields([
        ("ran for", f"{summary['colocated_s']:.0f} s of co-location ({summary['stopped_by']})"),
        ("training", f"{train.get('iterations_colocated', 0)} iterations while co-located, median "
                     f"{ms(train.get('median_ms_colocated'))}, p99 {ms(train.get('p99_ms_colocated'))} "
                     f"(before: median {ms(train.get('median_ms_before'))})"),
        ("online, clients", (f"whole run, from each request's scheduled send to its answer: "
                             f"{online.get('ok', 0)}/{online.get('sent', 0)} ok at {online['rate_rps']:g} rps, "
                             f"p50 {ms(online.get('p50_ms'))}, p99 {ms(online.get('p99_ms'))}, "
                             f"{(online.get('slo_attainment') or 0) * 100:.1f}% within the {online['slo_ms']:g} ms "
                             f"SLO, {online.get('shed', 0)} shed, layout {online.get('layout') or '-'} on cpus "
                             f"{online.get('cpus') or '-'}") if "sent" in online
         else f"no load result ({online.get('error', 'stopped early')})"),
        ("online, job", _job_windows_text(online)),
        ("offline", (f"{offline.get('done') or 0}/{offline.get('total') or '?'} inputs, "
                     f"{offline.get('throughput') or 0:.1f} inputs/s, state {offline.get('state')}, cpus "
                     f"{offline.get('cpus') or '-'}" + (" (incl. training cores)" if offline.get("on_training_cores") else ""))
         if offline else "-"),
        ("cleanup", "; ".join(summary["cleanup_problems"]) or "removed every job, process and cgroup"),
    ]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- cleanup


def cleanup(state: DemoState) -> list[str]:
    """Undo everything, in order: jobs, training, agent, stray job processes, cgroups, files."""
    problems: list[str] = []
    client = state.client
    if client is not None and state.agent is not None and state.agent.poll() is None:
        for name in list(state.jobs):
            try:
                client.remove_inference(name)
            except ReamerError as error:
                if "not found" not in error.message and "no inference job" not in error.message:
                    problems.append(f"remove {name}: {error.message}")
        if state.training_attached:
            try:
                client.detach_training(TRAINING_JOB)
            except ReamerError as error:
                problems.append(f"detach {TRAINING_JOB}: {error.message}")
    if state.trainer is not None:
        stop_process_group(state.trainer, timeout_s=20.0)
    if state.agent is not None:
        stop_process_group(state.agent, timeout_s=30.0)
    problems += stop_strays(state.workdir)
    problems += remove_cgroups(state.cgroup_name)
    if client is not None:
        client.close()
    return problems


def stop_process_group(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, wait, SIGKILL: the process and its session (each was started in a new session)."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
    try:  # children of the session it left behind (e.g. data-loader workers)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_strays(workdir: Path) -> list[str]:
    """Job processes (started by our agent, run from our work dir) that outlived their job."""
    import psutil

    marker = str(workdir)
    strays = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        if process.pid == os.getpid():
            continue
        try:
            if any(marker in arg for arg in process.info["cmdline"] or []):
                strays.append(process)
        except psutil.Error:
            continue
    for process in strays:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(strays, timeout=10)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=10)
    return [f"killed {len(alive)} job process(es) that ignored SIGTERM"] if alive else []


def remove_cgroups(cgroup_name: str, cgroup_root: str = "/sys/fs/cgroup") -> list[str]:
    """Remove the demo agent's cgroup (and what is below it) in every mounted hierarchy, through the host
    executor; returns the problems."""
    from reamer.host.cgroups import detect_driver
    from reamer.host.executor import HostExecutor

    try:
        host = HostExecutor(detect_driver(cgroup_root))
    except ReamerError:
        return []  # no cgroup hierarchy mounted: the demo made none
    return host.remove_named_everywhere(cgroup_name)


# ---------------------------------------------------------------------------------------------- command


@click.command()
@click.option("--duration", type=click.FloatRange(min=5), default=60.0, show_default=True,
              help="Seconds of co-location (load on the service, offline work, training) after setup.")
@click.option("--keep", is_flag=True, help="Keep the work directory (models, logs, agent store) afterwards.")
@pass_cli
def demo(cli: CliContext, duration: float, keep: bool) -> None:
    """Run the whole story on this machine and print a summary (needs root; cleans up after itself)."""
    if os.geteuid() != 0:
        raise ReamerError("reamer demo needs root: it creates cgroups and gives the training job SCHED_RR",
                          "run it as root: sudo reamer demo")
    from reamer.serve.measure.loadgen import infer_url

    workdir = Path(tempfile.mkdtemp(prefix="reamer-demo-"))
    state = DemoState(workdir=workdir, cgroup_name=f"reamer-demo-{os.getpid()}", socket_path=workdir / "reamer.sock")

    def interrupt(signum, _frame):
        raise DemoInterrupted(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    stopped_by = "finished"
    load: LoadThread | None = None
    phase_start = phase_end = None
    online_job = offline_job = None
    live: list[LiveSample] = []  # the online job's figures as the live tables showed them
    try:
        say(f"work directory {workdir}; cgroup {state.cgroup_name}")
        state.rt_runtime_us = rt_budget_us()
        say(f"starting a private agent (no reserved CPUs, RT budget {state.rt_runtime_us // 1000} ms/s for training)")
        start_agent(state, write_config(state))
        say("building models: MobileNetV2 (32x32: small JSON requests) for the online service, a 2-layer BERT for offline inference")
        online_model, offline_model, inputs = build_models(state)
        body = online_request_body(online_model)
        say("starting the emulated training job (duty 0.3)")
        pids = start_trainer(state, duration)
        job = state.client.attach_training({"name": TRAINING_JOB, "pids": pids, "cores": 1})
        state.training_attached = True
        say(f"training attached: cpus {job.cpus}, {job.threads_rr} thread(s) SCHED_RR at priority {job.priority}")
        say(f"deploying {ONLINE_JOB} (p99 SLO {ONLINE_SLO_MS:g} ms, {ONLINE_RATE_RPS:g} rps)")
        state.jobs.append(ONLINE_JOB)
        state.client.deploy_inference({"name": ONLINE_JOB, "model": online_model, "kind": "online",
                                       "slo_ms": ONLINE_SLO_MS, "rate_rps": ONLINE_RATE_RPS, "max_batch": 4})
        host, port = wait_online_ready(state, ONLINE_JOB)
        say(f"deploying {OFFLINE_JOB} ({OFFLINE_INPUTS} inputs, on spare cycles incl. training cores)")
        state.jobs.append(OFFLINE_JOB)
        state.client.deploy_inference({"name": OFFLINE_JOB, "model": offline_model, "kind": "offline",
                                       "input_dir": inputs, "output_dir": str(workdir / "offline-out")})
        say(f"driving {ONLINE_RATE_RPS:g} rps of open-loop load at http://{host}:{port} for {duration:g} s")
        load = LoadThread(infer_url(host, port, ONLINE_JOB), body, ONLINE_RATE_RPS, duration)
        phase_start = time.monotonic()
        load.start()
        interval = max(5.0, duration / 4)
        next_print = phase_start
        while load.alive():
            now = time.monotonic()
            if now >= next_print and not cli.json:
                sample = print_status(state, now - phase_start)
                if sample is not None:
                    live.append(sample)
                next_print = now + interval
            if state.agent.poll() is not None:
                raise ReamerError(f"the demo agent died (exit {state.agent.returncode}): {log_tail(state.agent_log)}",
                                  f"see {state.agent_log}")
            load.thread.join(timeout=0.5)
        phase_end = time.monotonic()
    except DemoInterrupted as why:
        stopped_by = f"stopped early by {why}"
        say(f"{stopped_by}: cleaning up")
    finally:
        # no second Ctrl-C may cut the cleanup short
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        try:
            if phase_end is None and phase_start is not None:
                phase_end = time.monotonic()
            if state.client is not None and state.agent is not None and state.agent.poll() is None:
                try:
                    online_job = state.client.get_inference_job(ONLINE_JOB) if ONLINE_JOB in state.jobs else None
                    offline_job = state.client.get_inference_job(OFFLINE_JOB) if OFFLINE_JOB in state.jobs else None
                except ReamerError:
                    pass
            say("cleaning up: removing jobs, detaching training, stopping the agent, removing cgroups")
            state.problems = cleanup(state)
            summary = {
                "stopped_by": stopped_by,
                "colocated_s": (phase_end - phase_start) if phase_start is not None else 0.0,
                "training": training_summary(state.trainer_report, phase_start),  # written when it stopped
                "online": online_summary(load, online_job, live),
                "offline": offline_summary(offline_job),
                "cleanup_problems": state.problems,
            }
            failed = sys.exc_info()[0] is not None
            if keep or failed:
                say(f"kept {workdir} (agent log: {state.agent_log})")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if cli.json:
        print_json(summary)
    else:
        click.echo(render_summary(summary))
    if state.problems:
        raise SystemExit(1)
