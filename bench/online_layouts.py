"""Which layout holds an open-loop rate best? Serves each given layout as a real online job (all loaded at
once, each idle while another is driven), then drives them in turn at each rate, the order rotating, with
online_peers' lean client and pass rule, and prints every step. With --shed-factors, each layout is served
once per factor: the job sheds a request when its estimated completion exceeds factor × SLO (1: reamer's
rule; a large factor: never).

    flock /work/coord/bench.lock .venv/bin/python -m bench.online_layouts --model resnet50 --slo 1000 \\
        --layouts 2x1:b4@onnxruntime,1x2:b8@onnxruntime,2x1:b8@openvino,1x2:b8@openvino --rates 30,34,38,30,34,38
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from bench.harness import bench_command, rotated


def job_main(factor: float, argv: list[str]) -> int:
    """The online job, its shedding estimate divided by `factor` (so it sheds above factor × SLO)."""
    from reamer.serve.runtime import batcher
    from reamer.serve.runtime.job import main

    estimate = batcher.DynamicBatcher.estimated_completion_s

    def scaled(self: batcher.DynamicBatcher) -> float | None:
        found = estimate(self)
        return None if found is None else found / factor

    batcher.DynamicBatcher.estimated_completion_s = scaled  # type: ignore[method-assign]
    return main(argv)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--job-shed-factor":
        return job_main(float(sys.argv[2]), sys.argv[3:])
    from bench.models import resolve_model
    from bench.online_peers import ReamerJob, _feeds

    from reamer.plan.layout import parse_layout

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--slo", type=float, default=1000.0, help="the online SLO, ms")
    p.add_argument("--layouts", required=True, help="comma-separated layouts, e.g. 2x1:b4@onnxruntime,1x2:b8@openvino")
    p.add_argument("--shed-factors", default="1", help="comma-separated; each layout is served once per factor")
    p.add_argument("--rates", required=True, help="comma-separated rates (requests/s), driven in this order")
    p.add_argument("--seconds", type=float, default=12.0, help="seconds of arrivals per step")
    p.add_argument("--model-dir", default="/tmp/reamer-bench-models")
    args = p.parse_args()
    model = resolve_model(args.model, Path(args.model_dir))
    cpus = sorted(os.sched_getaffinity(0))
    inputs = _feeds(model)
    servers = [(layout, factor) for layout in args.layouts.split(",") for factor in args.shed_factors.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    jobs = {}
    with tempfile.TemporaryDirectory(prefix="reamer-online-layouts-") as work:
        try:
            for i, (layout, factor) in enumerate(servers):
                jobs[(layout, factor)] = ReamerJob(
                    model, parse_layout(layout), cpus, args.slo, Path(work) / str(i), inputs,
                    command=bench_command("online_layouts", "--job-shed-factor", factor))
                jobs[(layout, factor)].step(10.0, 3.0, 1, 10.0)  # warm-up, discarded
            for i, rate in enumerate(rates):
                for layout, factor in rotated(servers, i):
                    s = jobs[(layout, factor)].step(rate, args.seconds, i, max(5.0, 5 * args.slo / 1e3))
                    judged = s.p99_judged_ms()
                    print(f"{rate:6.1f}/s  {layout:26} shed factor {factor:5}  ok {s.ok}/{s.sent}  shed "
                          f"{s.sent - s.ok - s.errors:3}  p99 {s.p99_ms:6.0f} ms  judged "
                          f"{judged if judged < 1e9 else float('inf'):6.0f} ms  p50 early/late "
                          f"{s.early_p50_ms:.0f}/{s.late_p50_ms:.0f} ms  {'meets' if s.meets(args.slo) else 'fails'}",
                          flush=True)
        finally:
            for job in jobs.values():
                job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
