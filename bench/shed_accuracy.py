"""How right is an online job's admission estimate? One reamer online job run with shedding turned off: each
request's estimated completion (what the batcher would have judged it by) is logged beside the time it actually
took, while the lean client sends fixed open-loop rates (12 s each). Prints, per rate: the error (actual − estimate)
quantiles, how many requests the job would have refused (estimate over the SLO) and how many of those finished in
time anyway, and how many finished late.

    .venv/bin/python -m bench.shed_accuracy --model resnet50 --layout 2x1:b1@onnxruntime --slo 200 --rates 22,24,26

The job runs in a wrapper process (`--job-wrapper`, used by this script itself) that replaces the batcher's
estimate with a logging one that never sheds; nothing of the agent or the job is changed on disk.
"""
from __future__ import annotations

import argparse
import contextvars
import json
import os
import runpy
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import bench_command


def job_wrapper(log_path: str, job_args: list[str]) -> None:
    """Run reamer.serve.runtime.job with each request's estimate and actual time appended to `log_path`, no shedding."""
    from reamer.serve.runtime import batcher

    estimate: contextvars.ContextVar = contextvars.ContextVar("estimate", default=None)
    real_estimate, real_infer = batcher.DynamicBatcher.estimated_completion_s, batcher.DynamicBatcher.infer

    def logged_estimate(self):  # type: ignore[no-untyped-def]
        estimate.set(real_estimate(self))
        return None  # the job admits every request

    async def timed_infer(self, inputs, *args, **kwargs):  # type: ignore[no-untyped-def]
        estimate.set(None)
        began = time.monotonic()
        out = await real_infer(self, inputs, *args, **kwargs)
        with open(log_path, "a") as log:
            log.write(json.dumps([estimate.get(), time.monotonic() - began]) + "\n")
        return out

    batcher.DynamicBatcher.estimated_completion_s = logged_estimate  # type: ignore[method-assign]
    batcher.DynamicBatcher.infer = timed_infer  # type: ignore[method-assign]
    sys.argv = ["reamer.serve.runtime.job", *job_args]
    runpy.run_module("reamer.serve.runtime.job", run_name="__main__")


def quantile(values: list[float], q: float) -> float:
    from reamer.plan.statistics import percentile

    return percentile(values, 100 * q)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--job-wrapper":
        job_wrapper(sys.argv[2], sys.argv[3:])
        return 0
    from bench.online_peers import ReamerJob, lean_step
    from bench.models import model_file
    from bench.serving_cost import inference_alone_ms

    from reamer.plan.layout import parse_layout

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--layout", default="2x1:b1@onnxruntime")
    p.add_argument("--slo", type=float, default=200.0, help="the job's SLO, ms")
    p.add_argument("--rates", default="22,24,26", help="open-loop requests/s, comma-separated")
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--model-dir", default="/tmp/reamer-bench-models")
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    model = str(model_file(args.model, {}, Path(args.model_dir)))
    _, inputs = inference_alone_ms("onnxruntime", model, cpus[-1], 2)
    rates = [float(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory(prefix="reamer-shed-accuracy-") as tmp:
        log = Path(tmp) / "estimates.jsonl"
        log.touch()
        job = ReamerJob(model, parse_layout(args.layout), cpus, args.slo, Path(tmp) / "job", inputs,
                        command=bench_command("shed_accuracy", "--job-wrapper", str(log)))
        try:
            lean_step(job.port, job.request, rates[0] * 0.7, 3.0, 1, 30.0)  # warm-up, discarded
            for rate in rates:
                seen = len(log.read_text().splitlines())
                step = lean_step(job.port, job.request, rate, args.seconds, 0, 30.0)
                rows = [json.loads(line) for line in log.read_text().splitlines()[seen:]]
                judged = [(est, took) for est, took in rows if est is not None]  # no instance was idle
                errors = sorted((took - est) * 1e3 for est, took in judged)
                refused = [(est, took) for est, took in judged if est * 1e3 > args.slo]
                print(f"{args.model} {args.layout} SLO {args.slo:g} ms, {rate:g}/s: answered {step.ok}/{step.sent}, "
                      f"p99 {step.p99_ms:.0f} ms; estimated {len(judged)} of {len(rows)} (the rest found an idle "
                      f"instance); actual − estimate p10 {quantile(errors, 0.1):.0f}, p50 {quantile(errors, 0.5):.0f}, "
                      f"p90 {quantile(errors, 0.9):.0f} ms; would refuse {len(refused)}, of which "
                      f"{sum(1 for _, took in refused if took * 1e3 <= args.slo)} finished in time; late "
                      f"{sum(1 for _, took in rows if took * 1e3 > args.slo)}", flush=True)
        finally:
            job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
