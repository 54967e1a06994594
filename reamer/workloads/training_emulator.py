"""A training emulator: the CPU side of GPU training, without a GPU.

This is an EMULATOR, not a training job. It reproduces what a GPU training
process does on its CPU cores (Cloud Reamer §II-A, Fig. 2), with real
processes and threads doing real work:

- data-loader worker processes (like a PyTorch DataLoader with workers) that
  decode (zlib), augment (random crop, flip, brightness) and normalise numpy
  images into shared-memory batch slots, prefetching ahead of the main loop;
- a main loop that, per iteration, takes the next batch, "dispatches kernels"
  (short back-to-back CPU bursts of small numpy ops), then waits for the "GPU
  step" — a sleep of the configured length, during which the CPU is idle as it
  would be while a real GPU computes;
- a communication thread that every `sync_every` iterations runs a gradient
  synchronisation burst (reductions over a gradient buffer) that the main loop
  waits for, like an all-reduce.

The CPU duty cycle (CPU busy time / (wall time × cores)) is set with `duty`:
the preprocessing work per batch is sized so that kernels + preprocessing +
sync take `duty` of each iteration. Work is sized in units calibrated once
(pass the same `Calibration` to compare runs: then every run does the same
work, and interference shows as longer iterations).

For a real GPU training loop see `bench/train_gpu_pytorch.py` (same report
format). Run: `python -m reamer.workloads.training_emulator --iterations 200
--gpu-step-ms 60 --kernel-ms 8 --loader-workers 2 --sync-every 4 --duty 0.4
--report out.json`.
"""
from __future__ import annotations

import os

# Small numpy ops must not fan out into a BLAS thread pool: the emulator's
# threads are the ones a training job would have.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import json
import multiprocessing as mp
import queue
import signal
import sys
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from reamer.host.errors import ReamerError

REPORT_FORMAT = "reamer-training-report/1"


class EmulatorConfigError(ReamerError):
    """The emulator's settings cannot produce the asked-for behaviour."""


@dataclass(frozen=True)
class Calibration:
    """CPU milliseconds one unit of each kind of work takes on this machine."""

    image_ms: float  # decode + augment + normalise one image
    kernel_unit_ms: float  # one small numpy "kernel launch"
    sync_unit_ms: float  # one reduction step over the gradient buffer
    image_size: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Calibration":
        return cls(**{k: data[k] for k in ("image_ms", "kernel_unit_ms", "sync_unit_ms", "image_size")})


@dataclass(frozen=True)
class EmulatorConfig:
    iterations: int | None = 100  # stop after this many iterations (None: only duration/SIGTERM)
    duration_s: float | None = None  # stop after this many seconds of iterations
    gpu_step_ms: float = 60.0  # sleep per iteration: the GPU computing
    kernel_ms: float = 8.0  # CPU per iteration spent dispatching kernels
    kernels_per_iteration: int = 16
    loader_workers: int = 2
    prefetch: int = 2  # batches in flight per loader worker
    sync_every: int = 4  # gradient sync burst every N iterations (0: never)
    sync_ms: float = 10.0  # CPU per sync burst
    duty: float | None = None  # target CPU busy fraction of our cores (None and no preprocess_ms: 0.4)
    preprocess_ms: float | None = None  # explicit CPU per batch for preprocessing (instead of duty)
    image_size: int = 64
    seed: int = 0
    calibration: Calibration | None = None
    ready_file: str | None = None  # touched after the first iteration


@dataclass(frozen=True)
class WorkPlan:
    """How many work units the config means on this machine."""

    images_per_batch: int
    kernel_units: int  # per kernel
    sync_units: int  # per sync burst
    cpus: int
    nominal_iteration_ms: float
    target_cpu_ms_per_iteration: float


@dataclass(frozen=True)
class IterationRecord:
    index: int
    start: float  # time.monotonic(); CLOCK_MONOTONIC is shared by all processes
    end: float
    data_wait_ms: float
    synced: bool

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1000.0


