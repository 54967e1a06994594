"""Instance workers: one process per instance, pinned before the runtime starts, and its supervision.

The child sets its cpu affinity (and SCHED_IDLE when asked) first, and only then imports and opens
the backend, so every runtime thread inherits the pinning and the policy. It warms up with two
inferences and then serves batches sent over a pipe. The parent (`InstanceWorker`) notices a death
through pipe EOF or the process sentinel, fails the batch that was in flight with a clear error,
records `worker_crashed`, and restarts the worker with a crash-loop backoff (`worker_restarted`).
"""
from __future__ import annotations

import asyncio
import json
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable

from reamer.host.errors import ReamerError
from reamer.serve.spec import InstanceSpec, append_event, static_batch_for
from reamer.serve.protocol.v2wire import binary_reply  # light (json, http); numpy only inside its functions

if TYPE_CHECKING:
    import numpy as np

    from reamer.serve.runtime.batchability import Batchability

    from reamer.serve.protocol.tensors import TensorInfo


class WorkerError(ReamerError):
    """An instance worker could not start or could not serve a batch."""


class WorkerStartError(WorkerError):
    """The worker process died or failed before it was ready (bad model, bad cpus, ...)."""


class InstanceCrashed(WorkerError):
    """The worker process died while a batch was in flight; that batch was not processed."""

    def __init__(self, index: int, exit_code: int | None) -> None:
        self.index = index
        self.exit_code = exit_code
        super().__init__(f"instance {index} crashed ({describe_exit(exit_code)}); request not processed — retry",
                         "retry the request; the instance is being restarted")


class InferenceFailed(WorkerError):
    """The backend raised on a batch (the worker itself is fine)."""


class ReplyBroken(WorkerError):
    """The worker began answering the client on its socket and could not finish (it died, or the client
    went away): the client holds part of a response, so the connection can only be closed."""


@dataclass
class Replied:
    """run_async's result when the worker answered the client itself (reply-through). `tail`: the end of
    the answer that the client's socket did not take at once, for the job to send (the worker never
    waits for a slow reader: that would hold the instance)."""

    tail: bytes = b""


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"exit code {code}, killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


