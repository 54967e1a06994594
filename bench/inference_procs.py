"""Processes the co-location bench starts (each runs as its own OS process).

    python -m bench.inference_procs exec-in [--cpuset P] [--cpu P] [--freezer P] [--cpus LIST]
                                           [--sched other|idle|rr:PRIO] -- CMD...
        join cgroups, set affinity and scheduling policy, then exec CMD (so every
        thread and child CMD starts inherits them — no thread escapes the set-up).
    python -m bench.inference_procs serve --model FILE --name NAME --port PORT [--threads 1]
        one online instance behind a KServe v2 REST front door (reamer.serve.doors.rest's
        request/response codec, ONNX Runtime backend); requests are served one at a time.
    python -m bench.inference_procs offline --model FILE --report FILE [--ready-file FILE]
        one single-thread offline instance at batch 1, inferring back to back until SIGTERM;
        writes the completion times (CLOCK_MONOTONIC, float64 .npy) to --report.
    python -m bench.inference_procs gang --train-freezer P --infer-freezer P [--train-s 0.8 --infer-s 0.2]
        gang scheduling with the cgroup v1 freezer until SIGTERM (then thaws both).
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import signal
import sys
import time
from pathlib import Path


def _exec_in(args: argparse.Namespace) -> int:
    from reamer.host.cgroups import CgroupV1Driver
    from reamer.host.cpulist import parse_cpulist

    driver = CgroupV1Driver()
    pid = os.getpid()
    # cpu first: a real-time task may only enter a cpu cgroup that has an RT budget.
    if args.cpu:
        driver.add_process(args.cpu, pid, controllers=("cpu",))
    if args.cpuset:
        driver.add_process(args.cpuset, pid, controllers=("cpuset",))
    if args.freezer:
        driver.add_process(args.freezer, pid, controllers=("freezer",))
    if args.cpus:
        os.sched_setaffinity(0, parse_cpulist(args.cpus))
    sched = args.sched
    if sched == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    elif sched.startswith("rr:"):
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(int(sched[3:])))
    elif sched != "other":
        print(f"exec-in: unknown --sched {sched!r} (other|idle|rr:PRIO)", file=sys.stderr)
        return 2
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    os.execvp(cmd[0], cmd)
    return 127  # not reached


def _serve(args: argparse.Namespace) -> int:
    import uvicorn
    from fastapi import FastAPI, Request, Response

    from reamer.serve.backends import open_backend
    from reamer.serve.protocol.rest_codec import HEADER_LENGTH, BadRequest, decode_request, encode_response

    backend = open_backend("onnxruntime", args.model, args.threads)
    app = FastAPI()

    @app.get("/v2/health/ready")
    async def ready() -> dict:
        return {"ready": True}

    @app.post(f"/v2/models/{args.name}/infer")
    async def infer(request: Request) -> Response:
        body = await request.body()
        header = request.headers.get(HEADER_LENGTH)
        try:
            decoded = decode_request(body, int(header) if header else None, backend.inputs, backend.outputs)
        except BadRequest as err:
            return Response(json.dumps({"error": str(err)}), status_code=400, media_type="application/json")
        # Run inline: one instance serves one request at a time, in arrival order.
        outputs = backend.run(decoded.inputs)
        content, headers = encode_response(args.name, decoded, outputs, backend.outputs)
        return Response(content, headers=headers)

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


def _offline(args: argparse.Namespace) -> int:
    import numpy as np

    from reamer.serve.backends import open_backend, sample_inputs

    backend = open_backend("onnxruntime", args.model, 1)
    feeds = sample_inputs(backend, 1, np.random.default_rng(0))
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("now", True))
    signal.signal(signal.SIGINT, lambda *_: stop.__setitem__("now", True))
    backend.run(feeds)  # warm-up
    if args.ready_file:
        Path(args.ready_file).write_text(str(os.getpid()))
    done: list[float] = []
    while not stop["now"]:
        backend.run(feeds)
        done.append(time.monotonic())
    tmp = Path(f"{args.report}.tmp.npy")
    np.save(tmp, np.asarray(done, dtype=np.float64))
    os.replace(tmp, args.report)
    return 0


def _gang(args: argparse.Namespace) -> int:
    from reamer.host.cgroups import CgroupV1Driver

    driver = CgroupV1Driver()
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("now", True))
    signal.signal(signal.SIGINT, lambda *_: stop.__setitem__("now", True))
    switches = 0
    try:
        while not stop["now"]:
            # training's turn: inference frozen
            driver.freeze(args.infer_freezer)
            driver.thaw(args.train_freezer)
            _sleep_unless(stop, args.train_s)
            if stop["now"]:
                break
            # inference's turn: training frozen
            driver.freeze(args.train_freezer)
            driver.thaw(args.infer_freezer)
            _sleep_unless(stop, args.infer_s)
            switches += 1
    finally:
        driver.thaw(args.train_freezer)
        driver.thaw(args.infer_freezer)
    print(f"gang: {switches} cycles", file=sys.stderr)
    return 0


def _sleep_unless(stop: dict, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not stop["now"]:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.05))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.inference_procs")
    sub = p.add_subparsers(dest="what", required=True)
    e = sub.add_parser("exec-in")
    e.add_argument("--cpuset")
    e.add_argument("--cpu")
    e.add_argument("--freezer")
    e.add_argument("--cpus")
    e.add_argument("--sched", default="other")
    e.add_argument("cmd", nargs=argparse.REMAINDER)
    s = sub.add_parser("serve")
    s.add_argument("--model", required=True)
    s.add_argument("--name", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--threads", type=int, default=1)
    o = sub.add_parser("offline")
    o.add_argument("--model", required=True)
    o.add_argument("--report", required=True)
    o.add_argument("--ready-file")
    g = sub.add_parser("gang")
    g.add_argument("--train-freezer", required=True)
    g.add_argument("--infer-freezer", required=True)
    g.add_argument("--train-s", type=float, default=0.8)
    g.add_argument("--infer-s", type=float, default=0.2)
    args = p.parse_args(argv)
    return {"exec-in": _exec_in, "serve": _serve, "offline": _offline, "gang": _gang}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
