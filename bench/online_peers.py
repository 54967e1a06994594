"""Online side by side (issue 14): the highest open-loop request rate each contender sustains with p99 latency
under the SLO (200 ms and 1 s), one run, same cpus, same model, same requests, same arrivals.

Contenders, each given every cpu of the run (`--cpus`):

- reamer: the layout that reamer's search picks for that SLO (`search_layout(model, "auto", cpus, slo_ms)` with
  the agent's deploy settings: 0.5 s warm-up, 0.25 s windows, `--search-budget` seconds, batches up to
  `--max-batch`; the two SLOs share one profile cache, as a node's deploys do), served as a real online job
  (`python -m reamer.serve.runtime.job`: front door on all the cpus, pinned instance workers, dynamic batcher with the
  SLO) and driven through its REST front door with binary tensors both ways (reamer.serve.measure.loadgen, httpx);
- OpenVINO THROUGHPUT hint at f32 (reamer's numerics): one process, OpenVINO's own streams, an AsyncInferQueue of
  OPTIMAL_NUMBER_OF_INFER_REQUESTS requests of batch 1, static shapes; requests arrive in-process and wait in
  arrival order for a free infer request;
- ONNX Runtime's default session (no options: all cores, spinning): requests served one at a time in arrival
  order, in-process.

These peers run in-process, with no HTTP, no request decoding and no client on the machine: that favours them,
they are an upper bound. So each also runs over HTTP ("... over HTTP", `--peers http`): behind the server a user
would write (uvicorn with uvloop and httptools, one worker, Starlette, one POST /v2/models/m/infer route that
parses the Triton binary-tensor request and answers binary outputs; OpenVINO's AsyncInferQueue answering when its
callback fires, ONNX Runtime's session in one worker thread), in a process of its own on the same cpus, driven by
reamer's client with the same request and arrivals. Its first answer is checked against ONNX Runtime in-process
(info.check in the JSON). Two ratios per SLO: reamer / the best in-process peer, reamer / the best HTTP peer.
Every contender sees the same Poisson arrivals (reamer.serve.measure.loadgen.poisson_schedule, seed `--seed`, the same
pattern stretched to each rate) and the same sample request. A rate passes when no request fails, p99 <= SLO
(nearest rank, reamer.plan.statistics.nearest_rank_percentile: at least 99 % of the requests within the SLO) with
each refused (shed, 503) request counted as answered too late (a refusal misses the SLO as a late answer does, no
more: a peer may answer 1 % late, reamer may refuse 1 %), and the server keeps up with the offered rate (the median latency of the last quarter of the
arrivals at most SLO/4 above that of the first half: a growing queue shows there; steps last long enough for
that, `step_seconds`). The rate
search: geometric steps from 0.7x the contender's closed-loop throughput until a pass and a fail bracket the answer, then
geometric bisection until the bracket is within `--precision` or the steps run out; the 200 ms search of a
peer starts from the bracket its 1 s search left (same server, same steps), reamer's runs on its own job.

    # the full run (~25 min on the 2-cpu machine when quiet), figures into bench/RESULTS.md:
    flock /work/coord/bench.lock .venv/bin/python -m bench.online_peers --results-md bench/RESULTS.md
    # one model while developing:
    .venv/bin/python -m bench.online_peers --models mobilenet_v2 --quick --out /tmp/online
    .venv/bin/python -m bench.online_peers --quick --models tiny --out /tmp/online      # smoke run, ~1 min
    .venv/bin/python -m bench.online_peers --peers http --models mobilenet_v2             # reamer and HTTP peers
    .venv/bin/python -m bench.online_peers --render bench/results/online_peers/online_peers.json \\
        --results-md bench/RESULTS.md                                                    # re-render a run
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from bench.harness import (RESULTS_DIR, ROOT, bench_command, command_and_machine, command_line, loadavg, machine_info,
                           publish, read_section, replace_section, rotated, write_json)
from bench.models import resolve_model

from reamer.plan import statistics

PARENT = "## Against each runtime's own tuning (issue 14)"
SECTION = "### Online: highest open-loop rate under the SLO (issue 14)"
AFTER = "### Offline: reamer's pick against OpenVINO THROUGHPUT, ONNX Runtime's default session, one backend alone"
DEFAULT_MODELS = "resnet50,mobilenet_v2,bert-base,deepspeech2,exported:bert,exported:resnet"
SLOS_MS = (1000.0, 200.0)  # the 1 s search first: a peer's 200 ms search starts from its bracket
INPROCESS_PEERS = ("OpenVINO THROUGHPUT f32", "ORT default")
HTTP_PEERS = ("OpenVINO THROUGHPUT f32 over HTTP", "ORT default over HTTP")
CONTENDERS = ("reamer", *INPROCESS_PEERS, *HTTP_PEERS)
PEER_KINDS = {"OpenVINO THROUGHPUT f32": "ov-throughput-f32", "ORT default": "ort-default",
              "OpenVINO THROUGHPUT f32 over HTTP": "ov-throughput-f32", "ORT default over HTTP": "ort-default"}
PEER_GROUPS = {"inprocess": INPROCESS_PEERS, "http": HTTP_PEERS}


# --- one step: the pass rule ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    """One open-loop run at `rate_rps` for `duration_s`: what came back."""

    rate_rps: float
    duration_s: float
    sent: int
    ok: int
    shed: int
    errors: int
    p50_ms: float
    p99_ms: float
    completed: int  # answers inside the arrival window shifted by the median latency (reported, not judged)
    early_p50_ms: float = math.nan  # median latency of the first half of the arrivals
    late_p50_ms: float = math.nan  # median latency of the last quarter: a server falling behind shows here
    wall_s: float = 0.0
    cpu_ms: float | None = None  # cpu per request of the driving process: reamer's HTTP client; a peer's whole process
    detail: str = ""
    p99_with_shed_ms: float = math.nan  # p99 over every request, a refused (shed) one counted as answered too late

    def p99_judged_ms(self) -> float:
        """The p99 the SLO judges: a shed request missed the SLO like a late answer (nan for a run from before
        this field with sheds in it: such a step fails, as it did then)."""
        return self.p99_ms if self.shed == 0 else self.p99_with_shed_ms

    def kept_up(self, slo_ms: float) -> bool:
        """The queue did not grow over the step: late arrivals waited at most a quarter SLO longer than early ones
        (a fixed completion-count window would punish latency spread, which p99 already judges)."""
        return not self.late_p50_ms > self.early_p50_ms + 0.25 * slo_ms

    def meets(self, slo_ms: float) -> bool:
        return (self.sent > 0 and self.errors == 0 and self.p99_judged_ms() <= slo_ms
                and self.kept_up(slo_ms))

    def why_not(self, slo_ms: float) -> str:
        if self.sent == 0:
            return "no request sent"
        if self.errors:
            why = f" ({self.detail})" if self.detail else ""
            return f"{self.errors} failed, {self.shed} shed of {self.sent}{why}"
        if not self.p99_judged_ms() <= slo_ms:
            if self.shed:
                return f"{self.shed} shed of {self.sent}: counted as late, p99 over the SLO ({slo_ms:g} ms)"
            return f"p99 {self.p99_ms:.0f} ms > {slo_ms:g} ms"
        if not self.kept_up(slo_ms):
            return f"fell behind: median latency {self.early_p50_ms:.0f} ms early, {self.late_p50_ms:.0f} ms late"
        return ""


def step_from(rate_rps: float, duration_s: float, scheduled_s: Sequence[float], latency_ms: Sequence[float],
              status: Sequence[str], wall_s: float = 0.0, cpu_ms: float | None = None,
              detail: str = "") -> Step:
    """A Step from per-request records (arrival offset s, latency ms from the arrival, "ok"/"shed"/"error")."""
    ok_lat = [lat for lat, st in zip(latency_ms, status) if st == "ok"]
    # nearest rank: p99 <= SLO exactly when at least 99 % of the requests were within it, however late the rest
    p50, p99 = statistics.p50(ok_lat), statistics.nearest_rank_percentile(ok_lat, 99)
    never_ms = 1e12  # a shed request: never answered
    judged = ok_lat + [never_ms for st in status if st == "shed"]
    p99_with_shed = statistics.nearest_rank_percentile(judged, 99)
    shift = p50 / 1e3 if ok_lat else 0.0
    completed = sum(st == "ok" and shift <= t + lat / 1e3 <= duration_s + shift
                    for t, lat, st in zip(scheduled_s, latency_ms, status))
    n = len(status)
    early = [lat for lat, st in zip(latency_ms[:n // 2], status[:n // 2]) if st == "ok"]
    late = [lat for lat, st in zip(latency_ms[n - n // 4:], status[n - n // 4:]) if st == "ok"]
    return Step(rate_rps, duration_s, n, len(ok_lat), sum(st == "shed" for st in status),
                sum(st == "error" for st in status), p50, p99, completed,
                float(np.median(early)) if early else math.nan, float(np.median(late)) if late else math.nan,
                wall_s, cpu_ms, detail, p99_with_shed)


def step_seconds(rate_rps: float, slo_ms: float, *, step_s: float, min_requests: int, precision: float,
                 max_step_s: float) -> float:
    """How long a step at `rate_rps` offers load: at least `step_s`, at least `min_requests` arrivals (a p99 that
    means something at low rates), and long enough for the queue of a server short of the rate by half the
    search's precision to show. Such a server's backlog grows by precision/2 s of work per second of arrivals;
    kept_up() compares the last quarter's median latency (arrivals centred at 7/8 of the step) with the first
    half's (at 1/4), 5/8 of the step apart, and fails a growth of SLO/4: 5/8 T precision/2 >= SLO/4 gives
    T >= 0.8 SLO / precision (10 s for a 1 s SLO at 8 %). Shorter steps let a server that only queues pass a
    rate it cannot hold."""
    steady_s = 0.8 * slo_ms / 1e3 / precision
    return min(max(step_s, min_requests / rate_rps, steady_s), max_step_s)


# --- the rate search (pure: unit-tested against a simulated server) -----------------------------------------

Probe = Callable[[float], Step]


@dataclass
class RateSearch:
    slo_ms: float
    best: Step | None  # the highest passing step (None: no rate tried passed)
    steps: list[Step] = field(default_factory=list)  # run by this search, in order
    below_rps: float | None = None  # the lowest rate that failed (an upper bound on the answer)

    max_rps: float = math.inf

    @property
    def rate_rps(self) -> float:
        return self.best.rate_rps if self.best else 0.0

    @property
    def at_ceiling(self) -> bool:
        return self.best is not None and self.best.rate_rps >= self.max_rps


def bracket(steps: Iterable[Step], slo_ms: float) -> tuple[Step | None, Step | None]:
    """(highest passing step, lowest failing step above it) among `steps` for this SLO."""
    steps = list(steps)
    passing = [s for s in steps if s.meets(slo_ms)]
    lo = max(passing, key=lambda s: s.rate_rps) if passing else None
    failing = [s for s in steps if not s.meets(slo_ms) and (lo is None or s.rate_rps > lo.rate_rps)]
    hi = min(failing, key=lambda s: s.rate_rps) if failing else None
    return lo, hi


def search_rate(probe: Probe, slo_ms: float, start_rps: float, *, known: Sequence[Step] = (), max_steps: int = 5,
                growth: float = 1.4, precision: float = 0.05, min_rps: float = 0.05,
                max_rps: float = 1e5, retries: int = 1) -> RateSearch:
    """The highest rate that `probe` says meets the SLO, within `precision` (relative) or `max_steps` probes,
    never above `max_rps` (a pass there reads "at least max_rps").

    `known`: steps already run on the same server (another SLO's search): they bound the first bracket.
    `retries`: this many failed steps are run once more at the same rate (beyond `max_steps`), and a pass
    then counts: on a shared machine one disturbed step would otherwise bound the search for good."""
    out = RateSearch(slo_ms, None, max_rps=max_rps)
    for _ in range(max_steps):
        lo, hi = bracket([*known, *out.steps], slo_ms)
        if lo is not None and hi is not None and hi.rate_rps <= lo.rate_rps * (1 + precision):
            break
        if lo is None and hi is None:
            rate = start_rps
        elif hi is None:
            rate = lo.rate_rps * growth
        elif lo is None:
            rate = hi.rate_rps / growth
        else:
            rate = math.sqrt(lo.rate_rps * hi.rate_rps)
        rate = min(rate, max_rps)
        if rate < min_rps or (lo is not None and rate <= lo.rate_rps):
            break  # below any useful rate, or already passed at the ceiling
        out.steps.append(probe(rate))
        if retries > 0 and not out.steps[-1].meets(slo_ms):
            retries -= 1
            out.steps.append(probe(rate))  # bracket() keeps the pass, if the re-run passes
    lo, hi = bracket([*known, *out.steps], slo_ms)
    out.best, out.below_rps = lo, hi.rate_rps if hi else None
    return out


# --- the peers, each in a pinned process of its own that serves step after step ----------------------------

def _feeds(model: str) -> dict[str, np.ndarray]:
    """One request's inputs, the same for every contender (peers.py's sample: reamer's rule, seed 0)."""
    from reamer.serve.backends import open_backend, sample_inputs

    with open_backend("onnxruntime", model, 1) as probe:
        return sample_inputs(probe, 1, np.random.default_rng(0))


def _schedule(rate: float, duration: float, seed: int) -> list[float]:
    from reamer.serve.measure.loadgen import poisson_schedule

    return poisson_schedule(rate, duration, np.random.default_rng(seed))


def _ov_throughput(model_path: str, feeds: dict[str, np.ndarray]):
    """OpenVINO's THROUGHPUT hint at f32 on the request shapes: (model, compiled, its optimal request count,
    an AsyncInferQueue of that many requests, what it chose for the run's JSON)."""
    import openvino as ov
    import openvino.properties.hint as hints

    core = ov.Core()
    model = core.read_model(model_path)
    model.reshape({p.get_any_name(): ov.PartialShape(list(feeds[p.get_any_name()].shape)) for p in model.inputs})
    compiled = core.compile_model(model, "CPU", {hints.performance_mode(): hints.PerformanceMode.THROUGHPUT,
                                                 hints.inference_precision(): ov.Type.f32})
    nireq = int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))
    info = {"streams": int(compiled.get_property("NUM_STREAMS")), "requests": nireq,
            "threads": int(compiled.get_property("INFERENCE_NUM_THREADS")),
            "precision": str(compiled.get_property("INFERENCE_PRECISION_HINT"))}
    return model, compiled, nireq, ov.AsyncInferQueue(compiled, nireq), info


