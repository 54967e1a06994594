"""The instance worker process: pins itself, opens the model, warms up, and serves the batches its parent
(runtime/instances.InstanceWorker) sends over the pipe.

The worker is a fresh interpreter that imports only this light module before it pins itself and sets its
policy; numpy's BLAS pool and the runtime start their threads after that and inherit both. It answers a
reply-through request on the client's socket itself, with the head the door put in the request's plan
(v2wire.ReplyPlan): it writes bytes, it knows no HTTP.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from typing import Any

from reamer.host.errors import ReamerError
from reamer.serve.protocol.v2wire import binary_reply  # light (json); numpy only inside its functions
from reamer.serve.runtime.instance_channel import Arena, Pipe, ReplyFlag, shareable
from reamer.serve.spec import static_batch_for


def child_main(argv: list[str]) -> None:
    """Worker process entry: argv = [fd, cpus "0,1", sched, threads, backend, precision, max batch, model path,
    samples (JSON of a samples.SampleSpec), in-arena fd, out-arena fd, reply flag fd]."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C on the job's terminal: the job stops its workers
    fd, cpu_list, sched, threads, backend_kind, precision, max_batch, model_path, samples, *shared_fds = argv
    from reamer.host.sched import set_affinity, set_idle_policy  # light: os and pathlib only

    cpus = [int(c) for c in cpu_list.split(",")]
    problem = ""
    try:
        set_affinity(0, cpus)
        if sched == "idle":
            set_idle_policy(0)
    except ReamerError as exc:
        problem = f"cannot place the worker (cpus {cpus}, sched {sched}): {exc}"
    threads_text, _, streams = threads.partition("s")  # "4" or "4s2": 4 threads in 2 OpenVINO streams
    _worker_main(int(fd), problem, int(threads_text), backend_kind, model_path, [int(f) for f in shared_fds],
                 json.loads(samples), int(streams or 1), precision, int(max_batch))


def _write_now(fd: int, parts: list[bytes]) -> bytes:
    """Write what a (non-blocking) socket takes of `parts` now, in gathered writes; the rest."""
    views = [memoryview(p) for p in parts if p]
    while views:
        try:
            n = os.writev(fd, views)
        except InterruptedError:
            continue
        except BlockingIOError:
            break
        while n and views:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0], n = views[0][n:], 0
    return b"".join(views)


def _reply_through(fd: int, plan: Any, outputs: dict[str, Any], elapsed: float, flag: ReplyFlag,
                   heads: dict) -> tuple:
    """Answer the client on its socket; the message for the parent."""
    try:
        parts = binary_reply(plan, outputs, elapsed, time.perf_counter(), heads)
    except Exception:  # noqa: BLE001 - outputs unlike the plan: the job encodes them itself
        return ("ok", outputs, elapsed)
    flag.set(True)
    try:
        tail = _write_now(fd, parts)
    except OSError as exc:  # the client went away: the job closes the connection
        return ("reply_broken", f"{exc}", elapsed)
    return ("replied", tail, elapsed)


def _warm_up(backend: Any, samples_doc: dict | None) -> float:
    """Two runs on the job's sample inputs (samples.py's rule); the second one's latency.
    WorkerError naming the inputs and the runtime's reason when the model refuses them."""
    from reamer.serve.samples import SampleSpec, explain_failure, plan_samples

    plan = plan_samples(backend.inputs, SampleSpec.from_doc(samples_doc), backend.model_path)
    warm = plan.batch(1)
    try:
        backend.run(warm)
        t0 = time.perf_counter()
        backend.run(warm)
        return time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - runtimes raise their own types
        raise ReamerError(explain_failure(backend.model_path, plan, warm, exc),
                          "give the traffic's shapes (--shape NAME:DIMS) or sample data (--input-data FILE) "
                          "that the model accepts") from None


def _batchability(backend: Any, samples_doc: dict | None) -> Any:
    """Whether this model may be batched (batchability.decide); not batchable when the check itself fails."""
    from reamer.serve.runtime.batchability import Batchability, decide

    try:
        return decide(backend, samples_doc)
    except Exception as exc:  # noqa: BLE001 - never merge requests of a model we could not check
        return Batchability(False, f"the batching check failed ({str(exc)[:300]}): served one request per run")


def _worker_main(fd: int, problem: str, threads: int, backend_kind: str, model_path: str,
                 shared_fds: list[int], samples_doc: dict | None = None, streams: int = 1,
                 precision: str = "f32", max_batch: int = 0) -> None:
    """Body of the worker process, after pinning: open the model, warm up, serve batches from the parent."""
    conn = Pipe(fd)
    in_arena, out_arena, flag = Arena(shared_fds[0]), Arena(shared_fds[1]), ReplyFlag(shared_fds[2])
    fd_sock = socket.socket(fileno=os.dup(fd))  # receives the client sockets of reply-through requests
    heads: dict = {}
    if problem:
        conn.send(("fatal", problem))
        raise SystemExit(2)
    try:
        from reamer.serve.backends import open_backend

        backend = open_backend(backend_kind, model_path, threads, streams, precision, static_batch_for(max_batch))
    except BaseException as exc:  # noqa: BLE001 - any failure here must reach the parent as text
        conn.send(("fatal", f"cannot open model {model_path} with {backend_kind}: {exc}"))
        raise SystemExit(3)
    try:
        warm_latency = _warm_up(backend, samples_doc)
    except BaseException as exc:  # noqa: BLE001
        conn.send(("fatal", f"warm-up of {os.path.basename(model_path)} with {backend_kind} failed: {exc}"))
        raise SystemExit(3)
    batchability = _batchability(backend, samples_doc)
    conn.send(("ready", {
        "pid": os.getpid(),
        "inputs": [(t.name, t.datatype, list(t.shape)) for t in backend.inputs],
        "outputs": [(t.name, t.datatype, list(t.shape)) for t in backend.outputs],
        "warmup_latency_s": warm_latency,
        "precision": backend.precision,  # what it computes in: OpenVINO keeps f32 where the CPU has no bf16
        "batchability": batchability.to_doc(),
    }))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break  # parent went away
        if msg[0] == "stop":
            break
        plan = msg[2] if len(msg) > 2 else None
        client_fd = -1
        try:
            if plan is not None:  # the client's socket follows the message
                _, fds, _, _ = socket.recv_fds(fd_sock, 1, 1)
                client_fd = fds[0]
            if msg[0] == "run_shared":
                inputs = in_arena.read(msg[1], copy=False)
            else:
                inputs = msg[1]
            t0 = time.perf_counter()
            outputs = backend.run(inputs)
            elapsed = time.perf_counter() - t0
            del inputs  # views of the arena
            reply = _reply_through(client_fd, plan, outputs, elapsed, flag, heads) if plan is not None else None
            # t0 travels too: perf_counter is the system-wide monotonic clock, so the parent can tell the
            # hand-over to this process from the run and from the way back (Triton's compute_input/output)
            if reply is not None and reply[0] != "ok":
                conn.send((*reply, t0))
            elif shareable(outputs):
                conn.send(("ok_shared", out_arena.write(outputs), elapsed, t0))
            else:
                conn.send(("ok", outputs, elapsed, t0))
        except Exception as exc:  # noqa: BLE001
            conn.send(("error", str(exc)))
        finally:
            if client_fd >= 0:
                os.close(client_fd)
    backend.close()
