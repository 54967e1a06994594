"""One inference's cpu with the batch axis compiled static or dynamic: OpenVINO and ONNX Runtime, 1 thread, batch
1, pinned to the last cpu, every form loaded in one process and measured in turn (rounds of 0.25 s each), so the
machine's drift falls on all of them; medians.

    .venv/bin/python -m bench.ov_static_shapes --model mobilenet_v2
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def main() -> int:
    from bench.models import model_file

    from reamer.plan.statistics import percentile
    from reamer.serve.backends import open_backend, sample_inputs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mobilenet_v2")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--model-dir", default="/tmp/reamer-bench-models")
    args = p.parse_args()
    os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[-1]])
    model = str(model_file(args.model, {}, Path(args.model_dir)))
    forms = {"openvino dynamic batch": open_backend("openvino", model, 1),
             "openvino static batch 1": open_backend("openvino", model, 1, static_batch=1),
             "onnxruntime": open_backend("onnxruntime", model, 1)}
    feeds = sample_inputs(forms["onnxruntime"], 1, np.random.default_rng(0))
    for backend in forms.values():
        for _ in range(10):
            backend.run(feeds)
    ms: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(args.rounds):
        for name, backend in forms.items():
            began, n = time.process_time(), 0
            while time.process_time() - began < 0.25:
                backend.run(feeds)
                n += 1
            ms[name].append((time.process_time() - began) / n * 1e3)
    for name, values in ms.items():
        print(f"{args.model} {name}: {statistics.median(values):.2f} ms of cpu per inference "
              f"(quartiles {percentile(values, 25):.2f}–{percentile(values, 75):.2f}, {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