def _ov_closed_loop(queue, arrays: list[np.ndarray], seconds: float) -> float:
    """Requests/s with every infer request kept busy for `seconds` (the queue's callback sees userdata None)."""
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        queue.start_async(arrays, None)
        n += 1
    queue.wait_all()
    return n / (time.perf_counter() - start)


def _ort_default(doc: dict):
    """ONNX Runtime's default session (all cores, spinning): (session, output names, what it chose)."""
    import onnxruntime as ort

    session = ort.InferenceSession(doc["model"], providers=["CPUExecutionProvider"])  # its defaults
    info = {"threads": session.get_session_options().intra_op_num_threads or len(doc["cpus"])}
    return session, [o.name for o in session.get_outputs()], info


def _sync_closed_loop(run_once: Callable[[], Any], seconds: float) -> float:
    """Requests/s of `run_once` back to back for `seconds` (at least once)."""
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or n == 0:
        run_once()
        n += 1
    return n / (time.perf_counter() - start)


def _paced(times: list[float], start: float, give_up: float, submit: Callable[[int], None]) -> list[str]:
    """Submit request i at start + times[i]; those not submitted by `give_up` are "error"."""
    status = ["ok"] * len(times)
    for i, t in enumerate(times):
        delay = start + t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if time.perf_counter() > give_up:
            status[i:] = ["error"] * (len(times) - i)
            break
        submit(i)
    return status


