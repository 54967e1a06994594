"""What serving costs per request in cpu, beside the inference itself: one inference alone in a pinned process,
then an online job with one 1-thread instance per cpu (its front door on all of them) driven open-loop at a
fixed rate with binary tensors by the lean client of bench/online_peers.py: the cpu per request of the job's own
process (the front door), of its instances, and of the client.

    .venv/bin/python -m bench.serving_cost --model mobilenet_v2 --backend onnxruntime --rate 200
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def inference_alone_ms(backend_kind: str, model: str, cpu: int, repeats: int = 200) -> tuple[float, dict]:
    """Cpu ms of one batch-1 inference, 1 thread, pinned to `cpu`; and the sample inputs."""
    from reamer.serve.backends import open_backend, sample_inputs

    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, [cpu])
    try:
        with open_backend(backend_kind, model, 1) as backend:
            inputs = sample_inputs(backend, 1, np.random.default_rng(0))
            for _ in range(20):
                backend.run(inputs)
            began = time.process_time()
            for _ in range(repeats):
                backend.run(inputs)
            return (time.process_time() - began) / repeats * 1e3, inputs
    finally:
        os.sched_setaffinity(0, allowed)


def main() -> int:
    from bench.metrics import process_cpu_seconds
    from bench.online_peers import ReamerJob, lean_step
    from bench.models import model_file

    from reamer.plan.layout import BACKENDS, Layout

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mobilenet_v2")
    p.add_argument("--backend", default="onnxruntime", choices=BACKENDS)
    p.add_argument("--rate", type=float, default=200.0, help="open-loop requests/s")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--model-dir", default="/tmp/reamer-bench-models")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures here")
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    model = str(model_file(args.model, {}, Path(args.model_dir)))
    alone_ms, inputs = inference_alone_ms(args.backend, model, cpus[-1])
    job = ReamerJob(model, Layout.uniform(len(cpus), 1, 1, backend=args.backend), cpus, 1000.0,
                    Path(tempfile.mkdtemp(prefix="reamer-serving-cost-")), inputs)
    try:
        lean_step(job.port, job.request, args.rate * 0.75, 2.0, 1, 5.0)  # warm-up, discarded
        pids = job.pids()
        before = [process_cpu_seconds(pid) for pid in pids]
        step = lean_step(job.port, job.request, args.rate, args.seconds, 0, 5.0)
        used = [process_cpu_seconds(pid) - b for pid, b in zip(pids, before)]
    finally:
        job.close()
    n = max(step.ok, 1)
    figures = {"model": args.model, "backend": args.backend, "cpus": cpus, "rate_rps": args.rate,
               "sent": step.sent, "answered": step.ok, "p99_ms": step.p99_ms, "inference_alone_ms": alone_ms,
               "instances_ms": sum(used[1:]) / n * 1e3, "frontdoor_ms": used[0] / n * 1e3,
               "client_ms": step.cpu_ms}
    serving = figures["instances_ms"] - alone_ms + figures["frontdoor_ms"]
    print(f"{args.model} {args.backend}, {len(cpus)} instances on cpus {cpus}, {args.rate:g} requests/s for "
          f"{args.seconds:g} s: {step.ok} of {step.sent} answered, p99 {step.p99_ms:.1f} ms")
    print(f"cpu ms per request: inference alone {alone_ms:.2f}; in the job: instances {figures['instances_ms']:.2f}, "
          f"front door {figures['frontdoor_ms']:.2f}, client {step.cpu_ms:.2f}; serving beside the inference "
          f"{serving:.2f} ({serving / alone_ms:.0%})")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