@dataclass
class EmulatorReport:
    config: dict[str, Any]
    calibration: dict[str, Any]
    plan: dict[str, Any]
    iterations: list[IterationRecord]
    wall_s: float
    cpu_s: float  # main process (all threads) + loader workers' busy time, over the iterations
    cpus: list[int]
    duty_measured: float  # cpu_s / (wall_s * len(cpus))
    pid: int
    stopped_by: str
    source: str = "emulator"
    format: str = REPORT_FORMAT
    extra: dict[str, Any] = field(default_factory=dict)

    def iteration_ms(self) -> list[float]:
        return [r.ms for r in self.iterations]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["iteration_ms"] = self.iteration_ms()
        return data

    def write(self, path: str | os.PathLike[str]) -> None:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, path)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EmulatorReport":
        data = dict(data)
        data.pop("iteration_ms", None)
        data["iterations"] = [IterationRecord(**r) for r in data["iterations"]]
        return cls(**data)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> "EmulatorReport":
        return cls.from_dict(json.loads(Path(path).read_text()))


# --- the work itself -------------------------------------------------------

_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def _source_images(size: int, rng: np.random.Generator, count: int = 8) -> list[bytes]:
    """Compressed synthetic photos (gradients + noise) standing in for JPEG files."""
    yy, xx = np.mgrid[0:size, 0:size]
    images = []
    for _ in range(count):
        base = (xx * rng.uniform(0.5, 2) + yy * rng.uniform(0.5, 2)) % 256
        img = np.stack([base, base[::-1], base.T], axis=-1) + rng.integers(0, 24, (size, size, 3))
        images.append(zlib.compress(np.clip(img, 0, 255).astype(np.uint8).tobytes(), 6))
    return images


def _preprocess(blob: bytes, size: int, rng: np.random.Generator, out: np.ndarray) -> None:
    """decode -> augment -> normalise one image into out (3, size, size) float32."""
    img = np.frombuffer(zlib.decompress(blob), dtype=np.uint8).reshape(size, size, 3)
    padded = np.pad(img, ((4, 4), (4, 4), (0, 0)), mode="reflect")
    y, x = rng.integers(0, 9, 2)
    img = padded[y : y + size, x : x + size]
    if rng.random() < 0.5:
        img = img[:, ::-1]
    img = np.clip(img.astype(np.int16) + int(rng.integers(-20, 21)), 0, 255)
    norm = (img.astype(np.float32) / 255.0 - _MEAN) / _STD
    out[...] = norm.transpose(2, 0, 1)


class _Kernels:
    """Small numpy ops, each standing for one CUDA kernel launch's CPU cost."""

    def __init__(self) -> None:
        rng = np.random.default_rng(1)
        self.a = rng.standard_normal((48, 48), dtype=np.float32)
        self.b = rng.standard_normal((48, 48), dtype=np.float32)
        self.c = np.empty((48, 48), dtype=np.float32)

    def run(self, units: int) -> None:
        for _ in range(units):
            np.dot(self.a, self.b, out=self.c)
            np.add(self.c, 1.0, out=self.c)


class _Gradients:
    """A gradient buffer whose reduction stands for one all-reduce step."""

    def __init__(self, floats: int = 1 << 18) -> None:
        rng = np.random.default_rng(2)
        self.mine = rng.standard_normal(floats, dtype=np.float32)
        self.peer = rng.standard_normal(floats, dtype=np.float32)

    def run(self, units: int) -> None:
        for _ in range(units):
            np.add(self.mine, self.peer, out=self.mine)
            np.multiply(self.mine, 0.5, out=self.mine)


def _cost_ms(fn, budget_s: float = 0.15) -> float:
    """Median thread-CPU ms of fn() over a short budget (preemption does not count)."""
    samples = []
    deadline = time.thread_time() + budget_s
    while time.thread_time() < deadline or len(samples) < 5:
        t0 = time.thread_time()
        fn()
        samples.append((time.thread_time() - t0) * 1000.0)
    return float(np.median(samples))