def peer_main(doc: dict) -> None:
    """The peer process: set up, report closed-loop throughput, then answer one step per stdin line."""
    os.sched_setaffinity(0, doc["cpus"])  # before the runtime starts its threads
    feeds = _feeds(doc["model"])
    done_at: list[float] = []
    if doc["kind"] == "ov-throughput-f32":
        model, _, _, queue, info = _ov_throughput(doc["model"], feeds)
        arrays = [feeds[p.get_any_name()] for p in model.inputs]
        queue.set_callback(lambda request, i: i is None or done_at.__setitem__(i, time.perf_counter()))

        def serve(times: list[float], start: float, give_up: float) -> list[str]:
            done_at[:] = [math.nan] * len(times)
            # start_async blocks while every infer request is busy: the FIFO in front
            status = _paced(times, start, give_up, lambda i: queue.start_async(arrays, i))
            queue.wait_all()
            return status

        def closed_loop(seconds: float) -> float:
            return _ov_closed_loop(queue, arrays, seconds)
    elif doc["kind"] == "ort-default":
        session, names, info = _ort_default(doc)

        def submit(i: int) -> None:
            session.run(names, feeds)
            done_at[i] = time.perf_counter()

        def serve(times: list[float], start: float, give_up: float) -> list[str]:
            done_at[:] = [math.nan] * len(times)
            return _paced(times, start, give_up, submit)

        def closed_loop(seconds: float) -> float:
            return _sync_closed_loop(lambda: session.run(names, feeds), seconds)
    else:
        raise SystemExit(f"unknown peer {doc['kind']}")
    closed_loop(doc["warmup_s"])
    info["closed_loop_rps"] = closed_loop(doc["warmup_s"])
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        times = _schedule(ask["rate"], ask["duration"], ask["seed"])
        cpu0 = time.process_time()
        start = time.perf_counter() + 0.01
        status = serve(times, start, start + ask["duration"] + ask["give_up_s"])
        wall = time.perf_counter() - start
        latency = [(done_at[i] - start - t) * 1e3 if st == "ok" else math.nan
                   for i, (t, st) in enumerate(zip(times, status))]
        print(json.dumps({"scheduled": times, "latency_ms": latency, "status": status, "wall_s": wall,
                          "cpu_s": time.process_time() - cpu0}), flush=True)


