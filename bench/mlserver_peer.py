"""A serving peer (issue 14): MLServer with a plain onnxruntime runtime against reamer's online job, same
model, same cpus, same tritonclient load.

Both servers get the same cpus (default 0-1) and one 1-thread model instance: MLServer 1.7.1 running the
model in its server process (`parallel_workers: 0`: its parallel inference worker dies at start here, "There is
no current event loop in thread 'MainThread'") with a ten-line runtime (an onnxruntime InferenceSession, 1 thread, NumpyCodec in and
out); reamer's job with one instance on the last cpu (max batch `--max-batch`, 1 by default: MLServer batches
nothing unless adaptive batching is configured, so both do the same work per request) and its front door on
all of them. The client is
tritonclient.http on the first cpu: throughput at concurrency 4 (4 threads, one client each, closed loop) and
p50 latency at concurrency 1, JSON tensors both ways (what MLServer decodes) and, for reamer, binary tensors
too. With JSON tensors the client's encoding (tritonclient writes 150,528 floats as text for every ResNet-50
request: 67 ms of cpu) fills its cpu and sets the rate for both servers; so both are also driven with
"replayed JSON": the body tritonclient would send, encoded once by tritonclient and sent again and again over
keep-alive connections, answers parsed by tritonclient (`--no-replay` leaves these out). At concurrency 4 the servers take turns round by round; at concurrency 1 request by request (so that other
tenants of a shared machine weigh on all alike); figures are medians over rounds; ratios are reamer / MLServer.

MLServer goes into a virtualenv of its own (`--venv`, made on first use with `pip install mlserver==1.7.1
onnxruntime==<ours>`): it pins FastAPI/Starlette below the versions reamer runs on, so it cannot share the
project's environment.

    .venv/bin/python -m bench.mlserver_peer --results-md bench/RESULTS.md
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import command_and_machine, RESULTS_DIR, ROOT, command_line, loadavg, machine_info, replace_section, write_json
from bench.models import resolve_model

SECTION = "### A serving peer: MLServer (issue 14)"
FLOATING = "reamer, instance on all cpus,"
REPLAYED = "replayed JSON"
PARENT = "## Against each runtime's own tuning (issue 14)"
RUNTIME = '''
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceResponse


class OrtRuntime(MLModel):
    async def load(self) -> bool:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = 1, 1
        self.session = ort.InferenceSession(self.settings.parameters.uri, opts, providers=["CPUExecutionProvider"])
        return True

    async def predict(self, payload):
        feeds = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        names = [o.name for o in self.session.get_outputs()]
        values = self.session.run(names, feeds)
        return InferenceResponse(model_name=self.name,
                                 outputs=[NumpyCodec.encode_output(n, v) for n, v in zip(names, values)])
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    mlserver = venv / "bin" / "mlserver"
    if mlserver.exists():
        return mlserver
    import onnxruntime

    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "mlserver==1.7.1",
                    f"onnxruntime=={onnxruntime.__version__}"], check=True)
    return mlserver


def wait_ready(port: int, timeout: float, proc: subprocess.Popen) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server not ready in time")


def start_mlserver(mlserver: Path, model: str, cpus: list[int], work: Path) -> tuple[subprocess.Popen, int]:
    folder = work / "mlserver"
    (folder / "model").mkdir(parents=True, exist_ok=True)
    (folder / "runtime.py").write_text(RUNTIME)
    port = free_port()
    (folder / "settings.json").write_text(json.dumps({"http_port": port, "grpc_port": free_port(),
                                                       "metrics_port": free_port(), "debug": False,
                                                       "parallel_workers": 0}))
    (folder / "model" / "model-settings.json").write_text(json.dumps({
        "name": "model", "implementation": "runtime.OrtRuntime", "parameters": {"uri": model}}))
    env = dict(os.environ, PYTHONPATH=str(folder), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(["taskset", "-c", ",".join(map(str, cpus)), str(mlserver), "start", str(folder)],
                            cwd=folder, env=env, stdout=open(work / "mlserver.log", "wb"), stderr=subprocess.STDOUT)
    wait_ready(port, 300, proc)
    return proc, port


def start_reamer(model: str, cpus: list[int], work: Path, instance_cpus: list[int] | None = None,
                 max_batch: int = 1, frontdoor_cpus: list[int] | None = None) -> tuple[subprocess.Popen, int]:
    from reamer.serve.spec import InstanceSpec, JobSpec, JobStatus

    run_dir = work / "reamer-run"
    spec = JobSpec(name="model", kind="online", model=model, backend="onnxruntime", run_dir=str(run_dir), port=0,
                   instances=[InstanceSpec(instance_cpus or [cpus[-1]], 1, max_batch)],
                   frontdoor_cpus=list(frontdoor_cpus or cpus),
                   host="127.0.0.1")
    spec.save(work / "spec.json")
    proc = subprocess.Popen([sys.executable, "-m", "reamer.serve.runtime.job", "--spec", str(work / "spec.json")], cwd=ROOT,
                            stdout=open(work / "reamer.log", "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            st = JobStatus.load(run_dir / "status.json")
            if st.state == "ready" and st.port:
                wait_ready(st.port, 60, proc)
                return proc, st.port
        except (FileNotFoundError, ValueError, OSError):
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"reamer job exited with {proc.returncode}")
        time.sleep(0.1)
    raise RuntimeError("reamer job not ready in time")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _request(inputs: dict[str, np.ndarray], binary: bool):
    import tritonclient.http as triton
    from tritonclient.utils import np_to_triton_dtype

    tensors = []
    for name, arr in inputs.items():
        t = triton.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr, binary_data=binary)
        tensors.append(t)
    return tensors


def _client(port: int, inputs: dict[str, np.ndarray], outputs: list[str], binary: bool):
    import tritonclient.http as triton

    c = triton.InferenceServerClient(f"127.0.0.1:{port}", connection_timeout=300, network_timeout=300)
    wanted = [triton.InferRequestedOutput(o, binary_data=binary) for o in outputs]
    return c, _request(inputs, binary), wanted


def replayed_body(inputs: dict[str, np.ndarray], outputs: list[str]) -> bytes:
    """The JSON body tritonclient.http sends for these inputs (its own generate_request_body), made once."""
    import tritonclient.http as triton

    body, json_size = triton.InferenceServerClient.generate_request_body(
        _request(inputs, False), outputs=[triton.InferRequestedOutput(o, binary_data=False) for o in outputs])
    assert json_size is None, "a JSON-only body"
    return body if isinstance(body, bytes) else body.encode()


def _sender(port: int, inputs: dict[str, np.ndarray], outputs: list[str], tensors: str):
    """(send one request and read its answer, close) for one client of kind `tensors`: tritonclient with JSON or
    binary tensors, or REPLAYED: tritonclient's JSON body encoded once and sent again and again (so the
    client's encoding, 67 ms of cpu per ResNet-50 request, does not set the rate), answers parsed by
    tritonclient."""
    if tensors == REPLAYED:
        import http.client

        import tritonclient.http as triton

        body = replayed_body(inputs, outputs)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)

        def send() -> None:
            conn.request("POST", "/v2/models/model/infer", body, {"Content-Type": "application/json"})
            reply = conn.getresponse()
            answer = reply.read()
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}: {answer[:200]!r}")
            triton.InferenceServerClient.parse_response_body(answer)
        return send, conn.close
    c, request, wanted = _client(port, inputs, outputs, tensors == "binary")
    return (lambda: c.infer("model", request, outputs=wanted)), c.close


def latencies(cases: dict[str, tuple[int, str]], inputs: dict[str, np.ndarray], outputs: list[str],
              requests: int) -> dict[str, float]:
    """Concurrency 1: p50 latency of `requests` requests per case (name -> (port, tensors)), the cases taking
    turns request by request, so that the other tenants of a shared machine weigh on all of them alike."""
    senders = {key: _sender(port, inputs, outputs, tensors) for key, (port, tensors) in cases.items()}
    lat: dict[str, list[float]] = {key: [] for key in cases}
    for send, _ in senders.values():
        send()  # warm
    for i in range(requests):
        keys = list(senders)
        for key in keys[i % len(keys):] + keys[:i % len(keys)]:
            t0 = time.perf_counter()
            senders[key][0]()
            lat[key].append((time.perf_counter() - t0) * 1e3)
    for _, close in senders.values():
        close()
    return {key: statistics.median(v) for key, v in lat.items()}


def load(port: int, inputs: dict[str, np.ndarray], outputs: list[str], tensors: str, concurrency: int,
         seconds: float) -> dict[str, float]:
    """Closed loop: `concurrency` threads, one client each (see `_sender`); throughput over `seconds`."""
    done, stop_at, errors = [0] * concurrency, [0.0], []

    def worker(i: int) -> None:
        send, close = _sender(port, inputs, outputs, tensors)
        send()
        while time.perf_counter() < stop_at[0]:
            try:
                send()
                done[i] += 1
            except Exception as exc:  # noqa: BLE001 - counted, reported
                errors.append(str(exc))
        close()
    stop_at[0] = time.perf_counter() + seconds + 1.0
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    from bench.metrics import cpu_idle_seconds

    started, cpu, idle, since = time.perf_counter(), os.times(), cpu_idle_seconds(), time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    used, served = os.times(), sum(done)
    client_cpu = used.user + used.system - cpu.user - cpu.system  # this process: only the client threads run in it
    return {"rps": served / (time.perf_counter() - started), "errors": len(errors),
            "client_cpu_ms": round(client_cpu / max(served, 1) * 1e3, 1),
            "client_cpu_busy": round(_busy_since(idle, since, os.sched_getaffinity(0)), 3)}


def _busy_since(idle_before: dict[int, float], since: float, cpus: set[int]) -> float:
    """How busy `cpus` were (anything running on them) since `since` (monotonic), from their idle time."""
    from bench.metrics import cpu_idle_seconds

    idle, wall = cpu_idle_seconds(), (time.monotonic() - since) * len(cpus)
    return max(0.0, 1.0 - sum(idle[c] - idle_before[c] for c in cpus) / wall)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet50,exported:bert")
    p.add_argument("--cpus", default="0,1")
    p.add_argument("--client-cpu", type=int, default=0)
    p.add_argument("--floating", action="store_true",
                   help="also a reamer job whose instance may run on all of --cpus, as MLServer's model does (JSON)")
    p.add_argument("--instance-cpus", default=None,
                   help="reamer's instance cpus (default: the last of --cpus; all of them to float like MLServer's)")
    p.add_argument("--max-batch", type=int, default=1,
                   help="reamer's instance's max batch (default 1: MLServer batches nothing unless adaptive batching "
                        "is configured, so both do the same work per request; >1 lets reamer's batcher batch)")
    p.add_argument("--frontdoor-cpus", default=None,
                   help="reamer's front door's cpus (default: all of --cpus)")
    p.add_argument("--no-replay", action="store_true",
                   help="leave out the replayed-JSON cases (tritonclient's JSON body encoded once, sent again and again)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--venv", default="/tmp/reamer-mlserver-venv")
    p.add_argument("--model-dir", default="/tmp/reamer-bench-models")
    p.add_argument("--out", default=str(RESULTS_DIR / "mlserver_peer"))
    p.add_argument("--results-md", default=None)
    p.add_argument("--render", default=None, metavar="JSON")
    args = p.parse_args(argv)
    if args.render:
        data = json.loads(Path(args.render).read_text())
    else:
        data = run(args)
    text = render(data)
    print(text)
    if args.results_md:
        replace_section(args.results_md, SECTION, text, parent=PARENT)
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from reamer.serve.backends import open_backend, sample_inputs

    cpus = [int(c) for c in args.cpus.split(",")]
    instance_cpus = [int(c) for c in args.instance_cpus.split(",")] if args.instance_cpus else [cpus[-1]]
    frontdoor_cpus = [int(c) for c in args.frontdoor_cpus.split(",")] if args.frontdoor_cpus else list(cpus)
    mlserver = ensure_venv(Path(args.venv))
    data: dict[str, Any] = {"command": command_line("mlserver_peer"),
                            "machine": machine_info(), "cpus": cpus, "client_cpu": args.client_cpu,
                            "instance_cpus": instance_cpus, "max_batch": args.max_batch,
                            "frontdoor_cpus": frontdoor_cpus,
                            "rounds": args.rounds, "seconds": args.seconds, "rows": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in [m for m in args.models.split(",") if m]:
        model = resolve_model(name, Path(args.model_dir), families={})  # every family at its default options
        with open_backend("onnxruntime", model, 1) as probe:
            inputs = sample_inputs(probe, 1, np.random.default_rng(0))
            outputs = [o.name for o in probe.outputs]
        row: dict[str, Any] = {"model": name, "load_before": loadavg(), "runs": {}}
        with tempfile.TemporaryDirectory(prefix="reamer-mlserver-") as tmp:
            work = Path(tmp)
            servers = {}
            try:
                servers["mlserver"] = start_mlserver(mlserver, model, cpus, work)
                servers["reamer"] = start_reamer(model, cpus, work, instance_cpus, args.max_batch, frontdoor_cpus)
                plan = [("mlserver", "JSON"), ("reamer", "JSON"), ("reamer", "binary")]
                if not args.no_replay:
                    plan += [("mlserver", REPLAYED), ("reamer", REPLAYED)]
                if args.floating:
                    (work / "floating").mkdir()
                    servers[FLOATING] = start_reamer(model, cpus, work / "floating", cpus, args.max_batch)
                    plan.append((FLOATING, "JSON"))
                os.sched_setaffinity(0, [args.client_cpu])
                cases = {f"{server} {tensors}": (servers[server][1], tensors) for server, tensors in plan}
                for r in range(args.rounds):
                    keys = list(cases)
                    keys = keys[r % len(keys):] + keys[:r % len(keys)]
                    c4 = {key: load(cases[key][0], inputs, outputs, cases[key][1], 4, args.seconds) for key in keys}
                    c1 = latencies({key: cases[key] for key in keys}, inputs, outputs, args.requests)
                    for key in cases:
                        row["runs"].setdefault(key, []).append({"rps_c4": c4[key]["rps"], "errors": c4[key]["errors"],
                                                                "p50_ms_c1": c1[key],
                                                                "client_cpu_ms": c4[key]["client_cpu_ms"],
                                                                "client_cpu_busy": c4[key]["client_cpu_busy"]})
                        print(f"  {name} {key}: {c4[key]['rps']:.2f}/s at c4, p50 {c1[key]:.1f} ms at c1", flush=True)
            except Exception as exc:  # noqa: BLE001 - one model failing must not lose the others' figures
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            finally:
                os.sched_setaffinity(0, sorted(set(cpus) | {args.client_cpu}))
                for proc, _ in servers.values():
                    stop(proc)
        row["median"] = {k: {m: statistics.median(x[m] for x in v)
                             for m in ("rps_c4", "p50_ms_c1", "client_cpu_ms", "client_cpu_busy")}
                         for k, v in row["runs"].items()}
        row["load_after"] = loadavg()
        data["rows"].append(row)
        write_json(out / "mlserver_peer.json", data)
    return data


def render(data: dict) -> str:
    lines = [command_and_machine(data) + f"; "
             f"servers on cpus {data['cpus']} (reamer's instance on {data.get('instance_cpus', data['cpus'][-1:])}, 1 thread, "
             f"max batch {data.get('max_batch', 4)}, its front door on {data.get('frontdoor_cpus', data['cpus'])}), tritonclient.http on cpu {data['client_cpu']} · {data['rounds']} rounds, {data['seconds']} s "
             "per server at concurrency 4 (the order turning each round), then concurrency 1 with the servers taking "
             "turns request by request; medians over rounds · load average per row (the machine was shared with other "
             "work).", "",
             "| model | server, tensors | requests/s at concurrency 4 | p50 ms at concurrency 1 | reamer / MLServer (JSON; "
             "replayed: replayed) throughput | p50 reamer / MLServer | client cpu ms/request · its cpu busy (c4) | load |",
             "|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        if row.get("error") and not row.get("median"):
            lines.append(f"| {row['model']} | {row['error']} | | | | | | |")
            continue
        for key, m in row["median"].items():
            ratio = p50 = ""
            base = row["median"].get(f"mlserver {REPLAYED}" if key.endswith(REPLAYED) else "mlserver JSON")
            if base and key.startswith("reamer"):
                ratio = f"{m['rps_c4'] / base['rps_c4']:.2f}×"
                p50 = f"{m['p50_ms_c1'] / base['p50_ms_c1']:.2f}"
            client = (f"{m['client_cpu_ms']:.1f} · {m['client_cpu_busy']:.0%}" if "client_cpu_ms" in m else "")
            lines.append(f"| {row['model']} | {key} | {m['rps_c4']:.2f} | {m['p50_ms_c1']:.1f} | {ratio} | {p50} | "
                         f"{client} | {row['load_before'][0]}→{row['load_after'][0]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