def calibrate(image_size: int = 64) -> Calibration:
    """Measure the CPU cost of one unit of each kind of work on this machine."""
    rng = np.random.default_rng(0)
    blobs = _source_images(image_size, rng, 2)
    out = np.empty((3, image_size, image_size), dtype=np.float32)
    kernels, grads = _Kernels(), _Gradients()
    return Calibration(
        image_ms=_cost_ms(lambda: [_preprocess(b, image_size, rng, out) for b in blobs]) / len(blobs),
        kernel_unit_ms=_cost_ms(lambda: kernels.run(20)) / 20,
        sync_unit_ms=_cost_ms(lambda: grads.run(2)) / 2,
        image_size=image_size,
    )


def plan_work(config: EmulatorConfig, calibration: Calibration, cpus: int) -> WorkPlan:
    """Turn milliseconds and duty into unit counts; refuse settings that cannot be met."""
    sync_share = config.sync_ms / config.sync_every if config.sync_every > 0 else 0.0
    nominal = config.kernel_ms + config.gpu_step_ms + sync_share
    fixed_cpu = config.kernel_ms + sync_share
    if config.preprocess_ms is not None and config.duty is not None:
        raise EmulatorConfigError(
            "both duty and preprocess_ms are set", "give one: --duty sizes the preprocessing for you"
        )
    if config.preprocess_ms is not None:
        preprocess = config.preprocess_ms
    else:
        duty = 0.4 if config.duty is None else config.duty
        if not 0.0 < duty < 1.0:
            raise EmulatorConfigError(f"duty {duty} is outside (0, 1)", "use e.g. --duty 0.4")
        preprocess = duty * nominal * cpus - fixed_cpu
        if preprocess < 0:
            raise EmulatorConfigError(
                f"duty {duty} is below what kernels and sync alone use "
                f"({fixed_cpu:.1f} ms of {nominal:.1f} ms per iteration on {cpus} cpu(s))",
                "raise --duty or lower --kernel-ms/--sync-ms",
            )
    parallel = max(1, min(config.loader_workers, cpus))
    if preprocess / parallel > 0.9 * nominal:
        raise EmulatorConfigError(
            f"preprocessing needs {preprocess:.1f} ms per batch but {parallel} loader worker(s) "
            f"have only ~{nominal:.1f} ms per iteration",
            "lower --duty or raise --loader-workers/--gpu-step-ms",
        )
    return WorkPlan(
        images_per_batch=max(1, round(preprocess / calibration.image_ms)),
        kernel_units=max(1, round(config.kernel_ms / config.kernels_per_iteration / calibration.kernel_unit_ms)),
        sync_units=max(1, round(config.sync_ms / calibration.sync_unit_ms)) if config.sync_every > 0 else 0,
        cpus=cpus,
        nominal_iteration_ms=nominal,
        target_cpu_ms_per_iteration=fixed_cpu + preprocess,
    )


# --- processes and threads -------------------------------------------------


