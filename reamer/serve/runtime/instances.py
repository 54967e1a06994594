"""Instance workers, the parent's side: one process per instance, pinned before the runtime starts
(runtime/instance_worker), and its supervision.

The child sets its cpu affinity (and SCHED_IDLE when asked) first, and only then imports and opens
the backend, so every runtime thread inherits the pinning and the policy. It warms up with two
inferences and then serves batches sent over a pipe. The parent (`InstanceWorker`) notices a death
through pipe EOF or the process sentinel, fails the batch that was in flight with a clear error,
records `worker_crashed`, and restarts the worker with a crash-loop backoff (`worker_restarted`).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from reamer.host.errors import ReamerError
from reamer.serve.protocol.errors import Fault
from reamer.serve.runtime.instance_channel import Arena, Pipe, ReplyFlag, shareable
from reamer.serve.spec import InstanceSpec, append_event

if TYPE_CHECKING:
    import numpy as np

    from reamer.serve.runtime.batchability import Batchability

    from reamer.serve.protocol.tensors import TensorInfo


class WorkerError(ReamerError):
    """An instance worker could not start or could not serve a batch."""

    fault = Fault.NOT_READY


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

    fault = Fault.BAD_INPUT


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


# The worker's entry: a fresh interpreter that imports only the light child module before it pins itself.
_BOOTSTRAP = "import sys; from reamer.serve.runtime.instance_worker import child_main; child_main(sys.argv[1:])"


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
        self._arenas: tuple[Arena, Arena] | None = None
        self._flag: ReplyFlag | None = None
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
            self._arenas = (Arena.create(f"reamer-instance-{self.index}-in"),
                            Arena.create(f"reamer-instance-{self.index}-out"))
            self._flag = ReplyFlag.create(f"reamer-instance-{self.index}-replying", size=1)
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
        parent_conn = Pipe(os.dup(parent_sock.fileno()))
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
        if shareable(inputs):
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