def _stop(proc: subprocess.Popen, ask: Callable[[], None], grace_s: float) -> None:
    """`ask` the process to end, wait `grace_s`, then kill it."""
    if proc.poll() is None:
        ask()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class PeerServer:
    """A peer process kept up for all the steps of one model."""

    def __init__(self, kind: str, model: str, cpus: list[int], warmup_s: float) -> None:
        doc = {"kind": kind, "model": model, "cpus": cpus, "warmup_s": warmup_s}
        self.proc = subprocess.Popen(bench_command("online_peers", "--peer", json.dumps(doc)), cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{kind} peer did not start (exit {self.proc.wait()})")
        self.info = json.loads(line)

    def step(self, rate: float, duration: float, seed: int, give_up_s: float) -> Step:
        self.proc.stdin.write(json.dumps({"rate": rate, "duration": duration, "seed": seed, "give_up_s": give_up_s})
                              + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited with {self.proc.wait()}")
        got = json.loads(line)
        n = max(len(got["status"]), 1)
        return step_from(rate, duration, got["scheduled"], got["latency_ms"], got["status"], got["wall_s"],
                         got["cpu_s"] * 1e3 / n, "" if "error" not in got["status"] else "not started in time")

    def close(self) -> None:
        _stop(self.proc, self.proc.stdin.close, 30)  # end of its step lines: it exits


# --- the peers over HTTP: the server a user would write in front of each runtime --------------------------

def _binary_tensors(body: bytes, header_length: int, specs: list[dict]) -> dict[str, np.ndarray]:
    """The tensors `specs` (a v2 header's inputs or outputs) name, read from the binary part in their order."""
    from reamer.serve.protocol.tensors import v2_to_numpy

    out, at = {}, header_length
    for spec in specs:
        size = int(spec["parameters"]["binary_data_size"])
        dtype = v2_to_numpy(spec["datatype"])
        out[spec["name"]] = np.frombuffer(body, dtype, size // dtype.itemsize, at).reshape(spec["shape"])
        at += size
    return out


def parse_binary_request(body: bytes, header_length: int) -> tuple[dict[str, np.ndarray], list[str]]:
    """A v2 infer request with binary inputs: (inputs by name, the output names asked for; empty: all)."""
    head = json.loads(body[:header_length])
    declared = sum(int(spec["parameters"]["binary_data_size"]) for spec in head["inputs"])
    if header_length + declared != len(body):
        raise ValueError(f"the request's binary part holds {len(body) - header_length} bytes, its header names "
                         f"{declared}")
    return _binary_tensors(body, header_length, head["inputs"]), [o["name"] for o in head.get("outputs", [])]


def parse_binary_response(body: bytes, header_length: int) -> dict[str, np.ndarray]:
    """The outputs of a v2 infer response with binary outputs (what the HTTP peers answer)."""
    return _binary_tensors(body, header_length, json.loads(body[:header_length])["outputs"])


def _http_runtime(doc: dict, feeds: dict[str, np.ndarray]):
    """(run, closed_loop, info, output names) for a peer served over HTTP: `run(inputs)` is awaited on the
    server's event loop and returns the outputs by name."""
    import concurrent.futures

    if doc["kind"] == "ov-throughput-f32":
        model, compiled, nireq, queue, info = _ov_throughput(doc["model"], feeds)
        in_names = [p.get_any_name() for p in model.inputs]
        import onnx

        graph_outputs = {o.name for o in onnx.load(doc["model"], load_external_data=False).graph.output}
        # the ONNX output names, as the client asks for them (OpenVINO may list another of a tensor's names first)
        out_names = [next((n for n in sorted(o.get_names()) if n in graph_outputs), o.get_any_name())
                     for o in compiled.outputs]
        free: list[asyncio.Semaphore] = []  # made on the server's loop

        def finished(request, userdata) -> None:  # an OpenVINO thread: copy out, hand over to the loop
            if userdata is None:  # a closed-loop run's request: nobody waits for it
                return
            loop, future = userdata
            outs = {n: request.get_output_tensor(i).data.copy() for i, n in enumerate(out_names)}
            loop.call_soon_threadsafe(_settle, future, outs)

        def _settle(future: asyncio.Future, outs: dict) -> None:
            free[0].release()
            if not future.done():
                future.set_result(outs)

        queue.set_callback(finished)

        async def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            if not free:
                free.append(asyncio.Semaphore(nireq))
            await free[0].acquire()  # requests wait in arrival order for a free infer request
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            queue.start_async([inputs[n] for n in in_names], (loop, future))
            return await future

        def closed_loop(seconds: float) -> float:
            return _ov_closed_loop(queue, [feeds[n] for n in in_names], seconds)
    elif doc["kind"] == "ort-default":
        session, out_names, info = _ort_default(doc)
        worker = concurrent.futures.ThreadPoolExecutor(1)  # one at a time, in arrival order

        async def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            outs = await asyncio.get_running_loop().run_in_executor(worker, session.run, out_names, inputs)
            return dict(zip(out_names, outs))

        def closed_loop(seconds: float) -> float:
            return _sync_closed_loop(lambda: session.run(out_names, feeds), seconds)
    else:
        raise SystemExit(f"unknown peer {doc['kind']}")
    return run, closed_loop, info, out_names


def http_peer_main(doc: dict) -> None:
    """A peer behind the server a user would write: uvicorn (uvloop, httptools, one worker) and Starlette with
    one route, POST /v2/models/m/infer, binary tensors both ways. Prints its port and info, serves until
    terminated."""
    os.sched_setaffinity(0, doc["cpus"])
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from reamer.serve.protocol.tensors import numpy_to_v2
    from reamer.serve.protocol.v2wire import HEADER_LENGTH, binary_body

    feeds = _feeds(doc["model"])
    run, closed_loop, info, out_names = _http_runtime(doc, feeds)
    closed_loop(doc["warmup_s"])
    info["closed_loop_rps"] = closed_loop(doc["warmup_s"])  # in-process, where the rate search starts

    async def infer(request: Request) -> Response:
        body = await request.body()
        try:
            inputs, wanted = parse_binary_request(body, int(request.headers[HEADER_LENGTH]))
        except (KeyError, ValueError, TypeError) as exc:
            return Response(f"bad request: {exc}", status_code=400)
        outs = await run(inputs)
        head, blobs = binary_body("m", None, [(n, numpy_to_v2(outs[n].dtype), outs[n]) for n in wanted or out_names])
        return Response(head + b"".join(blobs), media_type="application/octet-stream",
                        headers={HEADER_LENGTH: str(len(head))})

    app = Starlette(routes=[Route("/v2/models/m/infer", infer, methods=["POST"])])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    info |= {"port": sock.getsockname()[1], "server": f"uvicorn {uvicorn.__version__} (uvloop, httptools, 1 worker) "
                                                       f"+ Starlette"}
    print(json.dumps(info), flush=True)
    # keep-alive as long as reamer's front door keeps an idle connection (75 s, nginx's default): with uvicorn's
    # 5 s the client's pooled connections were closed under it at low rates (IncompleteReadError, counted failed)
    config = uvicorn.Config(app, loop="uvloop", http="httptools", log_level="warning", access_log=False,
                            lifespan="off", backlog=1024, timeout_keep_alive=75)
    uvicorn.Server(config).run(sockets=[sock])


def lean_step(port: int, request: bytes, rate: float, duration: float, seed: int, give_up_s: float) -> Step:
    """One open-loop step through the lean client, its cpu per request as the step's cpu_ms."""
    cpu0 = time.process_time()
    times = _schedule(rate, duration, seed)
    start = time.perf_counter() + 0.01
    latency, status, details = asyncio.run(lean_open_loop(port, request, times, start, give_up_s))
    n = max(len(times), 1)
    return step_from(rate, duration, times, latency, status, time.perf_counter() - start,
                     (time.process_time() - cpu0) * 1e3 / n, "; ".join(sorted(set(details))[:2]))


def raw_request(port: int, body: bytes, headers: dict[str, str], path: str = "/v2/models/m/infer") -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{head}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class HttpPeerServer:
    """A peer served over HTTP in a process of its own, driven by the same lean client as reamer's job."""

    def __init__(self, kind: str, model: str, cpus: list[int], warmup_s: float,
                 inputs: dict[str, np.ndarray], reference: dict[str, np.ndarray] | None = None) -> None:
        import httpx

        from reamer.serve.protocol.v2wire import HEADER_LENGTH

        doc = {"kind": kind, "model": model, "cpus": cpus, "warmup_s": warmup_s}
        self.proc = subprocess.Popen(bench_command("online_peers", "--http-peer", json.dumps(doc)),
                                     cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{kind} HTTP peer did not start (exit {self.proc.wait()})")
        self.info = json.loads(line)
        self.port = self.info["port"]
        names = list(reference) if reference else []
        body, headers = binary_request(inputs, names)
        self.request = raw_request(self.port, body, headers)
        deadline = time.monotonic() + 60
        while True:  # the socket listens before uvicorn serves: the first answer says it is up, and what it says
            try:
                got = httpx.post(f"http://127.0.0.1:{self.port}/v2/models/m/infer", content=body, headers=headers,
                                 timeout=60)
                break
            except httpx.TransportError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise
                time.sleep(0.1)
        if got.status_code != 200:
            self.close()
            raise RuntimeError(f"{kind} HTTP peer answered {got.status_code}: {got.text[:100]}")
        if reference:
            outs = parse_binary_response(got.content, int(got.headers[HEADER_LENGTH]))
            self.info["check"] = answer_check(outs, reference)

    def step(self, rate: float, duration: float, seed: int, give_up_s: float) -> Step:
        return lean_step(self.port, self.request, rate, duration, seed, give_up_s)

    def close(self) -> None:
        _stop(self.proc, self.proc.terminate, 30)


def answer_check(got: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> dict[str, Any]:
    """How far an HTTP peer's answer lies from the in-process ONNX Runtime output for the same request."""
    missing = sorted(set(reference) - set(got))
    diffs = [float(np.max(np.abs(got[n].astype(np.float64) - reference[n].astype(np.float64))))
             if got[n].shape == reference[n].shape else math.inf for n in reference if n in got]
    scale = max((float(np.max(np.abs(a))) for a in reference.values() if a.size), default=0.0)
    worst = max(diffs, default=math.inf if missing else 0.0)
    return {"outputs": len(reference), "missing": missing, "max_abs_diff": worst,
            "max_rel_diff": worst / scale if scale > 0 else worst, "reference": "ONNX Runtime in-process"}


def reference_outputs(model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The in-process ONNX Runtime default session's answer to the sample request (the HTTP peers' check)."""
    import onnxruntime as ort

    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs)))


# --- reamer: the search with the SLO, a real online job, its REST front door --------------------------------

def instances_of(layout, cpus: list[int]) -> list:
    """The layout's instances on consecutive slices of `cpus`."""
    from reamer.serve.spec import InstanceSpec

    out, at = [], 0
    for shape in layout.instances:
        out.append(InstanceSpec(cpus[at:at + shape.cores], shape.threads, shape.batch, streams=shape.streams))
        at += shape.cores
    return out


def binary_request(inputs: dict[str, np.ndarray], output_names: list[str]) -> tuple[bytes, dict[str, str]]:
    """A v2 infer request with binary tensors both ways (what tritonclient sends), encoded once."""
    from reamer.serve.protocol.tensors import numpy_to_v2
    from reamer.serve.protocol.v2wire import HEADER_LENGTH

    head = json.dumps({
        "inputs": [{"name": k, "shape": list(a.shape), "datatype": numpy_to_v2(a.dtype),
                    "parameters": {"binary_data_size": a.nbytes}} for k, a in inputs.items()],
        "outputs": [{"name": o, "parameters": {"binary_data": True}} for o in output_names]}).encode()
    body = head + b"".join(np.ascontiguousarray(a).tobytes() for a in inputs.values())
    return body, {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(head))}


async def lean_open_loop(port: int, request: bytes, times: Sequence[float], start: float,
                         give_up_s: float) -> tuple[list[float], list[str], list[str]]:
    """Send `request` (a whole HTTP/1.1 request, encoded once) at `start` + each of `times` over keep-alive
    connections (an idle one when there is one, else a new one); per request the latency from its arrival (ms),
    "ok"/"shed"/"error" and what went wrong. The least a client costs: no per-request encoding or parsing
    beyond the status line and Content-Length."""
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    latency = [math.nan] * len(times)
    status = ["error"] * len(times)
    details: list[str] = []

    async def one(i: int, due: float) -> None:
        conn = None
        try:
            if idle:
                conn = idle.pop()
            else:
                conn = await asyncio.open_connection("127.0.0.1", port)
                conn[1].get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reader, writer = conn
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            length = next((int(v) for k, _, v in (line.partition(":") for line in lines[1:])
                           if k.strip().lower() == "content-length"), 0)
            body = await reader.readexactly(length)
            latency[i] = (time.perf_counter() - due) * 1e3
            code = int(lines[0].split()[1])
            status[i] = "ok" if code == 200 else "shed" if code == 503 else "error"
            if code != 200:
                details.append(f"{code} {body[:80].decode('utf-8', 'replace')}")
            idle.append(conn)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError) as exc:
            details.append(f"{type(exc).__name__}: {exc}"[:80])
            if conn is not None:
                conn[1].close()

    tasks = []
    for i, t in enumerate(times):
        delay = start + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, start + t)))
    done, pending = await asyncio.wait(tasks, timeout=max(start + times[-1] + give_up_s - time.perf_counter(), 0.1)) \
        if tasks else (set(), set())
    for task in pending:
        task.cancel()
    if pending:
        details.append(f"{len(pending)} unanswered after {give_up_s:g} s")
    for _, writer in idle:
        writer.close()
    return latency, status, details


