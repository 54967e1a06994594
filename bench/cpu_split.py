"""Where the cpu of a served request goes: reamer's online job (one 1-thread instance per cpu, ONNX Runtime or
OpenVINO) and OpenVINO's THROUGHPUT hint behind uvicorn (bench/online_peers.py's HTTP peer), each driven by the
lean client at the same fixed rate, in rounds (A B C A B C ...: the machine's drift falls on every contender).
`perf record -e cpu-clock` samples the server's processes; each sample's weight goes to the runtime
(ONNX Runtime's or OpenVINO's libraries, OpenVINO's JIT code), to the front thread (reamer's job process' main
thread, or the peer's event-loop thread) or to the rest (the instance processes' own Python, pipes and socket
writes; the peer's other threads): ms of cpu per answered request. Needs `perf` (linux-perf).

    .venv/bin/python -m bench.cpu_split --contenders onnxruntime,openvino,peer --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


RUNTIME = re.compile(r"onnxruntime_pybind|libopenvino|\[JIT\]|libtbb|libdnnl")


def split(perf_data: str, front_tid: int, answered: int) -> dict[str, float]:
    """ms of cpu per answered request: runtime, front, rest (perf's period-weighted samples)."""
    out = subprocess.run(["perf", "report", "-i", perf_data, "--no-children", "--sort", "pid,dso",
                          "-F", "period,pid,dso", "-g", "none", "--stdio"], capture_output=True, text=True,
                         check=True).stdout
    ms = {"runtime": 0.0, "front": 0.0, "rest": 0.0}
    for line in out.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        period, tid_comm, *dso = line.split(None, 2)
        tid = int(tid_comm.split(":")[0])
        key = "runtime" if dso and RUNTIME.search(dso[0]) else ("front" if tid == front_tid else "rest")
        ms[key] += int(period) / 1e6
    return {k: round(v / max(answered, 1), 3) for k, v in ms.items()}


def main() -> int:
    from bench.online_peers import HttpPeerServer, ReamerJob, lean_step, reference_outputs
    from bench.models import model_file
    from bench.serving_cost import inference_alone_ms

    from reamer.plan.layout import Layout

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mobilenet_v2")
    p.add_argument("--contenders", default="onnxruntime,openvino,peer",
                   help="reamer on onnxruntime / openvino, and peer (OpenVINO THROUGHPUT behind uvicorn)")
    p.add_argument("--rate", type=float, default=200.0, help="open-loop requests/s")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model-dir", default="/tmp/reamer-bench-models")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures here")
    args = p.parse_args()
    if shutil.which("perf") is None:
        print("perf is not installed (apt install linux-perf)", file=sys.stderr)
        return 2
    cpus = sorted(os.sched_getaffinity(0))
    model = str(model_file(args.model, {}, Path(args.model_dir)))
    _, inputs = inference_alone_ms("onnxruntime", model, cpus[-1], 5)
    reference = reference_outputs(model, inputs)
    rows = []
    with tempfile.TemporaryDirectory(prefix="reamer-cpu-split-") as work:
        for round_ in range(args.rounds):
            for contender in args.contenders.split(","):
                if contender == "peer":
                    server = HttpPeerServer("ov-throughput-f32", model, cpus, 3.0, inputs, reference)
                    pids = [server.proc.pid]
                else:
                    server = ReamerJob(model, Layout.uniform(len(cpus), 1, 1, backend=contender), cpus, 1000.0,
                                       Path(work) / f"{contender}-{round_}", inputs)
                    pids = server.pids()
                data = str(Path(work) / f"{contender}-{round_}.data")
                try:
                    lean_step(server.port, server.request, args.rate * 0.75, 2.0, 1, 5.0)  # warm-up, discarded
                    perf = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "1000", "-o", data,
                                             "-p", ",".join(map(str, pids))],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(0.5)
                    step = lean_step(server.port, server.request, args.rate, args.seconds, 0, 5.0)
                    perf.send_signal(2)
                    perf.wait()
                finally:
                    server.close()
                figures = split(data, pids[0], step.ok)
                row = {"round": round_, "contender": contender, "answered": step.ok, "sent": step.sent,
                       "p99_ms": round(step.p99_ms, 1), "client_ms": round(step.cpu_ms, 3), **figures,
                       "server_ms": round(sum(figures.values()), 3)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "rate_rps": args.rate, "cpus": cpus,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
