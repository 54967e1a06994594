"""How stable is the online search's pick? Runs `search_layout(model, "auto", cpus, slo)` with online_peers'
settings (0.5 s warm-up, 0.25 s windows, 90 s budget, batches up to 8, a fresh profile cache each time) several
times in a row and prints, per run, every layout verification and the ranked candidates.

    flock /work/coord/bench.lock .venv/bin/python -m bench.search_picks --model resnet50 --slo 1000 --runs 2
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    from bench.models import model_file

    from reamer.plan.layout import format_layout
    from reamer.search.on_cores import MeasureSettings, batch_choices, search_layout

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--slo", type=float, default=1000.0, help="the online SLO, ms")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--budget", type=float, default=90.0, help="the search budget, s")
    p.add_argument("--model-dir", default="/tmp/reamer-bench-models")
    args = p.parse_args()
    model = str(model_file(args.model, {}, Path(args.model_dir)))
    cpus = sorted(os.sched_getaffinity(0))
    for run in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(prefix="reamer-search-picks-") as cache:
            started = time.monotonic()
            out = search_layout(model, "auto", cpus, args.slo, cache_dir=cache, batches=batch_choices(8),
                                budget_s=args.budget, settings=MeasureSettings(warmup_s=0.5, window_s=0.25),
                                strict_cache=False, cache_source="search_picks")
        pick = (f"{format_layout(out.best.layout)} {out.best.rps:.1f}/s p99 {out.best.p99_ms:.0f} ms"
                if out.best else "none")
        print(f"run {run} ({time.strftime('%H:%M:%S', time.gmtime())} UTC): {time.monotonic() - started:.1f} s, "
              f"complete {out.complete}, pick {pick}", flush=True)
        for r in out.rows:
            if r.kind in ("layout", "final"):
                print(f"  {'verified' if r.kind == 'layout' else 'final':8} {r.layout:30} {r.throughput_rps:7.2f}/s"
                      f"  batch p99 {r.p99_ms:6.1f} ms")
        for c in out.candidates[:8]:
            sustains = f"  sustains {c.sustained_rps:6.2f}/s" if c.sustained_rps is not None else ""
            print(f"  candidate {format_layout(c.layout):29} {c.rps:7.2f}/s  batch p99 {c.p99_ms:6.1f} ms"
                  f"  ({'measured' if c.measured_rps is not None else 'predicted'}){sustains}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