class _Pipe(Connection):
    """multiprocessing's Connection with plain pickle: its ForkingPickler builds a pickler with a copied
    dispatch table for every message, which cost more CPU than the rest of a small batch's round trip."""

    def send(self, obj: Any) -> None:
        self.send_bytes(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any:
        return pickle.loads(self.recv_bytes())


# ---------------------------------------------------------------- tensors through shared memory

class _Arena:
    """A growable shared-memory file (memfd) that parent and worker both map; holds one batch's tensors.

    Tensors go through it instead of being pickled through the pipe: a 600 KB image batch pickled over
    a socket takes several fills of the socket buffer, and so several cross-cpu wake-ups of a process on
    a busy core, per request. The pipe now carries only a small message naming offsets and shapes.
    One batch at a time per instance (the parent's lock), so the writer never overwrites what the reader
    still uses.
    """

    ALIGN = 64

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map: mmap.mmap | None = None
        self._size = 0
        self.refresh()

    @classmethod
    def create(cls, name: str, size: int = 1 << 20) -> "_Arena":
        fd = os.memfd_create(name)
        os.ftruncate(fd, size)
        return cls(fd)

    def refresh(self) -> None:
        """Map the file again if the other side grew it."""
        size = os.fstat(self.fd).st_size
        if size != self._size:
            # The old map is not closed: numpy views of it may still live; it goes when they do.
            self._map, self._size = mmap.mmap(self.fd, size), size

    def write(self, arrays: dict[str, np.ndarray]) -> list[tuple[str, str, tuple, int]]:
        """Copy `arrays` in (growing the file when needed); the layout to send to the other side."""
        import numpy as np

        layout, end = [], 0
        for name, arr in arrays.items():
            layout.append((name, arr.dtype.str, arr.shape, end))
            end += -(-arr.nbytes // self.ALIGN) * self.ALIGN
        if end > self._size:
            os.ftruncate(self.fd, max(end, 2 * self._size))
            self.refresh()
        for (name, dtype, shape, offset) in layout:
            np.copyto(np.ndarray(shape, np.dtype(dtype), buffer=self._map, offset=offset), arrays[name],
                      casting="no")
        return layout

    def read(self, layout: list[tuple[str, str, tuple, int]], copy: bool) -> dict[str, np.ndarray]:
        """The arrays of `layout`: views (valid until the next write) or copies."""
        import numpy as np

        out = {}
        for name, dtype, shape, offset in layout:
            try:
                view = np.ndarray(shape, np.dtype(dtype), buffer=self._map, offset=offset)
            except TypeError:  # beyond the mapping: the other side grew the file
                self.refresh()
                view = np.ndarray(shape, np.dtype(dtype), buffer=self._map, offset=offset)
            out[name] = view.copy() if copy else view
        return out

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


# Tensors up to this size go inline in the pipe message: for a few KB (BERT's token ids, most models'
# outputs) pickling costs less than the arena's per-tensor views and copies.
INLINE_MAX_BYTES = 64 << 10


class _Flag(_Arena):
    """One shared byte, set by the worker when it starts writing a response to a client: after a crash
    the parent can tell a request the client got nothing of (503) from a half-sent answer (close)."""

    def set(self, value: bool) -> None:
        self._map[0] = 1 if value else 0

    def is_set(self) -> bool:
        return self._map[0] == 1


def _shareable(arrays: dict[str, np.ndarray]) -> bool:
    """Worth sending through the arena: plain numeric tensors, more than INLINE_MAX_BYTES in all."""
    total = 0
    for a in arrays.values():
        if getattr(a, "dtype", None) is None or a.dtype.hasobject:
            return False
        total += a.nbytes
    return total > INLINE_MAX_BYTES


# ---------------------------------------------------------------- child side

# The worker is a fresh interpreter that imports only this light module before it pins itself and
# sets its policy; numpy's BLAS pool and the runtime start their threads after that and inherit both.
_BOOTSTRAP = "import sys; from reamer.serve.runtime.worker import child_main; child_main(sys.argv[1:])"


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


def _reply_through(fd: int, plan: Any, outputs: dict[str, Any], elapsed: float, flag: _Flag,
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
        raise WorkerError(explain_failure(backend.model_path, plan, warm, exc),
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
    conn = _Pipe(fd)
    in_arena, out_arena, flag = _Arena(shared_fds[0]), _Arena(shared_fds[1]), _Flag(shared_fds[2])
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
            elif _shareable(outputs):
                conn.send(("ok_shared", out_arena.write(outputs), elapsed, t0))
            else:
                conn.send(("ok", outputs, elapsed, t0))
        except Exception as exc:  # noqa: BLE001
            conn.send(("error", str(exc)))
        finally:
            if client_fd >= 0:
                os.close(client_fd)
    backend.close()


# ---------------------------------------------------------------- parent side

class InstanceWorker:
    """Parent-side handle of one supervised instance worker process.

    `run()` is blocking and serialised (one batch at a time per instance); call it from a thread.
    """

    CRASH_WINDOW_S = 60.0
    MAX_BACKOFF_S = 30.0

    def __init__(self, index: int, spec: InstanceSpec, model_path: str, backend: str = "onnxruntime",
                 run_dir: str | None = None, start_timeout_s: float = 120.0,
                 samples: dict | None = None, precision: str = "f32") -> None:
        self.index = index
        self.precision = precision  # asked for ("f32" | "bf16")
        self.effective_precision: str | None = None  # what the started backend computes in (its own report)
        self.batchability: Batchability | None = None  # whether requests may be merged: the started worker's finding
        self.samples = samples or {}  # samples.SampleSpec.to_doc(): the warm-up's shapes and data
        self.spec = spec
        self.model_path = str(model_path)
        self.backend = backend
        self.run_dir = run_dir
        self.start_timeout_s = start_timeout_s
        self.inputs: list[TensorInfo] = []
        self.outputs: list[TensorInfo] = []
        self.ready = False
        self.busy = False
        self.last_error = ""
        self.restarts = 0
        self.batches_run = 0
        self.samples_run = 0
        self.answered_directly = 0  # batches whose client the worker answered itself (reply-through)
        self.latency_ewma_s: float | None = None
        self.last_backend_s = 0.0  # time of the last batch inside the backend (without the pipe)
        self.last_input_s = 0.0  # of the last batch: hand-over to the worker process (until its run began)
        self.last_output_s = 0.0  # and the way back (from the end of its run until the parent had the outputs)
        self.batch_ewma = 1.0
        self._proc: Any = None
        self._conn: Any = None
        self._arenas: tuple[_Arena, _Arena] | None = None
        self._flag: _Flag | None = None
        self._fd_sock: socket.socket | None = None  # the pipe's socket, to pass client sockets to the worker
        self._unread_replies = 0
        self._crashes: deque[float] = deque()
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    # -- state
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    EWMA_WEIGHT = 0.3
    OUTLIER_FACTOR = 3.0

    def note_batch(self, elapsed_s: float, samples: int) -> None:
        """Fold one batch's latency into the estimate the batcher sheds on. A batch counts at most
        OUTLIER_FACTOR times the estimate: one batch stalled by a noisy neighbour would otherwise make the job
        shed requests it would answer in time (the EWMA jumped to 0.6 s on one 2 s batch of a 10 ms model); a
        lasting slowdown still reaches the estimate within a few batches (each may raise it 1.6x)."""
        a = self.EWMA_WEIGHT
        if self.latency_ewma_s is None:
            self.latency_ewma_s = elapsed_s
        else:
            counted = min(elapsed_s, self.OUTLIER_FACTOR * self.latency_ewma_s)
            self.latency_ewma_s = (1 - a) * self.latency_ewma_s + a * counted
        self.batch_ewma = (1 - a) * self.batch_ewma + a * samples

    def service_rate(self) -> float | None:
        """Samples per second this instance serves at its recent batch size (None before any measurement)."""
        if not self.latency_ewma_s:
            return None
        return self.batch_ewma / self.latency_ewma_s

    # -- lifecycle
    def start(self) -> None:
        """Spawn the worker and wait until it is warmed up; WorkerStartError with the child's reason."""
        from reamer.serve.protocol.tensors import TensorInfo

        if self._conn is not None:  # the pipe of a previous (dead) process
            try:
                self._conn.close()
            except OSError:
                pass
        if self._fd_sock is not None:
            self._fd_sock.close()
        parent_sock, child_sock = socket.socketpair()
        cpus = ",".join(str(c) for c in self.spec.cpus)
        if self._arenas is None:
            self._arenas = (_Arena.create(f"reamer-instance-{self.index}-in"),
                            _Arena.create(f"reamer-instance-{self.index}-out"))
            self._flag = _Flag.create(f"reamer-instance-{self.index}-replying", size=1)
        shared_fds = [a.fd for a in self._arenas] + [self._flag.fd]
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOTSTRAP, str(child_sock.fileno()), cpus, self.spec.sched,
                 f"{self.spec.threads}" + (f"s{self.spec.streams}" if self.spec.streams > 1 else ""),
                 self.backend, self.precision, str(self.spec.max_batch), self.model_path, json.dumps(self.samples),
                 *map(str, shared_fds)],
                pass_fds=(child_sock.fileno(), *shared_fds), stdin=subprocess.DEVNULL)
        finally:
            child_sock.close()  # so a dead child gives EOF here
        parent_conn = _Pipe(os.dup(parent_sock.fileno()))
        self._proc, self._conn, self._fd_sock, self._unread_replies = proc, parent_conn, parent_sock, 0
        deadline = time.monotonic() + self.start_timeout_s
        msg = None
        while msg is None:
            if self._stopping.is_set():
                self._kill()
                raise WorkerStartError(f"instance {self.index} was stopped while starting")
            if time.monotonic() > deadline:
                self._kill()
                raise WorkerStartError(f"instance {self.index} did not become ready within {self.start_timeout_s:.0f} s",
                                       "check the model size and the cpus given to the instance")
            if parent_conn.poll(0.2):
                try:
                    msg = parent_conn.recv()
                except (EOFError, OSError):
                    _reap(proc)
                    raise WorkerStartError(f"instance {self.index} died while starting ({describe_exit(proc.returncode)})",
                                           "run the model with the same backend by hand to see the error")
        if msg[0] != "ready":
            self._kill()
            raise WorkerStartError(f"instance {self.index} failed to start: {msg[1]}",
                                   "fix the model path, backend or cpus in the job spec")
        info = msg[1]
        self.inputs = [TensorInfo(name=n, datatype=d, shape=s) for n, d, s in info["inputs"]]
        self.outputs = [TensorInfo(name=n, datatype=d, shape=s) for n, d, s in info["outputs"]]
        if self.latency_ewma_s is None:
            self.latency_ewma_s = max(info["warmup_latency_s"], 1e-6)
        self.effective_precision = info.get("precision")
        from reamer.serve.runtime.batchability import Batchability

        doc = info.get("batchability")
        self.batchability = Batchability.from_doc(doc) if doc else Batchability(False, "the worker did not say")
        self.last_error = ""
        self.ready = True

    def run(self, inputs: dict[str, np.ndarray],
            meanwhile: Callable[[], None] | None = None) -> dict[str, np.ndarray]:
        """Run one batch on this instance. InstanceCrashed if the worker dies; InferenceFailed on a backend error.

        `meanwhile` runs in the caller's thread while the instance computes (the offline runner reads
        its next file there).
        """
        with self._lock:
            samples, t0 = self._begin(inputs)
            try:
                try:
                    self._send(inputs)
                    if meanwhile is not None:
                        try:
                            meanwhile()
                        except BaseException:
                            self._unread_replies += 1  # the worker still answers; the next send skips it
                            raise
                    reply = self._conn.recv()
                except (EOFError, OSError):
                    raise self._crashed() from None
            finally:
                self.busy = False
            return self._finish(reply, samples, t0)

    async def run_async(self, inputs: dict[str, np.ndarray], fallback: ThreadPoolExecutor | None = None,
                        reply_to: tuple[int, Any] | None = None) -> dict[str, np.ndarray]:
        """`run()` from an event loop without handing the batch to a thread and back.

        Each hand-off between threads is a wake-up that a loaded core can delay by a scheduling slice;
        here the loop writes the request itself and waits for the reply with `add_reader`. When a
        restart or stop holds the instance, it falls back to `run()` on `fallback`.

        `reply_to` = (client socket fd, v2wire.ReplyPlan): the worker answers the client on that socket
        itself and this returns a Replied, or the outputs when it could not (then nothing was sent).
        ReplyBroken when the worker died or failed after it began writing.
        """
        loop = asyncio.get_running_loop()
        if not self._lock.acquire(blocking=False):
            return await loop.run_in_executor(fallback, self.run, inputs)
        try:
            samples, t0 = self._begin(inputs)
            try:
                try:
                    self._send(inputs, reply_to)
                    reply = await self._reply(loop)
                except (EOFError, OSError):
                    crash = self._crashed()
                    if reply_to is not None and self._flag is not None and self._flag.is_set():
                        raise ReplyBroken(f"{crash.message}; its answer was cut off",
                                          "retry the request on a new connection") from None
                    raise crash from None
            finally:
                self.busy = False
            return self._finish(reply, samples, t0)
        finally:
            self._lock.release()

    async def _reply(self, loop: asyncio.AbstractEventLoop) -> Any:
        conn = self._conn
        if not conn.poll():
            ready = loop.create_future()
            fd = conn.fileno()
            loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
            try:
                await ready
            except asyncio.CancelledError:
                self._unread_replies += 1  # the worker still answers; the next send skips that answer
                raise
            finally:
                loop.remove_reader(fd)
                # uvloop (libuv's uv_poll_init) makes a watched fd non-blocking, and the pipe reads a
                # message in blocking reads: a reply over 16 KB comes as two writes (size, then body),
                # and a read between them failed with EAGAIN, which looked like a dead instance.
                os.set_blocking(fd, True)
        return conn.recv()

    def _begin(self, inputs: dict[str, np.ndarray]) -> tuple[int, float]:
        if not self.ready or not self.alive:
            raise self._crashed()
        self.busy = True
        # a model that is not batchable runs one request per run, whatever its first dimension
        batchable = self.batchability is None or self.batchability.batchable
        return (_batch_of(inputs) if batchable else 1), time.perf_counter()

    def _send(self, inputs: dict[str, np.ndarray], reply_to: tuple[int, Any] | None = None) -> None:
        if reply_to is not None:
            self._flag.set(False)  # before anything can fail: a crash from here on is a clean 503
        while self._unread_replies:
            self._conn.recv()
            self._unread_replies -= 1
        plan = reply_to[1] if reply_to is not None else None
        if _shareable(inputs):
            self._conn.send(("run_shared", self._arenas[0].write(inputs), plan))
        else:
            self._conn.send(("run", inputs, plan))
        if reply_to is not None:
            try:
                socket.send_fds(self._fd_sock, [b"F"], [reply_to[0]])
            except OSError:
                self._proc.kill()  # it has the message and would wait for the socket for ever
                raise

    def _finish(self, reply: tuple, samples: int, t0: float) -> dict[str, np.ndarray]:
        status, payload, *timing = reply
        if status == "ok_shared":
            status, payload = "ok", self._arenas[1].read(payload, copy=True)
        if status not in ("ok", "replied", "reply_broken"):
            raise InferenceFailed(f"instance {self.index} could not run the batch: {payload}",
                                  "check the input shapes and dtypes against GET /v2/models/<name>")
        now = time.perf_counter()
        elapsed = now - t0
        self.last_backend_s = timing[0] if timing else elapsed
        if len(timing) > 1:
            self.last_input_s = max(timing[1] - t0, 0.0)
            self.last_output_s = max(now - timing[1] - self.last_backend_s, 0.0)
        else:
            self.last_input_s, self.last_output_s = 0.0, max(elapsed - self.last_backend_s, 0.0)
        self.batches_run += 1
        self.samples_run += samples
        self.note_batch(elapsed, samples)
        if status == "reply_broken":
            raise ReplyBroken(f"instance {self.index} could not finish its answer to the client: {payload}",
                              "retry the request on a new connection, and read responses as they come")
        if status == "replied":
            self.answered_directly += 1
            return Replied(payload)
        return payload

    def _crashed(self) -> WorkerError:
        """Note a death (once), and build the error for the request that hit it."""
        exit_code = None
        if self._proc is not None:
            _reap(self._proc)
            exit_code = self._proc.returncode
        was_ready, self.ready = self.ready, False
        if self._stopping.is_set():
            return WorkerError(f"instance {self.index} is stopping; request not processed — retry")
        if was_ready:
            self._record_crash(exit_code)
        return InstanceCrashed(self.index, exit_code)

    def _record_crash(self, exit_code: int | None) -> None:
        self._crashes.append(time.monotonic())
        self.last_error = f"instance {self.index} crashed ({describe_exit(exit_code)})"
        if self.run_dir:
            append_event(self.run_dir, "worker_crashed", self.last_error, instance=self.index,
                         exit_code=exit_code, pid=self.pid)

    def backoff_s(self) -> float:
        """Wait before the next restart: none after a first crash, then doubling (crash-loop guard)."""
        now = time.monotonic()
        while self._crashes and self._crashes[0] < now - self.CRASH_WINDOW_S:
            self._crashes.popleft()
        n = len(self._crashes)
        return 0.0 if n <= 1 else min(0.5 * 2 ** (n - 2), self.MAX_BACKOFF_S)

    def ensure_running(self) -> bool:
        """Restart the worker if it died (blocking, with backoff). True when it is ready to serve."""
        with self._lock:
            if self.ready and self.alive:
                return True
            if self._stopping.is_set():
                return False
            if self.ready:  # died while idle: noticed here through the sentinel
                self._crashed()
            if self._stopping.wait(self.backoff_s()):
                return False
            try:
                self.start()
            except WorkerStartError as exc:
                if self._stopping.is_set():
                    return False
                self.last_error = exc.message
                self._crashes.append(time.monotonic())
                if self.run_dir:
                    append_event(self.run_dir, "worker_start_failed", exc.message, instance=self.index)
                return False
            self.restarts += 1
            if self.run_dir:
                append_event(self.run_dir, "worker_restarted", f"instance {self.index} restarted (pid {self.pid})",
                             instance=self.index, pid=self.pid, restarts=self.restarts)
            return True

    def request_stop(self) -> None:
        """Mark the worker as stopping: no restarts from now on; a running batch still finishes."""
        self._stopping.set()

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the worker: let a running batch finish (up to grace_s), then end the process."""
        self._stopping.set()
        self.ready = False
        if self._proc is None:
            return
        if self._lock.acquire(timeout=grace_s):
            try:
                try:
                    if self._proc.poll() is None:
                        self._conn.send(("stop",))
                except OSError:
                    pass
                _reap(self._proc, grace_s)
            finally:
                self._lock.release()
        self._kill()

    def _kill(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            _reap(proc)
        if proc.poll() is None:
            proc.kill()
            _reap(proc)
        for closable in (self._conn, self._fd_sock):
            try:
                closable.close()
            except OSError:
                pass
        if self._stopping.is_set() and self._arenas is not None:
            for shared in (*self._arenas, self._flag):
                shared.close()
            self._arenas = self._flag = None


def _reap(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass


def _batch_of(inputs: dict[str, np.ndarray]) -> int:
    for arr in inputs.values():
        return int(arr.shape[0]) if arr.ndim else 1
    return 1
