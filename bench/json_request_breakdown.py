"""Where a JSON ResNet-50 request's time goes in reamer's job at concurrency 4, set up as bench/mlserver_peer.py
sets it up (instance on cpu 1, front door on cpus 0-1, the client on cpu 0 encoding JSON per request as
tritonclient does): the job's Server-Timing (queue wait, backend compute, total in the job) per request, the
client's cpu per request, the front door's (the job's own process) cpu per request, and the instance's busy fraction (sum of compute / wall time; with max batch > 1 a
batch's compute is counted once per request in it, so read it at max batch 1).

    .venv/bin/python -m bench.json_request_breakdown [--max-batch 1] [--seconds 10]
    .venv/bin/python -m bench.json_request_breakdown --decode   # the front door's decode of one such body alone
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np


def server_timing(header: str) -> dict[str, float]:
    """{"queue": ms, "compute": ms, "total": ms} from the job's Server-Timing header."""
    parts = (item.strip().split(";dur=") for item in header.split(","))
    return {name: float(ms) for name, ms in parts}


def drive(port: int, body_of, seconds: float, concurrency: int = 4) -> list[tuple[float, dict[str, float]]]:
    """Closed loop, `concurrency` threads, each encoding its JSON body per request: (latency ms, timing)."""
    records: list[tuple[float, dict[str, float]]] = []
    stop_at = time.monotonic() + seconds

    def client() -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            while time.monotonic() < stop_at:
                body = json.dumps(body_of())
                began = time.monotonic()
                reply = c.post("/v2/models/model/infer", content=body, headers={"content-type": "application/json"})
                reply.json()
                records.append(((time.monotonic() - began) * 1e3, server_timing(reply.headers["server-timing"])))

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def decode_cost(body: bytes, inputs: list, outputs: list, repeats: int = 21) -> dict[str, float]:
    """Median cpu ms of the front door's decode_request on `body`, and of orjson.loads alone (its parse)."""
    import orjson

    from reamer.serve.protocol.rest_codec import decode_request

    def cpu_ms(fn) -> float:
        spent = []
        for _ in range(repeats):
            began = time.process_time()
            fn()
            spent.append(time.process_time() - began)
        return round(statistics.median(spent) * 1e3, 2)

    return {"decode_request": cpu_ms(lambda: decode_request(body, None, inputs, outputs, {})),
            "orjson.loads": cpu_ms(lambda: orjson.loads(body))}


def main() -> int:
    from bench.metrics import process_cpu_seconds
    from bench.mlserver_peer import start_reamer, stop
    from bench.models import model_file

    from reamer.serve.backends import open_backend, sample_inputs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-batch", type=int, default=1)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--decode", action="store_true", help="only time the front door's decode of one request body")
    args = p.parse_args()
    model = str(model_file("resnet50", {}, Path("/tmp/reamer-bench-models")))
    with open_backend("onnxruntime", model, 1) as backend:
        inputs = sample_inputs(backend, 1, np.random.default_rng(0))
        outputs = [o.name for o in backend.outputs]
        signature = (backend.inputs, backend.outputs)
    name, arr = next(iter(inputs.items()))
    data = arr.reshape(-1).tolist()

    def body_of() -> dict:
        return {"inputs": [{"name": name, "shape": list(arr.shape), "datatype": "FP32", "data": data}],
                "outputs": [{"name": o, "parameters": {"binary_data": False}} for o in outputs]}

    if args.decode:
        body = json.dumps(body_of()).encode()
        print(f"{len(body) / 1e6:.2f} MB body, cpu ms (medians): {decode_cost(body, *signature)}")
        return 0
    proc, port = start_reamer(model, [0, 1], Path(tempfile.mkdtemp()), [1], args.max_batch)
    try:
        os.sched_setaffinity(0, [0])
        drive(port, body_of, 3.0)  # warm-up, discarded
        cpu, door_cpu, began = os.times(), process_cpu_seconds(proc.pid), time.monotonic()
        records = drive(port, body_of, args.seconds)
        wall, used, door_used = time.monotonic() - began, os.times(), process_cpu_seconds(proc.pid)
    finally:
        stop(proc)
    n = len(records)
    client_cpu_ms = (used.user + used.system - cpu.user - cpu.system) / n * 1e3
    medians = {k: round(statistics.median(t[k] for _, t in records), 1) for k in records[0][1]}
    print(f"max batch {args.max_batch}: {n / wall:.2f} requests/s, client cpu {client_cpu_ms:.1f} ms/request, "
          f"client p50 {statistics.median(lat for lat, _ in records):.1f} ms")
    print(f"in the job (medians, ms): {medians}; the job's own process (front door): "
          f"{(door_used - door_cpu) / n * 1e3:.1f} ms of cpu per request")
    print(f"instance busy fraction: {sum(t['compute'] for _, t in records) / 1e3 / wall:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
