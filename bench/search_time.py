"""Where the quick search's wall time goes on this machine (issue 14: ≤ 2 min per model).

    python -m bench.search_time --models resnet50,bert-base            # `reamer search`'s defaults, backend auto
    python -m bench.search_time --models exported:bert --budget-s 100  # with a time budget

Runs `search_layout(model, "auto", cpus, slo)` as `reamer search --cores N --no-cache` does and times every
worker process the profiler starts: spawn → READY (process start, imports, model load/compile, first
batch, warm-up) and GO → RESULT (the measurement windows). A separate probe per backend times process
start + runtime import + model load + first batch alone, so start-up and warm-up can be told apart.
Per model: wall time, runs per phase (screening, per-backend points, layout verifications, streams
tries, baseline) and seconds per part. Writes OUT/search_time.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import RESULTS_DIR, ROOT, command_line, loadavg, machine_info, write_json
from bench.models import resolve_model

PROBE = r"""
import json, os, sys, time
t0 = time.perf_counter()
os.sched_setaffinity(0, [int(c) for c in sys.argv[3].split(",")])
import numpy as np
from reamer.serve.backends import open_backend
from reamer.serve.samples import SampleSpec, plan_samples
t_import = time.perf_counter()
backend = open_backend(sys.argv[1], sys.argv[2], len(sys.argv[3].split(",")))
t_load = time.perf_counter()
feeds = plan_samples(backend.inputs, SampleSpec.from_doc(None), sys.argv[2]).batch(1, np.random.default_rng(0))
backend.run(feeds)
t_first = time.perf_counter()
backend.run(feeds)
t_second = time.perf_counter()
print(json.dumps({"import_s": t_import - t0, "load_s": t_load - t_import, "first_batch_s": t_first - t_load,
                  "steady_batch_s": t_second - t_first}))