class ReamerJob:
    """A reamer online job (`python -m reamer.serve.runtime.job`, or `command` then `--spec FILE`) serving `layout` with
    the SLO, and its front door."""

    def __init__(self, model: str, layout, cpus: list[int], slo_ms: float, work: Path,
                 inputs: dict[str, np.ndarray], client: str = "lean",
                 command: Sequence[str] = (sys.executable, "-m", "reamer.serve.runtime.job")) -> None:
        import httpx

        from reamer.serve.spec import JobSpec, JobStatus

        work.mkdir(parents=True, exist_ok=True)
        run_dir = work / "run"
        spec = JobSpec(name="m", kind="online", model=model, backend=layout.backend or "onnxruntime",
                       run_dir=str(run_dir), port=0, host="127.0.0.1", instances=instances_of(layout, cpus),
                       frontdoor_cpus=list(cpus), slo_ms=slo_ms)
        spec.save(work / "spec.json")
        self.proc = subprocess.Popen([*command, "--spec", str(work / "spec.json")],
                                     cwd=ROOT, stdout=open(work / "job.out", "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while True:
            try:
                st = JobStatus.load(run_dir / "status.json")
            except (FileNotFoundError, json.JSONDecodeError, OSError):
                st = None
            if st is not None and st.state == "ready" and st.port:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"online job did not become ready: {st.message if st else 'no status'}")
            time.sleep(0.1)
        self.port, self.client = st.port, client
        self.url = f"http://127.0.0.1:{st.port}/v2/models/m/infer"
        meta = httpx.get(f"http://127.0.0.1:{st.port}/v2/models/m", timeout=60).json()
        self.body, self.headers = binary_request(inputs, [o["name"] for o in meta["outputs"]])
        head = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        self.request = (f"POST /v2/models/m/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}"
                        f"Content-Length: {len(self.body)}\r\n\r\n").encode() + self.body

    def pids(self) -> list[int]:
        """The job process (its front door) first, then its instance workers."""
        import psutil

        return [self.proc.pid, *(c.pid for c in psutil.Process(self.proc.pid).children())]

    def step(self, rate: float, duration: float, seed: int, give_up_s: float) -> Step:
        cpu0 = time.process_time()
        if self.client == "lean":
            return lean_step(self.port, self.request, rate, duration, seed, give_up_s)
        from reamer.serve.measure.loadgen import run_load

        got = run_load(self.url, self.body, rate, duration, seed=seed, timeout_s=give_up_s, headers=self.headers)
        n = max(len(got.records), 1)
        details = sorted({r.detail[:80] for r in got.records if r.status != "ok"})
        return step_from(rate, duration, [r.scheduled_s for r in got.records], [r.latency_ms for r in got.records],
                         [r.status for r in got.records], got.wall_s, (time.process_time() - cpu0) * 1e3 / n,
                         "; ".join(details[:2]))


    def close(self) -> None:
        _stop(self.proc, self.proc.terminate, 60)


# --- one model ----------------------------------------------------------------------------------------------

def _answer_status(port: int, request: bytes, timeout_s: float) -> int:
    """One request on a fresh connection: the status of its answer, once all of it has come."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(request)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(65536)
            if not chunk:
                raise RuntimeError("the server closed the connection before answering")
            head += chunk
        top, _, body = head.partition(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in top.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    return int(top.split(b" ", 2)[1])


def settle(port: int, request: bytes, timeout_s: float = 300.0) -> float:
    """Wait until the server answers one more request (again while it refuses it): a server still working
    through the requests that a failed step's client gave up on is done with them then (both kinds of server
    answer in arrival order). Without this, that backlog would take the cpus from the next step, the other
    contender's too. Seconds waited."""
    started = time.monotonic()
    while _answer_status(port, request, timeout_s) != 200 and time.monotonic() - started < timeout_s:
        time.sleep(0.1)
    return time.monotonic() - started


