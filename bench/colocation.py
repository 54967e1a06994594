"""Co-location bench: training + online + offline inference under each strategy, same cores, same load.

    python -m bench.colocation                     # defaults: 3 trials x 30 s per strategy (~15 min)
    python -m bench.colocation --quick --out /tmp/q  # smoke run: tiny models, 1 trial x 3 s
    python -m bench.colocation --results-md bench/RESULTS.md   # also write the section there

Needs root (cgroup v1 cpuset/cpu/freezer, SCHED_RR). The training job is the CPU-side training
EMULATOR (reamer.workloads.training_emulator): real loader processes, kernel-dispatch bursts, a
sleep standing for the GPU step, periodic gradient-sync bursts. Online requests go through a real
HTTP server (KServe v2 REST) driven by reamer.serve.measure.loadgen (open-loop Poisson). See bench/README.md.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import RESULTS_DIR, ROOT, bench_command, command_line, rotated, write_json
from bench.metrics import (
    IterationSummary,
    LatencySummary,
    Spread,
    change,
    cpu_idle_seconds,
    harvest_ratio,
    process_cpu_seconds,
    thread_policies,
)
from bench.strategies import CoreLayout, Placement, STRATEGY_ORDER, Strategy, build_strategies, select

from reamer.host.cgroups import CgroupV1Driver
from reamer.host.cpulist import format_cpulist, parse_cpulist
from reamer.host.errors import HostError, ReamerError

RT_LADDER_US = (500000, 400000, 300000, 200000, 100000)
RT_WAIT_S = 10.0
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
MIN_IDLE_PER_S = 0.05  # below this the training cores had no idle time to harvest (a busy shared machine)


class BenchError(ReamerError):
    """The bench could not run a phase."""


@dataclass
class TrainingSettings:
    gpu_step_ms: float = 60.0
    kernel_ms: float = 8.0
    kernels: int = 16
    loader_workers: int = 2
    sync_every: int = 4
    sync_ms: float = 10.0
    duty: float = 0.4
    image_size: int = 64


@dataclass
class BenchConfig:
    out: str
    trials: int = 3
    duration_s: float = 25.0
    warmup_s: float = 2.0
    rate_rps: float = 25.0
    slo_ms: float = 100.0
    # a BERT-family encoder (the paper's online model family), 1 layer, 32 tokens: ~10 ms per request
    # on one core here; integer inputs keep request decoding cheap next to the inference itself
    online_model: str = "bert-base"
    online_options: dict[str, Any] = field(default_factory=lambda: {"layers": 1, "seq_len": 32, "vocab_size": 8192})
    offline_model: str = "resnet50"
    offline_options: dict[str, Any] = field(default_factory=lambda: {"image_size": 112})
    training: TrainingSettings = field(default_factory=TrainingSettings)
    training_cpus: list[int] = field(default_factory=lambda: [1])
    online_cpus: list[int] = field(default_factory=lambda: [0])
    rr_priority: int = 10
    gang_train_s: float = 0.8
    gang_infer_s: float = 0.2
    strategies: list[str] | None = None
    server: str = "job"  # job: reamer's own `python -m reamer.serve.runtime.job`; bench: bench/inference_procs.py serve
    quick: bool = False
    seed: int = 0


@dataclass
class PhaseResult:
    strategy: str
    trial: int
    window_s: float
    iteration_ms: list[float] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    requests_sent: int = 0
    offline_completions: int = 0
    offline_cpu_s: float = 0.0  # all offline instances, over the window
    offline_cpu_on_training_s: float = 0.0  # offline instances pinned to training cores
    training_idle_s: float = 0.0  # idle time of the training cores over the window (/proc/stat)
    training_cpu_s: float = 0.0  # CPU time of the training process tree over the window
    training_policies: dict[str, int] = field(default_factory=dict)
    offline_policies: dict[str, int] = field(default_factory=dict)
    rt_runtime_us: int | None = None
    training_duty: float | None = None
    server_status: dict[str, Any] = field(default_factory=dict)  # the job's own status.json at the end (server side)
    notes: list[str] = field(default_factory=list)


# --- processes and cgroups -------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class Proc:
    """A process the bench started (its own session, so its children can be found and stopped)."""

    def __init__(self, name: str, popen: subprocess.Popen, log: Path) -> None:
        self.name, self.popen, self.log = name, popen, log

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 5.0
        while self.group_alive():
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if self.alive():
            self.popen.kill()
        return self.popen.wait(10)


def _tree(pid: int) -> list[int]:
    import psutil

    try:
        return [pid, *[c.pid for c in psutil.Process(pid).children(recursive=True)]]
    except psutil.Error:
        return [pid]


def _pdeathsig() -> None:
    """Children die with the bench (a killed bench must not leave workloads running)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Bench:
    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.out = Path(config.out)
        self.logs = self.out / "logs"
        self.work = self.out / "work"
        self.driver = CgroupV1Driver()
        self.root_cg = f"reamer-bench-{os.getpid()}-{secrets.token_hex(3)}"
        self.all_cpus = tuple(sorted(os.sched_getaffinity(0)))
        self.layout = CoreLayout(self.all_cpus, tuple(config.training_cpus), tuple(config.online_cpus))
        self.strategies = select(
            build_strategies(self.layout, config.rr_priority, (config.gang_train_s, config.gang_infer_s)),
            config.strategies,
        )
        self.procs: list[Proc] = []
        self.cgroups: list[str] = []
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))

    # cgroups
    def _cgroup(self, rel: str, controllers: tuple[str, ...]) -> str:
        path = f"{self.root_cg}/{rel}"
        self.driver.create(path, controllers)
        top = path.split("/")[0]
        if top not in self.cgroups:
            self.cgroups.append(top)
        return path

    def _rt_budget(self, path: str) -> int:
        """The largest RT budget the machine has room for; first wait a while for the full one
        (other cgroups may hold part of the machine-wide budget for a moment)."""
        deadline = time.monotonic() + RT_WAIT_S
        while True:
            try:
                self.driver.set_rt_runtime(path, RT_LADDER_US[0])
                return RT_LADDER_US[0]
            except HostError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        last: Exception | None = None
        for us in RT_LADDER_US[1:]:
            try:
                self.driver.set_rt_runtime(path, us)
                return us
            except HostError as err:
                last = err
        raise BenchError(f"no room for a real-time budget for the training cgroup: {last}",
                         "other cgroups hold the machine's RT budget; lower their cpu.rt_runtime_us")

    def launch(self, name: str, tag: str, placement: Placement | None, cmd: list[str],
               freezer_group: str | None = None) -> tuple[Proc, int | None]:
        args = bench_command("inference_procs", "exec-in")
        rt_us = None
        if placement is not None and placement.cpus is not None:
            cg = self._cgroup(f"{tag}/{name}", ("cpuset",))
            self.driver.set_cpus(cg, list(placement.cpus))
            args += ["--cpuset", cg, "--cpus", format_cpulist(placement.cpus)]
        else:
            args += ["--cpus", format_cpulist(self.all_cpus)]
        if placement is not None and placement.sched.startswith("rr"):
            cg = self._cgroup(f"{tag}/{name}", ("cpu",))
            rt_us = self._rt_budget(cg)
            args += ["--cpu", cg]
        if placement is not None:
            args += ["--sched", placement.sched]
        if freezer_group and placement is not None and placement.frozen_by_gang:
            cg = self._cgroup(f"{tag}/{freezer_group}", ("freezer",))
            args += ["--freezer", cg]
        log = self.logs / f"{tag}-{name}.log"
        fh = open(log, "wb")
        popen = subprocess.Popen([*args, "--", *cmd], stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                 env=self.env, start_new_session=True, preexec_fn=_pdeathsig)
        fh.close()
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc, rt_us

    def wait_until(self, what: str, proc: Proc, check, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if not proc.alive():
                raise BenchError(f"{what}: process exited with {proc.popen.returncode}; log {proc.log}:\n"
                                 f"{_tail(proc.log)}", "see the log above")
            if time.monotonic() > deadline:
                raise BenchError(f"{what}: not ready after {timeout:.0f} s; log {proc.log}:\n{_tail(proc.log)}",
                                 "the machine may be overloaded; retry on a quieter machine")
            time.sleep(0.05)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            try:
                proc.stop()
            except Exception:  # keep stopping the rest
                pass
        self.procs.clear()

    def remove_cgroups(self) -> None:
        for top in self.cgroups:
            deadline = time.monotonic() + 10.0
            while True:
                try:
                    if self.driver.exists(top):
                        self.driver.remove(top, recursive=True)
                    break
                except HostError:
                    if time.monotonic() > deadline:
                        print(f"warning: could not remove cgroup {top}", file=sys.stderr)
                        break
                    time.sleep(0.1)
        self.cgroups.clear()

    # setup
    def prepare(self) -> None:
        for d in (self.out, self.logs, self.work):
            d.mkdir(parents=True, exist_ok=True)
        from reamer.serve.backends import open_backend, sample_inputs
        from reamer.serve.measure.loadgen import v2_request_body
        from reamer.serve.models import build_model

        models = self.out / "models"
        self.online_model = str(models / f"online-{self.config.online_model}.onnx")
        self.offline_model = str(models / f"offline-{self.config.offline_model}.onnx")
        build_model(self.config.online_model, self.online_model, seed=1, **self.config.online_options)
        build_model(self.config.offline_model, self.offline_model, seed=2, **self.config.offline_options)
        backend = open_backend("onnxruntime", self.online_model, 1)
        request = v2_request_body(sample_inputs(backend, 1, np.random.default_rng(0)))
        # ask only for the smallest output, as binary: the response costs next to nothing to encode
        smallest = min(backend.outputs, key=lambda o: math.prod(d for d in o.shape if d > 0))
        request["outputs"] = [{"name": smallest.name, "parameters": {"binary_data": True}}]
        self.request_body = json.dumps(request).encode()
        backend.close()
        # Calibrate the emulator's work units once, on a training core, so every phase does the same work.
        self.calibration = self.work / "calibration.json"
        proc, _ = self.launch("calibrate", "setup", Placement(self.layout.training_cpus), [
            sys.executable, "-m", "reamer.workloads.training_emulator", "--calibrate-only",
            "--image-size", str(self.config.training.image_size), "--report", str(self.calibration)])
        code = proc.popen.wait(START_TIMEOUT_S)
        self.procs.remove(proc)
        if code != 0:
            raise BenchError(f"emulator calibration failed; log:\n{_tail(proc.log)}", "see the log")
        os.sched_setaffinity(0, self.layout.online_cpus)  # the bench itself is the client: keep it off training cores

    def _online_command(self, tag: str, placement: Placement, port: int) -> list[str]:
        """One online instance (threads = its cores; one thread when floating) behind a v2 REST front door."""
        cpus = list(placement.cpus) if placement.cpus is not None else list(self.all_cpus)
        threads = len(placement.cpus) if placement.cpus is not None else 1
        if self.config.server == "bench":
            return [*bench_command("inference_procs", "serve"), "--model", self.online_model, "--name", "online",
                    "--port", str(port), "--threads", str(threads)]
        from reamer.serve.spec import InstanceSpec, JobSpec

        run_dir = self.work / f"{tag}-online-job"
        spec = JobSpec(name="online", kind="online", model=self.online_model,
                       instances=[InstanceSpec(cpus=cpus, threads=threads, max_batch=1)],
                       run_dir=str(run_dir), frontdoor_cpus=cpus, slo_ms=self.config.slo_ms,
                       rate_rps=self.config.rate_rps, port=port)
        run_dir.mkdir(parents=True, exist_ok=True)
        spec_path = run_dir / "spec.json"
        spec_path.write_text(spec.to_json())
        return [sys.executable, "-m", "reamer.serve.runtime.job", "--spec", str(spec_path)]

    # one phase
    def run_phase(self, strategy: Strategy, trial: int) -> PhaseResult:
        cfg = self.config
        tag = f"t{trial}-{strategy.name}"
        result = PhaseResult(strategy.name, trial, 0.0)
        port = _free_port()
        server = None
        offline: list[tuple[Proc, Path]] = []
        gang_proc = None
        training = None
        try:
            if strategy.online is not None:
                server, _ = self.launch("online", tag, strategy.online, self._online_command(tag, strategy.online, port))
            for i, placement in enumerate(strategy.offline):
                report = self.work / f"{tag}-offline{i}.npy"
                ready = self.work / f"{tag}-offline{i}.ready"
                p, _ = self.launch(f"offline{i}", tag, placement, [
                    *bench_command("inference_procs", "offline"), "--model", self.offline_model,
                    "--report", str(report), "--ready-file", str(ready)],
                    freezer_group="offline" if strategy.gang is not None else None)
                offline.append((p, report))
            if strategy.training is not None:
                t = cfg.training
                train_report = self.work / f"{tag}-training.json"
                ready = self.work / f"{tag}-training.ready"
                training, result.rt_runtime_us = self.launch("train", tag, strategy.training, [
                    sys.executable, "-m", "reamer.workloads.training_emulator",
                    "--duration", str(cfg.warmup_s + cfg.duration_s + 300),
                    "--gpu-step-ms", str(t.gpu_step_ms), "--kernel-ms", str(t.kernel_ms), "--kernels", str(t.kernels),
                    "--loader-workers", str(t.loader_workers), "--sync-every", str(t.sync_every),
                    "--sync-ms", str(t.sync_ms), "--duty", str(t.duty), "--image-size", str(t.image_size),
                    "--calibration", str(self.calibration), "--ready-file", str(ready),
                    "--report", str(train_report)], freezer_group="train" if strategy.gang is not None else None)
                if strategy.gang is not None:
                    gang_proc, _ = self.launch("gang", tag, Placement(self.layout.online_cpus), [
                        *bench_command("inference_procs", "gang"),
                        "--train-freezer", f"{self.root_cg}/{tag}/train",
                        "--infer-freezer", f"{self.root_cg}/{tag}/offline",
                        "--train-s", str(strategy.gang[0]), "--infer-s", str(strategy.gang[1])])
            elif strategy.gang is not None:
                raise BenchError("gang scheduling needs a training job", "give the gang strategy a training placement")
            # everything starts together; then wait for each to be ready
            if server is not None:
                import httpx

                def server_ready() -> bool:
                    try:
                        return httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2.0).status_code == 200
                    except httpx.HTTPError:
                        return False

                self.wait_until(f"{tag}: online server", server, server_ready)
            for i, (p, _) in enumerate(offline):
                ready = self.work / f"{tag}-offline{i}.ready"
                self.wait_until(f"{tag}: offline instance {i}", p, ready.exists)
            if training is not None:
                self.wait_until(f"{tag}: training emulator", training, (self.work / f"{tag}-training.ready").exists)
            time.sleep(cfg.warmup_s)

            # --- measurement window ---
            off_pids = [p.pid for p, _ in offline]
            train_pids = _tree(training.pid) if training is not None else []
            idle0 = cpu_idle_seconds()
            cpu0 = [process_cpu_seconds(pid) for pid in off_pids]
            train0 = sum(process_cpu_seconds(pid) for pid in train_pids)
            t0 = time.monotonic()
            if server is not None:
                from reamer.serve.measure.loadgen import run_load

                load = run_load(f"http://127.0.0.1:{port}/v2/models/online/infer", self.request_body,
                                cfg.rate_rps, cfg.duration_s, seed=cfg.seed * 1000 + trial, timeout_s=15.0)
                result.latencies_ms = load.latencies
                result.requests_sent = len(load.records)
                failed = [r for r in load.records if r.status != "ok"]
                if failed:
                    result.notes.append(f"{len(failed)} request(s) failed, e.g. {failed[0].http_status}: "
                                        f"{failed[0].detail[:120]}")
            else:
                time.sleep(cfg.duration_s)
            t1 = time.monotonic()
            cpu1 = [process_cpu_seconds(pid) for pid in off_pids]
            result.training_cpu_s = sum(process_cpu_seconds(pid) for pid in train_pids) - train0
            idle1 = cpu_idle_seconds()
            result.window_s = t1 - t0
            result.training_idle_s = sum(idle1[c] - idle0[c] for c in self.layout.training_cpus)
            deltas = [b - a for a, b in zip(cpu0, cpu1)]
            result.offline_cpu_s = sum(deltas)
            result.offline_cpu_on_training_s = sum(deltas[i] for i in strategy.offline_on_training_cores)
            if training is not None:
                result.training_policies = thread_policies(_tree(training.pid))
            result.offline_policies = thread_policies(off_pids)

            # --- stop and collect ---
            if gang_proc is not None:
                gang_proc.stop()
            if training is not None:
                code = training.stop(timeout=STOP_TIMEOUT_S)
                if code != 0 or not train_report.exists():
                    raise BenchError(f"{tag}: training emulator exited with {code}; log:\n{_tail(training.log)}",
                                     "see the log")
                from reamer.workloads.training_emulator import EmulatorReport

                rep = EmulatorReport.read(train_report)
                result.iteration_ms = [r.ms for r in rep.iterations if r.start >= t0 and r.end <= t1]
                result.training_duty = rep.duty_measured
                if not result.iteration_ms:
                    result.notes.append("no training iteration completed inside the window")
            if server is not None:
                server.stop()
                status = self.work / f"{tag}-online-job" / "status.json"
                if status.exists():
                    try:
                        result.server_status = json.loads(status.read_text())
                    except ValueError:
                        pass
            for p, report in offline:
                p.stop()
                if report.exists():
                    done = np.load(report)
                    result.offline_completions += int(((done >= t0) & (done <= t1)).sum())
                else:
                    result.notes.append(f"offline instance {p.name} wrote no report")
            return result
        finally:
            self.stop_all()
            self.remove_cgroups()


