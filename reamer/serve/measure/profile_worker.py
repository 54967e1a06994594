"""The measuring child of the profiler (measure/profiler.py starts it: `python -m
reamer.serve.measure.profile_worker --worker CONFIG_JSON`).

It pins itself to its CPUs *before* importing numpy or the runtime, so every runtime thread inherits the
affinity; loads the model with threads = its cores, warms up (discarded), says READY, waits for GO, then runs
closed-loop batches in windows (point mode until stable, fixed mode for whole layouts; see profiler.py).
After READY it reads commands on stdin: `GO` measures the configured batch, says RESULT and exits; `RUN
{"batch": B}` measures batch B on the same loaded model, re-warming first when B is new to it, says RESULT and
waits for the next command; `EXIT` or end of input ends it. Lines on stdout: READY, RESULT or ERROR and a JSON
document.

Top-level imports are light (the standard library, host.sched, and profiler's dataclasses) for the same reason.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any

from reamer.host.errors import ReamerError
from reamer.host.sched import affinity_of, set_affinity
from reamer.serve.measure.profiler import WorkerConfig, WorkerResult, window_is_stable


def _emit(tag: str, payload: dict) -> None:
    sys.stdout.write(f"{tag} {json.dumps(payload)}\n")
    sys.stdout.flush()


def _worker_main(config_json: str) -> int:
    cfg = WorkerConfig(**json.loads(config_json))
    try:
        set_affinity(0, cfg.cpus)  # before numpy/runtime create their thread pools
    except ReamerError as exc:
        _emit("ERROR", {"message": exc.message, "fix": exc.fix})
        return 2

    import numpy as np

    from reamer.serve.backends import open_backend
    from reamer.serve.samples import SampleSpec, plan_samples

    try:
        backend = open_backend(cfg.backend, cfg.model_path, cfg.threads, cfg.streams, cfg.precision,
                               cfg.static_batch)
        plan = plan_samples(backend.inputs, SampleSpec.from_doc(cfg.samples), cfg.model_path)
        feeds = plan.batch(cfg.batch, np.random.default_rng(cfg.seed))
    except ReamerError as exc:
        _emit("ERROR", {"message": exc.message, "fix": exc.fix})
        return 2
    if not _first_run(backend, cfg, plan, feeds):
        return 2
    warm_until = time.perf_counter() + cfg.warmup_s
    while time.perf_counter() < warm_until:
        backend.run(feeds)
    _emit("READY", {"pid": os.getpid(), "cpus": affinity_of(0), "threads": cfg.threads,
                    "precision": backend.precision})
    warm_batch = cfg.batch
    while True:
        command, _, payload = sys.stdin.readline().strip().partition(" ")
        if command == "GO":  # one measurement of the configured batch, then exit (the instances of a layout)
            res = _measure(backend, feeds, cfg, cfg.batch, _rows(plan, feeds))
            backend.close()
            _emit("RESULT", asdict(res))
            return 0
        if command != "RUN":  # "EXIT", end of input (the parent went away) or anything else: done
            backend.close()
            return 0
        asked = json.loads(payload)
        batch = int(asked["batch"])
        if batch != warm_batch:
            feeds = plan.batch(batch, np.random.default_rng(cfg.seed))
            if not _first_run(backend, cfg, plan, feeds):
                return 2
            _rewarm(backend, feeds, cfg.warmup_s)
            warm_batch = batch
        else:
            warm_until = time.perf_counter() + float(asked.get("rewarm_s", 0.0))
            while time.perf_counter() < warm_until:
                backend.run(feeds)
        _emit("RESULT", asdict(_measure(backend, feeds, cfg, batch, _rows(plan, feeds))))


def _rows(plan: Any, feeds: dict) -> int:
    return next((len(feeds[p.info.name]) for p in plan.inputs if p.batched), 0)


def _first_run(backend: Any, cfg: WorkerConfig, plan: Any, feeds: dict) -> bool:
    """Run one batch; False (and an ERROR line naming the input at fault) when the runtime refuses it."""
    from reamer.serve.samples import explain_failure

    try:
        backend.run(feeds)
    except Exception as exc:  # noqa: BLE001 - runtimes raise their own types
        _emit("ERROR", {"message": explain_failure(cfg.model_path, plan, feeds, exc),
                        "fix": "give the traffic's shapes (--shape NAME:DIMS) or sample data (--input-data FILE) "
                               "that the model accepts"})
        return False
    return True


def _rewarm(backend: Any, feeds: dict, warmup_s: float, min_batches: int = 3) -> int:
    """Warm up a loaded model on a new batch shape (the first run of it already done): `warmup_s`, or less
    once two consecutive quarter-warm-up periods (half the warm-up together) ran within 10 % of each
    other's throughput — the runtime has settled on the new shape; never fewer than `min_batches` batches,
    the first run counted. Returns the batches run."""
    period = warmup_s / 4
    ran, rates = 1, []
    began = time.perf_counter()
    while True:
        p_start = now = time.perf_counter()
        n = 0
        while n == 0 or now - p_start < period:
            backend.run(feeds)
            n += 1
            now = time.perf_counter()
        ran += n
        rates.append(n / (now - p_start))
        if ran < min_batches:
            continue
        if now - began >= warmup_s:
            return ran
        if len(rates) >= 2 and abs(rates[-1] - rates[-2]) <= 0.10 * max(rates[-1], rates[-2]):
            return ran


def _measure(backend: Any, feeds: dict, cfg: WorkerConfig, batch: int, fed_batch: int) -> WorkerResult:
    """Closed-loop batches in windows: point mode until window_is_stable or max_windows, fixed mode
    exactly fixed_windows."""
    res = WorkerResult(cfg.cpus, cfg.threads, batch, fed_batch=fed_batch)
    limit = cfg.fixed_windows or cfg.max_windows
    began = time.perf_counter()
    while len(res.window_rps) < limit:
        w_start = now = time.perf_counter()
        n = 0
        while now - w_start < cfg.window_s:
            backend.run(feeds)
            done = time.perf_counter()
            res.latencies_ms.append((done - now) * 1e3)
            n += batch
            now = done
        res.window_rps.append(n / (now - w_start))
        res.samples += n
        if cfg.fixed_windows is None and window_is_stable(res.window_rps, cfg.stability):
            res.stable = True
            break
    res.measured_s = time.perf_counter() - began
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--worker":
        return _worker_main(argv[1])
    sys.stderr.write("usage: python -m reamer.serve.measure.profile_worker --worker CONFIG_JSON (started by reamer itself)\n")
    return 64


if __name__ == "__main__":
    sys.exit(main())