class Settled:
    """A server whose every step ends with `settle` when it is served over HTTP (an in-process peer has
    finished every request it took when its step returns)."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def step(self, rate: float, duration: float, seed: int, give_up_s: float) -> Step:
        step = self.server.step(rate, duration, seed, give_up_s)
        if hasattr(self.server, "port"):
            settle(self.server.port, self.server.request)
        return step


def _searches(server, capacity: float, args: argparse.Namespace, slos: Sequence[float],
              log: Callable[[str], None]) -> dict[str, Any]:
    """Warm-up, then the rate search for each SLO on one server (later SLOs start from the earlier steps), each
    step settled (`settle`)."""
    def probe_for(slo_ms: float) -> Callable[[float], Step]:
        def probe(rate: float) -> Step:
            duration = step_seconds(rate, slo_ms, step_s=args.step, min_requests=args.min_requests,
                                    precision=args.precision, max_step_s=args.max_step)
            step = server.step(rate, duration, args.seed, max(5.0, 5 * max(slos) / 1e3))
            log(f"    {rate:9.2f}/s  {duration:4.1f} s  p99 {step.p99_ms:8.1f} ms  ok {step.ok}/{step.sent}  p50 "
                f"early/late {step.early_p50_ms:.0f}/{step.late_p50_ms:.0f} ms  driver cpu {step.cpu_ms or 0:.2f} "
                f"ms/req")
            return step
        return probe

    server = Settled(server)
    server.step(min(max(capacity * 0.3, 0.5), args.max_rate * 0.3), args.warmup, args.seed + 1, 10.0)  # discarded
    out, known = {}, []
    for i, slo in enumerate(slos):
        found = search_rate(probe_for(slo), slo, min(max(capacity * 0.7, 0.1), args.max_rate), known=known,
                            max_steps=args.steps if i == 0 else args.more_steps, precision=args.precision,
                            max_rps=args.max_rate)
        known += found.steps
        out[f"{slo:g}"] = _search_doc(found)
    return out


def _search_doc(found: RateSearch) -> dict[str, Any]:
    best = found.best
    return {"rate_rps": found.rate_rps, "at_ceiling": found.at_ceiling, "p99_ms": best.p99_ms if best else None,
            "p50_ms": best.p50_ms if best else None,
            "below_rps": found.below_rps, "steps": [asdict(s) for s in found.steps],
            "why_not_above": (next((s.why_not(found.slo_ms) for s in found.steps
                                    if found.below_rps is not None and s.rate_rps == found.below_rps), None))}


def _reamer_at(slo: float, model: str, cpus: list[int], args: argparse.Namespace, row: dict, inputs: dict,
               cache: Path, work: Path, log: Callable[[str], None]) -> None:
    """reamer's search with the SLO, its pick deployed as an online job, the rate search through the front door."""
    from reamer.plan.layout import format_layout
    from reamer.search.on_cores import MeasureSettings, batch_choices, search_layout

    started = time.monotonic()
    outcome = search_layout(model, "auto", cpus, slo, cache_dir=cache, batches=batch_choices(args.max_batch),
                            budget_s=args.search_budget, settings=MeasureSettings(warmup_s=0.5, window_s=0.25),
                            strict_cache=False, cache_source="online_peers")
    pick = {"search_s": round(time.monotonic() - started, 1), "complete": outcome.complete, "runs": len(outcome.rows)}
    if outcome.best is None:
        row["info"][f"reamer {slo:g}"] = {**pick, "error": outcome.note or f"no layout meets {slo:g} ms"}
        row["results"]["reamer"][f"{slo:g}"] = {"rate_rps": 0.0, "p99_ms": None, "steps": [],
                                                "why_not_above": "the search found no layout under the SLO"}
        return
    layout = outcome.best.layout
    pick |= {"layout": format_layout(layout), "search_rps": outcome.best.rps, "search_p99_ms": outcome.best.p99_ms}
    row["info"][f"reamer {slo:g}"] = pick
    log(f"    {slo:g} ms: {pick['layout']} ({pick['search_rps']:.2f}/s in the search, {pick['search_s']} s)")
    job = ReamerJob(model, layout, cpus, slo, work / f"job-{slo:g}", inputs, args.client)
    try:
        row["results"]["reamer"] |= _searches(job, outcome.best.rps, args, [slo], log)
    finally:
        job.close()


def compare_model(name: str, model: str, cpus: list[int], args: argparse.Namespace, order: list[str],
                  work: Path) -> dict[str, Any]:
    def log(text: str) -> None:
        print(text, flush=True)

    row: dict[str, Any] = {"model": name, "file": os.path.basename(model), "cpus": cpus, "load_before": loadavg(),
                           "order": order, "results": {c: {} for c in order}, "info": {}}
    inputs = _feeds(model)
    reference = reference_outputs(model, inputs) if any(c in HTTP_PEERS for c in order) else None
    cache = work / "profiles"
    for contender in order:
        log(f"  {contender}")
        if contender in PEER_KINDS:
            try:
                server = (HttpPeerServer(PEER_KINDS[contender], model, cpus, args.warmup, inputs, reference)
                          if contender in HTTP_PEERS else PeerServer(PEER_KINDS[contender], model, cpus, args.warmup))
            except Exception as exc:  # noqa: BLE001 - a runtime refusing the model is a figure too
                row["info"][contender] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                continue
            if "check" in server.info:
                log(f"    answer vs ONNX Runtime in-process: max abs diff {server.info['check']['max_abs_diff']:.3g}")
            try:
                row["info"][contender] = server.info
                row["results"][contender] = _searches(server, server.info["closed_loop_rps"], args, SLOS_MS, log)
            finally:
                server.close()
            continue
        for slo in SLOS_MS:
            try:
                _reamer_at(slo, model, cpus, args, row, inputs, cache, work, log)
            except Exception as exc:  # noqa: BLE001 - the other SLO and the peers' figures still count
                row["info"][f"reamer {slo:g}"] = {**row["info"].get(f"reamer {slo:g}", {}),
                                                  "error": f"{type(exc).__name__}: {exc}"[:200]}
    row["ratio"] = ratios(row["results"])
    row["load_after"] = loadavg()
    return row


