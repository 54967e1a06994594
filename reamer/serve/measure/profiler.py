"""Measure a model's throughput and latency on given CPUs, the way perf_analyzer does.

Each instance runs in its own worker process (`python -m reamer.serve.measure.profile_worker --worker CONFIG`,
measure/profile_worker.py)
that pins itself to its CPUs *before* importing numpy or the runtime, so every runtime thread
inherits the affinity. The worker loads the model with threads = its cores, warms up (discarded),
says READY, waits for GO, then runs closed-loop batches in windows:

- point mode: windows until the throughput of the last three is stable (each within `stability`,
  10 % by default, of their mean) or `max_windows` is reached; throughput = mean of the last three;
- fixed mode (whole layouts): exactly `fixed_windows` windows, all instances started together.

p99 is pooled over the batch latencies of all measured windows.

After READY the worker reads commands on stdin: `GO` measures the configured batch, says RESULT and
exits (the instances of a layout); `RUN {"batch": B}` measures batch B in point mode on the same loaded
model, re-warming first when B is new to it, says RESULT and waits for the next command (PointSession, measure_point);
`EXIT` or end of input ends it.

Workers started inside `workers_run_as(identity, memory_mb)` (the agent's layout search on deploy) run
as that user (the job's), in Python's isolated mode from cwd "/", with a minimal environment and a
data-segment limit: the model and sample data they open are the user's files.

Top-level imports here are standard library only, because the worker imports this module (WorkerConfig,
WorkerResult) before it pins itself.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from reamer.host.errors import ReamerError
from reamer.serve.spec import static_batch_for

if TYPE_CHECKING:
    from reamer.host.access import Identity
    from reamer.plan.partition import ProfilePoint
    from reamer.serve.samples import SampleSpec


class ProfileError(ReamerError):
    """A measurement could not be made."""


@dataclass
class WorkerConfig:
    model_path: str
    backend: str
    cpus: list[int]
    threads: int
    batch: int
    warmup_s: float = 1.0
    window_s: float = 0.5
    max_windows: int = 10
    stability: float = 0.10
    fixed_windows: int | None = None
    seed: int = 0
    samples: dict | None = None  # samples.SampleSpec.to_doc(): the traffic's shapes and sample data
    streams: int = 1  # OpenVINO streams sharing `threads` (each batch is split among them)
    precision: str = "f32"  # "bf16": OpenVINO computes in bfloat16 where the CPU supports it
    # OpenVINO compiles for this batch first, as the job's instance would (spec.static_batch_for); a point
    # session compiles batch 1 and measures other batches on the dynamic form, as a max-batch-1 instance runs them
    static_batch: int | None = None


@dataclass
class WorkerResult:
    cpus: list[int]
    threads: int
    batch: int
    window_rps: list[float] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    stable: bool = False
    samples: int = 0
    measured_s: float = 0.0
    fed_batch: int = 0  # rows of the batched inputs as actually fed (0: the model has no batched input)

    @property
    def throughput_rps(self) -> float:
        """Samples/s: mean of the last three windows (point mode) or over all windows (fixed mode)."""
        last = self.window_rps[-3:]
        return sum(last) / len(last) if last else 0.0

    @property
    def overall_rps(self) -> float:
        return self.samples / self.measured_s if self.measured_s > 0 else 0.0


@dataclass
class LayoutMeasurement:
    throughput_rps: float  # sum over instances
    p99_ms: float  # pooled over every batch of every instance
    instances: list[WorkerResult]


def window_is_stable(window_rps: Sequence[float], stability: float = 0.10) -> bool:
    """True when the last three windows are each within `stability` (fraction) of their mean."""
    if len(window_rps) < 3:
        return False
    last = window_rps[-3:]
    mean = sum(last) / 3
    return mean > 0 and all(abs(x - mean) <= stability * mean for x in last)


def p99(latencies_ms: Sequence[float]) -> float:
    from reamer.plan import statistics  # numpy: not at the top (the worker pins itself first)

    return statistics.p99(latencies_ms)


@dataclass(frozen=True)
class WorkerUser:
    """Whom workers run as, and their data-segment limit (MiB)."""

    identity: "Identity | None"
    memory_mb: float


_RUN_AS: contextvars.ContextVar[WorkerUser | None] = contextvars.ContextVar("reamer_profiler_run_as", default=None)
WORKER_FILE_CAP = 64 << 20  # bytes a worker run as a user may write to a file (its stderr is one)


@contextlib.contextmanager
def workers_run_as(identity: "Identity | None", memory_mb: float) -> Iterator[None]:
    """Every worker started in this block (this thread) runs as `identity` (None: this process's user) in
    isolated mode, cwd "/", a minimal environment and a data-segment limit of `memory_mb`."""
    token = _RUN_AS.set(WorkerUser(identity, memory_mb))
    try:
        yield
    finally:
        _RUN_AS.reset(token)


def child_start(module: str, args: list[str], env: dict[str, str] | None = None) -> tuple[list[str], dict[str, Any]]:
    """Command line and Popen arguments of a child that runs the user's model (`python -m module args`): within
    workers_run_as, as that user, isolated, cwd "/", a minimal environment and the memory limit; else the
    invoking user's own process (the CLI's reamer search/profile)."""
    env = env or {}
    user = _RUN_AS.get()
    if user is None:
        return [sys.executable, "-m", module, *args], {"env": {**os.environ, **env}}
    from reamer.host.access import as_user_kwargs, child_env, limited_argv

    argv = limited_argv([sys.executable, "-I", "-m", module, *args], int(user.memory_mb * (1 << 20)),
                        WORKER_FILE_CAP)
    return argv, {"env": child_env(**env), "cwd": "/", **as_user_kwargs(user.identity)}


def _worker_start(config: WorkerConfig) -> tuple[list[str], dict[str, Any]]:
    """The worker's command line and Popen arguments (who it runs as, its environment, cwd, limits)."""
    threads = {"OMP_NUM_THREADS": str(config.threads), "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return child_start("reamer.serve.measure.profile_worker", ["--worker", json.dumps(asdict(config))], threads)


class ProfileWorker:
    """One pinned worker process: start -> wait_ready() -> go() -> result()."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        argv, how = _worker_start(config)
        self._stderr = tempfile.TemporaryFile(mode="w+b")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, bufsize=1, **how)
        self.pid = self.proc.pid
        self.ready_info: dict[str, Any] = {}
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _next(self, deadline: float, waiting_for: str) -> tuple[str, Any]:
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ProfileError(f"profile worker on cpus {self.config.cpus} sent no {waiting_for} in time",
                                   "give it a longer timeout, fewer windows, or a smaller batch") from None
            if line is None:
                raise self._exited(waiting_for)
            tag, _, payload = line.partition(" ")
            if tag == "ERROR":
                err = json.loads(payload)
                raise ProfileError(err["message"], err.get("fix", ""))
            if tag in ("READY", "RESULT"):
                return tag, json.loads(payload)
            # anything else is stray output from a runtime: ignore it

    def _exited(self, waiting_for: str) -> ProfileError:
        code = self.proc.wait()
        how = f"was killed by signal {-code}" if code < 0 else f"exited ({code})"
        return ProfileError(f"profile worker {self.pid} on cpus {self.config.cpus} {how} before {waiting_for}: "
                            f"{self.stderr_tail() or '(nothing on stderr)'}",
                            "check the model file and backend; the worker's stderr is above")

    def stderr_tail(self, chars: int = 2000) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-chars:].strip()

    def wait_ready(self, timeout_s: float = 300.0) -> dict[str, Any]:
        _, self.ready_info = self._next(time.monotonic() + timeout_s, "READY")
        return self.ready_info

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("GO\n")
        self.proc.stdin.flush()

    def result(self, timeout_s: float = 300.0) -> WorkerResult:
        _, data = self._next(time.monotonic() + timeout_s, "RESULT")
        self.proc.wait(timeout=30)
        return WorkerResult(**data)

    def run_batch(self, batch: int, timeout_s: float = 300.0) -> WorkerResult:
        """Measure `batch` on the loaded model (re-warmed when the batch is new to it) and stay up for the next."""
        self.send_run(batch)
        return self.run_result(batch, timeout_s)

    def send_run(self, batch: int, rewarm_s: float = 0.0) -> None:
        """Ask for a measurement of `batch`; a batch the model last ran is first re-warmed for `rewarm_s`."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"RUN {json.dumps({'batch': batch, 'rewarm_s': rewarm_s})}\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # ValueError: our end was closed
            raise self._exited(f"the RESULT of batch {batch}") from None

    def run_result(self, batch: int, timeout_s: float = 300.0) -> WorkerResult:
        _, data = self._next(time.monotonic() + timeout_s, f"the RESULT of batch {batch}")
        return WorkerResult(**data)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        finally:
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    if stream:
                        stream.close()
                except OSError:
                    pass
            self._stderr.close()

    def __enter__(self) -> "ProfileWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _usable_cpus(cpus: Sequence[int] | None, needed: int) -> list[int]:
    allowed = sorted(os.sched_getaffinity(0))
    chosen = list(cpus) if cpus is not None else allowed
    bad = sorted(set(chosen) - set(allowed))
    if bad:
        raise ProfileError(f"cpus {bad} are not available to this process (allowed: {allowed})",
                           "pass cpus from the allowed set")
    if len(set(chosen)) != len(chosen):
        raise ProfileError(f"cpus {chosen} list a cpu twice", "pass distinct cpus")
    if needed > len(chosen):
        raise ProfileError(f"the measurement needs {needed} cores but only {len(chosen)} cpus were given ({chosen})",
                           "use fewer cores or pass more cpus")
    return chosen


def _doc(samples: "SampleSpec | None") -> dict | None:
    return None if samples is None or samples.is_default else samples.to_doc()


def _started(configs: list[WorkerConfig], timeout_s: float) -> list[ProfileWorker]:
    """A worker per config, each loaded and warm (all of them killed if one fails)."""
    workers: list[ProfileWorker] = []
    try:
        for cfg in configs:
            workers.append(ProfileWorker(cfg))
        deadline = time.monotonic() + timeout_s
        for w in workers:
            w.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        for w in workers:
            w.close()
        raise
    return workers


def _run_workers(configs: list[WorkerConfig], timeout_s: float) -> list[WorkerResult]:
    deadline = time.monotonic() + timeout_s
    workers = _started(configs, timeout_s)
    try:
        for w in workers:  # start together, after every model is loaded and warm
            w.go()
        return [w.result(max(1.0, deadline - time.monotonic())) for w in workers]
    finally:
        for w in workers:
            w.close()


def measure_point(model_path: str | os.PathLike, backend: str, cores: int, batch: int,
                  cpus: Sequence[int] | None = None, *, warmup_s: float = 1.0, window_s: float = 0.5,
                  max_windows: int = 10, stability: float = 0.10, timeout_s: float = 600.0,
                  samples: "SampleSpec | None" = None, threads: int | None = None,
                  streams: int = 1, precision: str = "f32") -> "ProfilePoint":
    """One instance with `cores` cores (`threads`, default = cores, in `streams` streams) and batch `batch`, alone
    on the first `cores` of `cpus`, fed by `samples` (the traffic's shapes and data; default: reamer.serve.samples'
    rule), computing at the job's `precision`: a PointSession's one measurement (which checks cores and batch)."""
    with PointSession(model_path, backend, cores, cpus, warmup_s=warmup_s, window_s=window_s,
                      max_windows=max_windows, stability=stability, samples=samples, threads=threads,
                      streams=streams, precision=precision) as session:
        return session.measure(batch, timeout_s)


class PointSession:
    """Single-instance points of one shape (model, backend, cores, threads, streams, precision, samples) at
    any batch, from one worker process kept loaded between them: the process start, imports, model load
    and first warm-up are paid once, a new batch only re-warms (measure_point is one such measurement).

    A measurement that fails (the worker died, timed out or refused the batch) raises ProfileError and
    drops that worker; the next measurement starts a fresh one. close() kills the worker."""

    def __init__(self, model_path: str | os.PathLike, backend: str, cores: int, cpus: Sequence[int] | None = None,
                 *, warmup_s: float = 1.0, window_s: float = 0.5, max_windows: int = 10, stability: float = 0.10,
                 samples: "SampleSpec | None" = None, threads: int | None = None, streams: int = 1,
                 precision: str = "f32") -> None:
        if cores < 1:
            raise ProfileError(f"cores ({cores}) must be >= 1", "pass a positive core count")
        self.cores = cores
        self.config = WorkerConfig(os.fspath(model_path), backend, _usable_cpus(cpus, cores)[:cores], threads or cores,
                                   1, warmup_s, window_s, max(3, max_windows), stability, samples=_doc(samples),
                                   streams=streams, precision=precision, static_batch=1)
        self.pids: list[int] = []  # every worker process this session started, in order
        self._worker: ProfileWorker | None = None

    @property
    def alive(self) -> bool:
        """A loaded worker is waiting: the next measurement has no start-up."""
        return self._worker is not None and self._worker.proc.poll() is None

    def measure(self, batch: int, timeout_s: float = 600.0) -> "ProfilePoint":
        from reamer.plan.partition import ProfilePoint

        if batch < 1:
            raise ProfileError(f"batch ({batch}) must be >= 1", "pass a positive batch")
        deadline = time.monotonic() + timeout_s
        if not self.alive:
            self._drop()
            self._worker = ProfileWorker(WorkerConfig(**{**asdict(self.config), "batch": batch}))
            self.pids.append(self._worker.pid)
        worker = self._worker
        assert worker is not None
        try:
            if not worker.ready_info:
                worker.wait_ready(max(1.0, deadline - time.monotonic()))
            res = worker.run_batch(batch, max(1.0, deadline - time.monotonic()))
        except BaseException:
            self._drop()
            raise
        return ProfilePoint(cores=self.cores, batch=batch, throughput_rps=res.throughput_rps,
                            p99_ms=p99(res.latencies_ms))

    def _drop(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

    def close(self) -> None:
        """Kill the worker (idempotent): it holds its model's memory and may not outlive the search."""
        self._drop()

    def __enter__(self) -> "PointSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _layout_configs(model_path: str | os.PathLike, backend: str, layout: Any, cpus: Sequence[int], warmup_s: float,
                    window_s: float, windows: int, samples: "SampleSpec | None", precision: str) -> list[WorkerConfig]:
    """One worker per instance of `layout`, on disjoint slices of `cpus`, measuring exactly `windows` windows."""
    instances = list(layout.instances)
    chosen = _usable_cpus(cpus, sum(i.cores for i in instances))
    configs, start = [], 0
    for inst in instances:
        threads = getattr(inst, "threads", None) or inst.cores
        configs.append(WorkerConfig(os.fspath(model_path), backend, chosen[start:start + inst.cores], threads,
                                    inst.batch, warmup_s, window_s, windows, 0.0, fixed_windows=max(1, windows),
                                    samples=_doc(samples), streams=getattr(inst, "streams", 1),
                                    precision=precision, static_batch=static_batch_for(inst.batch)))
        start += inst.cores
    return configs


def _together(results: list[WorkerResult]) -> LayoutMeasurement:
    pooled = [lat for r in results for lat in r.latencies_ms]
    return LayoutMeasurement(sum(r.overall_rps for r in results), p99(pooled), results)


def measure_layout_detail(model_path: str | os.PathLike, backend: str, layout: Any, cpus: Sequence[int], *,
                          warmup_s: float = 1.0, window_s: float = 0.5, windows: int = 4,
                          timeout_s: float = 600.0, samples: "SampleSpec | None" = None,
                          precision: str = "f32") -> LayoutMeasurement:
    """Run every instance of `layout` (a plan.layout.Layout) together on disjoint slices of `cpus`."""
    configs = _layout_configs(model_path, backend, layout, cpus, warmup_s, window_s, windows, samples, precision)
    return _together(_run_workers(configs, timeout_s))


class LayoutSession:
    """The instances of one layout, loaded once and measured together as often as asked (a search's finals:
    the finalists stay loaded, idle while another runs, so their runs interleave without a process start).

    start() loads and warms them; run() re-warms each for `rewarm_s` (caches the other finalists' runs
    evicted) and measures `windows` windows of all of them together; close() kills them."""

    def __init__(self, model_path: str | os.PathLike, backend: str, layout: Any, cpus: Sequence[int], *,
                 warmup_s: float = 1.0, window_s: float = 0.5, windows: int = 4,
                 samples: "SampleSpec | None" = None, precision: str = "f32") -> None:
        self.configs = _layout_configs(model_path, backend, layout, cpus, warmup_s, window_s, windows, samples,
                                       precision)
        self.workers: list[ProfileWorker] = []

    def start(self, timeout_s: float = 300.0) -> None:
        self.workers = _started(self.configs, timeout_s)

    def run(self, rewarm_s: float = 0.0, timeout_s: float = 300.0) -> LayoutMeasurement:
        deadline = time.monotonic() + timeout_s
        try:
            for w, cfg in zip(self.workers, self.configs):  # start together
                w.send_run(cfg.batch, rewarm_s)
            return _together([w.run_result(cfg.batch, max(1.0, deadline - time.monotonic()))
                              for w, cfg in zip(self.workers, self.configs)])
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        workers, self.workers = self.workers, []
        for w in workers:
            w.close()

    def __enter__(self) -> "LayoutSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def measure_layout(model_path: str | os.PathLike, backend: str, layout: Any, cpus: Sequence[int],
                   **kwargs: Any) -> tuple[float, float]:
    """(total samples/s, pooled batch-latency p99 ms) of `layout` running together on `cpus`."""
    m = measure_layout_detail(model_path, backend, layout, cpus, **kwargs)
    return m.throughput_rps, m.p99_ms


def point_measurer(model_path: str | os.PathLike, backend: str, cpus: Sequence[int] | None = None,
                   **kwargs: Any) -> Callable[[int, int], "ProfilePoint"]:
    """`measure(cores, batch)` for reamer.search.method.quick_search."""
    return lambda cores, batch: measure_point(model_path, backend, cores, batch, cpus, **kwargs)


def layout_verifier(model_path: str | os.PathLike, backend: str, cpus: Sequence[int],
                    **kwargs: Any) -> Callable[[Any], tuple[float, float]]:
    """`verify(layout) -> (rps, p99_ms)` for reamer.search.method.quick_search."""
    return lambda layout: measure_layout(model_path, backend, layout, cpus, **kwargs)
