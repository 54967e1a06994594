"""Serving overhead of reamer's runtime (issue 3): offline vs a bare loop, online front door vs a direct call,
and OpenVINO's own THROUGHPUT hint vs reamer's best layout — all measured in the same run.

Offline: a reamer offline job (`python -m reamer.serve.runtime.job`, OfflineRunner + pinned workers) over a directory of
.npy batches, against a *bare loop*: one pinned process per instance calling `backend.run` on the same batches,
same cpus and threads. Throughput = completions per second between the first and the last completion.

Online: a reamer online job (front door on cpu 0, instance on cpu 1) serving requests from a real HTTP client
(tritonclient, binary tensor extension both ways) one at a time with random (exponential) think times, so
nothing queues, against the same inference called the same way directly in a process pinned like the instance. Overhead = p50(front door) - p50(direct).

    .venv/bin/python -m bench.serving_overhead                       # resnet50 + bert-base, 3 trials
    .venv/bin/python -m bench.serving_overhead --quick --out /tmp/so # tiny model, smoke run
    # the REST front door on the acceptance suite's exported BERT (transformers + torch.onnx), binary and JSON tensors:
    .venv/bin/python -m bench.serving_overhead --models exported:bert --online-only --encodings binary,json --trials 3
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench.harness import RESULTS_DIR, ROOT, command_line, machine_info, replace_section, write_json
from bench.models import EXPORTED, model_file

from reamer.plan.layout import Layout, parse_layout
from reamer.serve.spec import InstanceSpec, JobSpec, JobStatus

HEADING = "## Serving overhead (issue 3)"
MODEL_OPTIONS = {"resnet50": {}, "bert-base": {"layers": 12, "seq_len": 128}, "tiny": {}, "mobilenetv2": {}}
def exported_model(family: str, seq: int) -> tuple[str, dict[str, np.ndarray]]:
    """(path, one request's inputs with valid token ids at `seq`) of an exported model."""
    from tests.acceptance.exported_models import SPECS, ensure_models

    name = family[len(EXPORTED):]
    if name not in SPECS:
        raise SystemExit(f"no exported model {name!r}; choose from {', '.join(SPECS)}")
    return str(ensure_models() / f"{name}.onnx"), SPECS[name].sample(1, seq=seq, seed=1)


@dataclass
class Settings:
    models: list[str]
    trials: int
    offline_samples: dict[str, int]
    online_requests: dict[str, int]
    offline_layouts: dict[str, list[str]]
    backends: list[str]
    ov_compare: bool
    frontdoor_cpu: int
    instance_cpu: int
    client_cpu: int
    offline: bool = True
    online: bool = True
    encodings: tuple[str, ...] = ("binary",)  # online REST tensors: "binary" always, "json" beside it on request
    seq: int = 128  # sequence length of the requests to an exported sequence model


@dataclass
class Trials:
    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")


# ------------------------------------------------------------------ helpers run in child processes

_BARE = r"""
import json, os, sys, time
import numpy as np
cpus, threads, kind, model, files, out = sys.argv[1:7]
os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
from reamer.serve.backends import open_backend, sample_inputs
b = open_backend(kind, model, int(threads))
b.run(sample_inputs(b, 1, np.random.default_rng(0)))
batches = [dict(np.load(f)) for f in (files.split(",") if files else [])]  # preloaded: a pure loop
b.run(batches[0])
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.readline()  # go
stamps = []
for data in batches:
    b.run(data)
    stamps.append(time.time())
json.dump(stamps, open(out, "w"))
"""

_DIRECT = r"""
import json, os, sys, time
import numpy as np
cpus, threads, kind, model, n, gap, out, dims = sys.argv[1:9]
os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
from reamer.serve.backends import open_backend, sample_inputs
b = open_backend(kind, model, int(threads))
x = dict(np.load(sys.argv[9])) if len(sys.argv) > 9 else sample_inputs(b, 1, np.random.default_rng(1), dims=json.loads(dims))
for _ in range(2):
    b.run(x)
rng = np.random.default_rng(2)
lat = []
for _ in range(int(n)):
    time.sleep(rng.exponential(float(gap)))
    t0 = time.perf_counter(); b.run(x); lat.append((time.perf_counter() - t0) * 1e3)
json.dump(lat, open(out, "w"))
"""

# the direct servers' start: pinned like the instance, the model open and warm, `x` one sample
_DIRECT_PRELUDE = r"""
import os, socket, struct, sys, time
import numpy as np
cpus, threads, kind, model = sys.argv[1:5]
os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
from reamer.serve.backends import open_backend, sample_inputs
b = open_backend(kind, model, int(threads))
x = dict(np.load(sys.argv[5])) if len(sys.argv) > 5 else sample_inputs(b, 1, np.random.default_rng(1))
b.run(x); b.run(x)
"""

_DIRECT_SERVER = _DIRECT_PRELUDE + r"""
print("ready", flush=True)
for line in sys.stdin:  # one inference per line; answers its time inside backend.run
    t0 = time.perf_counter(); b.run(x); print((time.perf_counter() - t0) * 1e3, flush=True)
"""

_DIRECT_TCP = _DIRECT_PRELUDE + r"""
specs = [(k, a.dtype, a.shape, a.nbytes) for k, a in x.items()]
size = sum(n for *_, n in specs)
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(size)
view = memoryview(buf)
while True:  # the request is the input tensors' raw bytes; the answer: compute ms, length, output bytes
    got = 0
    while got < size:
        k = conn.recv_into(view[got:], size - got)
        if not k:
            sys.exit(0)
        got += k
    inputs, off = {}, 0
    for name, dtype, shape, n in specs:
        inputs[name] = np.frombuffer(buf, dtype, count=n // dtype.itemsize, offset=off).reshape(shape)
        off += n
    t0 = time.perf_counter(); out = b.run(inputs); took = (time.perf_counter() - t0) * 1e3
    raw = b"".join(np.ascontiguousarray(a).tobytes() for a in out.values())
    conn.sendall(struct.pack("<dI", took, len(raw)) + raw)
"""

_OV_THROUGHPUT = r"""
import json, os, sys, time
import numpy as np
cpus, model, n, out = sys.argv[1:5]
os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
import openvino as ov, openvino.properties as props, openvino.properties.hint as hints
core = ov.Core()
m = core.read_model(model)
m.reshape({p.get_any_name(): ov.PartialShape([1] + [d for d in list(p.get_partial_shape())[1:]]) for p in m.inputs})
c = core.compile_model(m, "CPU", {hints.performance_mode(): hints.PerformanceMode.THROUGHPUT,
                                  props.inference_num_threads(): len(cpus.split(",")),
                                  hints.inference_precision(): ov.Type.f32})
nreq = c.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")
streams = c.get_property("NUM_STREAMS")
rng = np.random.default_rng(0)
feeds = []
for p in c.inputs:
    shape = [d.get_length() for d in p.get_partial_shape()]
    dt = p.get_element_type().to_dtype()
    feeds.append(rng.standard_normal(shape).astype(dt) if dt.kind == "f" else np.ones(shape, dt))
q = ov.AsyncInferQueue(c, nreq)
stamps = []
q.set_callback(lambda req, _: stamps.append(time.time()))
for _ in range(nreq):
    q.start_async(feeds)
q.wait_all(); stamps.clear()
for _ in range(int(n)):
    q.start_async(feeds)
q.wait_all()
json.dump({"stamps": stamps, "nreq": nreq, "streams": streams}, open(out, "w"))
"""


def _py(code: str, *args: str, stdin=None, stdout=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, stdin=stdin, stdout=stdout,
                            text=True)


def _rate(stamps: list[float]) -> float:
    """Completions per second between the first and the last completion."""
    stamps = sorted(stamps)
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return float("nan")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _inputs_for(model_path: str, batch: int, seed: int) -> dict[str, np.ndarray]:
    from reamer.serve.backends import open_backend, sample_inputs

    with open_backend("onnxruntime", model_path, 1) as b:
        return sample_inputs(b, batch, np.random.default_rng(seed))


def _write_batches(model_path: str, directory: Path, samples: int, batch: int) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    base = _inputs_for(model_path, batch, 0)
    for i in range(max(1, samples // batch)):
        f = directory / f"in-{i:05d}.npz"
        np.savez(f, **base)
        files.append(str(f))
    return files


def _layout_instances(layout: Layout, cpus: list[int]) -> list[InstanceSpec]:
    out, at = [], 0
    for shape in layout.instances:
        out.append(InstanceSpec(cpus[at:at + shape.cores], shape.threads, shape.batch))
        at += shape.cores
    return out


def _wait_job(proc: subprocess.Popen, run_dir: Path, pred, timeout: float) -> JobStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            st = JobStatus.load(run_dir / "status.json")
        except (FileNotFoundError, json.JSONDecodeError, OSError):
            st = None
        if st is not None and pred(st):
            return st
        if proc.poll() is not None and not (st is not None and pred(st)):
            raise RuntimeError(f"job exited with {proc.returncode}: {st.message if st else 'no status'}")
        time.sleep(0.05)
    raise RuntimeError("job did not reach the expected state in time")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------ offline

def offline_bare(model: str, backend: str, layout: Layout, cpus: list[int], files: list[str], work: Path) -> float:
    instances = _layout_instances(layout, cpus)
    shares = [files[i::len(instances)] for i in range(len(instances))]
    procs, outs = [], []
    for i, (inst, share) in enumerate(zip(instances, shares)):
        # the bare loop runs each instance's batches as stored: re-split files into max_batch chunks like reamer
        out = work / f"bare-{i}.json"
        outs.append(out)
        procs.append(_py(_BARE, ",".join(map(str, inst.cpus)), inst.threads, backend, model, ",".join(share), out,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE))
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("bare loop failed to start")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    rates = []
    for p, out in zip(procs, outs):
        if p.wait(1800) != 0:
            raise RuntimeError("bare loop failed")
        rates.append(_rate(json.loads(out.read_text())))
    # sum of each instance's own rate: a static split must not lose to reamer's shared queue only because
    # another engineer's load slowed one cpu and that instance finished last
    return float(sum(r * l.batch for r, l in zip(rates, layout.instances)))


def offline_reamer(model: str, backend: str, layout: Layout, cpus: list[int], in_dir: Path, work: Path,
                   job_cpus: list[int]) -> float:
    out_dir = work / "results"
    run_dir = work / "run"
    spec = JobSpec(name="offline-bench", kind="offline", model=model, backend=backend, run_dir=str(run_dir),
                   instances=_layout_instances(layout, cpus), frontdoor_cpus=job_cpus, input_dir=str(in_dir),
                   output_dir=str(out_dir))
    spec.save(work / "spec.json")
    proc = subprocess.Popen([sys.executable, "-m", "reamer.serve.runtime.job", "--spec", str(work / "spec.json")], cwd=ROOT)
    try:
        if proc.wait(1800) != 0:
            raise RuntimeError(f"offline job failed: {(run_dir / 'status.json').read_text()}")
    finally:
        _stop(proc)
    # the first results come after the workers warmed up, so startup does not count (same as the bare loop)
    return _rate([f.stat().st_mtime_ns / 1e9 for f in out_dir.iterdir() if f.suffix == ".npz"]) * layout.instances[0].batch


def ov_throughput_hint(model: str, cpus: list[int], samples: int, work: Path) -> dict:
    out = work / "ov.json"
    p = _py(_OV_THROUGHPUT, ",".join(map(str, cpus)), model, samples, out)
    if p.wait(1800) != 0:
        raise RuntimeError("OpenVINO THROUGHPUT run failed")
    data = json.loads(out.read_text())
    return {"rate": _rate(data["stamps"]), "nreq": data["nreq"], "streams": data["streams"]}


# ------------------------------------------------------------------ online

def online_direct(model: str, backend: str, cpu: int, n: int, gap_s: float, work: Path,
                  inputs_file: Path | None = None) -> list[float]:
    out = work / "direct.json"
    p = _py(_DIRECT, cpu, 1, backend, model, n, gap_s, out, "{}", *([inputs_file] if inputs_file else []))
    if p.wait(1800) != 0:
        raise RuntimeError("direct run failed")
    return json.loads(out.read_text())


class _PlainClient:
    """The least a client can do: one keep-alive socket, the request's bytes encoded once, the answer
    read by its Content-Length. What it measures is the server's time plus the loopback transfer."""

    def __init__(self, port: int, path: str, body: bytes, headers: dict[str, str]) -> None:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.request = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}Content-Length: {len(body)}\r\n\r\n"
                        ).encode() + body
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def post(self) -> tuple[int, dict[str, str]]:
        """Send the request; (status, headers) of the answer, after its whole body arrived."""
        self.sock.sendall(self.request)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise RuntimeError("front door closed the connection")
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        need = int(headers.get("content-length", "0")) - len(rest)
        while need > 0:
            chunk = self.sock.recv(max(need, 1 << 16))
            if not chunk:
                raise RuntimeError("front door closed the connection")
            need -= len(chunk)
        return int(lines[0].split()[1]), headers

    def close(self) -> None:
        self.sock.close()


class _TensorClient:
    """Client of the direct TCP server: sends the input tensors' raw bytes, reads the compute time and the
    output bytes. The least any network server in front of the model must move."""

    def __init__(self, port: int, inputs: dict[str, np.ndarray]) -> None:
        self.request = b"".join(np.ascontiguousarray(a).tobytes() for a in inputs.values())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _exactly(self, n: int) -> bytes:
        parts = []
        while n > 0:
            chunk = self.sock.recv(n)
            if not chunk:
                raise RuntimeError("direct TCP server closed the connection")
            parts.append(chunk)
            n -= len(chunk)
        return b"".join(parts)

    def call(self) -> float:
        """One inference; the server's compute time (ms)."""
        self.sock.sendall(self.request)
        took, size = struct.unpack("<dI", self._exactly(12))
        self._exactly(size)
        return took

    def close(self) -> None:
        self.sock.close()


class _GrpcClient:
    """The gRPC counterpart of _PlainClient: one channel, the ModelInferRequest encoded once (raw tensors),
    the answer's bytes left unparsed; the job's time from its `server-timing` trailing metadata."""

    def __init__(self, port: int, name: str, inputs: dict[str, np.ndarray]) -> None:
        import grpc

        from reamer.serve.doors.grpc_v2 import messages as pb
        from reamer.serve.protocol.tensors import numpy_to_v2

        req = pb.ModelInferRequest(model_name=name)
        for k, a in inputs.items():
            req.inputs.add(name=k, datatype=numpy_to_v2(a.dtype), shape=list(a.shape))
            req.raw_input_contents.append(np.ascontiguousarray(a).tobytes())
        self.request = req.SerializeToString()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.call = self.channel.unary_unary(f"/{pb.SERVICE}/ModelInfer")  # bytes in, bytes out

    def infer(self) -> dict[str, float]:
        """One request; the job's Server-Timing parts (ms)."""
        _, call = self.call.with_call(self.request, timeout=600)
        return _server_timing(dict(call.trailing_metadata()).get("server-timing"))

    def close(self) -> None:
        self.channel.close()


def _raw_request(name: str, inputs: dict[str, np.ndarray], output_names: list[str]) -> tuple[bytes, dict[str, str]]:
    """A v2 infer request with binary tensors both ways, encoded once."""
    from reamer.serve.protocol.tensors import numpy_to_v2

    head = json.dumps({
        "inputs": [{"name": k, "shape": list(a.shape), "datatype": numpy_to_v2(a.dtype),
                    "parameters": {"binary_data_size": a.nbytes}} for k, a in inputs.items()],
        "outputs": [{"name": o, "parameters": {"binary_data": True}} for o in output_names]}).encode()
    body = head + b"".join(np.ascontiguousarray(a).tobytes() for a in inputs.values())
    return body, {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}


def _json_request(inputs: dict[str, np.ndarray], output_names: list[str]) -> tuple[bytes, dict[str, str]]:
    """A v2 infer request with JSON tensors both ways (what curl users and the KServe client send), encoded once."""
    from reamer.serve.protocol.tensors import numpy_to_v2

    body = json.dumps({
        "inputs": [{"name": k, "shape": list(a.shape), "datatype": numpy_to_v2(a.dtype), "data": a.ravel().tolist()}
                   for k, a in inputs.items()],
        "outputs": [{"name": o, "parameters": {"binary_data": False}} for o in output_names]}).encode()
    return body, {"Content-Type": "application/json"}


def _server_timing(header: str | None) -> dict[str, float]:
    out = {}
    for part in (header or "").split(","):
        key, _, dur = part.strip().partition(";dur=")
        if dur:
            out[key] = float(dur)
    return out


def online_paired(model: str, backend: str, name: str, instance: InstanceSpec, frontdoor_cpu: int, client_cpu: int,
                  n: int, gap_s: float, work: Path, inputs: dict[str, np.ndarray],
                  encodings: tuple[str, ...] = ("binary",)) -> dict[str, list[float]]:
    """Latency through the front door and of a direct call, interleaved request by request.

    Three ways take turns (order rotating), one request at a time after a random think time, so load
    from other users of the machine hits all alike and nothing queues: the front door with a plain
    HTTP client (one socket, the request's bytes encoded once), the front door with tritonclient (the standard
    client, which encodes every request), and a direct call: a process pinned like the instance (same
    cpus, threads) that waits on a pipe, as the instance waits on its own.
    """
    try:
        import tritonclient.http as triton
    except ImportError:  # the test extra is not installed: no tritonclient column
        triton = None

    run_dir = work / "run"
    spec = JobSpec(name=name, kind="online", model=model, backend=backend, run_dir=str(run_dir), port=0,
                   instances=[instance], frontdoor_cpus=[frontdoor_cpu])
    spec.save(work / "spec.json")
    proc = subprocess.Popen([sys.executable, "-m", "reamer.serve.runtime.job", "--spec", str(work / "spec.json")], cwd=ROOT)
    cpus = ",".join(map(str, instance.cpus))
    inputs_file = work / "inputs.npz"  # the direct processes run on the very tensors the clients send
    np.savez(inputs_file, **inputs)
    direct = _py(_DIRECT_SERVER, cpus, instance.threads, backend, model, inputs_file, stdin=subprocess.PIPE,
                 stdout=subprocess.PIPE)
    direct_tcp = _py(_DIRECT_TCP, cpus, instance.threads, backend, model, inputs_file, stdout=subprocess.PIPE)
    tcp = None
    try:
        if direct.stdout.readline().strip() != "ready":
            raise RuntimeError("direct process failed to start")
        tcp = _TensorClient(int(direct_tcp.stdout.readline()), inputs)
        st = _wait_job(proc, run_dir, lambda s: s.state == "ready" and s.port, timeout=600)
        os.sched_setaffinity(0, [client_cpu])  # never the instance's cpu
        names = _output_names(st.port, name)
        client, tensors, outputs = None, [], []
        if triton is not None:
            client = triton.InferenceServerClient(f"127.0.0.1:{st.port}", connection_timeout=600, network_timeout=600)
            for key, arr in inputs.items():
                t = triton.InferInput(key, list(arr.shape), {np.float32: "FP32", np.int64: "INT64"}[arr.dtype.type])
                t.set_data_from_numpy(arr, binary_data=True)
                tensors.append(t)
            outputs = [triton.InferRequestedOutput(o, binary_data=True) for o in names]
        raw_body, raw_headers = _raw_request(name, inputs, names)
        plain = _PlainClient(st.port, f"/v2/models/{name}/infer", raw_body, raw_headers)
        # JSON tensors both ways (--encodings json): the plain client and tritonclient with binary_data=False
        plain_json, json_tensors, json_outputs = None, [], []
        if "json" in encodings:
            plain_json = _PlainClient(st.port, f"/v2/models/{name}/infer", *_json_request(inputs, names))
            if triton is not None:
                from tritonclient.utils import np_to_triton_dtype

                for key, arr in inputs.items():
                    t = triton.InferInput(key, list(arr.shape), np_to_triton_dtype(arr.dtype))
                    t.set_data_from_numpy(arr, binary_data=False)
                    json_tensors.append(t)
                json_outputs = [triton.InferRequestedOutput(o, binary_data=False) for o in names]
        # the gRPC front door of the same job: a plain gRPC client and tritonclient.grpc
        rpc = _GrpcClient(st.grpc_port, name, inputs)
        triton_grpc, grpc_tensors = None, []
        if triton is not None:
            import tritonclient.grpc as tgrpc

            triton_grpc = tgrpc.InferenceServerClient(f"127.0.0.1:{st.grpc_port}")
            for key, arr in inputs.items():
                t = tgrpc.InferInput(key, list(arr.shape), {np.float32: "FP32", np.int64: "INT64"}[arr.dtype.type])
                t.set_data_from_numpy(arr)
                grpc_tensors.append(t)
        # per request: (latency, latency minus the model's own run time) in ms; in_job: the job's own time
        # besides compute, from its Server-Timing header
        lat: dict[str, list[tuple[float, float]]] = {"http": [], "tritonclient": [], "direct": [], "direct_tcp": [],
                                                     "grpc": [], "tritonclient_grpc": []}
        in_job: list[float] = []
        in_job_grpc: list[float] = []
        in_job_json: list[float] = []

        def via_door(post, in_job_sink: list[float], what: str):
            def way() -> tuple[float, float]:
                t0 = time.perf_counter()
                status, headers = post()
                took = (time.perf_counter() - t0) * 1e3
                if status != 200:
                    raise RuntimeError(f"front door answered {status} to {what}")
                timing = _server_timing(headers.get("server-timing"))
                in_job_sink.append(timing["total"] - timing["compute"])
                return took, took - timing["compute"]
            return way

        def via_triton_client(triton, *args, **kwargs):
            def way() -> tuple[float, float]:  # tritonclient does not show the response headers
                if triton is None:
                    return float("nan"), float("nan")
                t0 = time.perf_counter()
                triton.infer(*args, **kwargs)
                return (time.perf_counter() - t0) * 1e3, float("nan")
            return way

        via_http = via_door(plain.post, in_job, "a binary request")
        via_triton = via_triton_client(client, name, tensors, outputs=outputs)

        def via_direct() -> tuple[float, float]:
            t0 = time.perf_counter()
            direct.stdin.write("go\n")
            direct.stdin.flush()
            compute = float(direct.stdout.readline())
            took = (time.perf_counter() - t0) * 1e3
            return took, took - compute

        def via_direct_tcp() -> tuple[float, float]:
            t0 = time.perf_counter()
            compute = tcp.call()
            took = (time.perf_counter() - t0) * 1e3
            return took, took - compute

        def via_grpc() -> tuple[float, float]:
            t0 = time.perf_counter()
            timing = rpc.infer()
            took = (time.perf_counter() - t0) * 1e3
            in_job_grpc.append(timing["total"] - timing["compute"])
            return took, took - timing["compute"]

        via_triton_grpc = via_triton_client(triton_grpc, name, grpc_tensors)

        ways = {"http": via_http, "tritonclient": via_triton, "direct": via_direct, "direct_tcp": via_direct_tcp,
                "grpc": via_grpc, "tritonclient_grpc": via_triton_grpc}
        if plain_json is not None:
            ways |= {"http_json": via_door(plain_json.post, in_job_json, "a JSON request"),
                     "tritonclient_json": via_triton_client(client, name, json_tensors, outputs=json_outputs)}
            lat |= {"http_json": [], "tritonclient_json": []}
        for _ in range(3):
            for way in ways.values():
                way()
        in_job.clear()
        in_job_grpc.clear()
        in_job_json.clear()
        rng = np.random.default_rng(2)
        order = list(ways)
        for i in range(n):
            for key in order[i % len(order):] + order[:i % len(order)]:
                time.sleep(rng.exponential(gap_s))
                lat[key].append(ways[key]())
        if client is not None:
            client.close()
        plain.close()
        if plain_json is not None:
            plain_json.close()
        rpc.close()
        if triton_grpc is not None:
            triton_grpc.close()
        return {**lat, "in_job": in_job, "in_job_grpc": in_job_grpc, "in_job_json": in_job_json}
    finally:
        os.sched_setaffinity(0, _ALL_CPUS)
        if direct.poll() is None:
            direct.stdin.close()
            try:
                direct.wait(30)
            except subprocess.TimeoutExpired:
                direct.kill()
        if tcp is not None:
            tcp.close()
        try:
            direct_tcp.wait(30)
        except subprocess.TimeoutExpired:
            direct_tcp.kill()
        _stop(proc)


def _output_names(port: int, name: str) -> list[str]:
    meta = httpx.get(f"http://127.0.0.1:{port}/v2/models/{name}", timeout=60).json()
    return [o["name"] for o in meta["outputs"]]


_ALL_CPUS = sorted(os.sched_getaffinity(0))


# ------------------------------------------------------------------ driver

def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        la = os.getloadavg()
        return f"load average: {la[0]:.2f}, {la[1]:.2f}, {la[2]:.2f}"


def run(settings: Settings, out: Path, command: str = "") -> dict:
    out.mkdir(parents=True, exist_ok=True)
    # built models are hundreds of MB: cache them outside the repository, never next to the results
    models_dir = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "reamer" / "bench-models"
    results: dict = {"machine": machine_info(), "uptime_before": _uptime(), "settings": asdict(settings),
                     "command": command,
                     "offline": {}, "online": {}, "ov_compare": {}}
    fd_cpu, inst_cpu = settings.frontdoor_cpu, settings.instance_cpu
    for family in settings.models:
        exported_inputs = None
        if family.startswith(EXPORTED):
            model, exported_inputs = exported_model(family, settings.seq)
        else:
            model = str(model_file(family, MODEL_OPTIONS.get(family, {}), models_dir))
        with tempfile.TemporaryDirectory(prefix="reamer-so-") as tmp:
            work = Path(tmp)
            # --- offline, per backend and layout
            for backend in (settings.backends if settings.offline else []):
                for lay in settings.offline_layouts[family]:
                    layout = parse_layout(lay)
                    batch = layout.instances[0].batch
                    files = _write_batches(model, work / "in" / lay, settings.offline_samples[family], batch)
                    bare, ream = Trials(), Trials()
                    job_cpus, instance_cpus = _offline_placement(layout, _ALL_CPUS)
                    for t in range(settings.trials):  # interleaved, so load drifts hit both alike
                        bare.values.append(offline_bare(model, backend, layout, instance_cpus, files, work))
                        wd = work / f"job-{backend}-{lay}-{t}"
                        wd.mkdir()
                        ream.values.append(offline_reamer(model, backend, layout, instance_cpus, work / "in" / lay,
                                                          wd, job_cpus))
                    ratios = [r / b for r, b in zip(ream.values, bare.values)]
                    key = f"{family}/{backend}/{lay}"
                    results["offline"][key] = {
                        "bare_rps": bare.values, "reamer_rps": ream.values, "bare_median": bare.median,
                        "reamer_median": ream.median, "ratio_median": statistics.median(ratios), "ratios": ratios,
                        "samples": len(files) * batch, "loadavg": os.getloadavg(),
                        "job_cpus": job_cpus, "instance_cpus": instance_cpus[:layout.total_cores]}
                    print(f"offline {key}: bare {bare.median:.2f}/s reamer {ream.median:.2f}/s "
                          f"ratio {statistics.median(ratios):.3f}", flush=True)
            # --- OpenVINO's THROUGHPUT hint on all cpus vs reamer's best layout
            if settings.offline and settings.ov_compare and "openvino" in settings.backends:
                hint = Trials()
                info = {}
                for _ in range(settings.trials):
                    info = ov_throughput_hint(model, _ALL_CPUS, settings.offline_samples[family], work)
                    hint.values.append(info["rate"])
                best = {}
                for backend in settings.backends:
                    cands = {k: v["reamer_median"] for k, v in results["offline"].items()
                             if k.startswith(f"{family}/{backend}/")}
                    if cands:
                        k = max(cands, key=cands.get)
                        best[backend] = {"layout": k.split("/")[-1], "rps": cands[k]}
                results["ov_compare"][family] = {"ov_hint_rps": hint.values, "ov_hint_median": hint.median,
                                                 "nreq": info.get("nreq"), "streams": info.get("streams"),
                                                 "reamer_best": best}
                print(f"ov THROUGHPUT {family}: {hint.median:.2f}/s (streams {info.get('streams')}); reamer best {best}",
                      flush=True)
            # --- online: front door vs direct, same instance (1 core, 1 thread)
            if not settings.online:
                continue
            n = settings.online_requests[family]
            inputs = exported_inputs if exported_inputs is not None else _inputs_for(model, 1, 1)
            np.savez(work / "probe-inputs.npz", **inputs)
            backend = settings.backends[0]
            trials: list[dict[str, float]] = []
            # random think times (mean: one inference time, at least 20 ms) between single requests
            probe = online_direct(model, backend, inst_cpu, 3, 0.0, work, work / "probe-inputs.npz")
            gap = max(0.02, statistics.median(probe) / 1000.0)
            for t in range(settings.trials):
                wd = work / f"online-{t}"
                wd.mkdir()
                lat = online_paired(model, backend, re.sub(r"[^A-Za-z0-9_]", "_", family), InstanceSpec([inst_cpu], 1, 4),
                                    fd_cpu, settings.client_cpu, n, gap, wd, inputs, tuple(settings.encodings))

                def p50(key: str, part: int) -> float:
                    return statistics.median(x[part] for x in lat[key])
                trials.append({
                    "direct_p50_ms": p50("direct", 0), "http_p50_ms": p50("http", 0),
                    "tritonclient_p50_ms": p50("tritonclient", 0),
                    "direct_noncompute_p50_ms": p50("direct", 1), "http_noncompute_p50_ms": p50("http", 1),
                    "direct_tcp_p50_ms": p50("direct_tcp", 0), "direct_tcp_noncompute_p50_ms": p50("direct_tcp", 1),
                    "overhead_ms": p50("http", 1) - p50("direct_tcp", 1),
                    "overhead_vs_pipe_ms": p50("http", 1) - p50("direct", 1),
                    "in_job_p50_ms": statistics.median(lat["in_job"]),
                    "tritonclient_minus_direct_ms": p50("tritonclient", 0) - p50("direct", 0),
                    # the gRPC front door of the same job, measured the same way
                    "grpc_p50_ms": p50("grpc", 0), "grpc_noncompute_p50_ms": p50("grpc", 1),
                    "grpc_overhead_ms": p50("grpc", 1) - p50("direct_tcp", 1),
                    "grpc_overhead_vs_pipe_ms": p50("grpc", 1) - p50("direct", 1),
                    "grpc_in_job_p50_ms": statistics.median(lat["in_job_grpc"]),
                    "tritonclient_grpc_p50_ms": p50("tritonclient_grpc", 0)})
                if "http_json" in lat:  # the same front door with JSON tensors both ways
                    trials[-1].update({
                        "json_p50_ms": p50("http_json", 0), "json_noncompute_p50_ms": p50("http_json", 1),
                        "json_overhead_ms": p50("http_json", 1) - p50("direct_tcp", 1),
                        "json_in_job_p50_ms": statistics.median(lat["in_job_json"]),
                        "tritonclient_json_p50_ms": p50("tritonclient_json", 0)})
            summary = {k: statistics.median(tr[k] for tr in trials) for k in trials[0]}
            results["online"][family] = {"trials": trials, "median": summary, "overheads": [tr["overhead_ms"] for tr in trials],
                                         "grpc_overheads": [tr["grpc_overhead_ms"] for tr in trials],
                                         "json_overheads": [tr["json_overhead_ms"] for tr in trials if "json_overhead_ms" in tr],
                                         "inputs": {k: [str(a.dtype), list(a.shape)] for k, a in inputs.items()},
                                         "gap_s": gap, "requests": n, "backend": backend, "loadavg": os.getloadavg()}
            print(f"online {family}: overhead {summary['overhead_ms']:.2f} ms (vs pipe {summary['overhead_vs_pipe_ms']:.2f}; "
                  f"front door {summary['http_noncompute_p50_ms']:.2f} ms besides compute, direct TCP "
                  f"{summary['direct_tcp_noncompute_p50_ms']:.2f}, direct pipe {summary['direct_noncompute_p50_ms']:.2f} ms; in the job "
                  f"{summary['in_job_p50_ms']:.2f} ms); p50 direct {summary['direct_p50_ms']:.2f}, front door "
                  f"{summary['http_p50_ms']:.2f}, tritonclient {summary['tritonclient_p50_ms']:.2f} ms; gRPC overhead "
                  f"{summary['grpc_overhead_ms']:.2f} ms (in the job {summary['grpc_in_job_p50_ms']:.2f} ms, p50 "
                  f"{summary['grpc_p50_ms']:.2f}, tritonclient.grpc {summary['tritonclient_grpc_p50_ms']:.2f} ms)", flush=True)
    results["uptime_after"] = _uptime()
    write_json(out / "serving_overhead.json", results, indent=2)
    return results


def markdown(results: dict, command: str) -> str:
    m = results["machine"]
    lines = [f"Machine: {m['cpu_model']}, {m['cpus']} cpus, shared with other engineers' test runs.",
             (f"Load (`uptime`) per run, before → after: {'; '.join(results['loads'])}." if results.get("loads") else
              f"Load before: `{results['uptime_before']}`; after: `{results['uptime_after']}`."),
             f"Command: `{command}`. Figures are medians of {results['settings']['trials']} trials; ratios and "
             "differences pair the trials of one run. Models from `reamer.serve.models.build_model` with random "
             "weights; bert-base is the full model (12 layers, seq 128, ≈ 0.3–0.5 s per sample on one core here), "
             "so it runs with few samples at a low rate.", ""]
    if results["offline"]:
        lines += ["Offline throughput: reamer offline job (OfflineRunner, .npz in/out) vs a bare loop of pinned "
                  "processes calling `backend.run` on the same batches, preloaded in memory, same cpus/threads "
                  "(target ≥ 0.95). The job process (reading and writing the files) runs on a housekeeping cpu of its "
                  "own, as the agent places it, where the layout leaves one (*runner* column: `own`); else it shares "
                  "the instances' cpus (`shared`).", "",
                  "| model/backend/layout | runner | bare (samples/s) | reamer (samples/s) | ratio (median) | "
                  "ratio per trial | met | load (1 min) |",
                  "|---|---|---|---|---|---|---|---|"]
        for k, v in results["offline"].items():
            per_trial = ", ".join(f"{r:.2f}" for r in v["ratios"])
            # (runs before the job cpus were recorded always shared the instances' cpus)
            runner = "shared" if "job_cpus" not in v or set(v["job_cpus"]) & set(v["instance_cpus"]) else "own"
            lines.append(f"| {k} | {runner} | {v['bare_median']:.2f} | {v['reamer_median']:.2f} | {v['ratio_median']:.3f} | "
                         f"{per_trial} | {'yes' if v['ratio_median'] >= 0.95 else 'no'} | {v['loadavg'][0]:.1f} |")
        lines += ["", "Both sides run the same number of samples per trial, interleaved trial by trial; the bare "
                  "side's rate is the sum of its instances' own rates, reamer's is its results' completions per second "
                  "(first to last). Per-trial ratios still spread by several percent on this shared VM.", ""]
    if results["online"]:
        st = results["settings"]
        lines += [f"Online front-door overhead: one instance (1 core, 1 thread, max_batch 4) on cpu {st['instance_cpu']}, "
                  f"the job's front door on cpu {st['frontdoor_cpu']}, the clients on cpu {st['client_cpu']}. Four ways "
                  "take turns request by request, one request at a time after exponential think times, so nothing "
                  "queues and load drift hits all alike: (a) the front door with a plain client (one keep-alive socket, "
                  "request bytes encoded once, binary tensors both ways); (b) the front door with tritonclient; (c) a "
                  "direct TCP server: one process pinned like the instance that receives the input tensors' raw bytes "
                  "over a socket from the same client cpu, runs `backend.run` on them and sends the output bytes back, "
                  "the least any network server in front of the model must do; (d) a direct call triggered over a pipe "
                  "(no tensor bytes move). **Overhead** = p50 of (latency − the model's own run time) through (a), minus "
                  "the same for (c): the run time comes from the job's `Server-Timing` header and from the direct "
                  "process itself, so the model's own run-to-run spread (several ms for ResNet-50) cancels out of each "
                  "request. *vs pipe* is the same against (d), which also charges the front door with moving the "
                  "request's bytes over TCP. In the job = p50 of `Server-Timing` total − compute. Target ≤ 1 ms. "
                  "Rows marked gRPC: the same job's gRPC front door, with a plain gRPC client (one channel, the "
                  "request encoded once, raw tensors) as (a), tritonclient.grpc as (b), and the `server-timing` "
                  "trailing metadata as the header; both front doors take turns in the same run.", "",
                  "| model | backend | overhead (ms) | per trial | vs pipe (ms) | front door / direct TCP / direct pipe, "
                  "besides compute (ms) | in the job (ms) | p50 direct TCP / front door / tritonclient (ms) | met | "
                  "load (1 min) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for k, v in results["online"].items():
            md = v["median"]
            per_trial = ", ".join(f"{x:.2f}" for x in v["overheads"])
            lines.append(f"| {k} | {v['backend']} | {md['overhead_ms']:.2f} | {per_trial} | "
                         f"{md['overhead_vs_pipe_ms']:.2f} | {md['http_noncompute_p50_ms']:.2f} / "
                         f"{md['direct_tcp_noncompute_p50_ms']:.2f} / {md['direct_noncompute_p50_ms']:.2f} | "
                         f"{md['in_job_p50_ms']:.2f} | {md['direct_tcp_p50_ms']:.1f} / {md['http_p50_ms']:.1f} / "
                         f"{md['tritonclient_p50_ms']:.1f} | {'yes' if md['overhead_ms'] <= 1.0 else 'no'} | "
                         f"{v['loadavg'][0]:.1f} |")
            if "grpc_overhead_ms" in md:  # the same job's gRPC front door (client column: tritonclient.grpc)
                per_trial = ", ".join(f"{x:.2f}" for x in v["grpc_overheads"])
                lines.append(f"| {k}, gRPC | {v['backend']} | {md['grpc_overhead_ms']:.2f} | {per_trial} | "
                             f"{md['grpc_overhead_vs_pipe_ms']:.2f} | {md['grpc_noncompute_p50_ms']:.2f} / "
                             f"{md['direct_tcp_noncompute_p50_ms']:.2f} / {md['direct_noncompute_p50_ms']:.2f} | "
                             f"{md['grpc_in_job_p50_ms']:.2f} | {md['direct_tcp_p50_ms']:.1f} / {md['grpc_p50_ms']:.1f} / "
                             f"{md['tritonclient_grpc_p50_ms']:.1f} | {'yes' if md['grpc_overhead_ms'] <= 1.0 else 'no'} | "
                             f"{v['loadavg'][0]:.1f} |")
        lines.append("")
        by_encoding = {k: v for k, v in results["online"].items() if "json_overhead_ms" in v["median"]}
        if by_encoding:
            lines += ["REST front door by tensor encoding: the same job and the same request through (a) with binary "
                      "tensors both ways and with JSON tensors both ways (`binary_data: false`, what curl users and "
                      "the KServe client send), each against the same direct TCP server (c). `exported:NAME` models "
                      "come from the acceptance suite's builder (`tests/acceptance/exported_models.py`: bert is "
                      "transformers' BertModel, 2 layers, hidden 64, exported by torch.onnx), sent one sample of "
                      "real token ids.", "",
                      "| model | backend | inputs | binary overhead (ms) | JSON overhead (ms) | JSON per trial | "
                      "in the job binary / JSON (ms) | p50 direct TCP / binary / JSON / tritonclient binary / "
                      "tritonclient JSON (ms) | load (1 min) |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for k, v in by_encoding.items():
                md = v["median"]
                shapes = ", ".join(f"{n} {d[0]} {d[1]}" for n, d in v.get("inputs", {}).items())
                lines.append(f"| {k} | {v['backend']} | {shapes} | {md['overhead_ms']:.2f} | {md['json_overhead_ms']:.2f} | "
                             f"{', '.join(f'{x:.2f}' for x in v['json_overheads'])} | {md['in_job_p50_ms']:.2f} / "
                             f"{md['json_in_job_p50_ms']:.2f} | {md['direct_tcp_p50_ms']:.1f} / {md['http_p50_ms']:.1f} / "
                             f"{md['json_p50_ms']:.1f} / {md['tritonclient_p50_ms']:.1f} / "
                             f"{md['tritonclient_json_p50_ms']:.1f} | {v['loadavg'][0]:.1f} |")
            lines.append("")
    if results["ov_compare"]:
        lines += ["OpenVINO's own THROUGHPUT hint (one process on all cpus, async infer requests, batch 1) vs "
                  "reamer's best measured offline layout per backend:", "",
                  "| model | OpenVINO THROUGHPUT (samples/s) | streams / requests | reamer best OpenVINO | "
                  "reamer best ONNX Runtime |", "|---|---|---|---|---|"]
        for k, v in results["ov_compare"].items():
            b = v["reamer_best"]

            def cell(kind: str) -> str:
                return f"{b[kind]['rps']:.2f} ({b[kind]['layout']})" if kind in b else "—"
            lines.append(f"| {k} | {v['ov_hint_median']:.2f} | {v['streams']} / {v['nreq']} | {cell('openvino')} | "
                         f"{cell('onnxruntime')} |")
        lines.append("")
    lines += [
        "What the request path cost and what was changed. These figures come from ad-hoc probes during "
        "development, not from this script: a raw-socket client sending 200–3000 requests to a tiny-model or "
        "ResNet-50 job (one at a time, 20 ms mean think time) while py-spy sampled the job, its CPU time was read "
        "from /proc, and a patched copy of the job stamped the time at every stage of the path. \"Before\" is "
        "commit 34a5adb, \"after\" the commit that made each change; the page-fault effect is also checked by "
        "`tests/host/test_malloc.py`:",
        "",
        "- **40 ms stalls:** the listening socket was made with proto 0, so asyncio did not set TCP_NODELAY on "
        "accepted connections, and Nagle held each response body until the client acknowledged its head (up to "
        "40 ms with delayed ACKs). Fixed: TCP_NODELAY on every connection.",
        "- **uvicorn + FastAPI: 1.6 ms of CPU per request** in the job process (tiny model, 500 requests; "
        "middleware stack, routing, Request/Response objects, ASGI cycle). The front door is now a small "
        "HTTP/1.1 protocol on httptools (the C parser uvicorn uses) and uvloop: 0.8 ms, then 0.6 ms with the "
        "changes below. A request that finds an idle instance and nothing queued runs on it from its own task "
        "instead of handing off to the instance's loop and back (two event-loop turns, ~0.25 ms on a cold core).",
        "- **Page faults on every request body:** joining a 600 KB body took 0.48 ms because every fresh buffer "
        "that size was new memory from the kernel (glibc returns it on free); the job process now keeps large "
        "buffers in its heap (`mallopt`): 0.07 ms. The same applies to offline inputs.",
        "- **Pickling:** multiprocessing's ForkingPickler builds a pickler with a copied dispatch table per "
        "message; the instance pipe now uses plain pickle. A byte-identical JSON header (one client, one shape) "
        "reuses its checked decode plan.",
        "- **Offline gaps:** each lane read its next file only after its instance finished the current one "
        "(np.load of a 600 KB .npz: 1.9 ms), and the lane thread, woken on the instance's core, kept the instance "
        "waiting for its time slice. Now the next file is read while the instance computes, .npz files are read "
        "from the zip member and the .npy header directly (0.5 ms, CRC still checked), and the runner's threads run "
        "at nice 19 so the instance preempts them at once.",
        "- **Where the rest went (tiny model, per-stage time stamps, p50, one request at a time, before "
        "reply-through):** client to front door 0.16 ms, parse 0.06, decode 0.05–0.19, hand-off to the instance "
        "(shared-memory copy, pipe message, wake-up of the instance's core) 0.3, reply back (copy, message, wake-up "
        "of the job's core) 0.3, encode and write 0.15, back to the client 0.1. After a long model run everything "
        "past the compute was 3–4 times slower (BERT-base, traced with a patched job: reply back 0.67 ms, encode "
        "0.21, write 0.19): the model's weights push the job's code and data out of the shared cache. Moving 600 KB "
        "over loopback TCP costs ~0.55 ms by itself on this VM: a raw-socket client and server on one cpu take 0.73 "
        "ms p50 per round trip with a 602112-byte request against 0.18 ms with a 3000-byte one "
        "(`python -m bench.loopback_floor`, 200 requests each, load 0.6). So the overhead is now measured against "
        "a direct TCP server that moves the same bytes.",
        "- **Reply-through (this change):** the instance answers all-binary requests on the client's socket itself "
        "(the socket passed with the batch), so the reply-back hop, the wake-up of the job and its cold encode and "
        "write leave the request's path; encoded JSON headers of responses are cached, and tensors up to 64 KB go "
        "inline in the pipe message. In the job per request: ResNet-50 0.94 → 0.62 ms here, 0.98 → 0.55 ms on the "
        "16-core Xeon; BERT-base 1.26 → 0.55 ms there. What remains here for ResNet-50 comes mostly from the clients "
        "sharing cpu 0 with the front door (a 2-cpu machine has no other): the 600 KB request crosses loopback on "
        "one cpu, and the instance's note that it answered wakes the job on cpu 0 just when the client should "
        "read its answer. With the clients on a cpu of their own (16-core Xeon) the overhead is 0.96 ms (ResNet-50) "
        "and 0.74 ms (BERT-base): see the next section.",
        "- **Offline, what is left:** after these changes an instance waits ~1 ms between batches (traced: BERT-base "
        "ORT 1x2 0.9 ms p50 over 60 batches of ~200 ms). The rest of the shortfall, where there is one, is compute "
        "slowed by the runner sharing the instance's cores: in one traced OpenVINO 1x2 ResNet-50 run the instance's "
        "compute per batch was 69.6 ms p50 against 61 ms in the bare loop, as two threads on the only two cores lose "
        "time whenever the runner's few ms of CPU per file (reading, writing, status) take one of them. A 2-core host "
        "has no core to spare for the runner; the agent keeps at least one housekeeping core for it, which the "
        "1x1 rows reproduce (runner `own`).",
        "",
    ]
    return "\n".join(lines)


def _placement(cpus: list[int]) -> dict:
    """Where the online bench puts things: the front door on a housekeeping cpu of its own and the clients on
    another, when the machine has them; on two cpus the front door shares its cpu with the clients."""
    if len(cpus) >= 3:
        return {"frontdoor_cpu": cpus[0], "instance_cpu": cpus[1], "client_cpu": cpus[2],
        }
    return {"frontdoor_cpu": cpus[0], "instance_cpu": cpus[1], "client_cpu": cpus[0],
}


def _offline_placement(layout: Layout, cpus: list[int]) -> tuple[list[int], list[int]]:
    """(job cpus, instance cpus) of an offline run: the job process (reading and writing files) on a
    housekeeping cpu of its own, as the agent places it, when the layout leaves one; else on all cpus."""
    if layout.total_cores < len(cpus):
        return [cpus[0]], cpus[1:]
    return list(cpus), list(cpus)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 trial, few samples")
    p.add_argument("--models", default=None, help="comma-separated model families (default resnet50,bert-base)")
    p.add_argument("--backends", default="onnxruntime,openvino")
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--out", default=str(RESULTS_DIR / "serving_overhead"))
    p.add_argument("--results-md", default=None, help="write the section into this RESULTS.md")
    p.add_argument("--no-ov-compare", action="store_true")
    p.add_argument("--online-only", action="store_true", help="measure only the front-door overhead")
    p.add_argument("--offline-only", action="store_true", help="measure only the offline throughput")
    p.add_argument("--offline-samples", type=int, default=None, help="samples per offline trial (default per model)")
    p.add_argument("--online-requests", type=int, default=None, help="requests per online trial (default per model)")
    p.add_argument("--layouts", default=None, help="comma-separated offline layouts (default 2x1:b1,1x2:b1,1x1:b1)")
    p.add_argument("--encodings", default="binary",
                   help="online REST tensor encodings: binary, or binary,json to measure JSON tensors both ways too")
    p.add_argument("--seq", type=int, default=128,
                   help="sequence length of the requests to an exported sequence model (--models exported:bert)")
    p.add_argument("--render", default=None,
                   help="comma-separated serving_overhead.json files of earlier runs: merge them and write the "
                        "section without measuring")
    args = p.parse_args(argv)
    if args.render:
        merged: dict = {}
        commands, loads = [], []
        for f in args.render.split(","):
            r = json.loads(Path(f).read_text())
            commands.append(r.get("command") or "python -m bench.serving_overhead")
            loads.append(f"`{r['uptime_before']}` → `{r['uptime_after']}`")
            if not merged:
                merged = r
            else:  # later runs replace earlier figures of the same key
                for k in ("offline", "online", "ov_compare"):
                    merged[k].update(r[k])
        merged["loads"] = loads
        body = markdown(merged, "`; `".join(commands))
        print(body)
        if args.results_md:
            replace_section(Path(args.results_md), HEADING, body)
        return 0
    if len(_ALL_CPUS) < 2:
        print("serving_overhead needs two cpus (front door and instance)", file=sys.stderr)
        return 2
    models = args.models.split(",") if args.models else (["tiny"] if args.quick else ["resnet50", "bert-base"])
    quick = args.quick
    settings = Settings(
        models=models, trials=args.trials or (1 if quick else 3),
        offline_samples={m: args.offline_samples or (16 if quick else {"bert-base": 60, "resnet50": 240}.get(m, 400))
                         for m in models},
        online_requests={m: args.online_requests or (15 if quick else {"bert-base": 60, "resnet50": 150}.get(m, 200))
                         for m in models},
        offline_layouts={m: (args.layouts.split(",") if args.layouts else ["2x1:b1"] if quick else ["2x1:b1", "1x2:b1", "1x1:b1"])
                         for m in models},
        backends=args.backends.split(","), ov_compare=not args.no_ov_compare,
        **_placement(_ALL_CPUS), offline=not args.online_only,
        online=not args.offline_only, encodings=tuple(args.encodings.split(",")), seq=args.seq)
    command = command_line("serving_overhead", argv)
    results = run(settings, Path(args.out), command.strip())
    body = markdown(results, command.strip())
    print(body)
    if args.results_md:
        replace_section(Path(args.results_md), HEADING, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