"""


def probe(backend: str, path: str, cpus: list[int]) -> dict[str, float]:
    """Process start to first batch, in parts, for one process of `backend` on `cpus` (batch 1)."""
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PROBE, backend, path, ",".join(map(str, cpus))],
                         capture_output=True, text=True, check=True, cwd=str(ROOT))
    found = json.loads(out.stdout.strip().splitlines()[-1])
    found["process_s"] = time.perf_counter() - started
    return {k: round(v, 3) for k, v in found.items()}


class WorkerClock:
    """Wraps reamer.serve.measure.profiler.ProfileWorker to time every worker: spawn → READY → GO → RESULT (or, on a
    worker kept loaded by a PointSession, RUN → RESULT per point)."""

    def __init__(self) -> None:
        self.workers: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []  # one per measurement (a layout's workers together)

    def install(self) -> None:
        from reamer.serve.measure import profiler

        cls, clock = profiler.ProfileWorker, self
        init, wait_ready, go, result = cls.__init__, cls.wait_ready, cls.go, cls.result
        run_workers = profiler._run_workers

        def timed_run_workers(configs, timeout_s):  # type: ignore[no-untyped-def]
            first = len(clock.workers)
            try:
                return run_workers(configs, timeout_s)
            finally:
                group = clock.workers[first:]
                if group and all("result" in w for w in group):
                    clock.runs.append({"start_load_warm_s": max(w["ready"] for w in group) - group[0]["spawn"],
                                       "windows_s": max(w["result"] for w in group) - group[0]["go"],
                                       "total_s": time.monotonic() - group[0]["spawn"],
                                       "fixed": group[0]["fixed"], "instances": len(group)})

        def timed_init(worker, config):  # type: ignore[no-untyped-def]
            worker._clock = {"spawn": time.monotonic(), "backend": config.backend, "cores": len(config.cpus),
                             "threads": config.threads, "streams": getattr(config, "streams", 1),
                             "batch": config.batch, "fixed": config.fixed_windows is not None}
            clock.workers.append(worker._clock)
            init(worker, config)

        def timed_ready(worker, *a, **k):  # type: ignore[no-untyped-def]
            out = wait_ready(worker, *a, **k)
            worker._clock["ready"] = time.monotonic()
            return out

        def timed_go(worker):  # type: ignore[no-untyped-def]
            worker._clock["go"] = time.monotonic()
            return go(worker)

        def timed_result(worker, *a, **k):  # type: ignore[no-untyped-def]
            res = result(worker, *a, **k)
            worker._clock.update({"result": time.monotonic(), "windows": len(res.window_rps),
                                  "measured_s": res.measured_s, "stable": res.stable,
                                  "batch_ms": (sum(res.latencies_ms) / len(res.latencies_ms)) if res.latencies_ms
                                  else None})
            return res

        cls.__init__, cls.wait_ready, cls.go, cls.result = timed_init, timed_ready, timed_go, timed_result
        profiler._run_workers = timed_run_workers

        # points measured on a worker kept loaded between batches (PointSession): start-up only when the
        # session spawned one for this point; "windows" = RUN -> RESULT (re-warm-up on a new batch included)
        measure, run_batch = profiler.PointSession.measure, cls.run_batch

        def timed_run_batch(worker, batch, *a, **k):  # type: ignore[no-untyped-def]
            worker._clock["go"] = time.monotonic()
            res = run_batch(worker, batch, *a, **k)
            worker._clock.update({"result": time.monotonic(), "batch": batch, "windows": len(res.window_rps),
                                  "measured_s": res.measured_s, "stable": res.stable,
                                  "batch_ms": (sum(res.latencies_ms) / len(res.latencies_ms)) if res.latencies_ms
                                  else None})
            return res

        def timed_measure(session, batch, *a, **k):  # type: ignore[no-untyped-def]
            began, known = time.monotonic(), len(clock.workers)
            point = measure(session, batch, *a, **k)
            w = session._worker._clock
            fresh = len(clock.workers) > known
            clock.runs.append({"start_load_warm_s": w["ready"] - w["spawn"] if fresh else 0.0,
                               "windows_s": w["result"] - w["go"], "total_s": time.monotonic() - began,
                               "fixed": False, "instances": 1, "reused_worker": not fresh})
            return point

        cls.run_batch, profiler.PointSession.measure = timed_run_batch, timed_measure


CLOCK = WorkerClock()


def time_search(name: str, path: str, cpus: list[int], args: argparse.Namespace) -> dict[str, Any]:
    from reamer.search.on_cores import MeasureSettings, search_layout

    clock = CLOCK
    clock.workers.clear()
    clock.runs.clear()
    settings = MeasureSettings(warmup_s=args.warmup, window_s=args.window, max_windows=args.max_windows,
                               verify_windows=args.verify_windows)
    row: dict[str, Any] = {"model": name, "file": os.path.basename(path), "load_before": loadavg()}
    started = time.monotonic()
    extra = {"budget_s": args.budget_s} if args.budget_s is not None else {}
    outcome = search_layout(path, args.backend, cpus, args.slo_ms, batches=args.batches, settings=settings, **extra)
    row["wall_s"] = round(time.monotonic() - started, 1)
    row["load_after"] = loadavg()
    row["complete"] = outcome.complete
    row["pick"] = str(outcome.best.layout) if outcome.best else None
    row["pick_rps"] = outcome.best.rps if outcome.best else None
    row["screens"] = [{"backend": s.backend, "dropped": s.dropped, "throughput": {f"{c}x{b}": r for (c, b), r in
                                                                                 s.throughput.items()}}
                      for s in outcome.screens]
    row["rows"] = [{"kind": r.kind, "layout": r.layout, "backend": r.backend, "rps": round(r.throughput_rps, 3),
                    "p99_ms": round(r.p99_ms, 1), "seconds": round(r.seconds, 2), "cached": r.cached}
                   for r in outcome.rows]
    row["workers"] = clock.workers
    parts = {"start_load_warm_s": 0.0, "windows_s": 0.0, "teardown_s": 0.0}
    for run in clock.runs:
        parts["start_load_warm_s"] += run["start_load_warm_s"]
        parts["windows_s"] += run["windows_s"]
        parts["teardown_s"] += run["total_s"] - run["start_load_warm_s"] - run["windows_s"]
    parts["outside_workers_s"] = row["wall_s"] - sum(run["total_s"] for run in clock.runs)
    row["parts_s"] = {k: round(v, 1) for k, v in parts.items()}
    row["runs"] = clock.runs
    by_kind: dict[str, dict[str, float]] = {}
    for r in outcome.rows:
        key = f"{r.kind} {r.backend}"
        got = by_kind.setdefault(key, {"runs": 0, "seconds": 0.0})
        got["runs"] += 1
        got["seconds"] = round(got["seconds"] + r.seconds, 1)
    row["by_kind"] = by_kind
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet50,mobilenet_v2,bert-base,deepspeech2,exported:bert,exported:resnet")
    p.add_argument("--backend", default="auto")
    p.add_argument("--cpus", default=None, help="cpu list (default: every cpu this process may use)")
    p.add_argument("--batches", default="1,2,4,8,16,32", help="`reamer search`'s default: powers of two to 32")
    p.add_argument("--slo-ms", type=float, default=None)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--window", type=float, default=0.5)
    p.add_argument("--max-windows", type=int, default=10)
    p.add_argument("--verify-windows", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--no-probe", action="store_true", help="skip the start-up probe per backend")
    p.add_argument("--model-dir", default="/tmp/reamer-bench-models")
    p.add_argument("--out", default=str(RESULTS_DIR / "search_time"))
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    from reamer.search.on_cores import resolve_backends

    CLOCK.install()
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else sorted(os.sched_getaffinity(0))
    data: dict[str, Any] = {"command": command_line("search_time", argv),
                            "machine": machine_info(), "cpus": cpus, "load_start": loadavg(), "rows": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in [m for m in args.models.split(",") if m]:
        path = resolve_model(name, Path(args.model_dir))
        probes = {} if args.no_probe else {b: probe(b, path, cpus[:1]) for b in resolve_backends(args.backend)}
        row = time_search(name, path, cpus, args)
        row["probe"] = probes
        data["rows"].append(row)
        write_json(out / "search_time.json", data)
        print(f"== {name}: {row['wall_s']} s, {len(row['rows'])} runs, pick {row['pick']}, complete {row['complete']},"
              f" load {row['load_before']} -> {row['load_after']}", flush=True)
        print(f"   parts {row['parts_s']}; by kind {row['by_kind']}; probe {probes}", flush=True)
        for w in row["workers"]:
            if "result" in w:
                print(f"   {w['backend']:11s} {w['cores']}c t{w['threads']} s{w['streams']} b{w['batch']:<3d} "
                      f"{'layout' if w['fixed'] else 'point '} ready {w['ready'] - w['spawn']:5.1f} s  windows "
                      f"{w['result'] - w['go']:5.1f} s ({w['windows']} × batch {w['batch_ms'] or 0:.0f} ms)",
                      flush=True)
    data["load_end"] = loadavg()
    write_json(out / "search_time.json", data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