def _loader_worker(worker_id: int, seed: int, image_size: int, images: int, slots: list, tasks, results) -> None:
    """One data-loader worker process: fill the slot it is told to with a batch."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rng = np.random.default_rng(seed * 1000 + worker_id)
    blobs = _source_images(image_size, rng)
    busy = 0.0
    while True:
        task = tasks.get()
        if task is None:
            break
        batch_index, slot = task
        t0 = time.thread_time()
        batch = np.frombuffer(slots[slot], dtype=np.float32).reshape(images, 3, image_size, image_size)
        for i in range(images):
            _preprocess(blobs[(batch_index + i) % len(blobs)], image_size, rng, batch[i])
        busy += time.thread_time() - t0
        results.put((batch_index, slot))
    results.put(("cpu", worker_id, busy))


class _SyncThread(threading.Thread):
    """The communication thread: runs a gradient-sync burst when asked."""

    def __init__(self, units: int) -> None:
        super().__init__(name="grad-sync", daemon=True)
        self.units = units
        self.grads = _Gradients()
        self.request = threading.Event()
        self.done = threading.Event()
        self.stop = False

    def run(self) -> None:
        while True:
            self.request.wait()
            self.request.clear()
            if self.stop:
                return
            self.grads.run(self.units)
            self.done.set()

    def sync(self) -> None:
        self.done.clear()
        self.request.set()
        self.done.wait()


class _StopFlag:
    def __init__(self) -> None:
        self.reason = ""

    def set(self, reason: str) -> None:
        self.reason = self.reason or reason


def run_emulator(config: EmulatorConfig, stop: threading.Event | None = None) -> EmulatorReport:
    """Run the emulator in this process (loader workers are child processes)."""
    if config.iterations is None and config.duration_s is None and stop is None:
        raise EmulatorConfigError("no stop condition", "give --iterations or --duration")
    cpus = sorted(os.sched_getaffinity(0))
    calibration = config.calibration or calibrate(config.image_size)
    if calibration.image_size != config.image_size:
        raise EmulatorConfigError(
            f"calibration was made for image size {calibration.image_size}, config uses {config.image_size}",
            "calibrate again with the same --image-size",
        )
    plan = plan_work(config, calibration, len(cpus))
    ctx = mp.get_context("spawn")
    slot_floats = plan.images_per_batch * 3 * config.image_size * config.image_size
    n_slots = max(1, config.loader_workers) * max(1, config.prefetch)
    slots = [ctx.RawArray("f", slot_floats) for _ in range(n_slots)]
    results = ctx.Queue()
    task_queues = [ctx.Queue() for _ in range(max(1, config.loader_workers))]
    workers = [
        ctx.Process(
            target=_loader_worker,
            args=(i, config.seed, config.image_size, plan.images_per_batch, slots, task_queues[i], results),
            name=f"loader-{i}",
            daemon=True,
        )
        for i in range(len(task_queues))
    ]
    for w in workers:
        w.start()
    sync_thread = _SyncThread(plan.sync_units)
    sync_thread.start()
    kernels = _Kernels()
    flag = _StopFlag()
    records: list[IterationRecord] = []
    arrived: dict[int, int] = {}
    worker_busy: dict[int, float] = {}

    def submit(batch_index: int, slot: int) -> None:
        task_queues[batch_index % len(task_queues)].put((batch_index, slot))

    for i in range(n_slots):
        submit(i, i)

    t_start = time.monotonic()
    cpu_start = time.process_time()
    deadline = t_start + config.duration_s if config.duration_s is not None else None
    index = 0
    try:
        while True:
            if config.iterations is not None and index >= config.iterations:
                flag.set("iterations")
            if deadline is not None and time.monotonic() >= deadline:
                flag.set("duration")
            if stop is not None and stop.is_set():
                flag.set("signal")
            if flag.reason:
                break
            start = time.monotonic()
            while index not in arrived:
                try:
                    item = results.get(timeout=0.5)
                except queue.Empty:
                    if stop is not None and stop.is_set():
                        break
                    dead = [w.name for w in workers if not w.is_alive()]
                    if dead:
                        raise RuntimeError(f"data-loader worker(s) died: {dead}")
                    continue
                arrived[item[0]] = item[1]
            if index not in arrived:
                continue
            got_data = time.monotonic()
            if index == 0:  # measure from the first batch: loader start-up (imports) is not training
                t_start, cpu_start = got_data, time.process_time()
            slot = arrived.pop(index)
            batch = np.frombuffer(slots[slot], dtype=np.float32, count=3 * config.image_size)
            float(batch.sum())  # the host-to-device copy touches the batch
            per_kernel = plan.kernel_units
            for _ in range(config.kernels_per_iteration):
                kernels.run(per_kernel)
            submit(index + n_slots, slot)  # slot consumed: ask for a later batch
            time.sleep(config.gpu_step_ms / 1000.0)  # the GPU computes; this thread waits
            synced = config.sync_every > 0 and (index + 1) % config.sync_every == 0
            if synced:
                sync_thread.sync()
            end = time.monotonic()
            records.append(IterationRecord(index, start, end, (got_data - start) * 1000.0, synced))
            if index == 0 and config.ready_file:
                Path(config.ready_file).write_text(str(os.getpid()))
            index += 1
    finally:
        wall = time.monotonic() - t_start
        main_cpu = time.process_time() - cpu_start
        sync_thread.stop = True
        sync_thread.request.set()
        for q in task_queues:
            q.put(None)
        deadline_join = time.monotonic() + 10.0
        while len(worker_busy) < len(workers) and time.monotonic() < deadline_join:
            try:
                item = results.get(timeout=0.5)
            except queue.Empty:
                if not any(w.is_alive() for w in workers):
                    break
                continue
            if item[0] == "cpu":
                worker_busy[item[1]] = item[2]
        for w in workers:
            w.join(timeout=5.0)
            if w.is_alive():
                w.kill()
                w.join(timeout=5.0)
    cpu_s = main_cpu + sum(worker_busy.values())
    return EmulatorReport(
        config={k: v for k, v in asdict(config).items() if k != "calibration"},
        calibration=calibration.to_dict(),
        plan=asdict(plan),
        iterations=records,
        wall_s=wall,
        cpu_s=cpu_s,
        cpus=cpus,
        duty_measured=cpu_s / (wall * len(cpus)) if wall > 0 else 0.0,
        pid=os.getpid(),
        stopped_by=flag.reason or "error",
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m reamer.workloads.training_emulator",
        description="Emulate the CPU side of GPU training (an emulator: no GPU, no model).",
    )
    p.add_argument("--iterations", type=int, default=None, help="stop after N iterations")
    p.add_argument("--duration", type=float, default=None, help="stop after S seconds")
    p.add_argument("--gpu-step-ms", type=float, default=60.0)
    p.add_argument("--kernel-ms", type=float, default=8.0)
    p.add_argument("--kernels", type=int, default=16, help="kernel launches per iteration")
    p.add_argument("--loader-workers", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--sync-ms", type=float, default=10.0)
    p.add_argument("--duty", type=float, default=None, help="CPU busy fraction of our cores (default 0.4)")
    p.add_argument("--preprocess-ms", type=float, default=None, help="CPU ms per batch instead of --duty")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibration", default=None, help="calibration JSON to reuse (from --calibrate-only)")
    p.add_argument("--calibrate-only", action="store_true", help="write the calibration to --report and exit")
    p.add_argument("--ready-file", default=None, help="written after the first iteration")
    p.add_argument("--report", required=True, help="JSON report path")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.calibrate_only:
            Path(args.report).write_text(json.dumps(calibrate(args.image_size).to_dict()))
            return 0
        calibration = None
        if args.calibration:
            calibration = Calibration.from_dict(json.loads(Path(args.calibration).read_text()))
        iterations = args.iterations
        if iterations is None and args.duration is None:
            iterations = 100
        config = EmulatorConfig(
            iterations=iterations,
            duration_s=args.duration,
            gpu_step_ms=args.gpu_step_ms,
            kernel_ms=args.kernel_ms,
            kernels_per_iteration=args.kernels,
            loader_workers=args.loader_workers,
            prefetch=args.prefetch,
            sync_every=args.sync_every,
            sync_ms=args.sync_ms,
            duty=args.duty,
            preprocess_ms=args.preprocess_ms,
            image_size=args.image_size,
            seed=args.seed,
            calibration=calibration,
            ready_file=args.ready_file,
        )
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        report = run_emulator(config, stop=stop)
    except ReamerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report.write(args.report)
    ms = report.iteration_ms()
    print(
        f"{len(ms)} iterations, median {np.median(ms) if ms else float('nan'):.1f} ms, "
        f"duty {report.duty_measured:.2f} of {len(report.cpus)} cpu(s); report: {args.report}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