def ratios(results: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """Per SLO: reamer / the best in-process peer (best_peer, ratio) and reamer / the best peer over HTTP
    (best_http_peer, ratio_http); None where reamer or that kind of peer has no figure."""
    out = {}
    for slo in SLOS_MS:
        key = f"{slo:g}"
        rates = {c: results.get(c, {}).get(key, {}).get("rate_rps") for c in CONTENDERS}
        mine = rates.get("reamer")
        doc: dict[str, Any] = {}
        for group, suffix in ((INPROCESS_PEERS, ""), (HTTP_PEERS, "_http")):
            peers = {c: rates[c] for c in group if rates[c] is not None}
            best = max(peers, key=peers.get) if peers else None
            doc[f"best{suffix and '_http'}_peer"] = best
            doc[f"ratio{suffix}"] = mine / peers[best] if best and peers[best] > 0 and mine is not None else None
        out[key] = doc
    return out


# --- output -------------------------------------------------------------------------------------------------

def _cell(result: dict) -> str:
    if not result:
        return "-"
    rate = result.get("rate_rps") or 0.0
    if rate <= 0:
        why = str(result.get("why_not_above") or "failed").replace("|", "/")
        return f"none ({why[:70]}{'…' if len(why) > 70 else ''})"
    figure = f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"
    return f"{'≥ ' if result.get('at_ceiling') else ''}{figure} (p99 {result['p99_ms']:.0f})"


def render(data: dict) -> str:
    contenders = data.get("contenders") or ["reamer", *INPROCESS_PEERS]  # runs before the HTTP peers: these three
    peers = [c for c in contenders if c != "reamer"]
    http = [c for c in peers if c in HTTP_PEERS]
    inproc = [c for c in peers if c in INPROCESS_PEERS]
    lines = [
        command_and_machine(data) + f", all of them given to every "
        f"contender ({data['cpus']}) · load average (1 min) {data['load_start'][0]} at the start, "
        f"{data['load_end'][0]} at the end (per row below) · {data['started']}–{data['ended']} UTC · steps of "
        f"{data['step_s']} s (longer where fewer than {data.get('min_requests', 0)} requests would arrive"
        + (", and at least 0.8 × SLO / precision, so that a queue growing at half the precision shows"
           if data.get("steady_steps") else "")
        + f", up to {data.get('max_step_s', '-')} s), Poisson arrivals seed {data['seed']}, rate precision "
        f"{data['precision']:.0%}.",
        "",
        "Rate = the highest open-loop request rate (requests/s, batch 1 per request) with "
        + ("no request failed, p99 ≤ the SLO counting each refused (shed) request as answered too late"
           if data.get("shed_counts_late") else "every request answered, p99 ≤ the SLO")
        + (" (p99 by nearest rank: at least 99 % of the requests within it)" if data.get("p99_nearest_rank") else "")
        + " and no growing queue (the last quarter's median latency at most SLO/4 above the first "
        "half's); p99 in ms at that rate (of the answered requests). reamer = the layout its search picks for the "
        "SLO (both backends, the agent's deploy settings), served as a real online job and driven through its "
        "REST front door (binary "
        f"tensors, the {data.get('client', 'lean')} client on the same cpus, its cpu per request in the JSON).",
    ]
    if inproc:
        lines[-1] += (" In-process peers are driven with no HTTP, no decoding and no client beside them, which "
                      "favours them: an upper bound.")
    if http:
        lines[-1] += (" Peers over HTTP: each runtime behind the server a user would write (uvicorn with uvloop "
                      "and httptools, one worker, Starlette, one POST /v2/models/m/infer route parsing the same "
                      "binary request and answering binary outputs), in a process of its own on the same cpus, "
                      "driven by the same client with the same request and arrivals as reamer.")
    lines[-1] += (" OpenVINO THROUGHPUT = its own streams, OPTIMAL_NUMBER_OF_INFER_REQUESTS async requests of "
                  "batch 1, f32 (reamer's numerics), requests waiting in arrival order for a free one; ORT default "
                  "= InferenceSession with no options, one request at a time in arrival order (over HTTP: in one "
                  "worker thread).")
    ratio_cols = [("ratio", "best_peer", "reamer / best in-process peer")] if inproc else []
    ratio_cols += [("ratio_http", "best_http_peer", "reamer / best peer over HTTP")] if http else []
    head = ["model", "SLO ms"] + (["reamer layout", "reamer /s (p99)"] if "reamer" in contenders else []) + \
        [f"{c} /s (p99)" for c in peers] + [title for _, _, title in ratio_cols] + ["load"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | | {r['error']} |" + " |" * (len(head) - 3))
            continue
        for slo in SLOS_MS:
            key = f"{slo:g}"
            cells = [r["model"], key]
            if "reamer" in contenders:
                pick = r["info"].get(f"reamer {key}", {})
                cells += [pick.get("layout") or pick.get("error", "-"), _cell(r["results"]["reamer"].get(key, {}))]
            for c in peers:
                info = r["info"].get(c, {})
                cells.append(f"refused: {info['error'][:60]}" if "error" in info else
                             _cell(r["results"].get(c, {}).get(key, {})))
            ratio = r["ratio"][key]
            for value, best, _ in ratio_cols:
                cells.append(f"{ratio[value]:.2f}× ({ratio[best]})" if ratio.get(value) is not None else "-")
            cells.append(f"{r['load_before'][0]}→{r['load_after'][0]}")
            lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    for value, _, title in ratio_cols if "reamer" in contenders else []:
        met = [r["ratio"][f"{s:g}"].get(value) for r in data["rows"] if "ratio" in r for s in SLOS_MS]
        met = [x for x in met if x is not None]
        lines += ["", f"Target {title} ≥ 1.0: met in {sum(x >= 1.0 for x in met)} of {len(met)} (model, SLO) rows; "
                      f"within one search step's precision (≥ {1 - data['precision']:.2f}) in "
                      f"{sum(x >= 1 - data['precision'] for x in met)}."]
    checks = {f"{r['model']} {c}": r["info"][c]["check"] for r in data["rows"] if "info" in r for c in http
              if "check" in r["info"].get(c, {})}
    if checks:
        worst = max(checks.values(), key=lambda c: c["max_rel_diff"])
        lines += ["", f"The HTTP peers' answers to the sample request against ONNX Runtime in-process: "
                      f"{len(checks)} checked, largest difference {worst['max_abs_diff']:.2g} "
                      f"({worst['max_rel_diff']:.2g} of the largest output value)"
                      f"{', outputs missing' if any(c['missing'] for c in checks.values()) else ''}."]
    return "\n".join(lines)


def write_section(path: str, text: str) -> None:
    """Our subsection, placed right after the offline peers table on first write, replaced in place after."""
    if read_section(path, SECTION) is None and read_section(path, AFTER) is not None:
        lines = Path(path).read_text().splitlines(keepends=True)
        start = next(i for i, line in enumerate(lines) if line.rstrip() == AFTER)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(("## ", "### ", "<!-- bench:"))),
                   len(lines))
        Path(path).write_text("".join(lines[:end]).rstrip("\n") + f"\n\n{SECTION}\n\n" + "".join(lines[end:]))
    replace_section(path, SECTION, text, parent=PARENT)