# --- the whole bench -------------------------------------------------------


def machine_info() -> dict[str, Any]:
    from reamer.host.topology import read_topology

    model = read_topology().model_name
    import onnxruntime

    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu_model": model, "cpus": os.cpu_count(), "memory_gib": round(mem_gib, 1),
        "kernel": platform.release(), "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__, "loadavg_start": list(os.getloadavg()),
        "rt_runtime_us": Path("/proc/sys/kernel/sched_rt_runtime_us").read_text().strip(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def trial_order(strategies: list[Strategy], trial: int) -> list[Strategy]:
    """Baselines first in every trial; the rest rotated per trial so machine drift hits all alike."""
    base = [s for s in strategies if s.baseline]
    rest = [s for s in strategies if not s.baseline]
    return base + rotated(rest, trial)


def run_bench(config: BenchConfig, progress=print) -> dict[str, Any]:
    if os.geteuid() != 0:
        raise BenchError("the co-location bench needs root (cgroups, SCHED_RR)", "run it as root (sudo)")
    bench = Bench(config)
    info = machine_info()
    phases: list[PhaseResult] = []
    started = time.monotonic()
    try:
        bench.prepare()
        for trial in range(config.trials):
            for strategy in trial_order(bench.strategies, trial):
                progress(f"[{time.monotonic() - started:6.0f}s] trial {trial + 1}/{config.trials}: {strategy.name}")
                phases.append(bench.run_phase(strategy, trial))
    finally:
        bench.stop_all()
        bench.remove_cgroups()
    info["loadavg_end"] = list(os.getloadavg())
    info["bench_wall_s"] = round(time.monotonic() - started, 1)
    return {
        "config": asdict(config),
        "machine": info,
        "layout": {"training_cpus": list(bench.layout.training_cpus), "online_cpus": list(bench.layout.online_cpus),
                   "offline_cpus": list(bench.layout.offline_cpus)},
        "strategies": [asdict(s) for s in bench.strategies],
        "phases": [asdict(p) for p in phases],
        "summary": summarise(config, bench.strategies, phases),
    }


def summarise(config: BenchConfig, strategies: list[Strategy], phases: list[PhaseResult]) -> dict[str, Any]:
    by = {(p.strategy, p.trial): p for p in phases}
    trials = sorted({p.trial for p in phases})
    out: dict[str, Any] = {}
    for s in strategies:
        rows = [by[(s.name, t)] for t in trials if (s.name, t) in by]
        it = [IterationSummary.of(r.iteration_ms) for r in rows]
        lat = [LatencySummary.of(r.latencies_ms, r.requests_sent, config.slo_ms, r.window_s) for r in rows]
        alone_it = {t: IterationSummary.of(by[("training_alone", t)].iteration_ms)
                    for t in trials if ("training_alone", t) in by}
        alone_lat = {t: LatencySummary.of(by[("inference_alone", t)].latencies_ms, by[("inference_alone", t)].requests_sent,
                                          config.slo_ms, by[("inference_alone", t)].window_s)
                     for t in trials if ("inference_alone", t) in by}
        alone_idle_all = {t: by[("training_alone", t)].training_idle_s / by[("training_alone", t)].window_s
                          for t in trials if ("training_alone", t) in by and by[("training_alone", t)].window_s > 0}
        alone_idle = {t: v for t, v in alone_idle_all.items() if v >= MIN_IDLE_PER_S}
        n_train = len(config.training_cpus)
        alone_unused = {t: n_train - by[("training_alone", t)].training_cpu_s / by[("training_alone", t)].window_s
                        for t in trials if ("training_alone", t) in by and by[("training_alone", t)].window_s > 0}
        entry: dict[str, Any] = {"title": s.title, "trials": len(rows)}
        if s.name == "training_alone":
            for t, idle in alone_idle_all.items():
                if idle < MIN_IDLE_PER_S:
                    entry.setdefault("notes", []).append(
                        f"trial {t}: the training cores were idle only {idle:.2f} s/s with training alone (other "
                        "tenants?), so the harvest ratio of that trial is not reported")
        if s.training is not None:
            entry["iteration_median_ms"] = Spread.of([i.median_ms for i in it]).to_dict()
            entry["iteration_p99_ms"] = Spread.of([i.p99_ms for i in it]).to_dict()
            entry["iterations"] = sum(i.n for i in it)
            entry["slowdown_median"] = Spread.of(
                [change(i.median_ms, alone_it[r.trial].median_ms) for i, r in zip(it, rows) if r.trial in alone_it]).to_dict()
            entry["slowdown_p99"] = Spread.of(
                [change(i.p99_ms, alone_it[r.trial].p99_ms) for i, r in zip(it, rows) if r.trial in alone_it]).to_dict()
            entry["training_policies"] = rows[-1].training_policies if rows else {}
            entry["rt_runtime_us"] = rows[-1].rt_runtime_us if rows else None
            entry["training_idle_per_s"] = Spread.of([r.training_idle_s / r.window_s for r in rows if r.window_s]).to_dict()
            entry["training_cpu_per_s"] = Spread.of([r.training_cpu_s / r.window_s for r in rows if r.window_s]).to_dict()
        if s.online is not None:
            for key in ("mean_ms", "std_ms", "p50_ms", "p99_ms", "p999_ms", "slo_attainment"):
                entry[key] = Spread.of([getattr(x, key) for x in lat]).to_dict()
            entry["requests"] = sum(x.sent for x in lat)
            entry["failed"] = sum(x.failed for x in lat)
            entry["p99_vs_alone"] = Spread.of(
                [change(x.p99_ms, alone_lat[r.trial].p99_ms) for x, r in zip(lat, rows) if r.trial in alone_lat]).to_dict()
            pooled = [v for r in rows for v in r.latencies_ms]
            sent = sum(r.requests_sent for r in rows)
            entry["pooled"] = asdict(LatencySummary.of(pooled, sent, config.slo_ms, sum(r.window_s for r in rows)))
        if s.offline:
            entry["offline_rps"] = Spread.of([r.offline_completions / r.window_s for r in rows if r.window_s]).to_dict()
            if s.offline_on_training_cores and s.training is not None:
                entry["offline_cpu_on_training_per_s"] = Spread.of(
                    [r.offline_cpu_on_training_s / r.window_s for r in rows if r.window_s]).to_dict()
                entry["harvest_ratio"] = Spread.of(
                    [harvest_ratio(r.offline_cpu_on_training_s / r.window_s, alone_idle[r.trial])
                     for r in rows if r.window_s and r.trial in alone_idle]).to_dict()
                entry["harvest_of_unused"] = Spread.of(
                    [harvest_ratio(r.offline_cpu_on_training_s / r.window_s, alone_unused[r.trial])
                     for r in rows if r.window_s and r.trial in alone_unused]).to_dict()
        notes = sorted({n for r in rows for n in r.notes})
        if notes:
            entry["notes"] = entry.get("notes", []) + notes
        out[s.name] = entry
    return out


# --- report ----------------------------------------------------------------


def _sp(d: dict | None) -> Spread:
    return Spread(**d) if d else Spread(math.nan, math.nan, math.nan, 0)


def targets(summary: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    rows: list[tuple[str, str, bool | None]] = []
    r = summary.get("reamer", {})
    slow = _sp(r.get("slowdown_median"))
    rows.append(("training slowdown under reamer ≤ 2 % (paper: 3.2 %)", slow.fmt(100, 1, " %", sign=True),
                 slow.median <= 0.02 if slow.n else None))
    p99 = _sp(r.get("p99_vs_alone"))
    rows.append(("online p99 within 10 % of inference alone", p99.fmt(100, 1, " %", sign=True),
                 p99.median <= 0.10 if p99.n else None))
    slo = _sp(r.get("slo_attainment"))
    rows.append(("SLO attainment ≥ 99.9 % at the offered rate", slo.fmt(100, 2, " %"),
                 slo.median >= 0.999 if slo.n else None))
    hv = _sp(r.get("harvest_ratio"))
    rows.append(("harvest ratio ≥ 0.8", hv.fmt(1, 2), hv.median >= 0.8 if hv.n else None))
    return rows


SERVER_DESCRIPTION = {
    "job": "reamer's own job runner (`python -m reamer.serve.runtime.job`: KServe v2 REST front door, batcher, load shedding)",
    "bench": "the minimal KServe v2 REST server of `python -m bench.inference_procs serve` (reamer's request codec)",
}


def render_markdown(data: dict[str, Any], image_dir: str, command: str) -> str:
    cfg, m, summ, lay = data["config"], data["machine"], data["summary"], data["layout"]
    t = cfg["training"]
    lines = ["## Co-location: training + online + offline inference (Cloud Reamer §IV, Fig. 8, 10, 11)", ""]
    if cfg["quick"]:
        lines += ["> **Smoke run (`--quick`)** — tiny models and seconds-long windows: shows the harness works, "
                  "not how the strategies compare.", ""]
    lines += [
        f"- Command: `{command}`",
        f"- Machine: {m['cpu_model']}, {m['cpus']} cpus, {m['memory_gib']} GiB, Linux {m['kernel']}, "
        f"Python {m['python']}, ONNX Runtime {m['onnxruntime']}; load average at start "
        f"{m['loadavg_start'][0]:.2f}, at end {m['loadavg_end'][0]:.2f}; {m['date']}; bench wall time {m['bench_wall_s']:.0f} s.",
        f"- Layout: training on cpus {format_cpulist(lay['training_cpus'])}; the online instance on cpus "
        f"{format_cpulist(lay['online_cpus'])} (with its HTTP front door and the load generator); one "
        f"single-thread offline instance on each of cpus {format_cpulist(lay['offline_cpus'])}.",
        f"- Training: the CPU-side training **emulator** (`reamer.workloads.training_emulator`: "
        f"{t['loader_workers']} loader processes, {t['kernel_ms']:g} ms of kernel dispatch and a {t['gpu_step_ms']:g} ms "
        f"sleep for the GPU step per iteration, a {t['sync_ms']:g} ms gradient-sync burst every {t['sync_every']} "
        f"iterations, duty {t['duty']:g}) — not a real GPU job.",
        f"- Online: `{cfg['online_model']}` {cfg['online_options']}, one instance (max batch 1) behind "
        f"{SERVER_DESCRIPTION[cfg['server']]}, open-loop "
        f"Poisson at {cfg['rate_rps']:g} req/s, SLO {cfg['slo_ms']:g} ms. Offline: `{cfg['offline_model']}` "
        f"{cfg['offline_options']}, batch 1, back to back.",
        f"- {cfg['trials']} trial(s) × {cfg['duration_s']:g} s window per strategy (after {cfg['warmup_s']:g} s warm-up). "
        "Cells show the median over trials and (min…max) of the per-trial values.",
        "",
        "### Training iteration time",
        "",
        "| strategy | median ms | p99 ms | change of median vs alone | change of p99 vs alone | training threads |",
        "|---|---|---|---|---|---|",
    ]
    for name, e in summ.items():
        if "iteration_median_ms" not in e:
            continue
        pol = ", ".join(f"{k} {v}" for k, v in sorted(e.get("training_policies", {}).items()))
        lines.append(f"| {e['title']} | {_sp(e['iteration_median_ms']).fmt()} | {_sp(e['iteration_p99_ms']).fmt()} | "
                     f"{_sp(e['slowdown_median']).fmt(100, 1, ' %', sign=True)} | "
                     f"{_sp(e['slowdown_p99']).fmt(100, 1, ' %', sign=True)} | {pol} |")
    lines += ["", "### Online latency", "",
              "| strategy | mean ms | std ms | p50 ms | p99 ms | p99.9 ms | SLO attainment | p99 vs alone | requests (failed) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, e in summ.items():
        if "p99_ms" not in e:
            continue
        lines.append(f"| {e['title']} | {_sp(e['mean_ms']).fmt()} | {_sp(e['std_ms']).fmt()} | {_sp(e['p50_ms']).fmt()} | "
                     f"{_sp(e['p99_ms']).fmt()} | {_sp(e['p999_ms']).fmt()} | {_sp(e['slo_attainment']).fmt(100, 2, ' %')} | "
                     f"{_sp(e['p99_vs_alone']).fmt(100, 1, ' %', sign=True)} | {e['requests']} ({e['failed']}) |")
    lines += ["", "### Offline throughput and harvest", "",
              "Harvest ratio = CPU time of the offline instances on the training cores ÷ the idle time those cores "
              "had with training alone (same trial, per second; /proc/<pid>/task/*/schedstat and /proc/stat). "
              "On a machine shared with other work, other tenants also use that idle time; the last column "
              "divides instead by the time training alone left unused (cores × window − training CPU time).", "",
              "| strategy | offline inferences/s | offline CPU s/s on training cores | harvest ratio | harvest of training's unused time |",
              "|---|---|---|---|---|"]
    for name, e in summ.items():
        if "offline_rps" not in e:
            continue
        lines.append(f"| {e['title']} | {_sp(e['offline_rps']).fmt(1, 1)} | "
                     f"{_sp(e.get('offline_cpu_on_training_per_s')).fmt(1, 2)} | {_sp(e.get('harvest_ratio')).fmt(1, 2)} | "
                     f"{_sp(e.get('harvest_of_unused')).fmt(1, 2)} |")
    alone = summ.get("training_alone", {})
    if alone.get("training_idle_per_s"):
        lines.append(f"\nWith training alone, its cores were idle {_sp(alone['training_idle_per_s']).fmt(1, 2)} s per "
                     f"second (/proc/stat) and training used {_sp(alone['training_cpu_per_s']).fmt(1, 2)} CPU s per second.")
    rr = summ.get("reamer", {})
    if rr.get("rt_runtime_us"):
        lines.append(f"\nreamer's training cgroup ran with cpu.rt_runtime_us = {rr['rt_runtime_us']} per 1 s period "
                     "(the largest of 500000…100000 the machine's RT budget had room for).")
    lines += ["", "### Targets (reamer)", "", "| target | measured | met |", "|---|---|---|"]
    for what, measured, ok in targets(summ):
        lines.append(f"| {what} | {measured} | {'yes' if ok else ('no' if ok is False else 'n/a')} |")
    notes = [f"{e['title']}: {n}" for e in summ.values() for n in e.get("notes", [])]
    if notes:
        lines += ["", "Notes: " + "; ".join(notes)]
    lines += ["", f"![latency CDFs]({image_dir}/latency_cdf.png)",
              f"![training slowdown]({image_dir}/training_slowdown.png)",
              f"![offline throughput]({image_dir}/offline_throughput.png)", ""]
    return "\n".join(lines)


def write_outputs(data: dict[str, Any], out: Path, command: str, results_md: Path | None) -> None:
    from bench import plots

    write_json(out / "colocation.json", data)
    plots.plot_all(data, out)
    (out / "colocation.md").write_text(render_markdown(data, ".", command))
    if results_md is not None:
        rel = os.path.relpath(out, results_md.resolve().parent)
        from bench.harness import replace_section

        heading, _, body = render_markdown(data, rel, command).partition("\n")
        replace_section(results_md, heading, body)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=None, help="repeated trials (default 3; quick 1)")
    p.add_argument("--duration", type=float, default=None, help="measurement window per strategy, s (default 25; quick 2)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up before each window, s (default 2; quick 0.5)")
    p.add_argument("--rate", type=float, default=None, help="online request rate, req/s (default 25; quick 20)")
    p.add_argument("--slo-ms", type=float, default=None, help="online latency SLO, ms (default 100)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny models, 1 short trial")
    p.add_argument("--out", default=str(RESULTS_DIR / "colocation"), help="output directory")
    p.add_argument("--results-md", default=None, help="also write this bench's section into this RESULTS.md")
    p.add_argument("--training-cpus", default="1", help="cpus of the training job (default 1)")
    p.add_argument("--online-cpus", default="0", help="cpus of the online instance (default 0)")
    p.add_argument("--strategies", default=None, help=f"comma list (baselines always run): {','.join(STRATEGY_ORDER)}")
    p.add_argument("--duty", type=float, default=None, help="training emulator CPU duty (default 0.4)")
    p.add_argument("--gpu-step-ms", type=float, default=None)
    p.add_argument("--server", choices=("job", "bench"), default=None,
                   help="online server: job = reamer's `python -m reamer.serve.runtime.job` (default when present), "
                        "bench = the minimal server in bench/inference_procs.py (python -m bench.inference_procs serve)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _default_server() -> str:
    import importlib.util

    return "job" if importlib.util.find_spec("reamer.serve.runtime.job") is not None else "bench"


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    cfg = BenchConfig(out=args.out, quick=args.quick, seed=args.seed,
                      training_cpus=parse_cpulist(args.training_cpus), online_cpus=parse_cpulist(args.online_cpus),
                      strategies=[s for s in args.strategies.split(",") if s] if args.strategies else None,
                      server=args.server or _default_server())
    if args.quick:
        cfg.trials, cfg.duration_s, cfg.warmup_s, cfg.rate_rps = 1, 2.0, 0.5, 20.0
        cfg.online_model, cfg.online_options = "tiny", {}
        cfg.offline_model, cfg.offline_options = "tiny", {}
        cfg.training = TrainingSettings(gpu_step_ms=30.0, kernel_ms=4.0, kernels=8, loader_workers=1,
                                        sync_every=3, sync_ms=4.0, duty=0.4, image_size=32)
    for attr, val in (("trials", args.trials), ("duration_s", args.duration), ("warmup_s", args.warmup),
                      ("rate_rps", args.rate), ("slo_ms", args.slo_ms)):
        if val is not None:
            setattr(cfg, attr, val)
    if args.duty is not None:
        cfg.training.duty = args.duty
    if args.gpu_step_ms is not None:
        cfg.training.gpu_step_ms = args.gpu_step_ms
    return cfg


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = command_line("colocation", argv)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        cfg = config_from_args(args)
        data = run_bench(cfg)
        out = Path(cfg.out)
        write_outputs(data, out, command.strip(), Path(args.results_md) if args.results_md else None)
    except ReamerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; processes stopped and cgroups removed", file=sys.stderr)
        return 130
    print((out / "colocation.md").read_text())
    print(f"results: {out}/colocation.json, {out}/colocation.md, plots in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
