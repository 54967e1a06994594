"""How the job should run its gRPC front door: grpc.aio on the job's uvloop event loop (what reamer does) or
grpc's thread-pool server handing each call to that loop (run_coroutine_threadsafe) and waiting for it;
and, as the floor of the gRPC stack itself (grpcio server and client in Python), a grpc.aio server that
answers every request with one answer made once, never touching the model.

Each mode serves the same model from a server process laid out like a job (front door on one cpu, one
instance worker on another); a tritonclient.grpc client sends requests one at a time. Reported per mode:
p50 latency seen by the client, and the front-door process's CPU time per request (user + system,
all its threads), the cost the front door's core pays. Modes alternate in rounds so the machine's noise
hits both alike.

    .venv/bin/python -m bench.grpc_server_modes                  # tiny model, 3 rounds x 1000 requests
    .venv/bin/python -m bench.grpc_server_modes --requests 300 --rounds 2
    .venv/bin/python -m bench.grpc_server_modes --requests 200 --gap-ms 20   # idle between requests
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.harness import ROOT, bench_command, command_line

MODES = ("aio", "threads", "floor")


def serve(mode: str, model: str, frontdoor_cpu: int, instance_cpu: int) -> None:
    """Run one server; print its port; serve until stdin closes."""
    import grpc
    import uvloop

    from reamer.serve.runtime.batcher import DynamicBatcher
    from reamer.serve.doors.grpc import GrpcFrontDoor, GrpcV2Service, _Abort
    from reamer.serve.doors.grpc_v2 import messages as pb
    from reamer.serve.spec import InstanceSpec
    from reamer.serve.runtime.instances import InstanceWorker

    os.sched_setaffinity(0, [frontdoor_cpu])
    run_dir = tempfile.mkdtemp(prefix="grpc-modes-")
    worker = InstanceWorker(0, InstanceSpec([instance_cpu], 1, 1), model, run_dir=run_dir)
    worker.start()
    batcher = DynamicBatcher(None, name="m")
    service = GrpcV2Service("m", batcher)
    loop = uvloop.new_event_loop()
    started = threading.Event()
    port: list[int] = []

    class Floor(GrpcV2Service):
        """grpc.aio on uvloop answering ModelInfer with an answer made once: the gRPC stack's own cost."""

        answer = None

        async def ModelInfer(self, request, context):
            if self.answer is None:
                self.answer = await GrpcV2Service.ModelInfer(self, request, context)
            return self.answer

    async def main() -> None:
        batcher.add_instance(worker)
        if mode in ("aio", "floor"):
            door = GrpcFrontDoor(Floor("m", batcher) if mode == "floor" else service, "127.0.0.1", 0, 64 << 20)
            port.append(await door.start())
            started.set()
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
            door.request_stop()
            await door.serve()
        else:
            started.set()
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    started.wait(60)
    if mode == "threads":
        def bridge(method):
            def call(request, context):
                try:
                    return asyncio.run_coroutine_threadsafe(method(request, context), loop).result()
                except _Abort as exc:
                    context.abort(exc.code, exc.message)
            return call

        server = grpc.server(ThreadPoolExecutor(max_workers=8))
        handlers = {name: grpc.unary_unary_rpc_method_handler(bridge(getattr(service, name)), req.FromString,
                                                               resp.SerializeToString)
                    for name, (req, resp) in pb.METHODS.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(pb.SERVICE, handlers),))
        port.append(server.add_insecure_port("127.0.0.1:0"))
        server.start()
    while not worker.ready:
        time.sleep(0.05)
    print(port[0], flush=True)
    thread.join()
    worker.stop(grace_s=5)


def measure(port: int, n: int, inputs, gap_ms: float) -> list[float]:
    import numpy as np
    import tritonclient.grpc as tgrpc

    rng = np.random.default_rng(1)

    client = tgrpc.InferenceServerClient(f"127.0.0.1:{port}")
    tensors = []
    for name, arr in inputs.items():
        t = tgrpc.InferInput(name, list(arr.shape), "FP32")
        t.set_data_from_numpy(arr)
        tensors.append(t)
    for _ in range(20):
        client.infer("m", tensors)
    lat = []
    for _ in range(n):
        if gap_ms:
            time.sleep(rng.exponential(gap_ms / 1000.0))
        t0 = time.perf_counter()
        client.infer("m", tensors)
        lat.append((time.perf_counter() - t0) * 1e3)
    client.close()
    return lat


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="mean think time between requests (exponential); 0 = back to back")
    parser.add_argument("--frontdoor-cpu", type=int, default=0)
    parser.add_argument("--instance-cpu", type=int, default=None)
    args = parser.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    instance_cpu = args.instance_cpu if args.instance_cpu is not None else cpus[-1]
    if args.serve:
        serve(args.serve, args.model, args.frontdoor_cpu, instance_cpu)
        return 0

    import numpy as np
    import psutil

    from reamer.serve.models import build_model

    work = Path(tempfile.mkdtemp(prefix="grpc-modes-"))
    info = build_model("tiny", work / "tiny.onnx")
    inputs = {t.name: np.ones([1, *t.shape[1:]], np.float32) for t in info.inputs}
    os.sched_setaffinity(0, [c for c in cpus if c != args.frontdoor_cpu] or cpus)  # the client: not the door's cpu
    results: dict[str, dict[str, list[float]]] = {m: {"p50_ms": [], "cpu_ms_per_request": []} for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            proc = subprocess.Popen([*bench_command("grpc_server_modes", "--serve", mode), "--model", info.path,
                                     "--frontdoor-cpu", str(args.frontdoor_cpu), "--instance-cpu", str(instance_cpu)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
            try:
                port = int(proc.stdout.readline())
                server = psutil.Process(proc.pid)
                before = server.cpu_times()
                lat = measure(port, args.requests, inputs, args.gap_ms)
                after = server.cpu_times()
                cpu = (after.user + after.system - before.user - before.system) * 1e3 / (args.requests + 20)
                results[mode]["p50_ms"].append(statistics.median(lat))
                results[mode]["cpu_ms_per_request"].append(cpu)
            finally:
                proc.stdin.close()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    summary = {m: {k: round(statistics.median(v), 3) for k, v in r.items()} for m, r in results.items()}
    print(json.dumps({"command": command_line("grpc_server_modes", argv or sys.argv[1:]),
                      "rounds": results, "median": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