def select_contenders(peers: str, reamer: bool = True) -> list[str]:
    """The contenders of a run, in CONTENDERS' order, from `--peers` (comma-separated groups)."""
    groups = [g.strip() for g in peers.split(",") if g.strip()]
    unknown = [g for g in groups if g not in PEER_GROUPS]
    if unknown:
        raise SystemExit(f"--peers: unknown group {', '.join(unknown)}; use inprocess, http or inprocess,http")
    chosen = {c for g in groups for c in PEER_GROUPS[g]} | ({"reamer"} if reamer else set())
    if not chosen:
        raise SystemExit("nothing to run: give --peers a group, or drop --no-reamer")
    return [c for c in CONTENDERS if c in chosen]


def run_models(names: Sequence[str], one: Callable[[int, str, str, Path], dict[str, Any]], model_dir: str,
               data: dict[str, Any], out: Path) -> None:
    """`one(index, name, model file, work dir)` for each model, its row (or the error that stopped it: the other
    models' figures still count) appended to data["rows"] and the JSON rewritten after each."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{out.stem}-") as tmp:
        for index, name in enumerate(names):
            print(f"== {name} (load {loadavg()})", flush=True)
            try:
                row = one(index, name, resolve_model(name, Path(model_dir)), Path(tmp) / name.replace(":", "_"))
            except Exception as exc:  # noqa: BLE001 - one model failing must not lose the others' figures
                row = {"model": name, "error": f"{type(exc).__name__}: {exc}"[:200]}
            data["rows"].append(row)
            data["load_end"], data["ended"] = loadavg(), time.strftime("%H:%M", time.gmtime())
            write_json(out, data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog=__doc__[__doc__.index("    # the full run"):],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    p.add_argument("--http-peer", default=None, help=argparse.SUPPRESS)
    p.add_argument("--peers", default="inprocess,http",
                   help="which peers run beside reamer: inprocess (the runtimes driven in-process, an upper bound), "
                        "http (each behind a uvicorn + Starlette server, driven by reamer's client), or both "
                        "(default inprocess,http)")
    p.add_argument("--no-reamer", action="store_true", help="run the peers only")
    p.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated (default {DEFAULT_MODELS}; also tiny)")
    p.add_argument("--cpus", default=None, help="cpu list, e.g. 0,1 (default: every cpu this process may use)")
    p.add_argument("--step", type=float, default=4.0, help="seconds of arrivals per rate step (default 4)")
    p.add_argument("--min-requests", type=int, default=200,
                   help="a step lasts until this many arrivals are due (default 200: the p99 of fewer than 100 is "
                        "their slowest), at most --max-step s")
    p.add_argument("--max-step", type=float, default=30.0, help="the longest step, seconds (default 30)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of discarded load on each server first")
    p.add_argument("--steps", type=int, default=5, help="rate steps of a first search (default 5)")
    p.add_argument("--more-steps", type=int, default=3, help="rate steps of a peer's 200 ms search (default 3)")
    p.add_argument("--precision", type=float, default=0.08, help="stop when the bracket is this tight (0.08 = 8%%)")
    p.add_argument("--max-rate", type=float, default=2000.0,
                   help="the highest rate tried, requests/s (default 2000: about what one Python HTTP client sends)")
    p.add_argument("--client", choices=("lean", "loadgen"), default="lean",
                   help="reamer's HTTP client: lean (asyncio, keep-alive, the request encoded once; default) or "
                        "loadgen (reamer.serve.measure.loadgen, httpx: several ms of cpu per request on this machine)")
    p.add_argument("--seed", type=int, default=0, help="the Poisson arrivals' seed")
    p.add_argument("--search-budget", type=float, default=90.0, help="reamer's search budget s (the agent's default)")
    p.add_argument("--max-batch", type=int, default=8, help="reamer's search: batches up to this (default 8)")
    p.add_argument("--model-dir", default="/tmp/reamer-bench-models")
    p.add_argument("--quick", action="store_true", help="shorter steps, fewer of them, a 30 s search budget")
    p.add_argument("--out", default=str(RESULTS_DIR / "online_peers"))
    p.add_argument("--results-md", default=None, help="write the section into this RESULTS.md (full runs only)")
    p.add_argument("--render", default=None, metavar="JSON", help="write the section from an online_peers.json")
    p.add_argument("--notes", default=None, metavar="MD", help="with --render: text to put under the table")
    args = p.parse_args(argv)
    if args.peer:
        peer_main(json.loads(args.peer))
        return 0
    if args.http_peer:
        http_peer_main(json.loads(args.http_peer))
        return 0
    if args.render:
        text = render(json.loads(Path(args.render).read_text()))
        if args.notes:  # what the run's own JSON shows about the misses, written by whoever read it
            text += "\n\n" + Path(args.notes).read_text().strip()
        print(text)
        if args.results_md:
            write_section(args.results_md, text)
        return 0
    if args.quick:  # shorter everything, except what was asked for explicitly
        quick = {"step": 2.0, "warmup": 1.0, "steps": 4, "more_steps": 3, "search_budget": 30.0, "max_batch": 4,
                 "precision": 0.15, "min_requests": 20, "max_step": 8.0}
        for key, value in quick.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else sorted(os.sched_getaffinity(0))
    contenders = select_contenders(args.peers, not args.no_reamer)
    names = [m for m in args.models.split(",") if m]
    command = command_line("online_peers", argv)
    data: dict[str, Any] = {"command": command,
                            "machine": machine_info(), "cpus": cpus, "step_s": args.step,
                            "min_requests": args.min_requests,
                            "steady_steps": True, "shed_counts_late": True, "p99_nearest_rank": True,
                            "max_step_s": args.max_step, "seed": args.seed,
                            "precision": args.precision, "client": args.client, "contenders": contenders,
                            "load_start": loadavg(),
                            "started": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "rows": []}
    def one(index: int, name: str, model: str, work: Path) -> dict[str, Any]:
        row = compare_model(name, model, cpus, args, rotated(contenders, index), work)  # rotated: drift
        print(json.dumps({k: row.get(k) for k in ("model", "ratio", "error")}), flush=True)  # hits all alike
        return row

    run_models(names, one, args.model_dir, data, Path(args.out) / "online_peers.json")
    return publish(render(data), None if args.quick else args.results_md, write_section)


if __name__ == "__main__":
    sys.exit(main())
