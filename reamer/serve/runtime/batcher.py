"""Dynamic batching of online requests over instance workers, with SLO-based load shedding.

Requests wait in one queue. Every instance has a serving loop: when it is idle it takes the oldest
request and, up to its max batch, the compatible ones that arrived; it waits for more at most
`max_wait = min(0.2 * SLO, estimated batch latency)` after the oldest arrived — but only while requests
arrive densely enough (recent mean gap between arrivals within that window) for waiting to fill the
batch. At a low rate an idle instance starts at once: waiting would add latency and batch nothing.
Under load batches still form, from the requests that queue while every instance is busy.
Only a batchable model's requests are merged (batchability.py: Triton's rule on the declared shapes, confirmed
on the job's sample inputs when each instance starts); a model that is not batchable runs one request per run,
whatever its first dimension, and its outputs go back whole. For a batchable model, inputs are concatenated
along axis 0 (a request may carry a batch) and every output is split back by the batch dimension; an output
without one row per input row fails that check, and the model is then served one request per run. A request whose
batch is larger than the instances' max_batch is split into parts of at most max_batch samples, queued
as separate requests, at most one per instance at a time (so a huge request neither floods the queue
nor holds every instance while others wait), and answered as one; it is never answered by the instance
itself (reply-through needs the whole answer in one batch).
A request that finds nothing queued, an idle instance and no reason to wait for a fuller batch runs
on that instance straight from the request's own task (no hand-off to the instance's loop and back:
each hand-off is an event-loop turn, about 0.1 ms on a cold core).

A fault anywhere in a batch (assembling it, the run, splitting its outputs) fails or re-runs alone the requests
it holds, is logged, and the instance's loop takes the next batch; a loop that still ends marks the job not ready.

A new request is shed (Overloaded) when no instance is idle and its estimated completion —
what is left of the soonest batch in flight + the whole batches queued ahead at the measured service rate +
a full batch of its own (it fills while it waits) — would exceed the SLO.
"""
from __future__ import annotations

import asyncio
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from reamer.host.errors import ReamerError
from reamer.plan.online_sim import MAX_WAIT_SHARE_OF_SLO
from reamer.serve.runtime.batchability import Batchability
from reamer.serve.protocol.errors import Fault
from reamer.serve.protocol.model_stats import ModelStatistics
from reamer.serve.measure.stats import RequestStats
from reamer.serve.runtime.instances import InferenceFailed, InstanceWorker, Replied, WorkerError

if TYPE_CHECKING:
    from reamer.serve.protocol.tensors import TensorInfo


class Overloaded(ReamerError):
    """The job cannot serve this request within its SLO right now."""

    fault = Fault.NOT_READY


class NotReady(ReamerError):
    """No instance of the job is ready to serve."""

    fault = Fault.NOT_READY


class RequestRefused(InferenceFailed):
    """The request does not fit the way the model is served (the client's to fix: 400)."""


class ModelFault(WorkerError):
    """The model's answer to a batch could not be handed back to its requests (500, with the reason)."""

    fault = Fault.MODEL_FAULT



@dataclass
class RequestTiming:
    """Where one request's time went inside the job (seconds): waiting for an instance, and the
    backend run of the batch it was in (the rest is decode, batching and the hop to the instance)."""

    queue_s: float = 0.0
    compute_s: float = 0.0
    # Triton's statistics: rows the request counted (1 for a model that is not batchable), and the batch's
    # hand-over to the instance and way back (compute_s is its run)
    rows: int = 1
    input_s: float = 0.0
    output_s: float = 0.0


@dataclass(eq=False)  # compared by identity: queue.remove() must not compare the tensors
class _Request:
    inputs: dict[str, np.ndarray]
    batch: int
    signature: tuple
    arrived: float
    future: asyncio.Future = field(repr=False)
    timing: RequestTiming = field(default_factory=RequestTiming)
    reply_to: tuple | None = None  # (client socket fd, v2wire.ReplyPlan): the instance may answer itself


@dataclass
class _Lane:
    """One instance and the asyncio task that feeds it."""

    worker: InstanceWorker
    executor: ThreadPoolExecutor
    task: asyncio.Task | None = None
    retiring: bool = False
    idle: bool = False
    claimed: bool = False  # a request runs on it directly, outside its serving loop
    busy_since: float | None = None  # monotonic start of the batch in flight (None: none)
    failed: str = ""  # why its serving loop ended for good (the job is then not ready)


class DynamicBatcher:
    IDLE_CHECK_S = 0.25

    FAULT_EVENT_GAP_S = 10.0  # on_fault is called at most this often per kind (every fault is logged)

    def __init__(self, slo_ms: float | None, stats: RequestStats | None = None, name: str = "job",
                 default_max_wait_ms: float = 5.0, on_fault: Callable[[str, str], None] | None = None) -> None:
        self.slo_ms = slo_ms
        self.stats = stats or RequestStats(slo_ms)
        self.model_stats = ModelStatistics()
        self.name = name
        self.default_max_wait_ms = default_max_wait_ms
        self.on_fault = on_fault  # (kind, message): the job records an event
        self._fault_noted: dict[str, float] = {}
        self._refuted: Batchability | None = None  # outputs seen without one row per input row
        self._queue: list[_Request] = []
        self._lanes: list[_Lane] = []
        self._wakeup: asyncio.Condition | None = None
        self._closed = False
        self._last_arrival: float | None = None
        self._gap_ewma_s: float | None = None  # recent mean gap between arrivals

    # -- instances
    @property
    def workers(self) -> list[InstanceWorker]:
        return [lane.worker for lane in self._lanes if not lane.retiring]

    def _serving(self, lane: _Lane) -> bool:
        w = lane.worker
        return w.ready and w.alive and not lane.failed

    def ready_count(self) -> int:
        return sum(1 for lane in self._lanes if not lane.retiring and self._serving(lane))

    def all_ready(self) -> bool:
        lanes = [lane for lane in self._lanes if not lane.retiring]
        return bool(lanes) and all(self._serving(lane) for lane in lanes)

    def not_ready_reason(self) -> str:
        """Why the job is not ready (for the 503 of the ready endpoints)."""
        lanes = [lane for lane in self._lanes if not lane.retiring]
        failed = [lane.failed for lane in lanes if lane.failed]
        down = [lane.worker.last_error for lane in lanes if not self._serving(lane) and lane.worker.last_error]
        return "; ".join([f"{self.ready_count()} of {len(lanes)} instances are ready", *failed, *down[:1]])

    def batchability(self) -> Batchability | None:
        """Whether requests are merged: what the started instances found (batchability.py), unless a batch's
        outputs have since shown otherwise; None while no instance has started."""
        if self._refuted is not None:
            return self._refuted
        verdicts = [w.batchability for w in self.workers if w.batchability is not None]
        if not verdicts:
            return None
        return next((v for v in verdicts if not v.batchable), verdicts[0])

    def merging(self) -> bool:
        verdict = self.batchability()
        return verdict is not None and verdict.batchable

    def _run_size(self, worker: InstanceWorker) -> int:
        """The most rows one run of `worker` takes: its max batch, or one request for a model not batchable."""
        return worker.spec.max_batch if self.merging() else 1

    def _fault(self, kind: str, message: str, trace: bool = False) -> None:
        """Log a fault in the batch path (the job's log), and tell the job (an event), at most every
        FAULT_EVENT_GAP_S per kind."""
        print(f"reamer job {self.name}: {message}", file=sys.stderr)
        if trace:
            traceback.print_exc(file=sys.stderr)
        now = time.monotonic()
        if self.on_fault is not None and now - self._fault_noted.get(kind, -1e9) >= self.FAULT_EVENT_GAP_S:
            self._fault_noted[kind] = now
            try:
                self.on_fault(kind, message)
            except Exception:  # noqa: BLE001 - recording must never break serving
                traceback.print_exc(file=sys.stderr)

    def _refute(self, reason: str) -> None:
        if self._refuted is None:
            self._refuted = Batchability(False, reason)
            self._fault("not_batchable", f"requests are no longer merged: {reason}")

    def signature(self) -> tuple[list[TensorInfo], list[TensorInfo]] | None:
        """The model's (inputs, outputs) from the first instance that has loaded it; None while none has."""
        for w in self.workers:
            if w.inputs:
                return w.inputs, w.outputs
        return None

    def _cond(self) -> asyncio.Condition:
        if self._wakeup is None:
            self._wakeup = asyncio.Condition()
        return self._wakeup

    def add_instance(self, worker: InstanceWorker) -> None:
        """Start feeding a (started) worker. Must be called from the event loop."""
        lane = _Lane(worker, ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"instance-{worker.index}"))
        lane.task = asyncio.get_running_loop().create_task(self._serve(lane))
        lane.task.add_done_callback(lambda task, lane=lane: self._lane_ended(lane, task))
        self._lanes.append(lane)

    def _lane_ended(self, lane: _Lane, task: asyncio.Task) -> None:
        if lane.retiring or task.cancelled():
            return
        exc = task.exception()
        lane.failed = (f"instance {lane.worker.index}'s serving loop stopped"
                       + (f": {type(exc).__name__}: {exc}" if exc is not None else ""))
        self._fault("lane_failed", lane.failed + "; the job is not ready")

    async def remove_instance(self, worker: InstanceWorker) -> None:
        """Stop feeding a worker after its current batch, then stop its process."""
        lane = next((ln for ln in self._lanes if ln.worker is worker), None)
        if lane is None:
            return
        lane.retiring = True
        worker.request_stop()  # no restart of a retiring worker; its running batch still finishes
        async with self._cond():
            self._cond().notify_all()
        if lane.task is not None:
            await lane.task
        await asyncio.get_running_loop().run_in_executor(lane.executor, worker.stop)
        lane.executor.shutdown(wait=False)
        self._lanes.remove(lane)

    async def close(self) -> None:
        """Stop all instances after their current batches; fail what is still queued."""
        self._closed = True
        await asyncio.gather(*(self.remove_instance(lane.worker) for lane in list(self._lanes)))
        for req in self._queue:
            if not req.future.done():
                req.future.set_exception(NotReady(f"job {self.name} is shutting down; request not processed — retry"))
        self._queue.clear()

    # -- admission
    def estimated_completion_s(self) -> float | None:
        """Estimated time until a request arriving now would be answered (None before any measurement): what is
        left of the soonest batch in flight, the whole batches queued ahead at the instances' combined rate, then
        a full batch of its own. (Counting a whole batch for the one in flight shed requests that arrived late in
        it, and would have made it; counting every queued sample and the mean batch's latency ran 53-82 ms high
        for BERT-base at max batch 4, bench/shed_accuracy.py.)"""
        measured = [(self._run_size(w), rate) for w in self.workers if w.ready and (rate := w.service_rate())]
        if not measured:
            return None
        rates = [rate for _, rate in measured]
        # its own batch fills up to the instance's max batch while it waits: count a full one at the measured rate
        full_batch_s = [max_batch / rate for max_batch, rate in measured]
        now = time.monotonic()
        # an overdue batch is still counted at a quarter of its usual time: when it ends is unknown
        left = [max(lane.worker.latency_ewma_s - (now - lane.busy_since), 0.25 * lane.worker.latency_ewma_s)
                for lane in self._lanes if lane.busy_since is not None and lane.worker.latency_ewma_s]
        batch = max(min((self._run_size(w) for w in self.workers), default=1), 1)
        ahead = sum(r.batch for r in self._queue) // batch * batch  # the samples that start before its batch does
        return (min(left) if left else 0.0) + ahead / sum(rates) + sum(full_batch_s) / len(full_batch_s)

    GAP_EWMA_WEIGHT = 0.2

    def _note_arrival(self, now: float) -> None:
        if self._last_arrival is not None:
            gap = now - self._last_arrival
            a = self.GAP_EWMA_WEIGHT
            self._gap_ewma_s = gap if self._gap_ewma_s is None else (1 - a) * self._gap_ewma_s + a * gap
        self._last_arrival = now

    def _max_wait_s(self, worker: InstanceWorker) -> float:
        if self._run_size(worker) <= 1:
            return 0.0
        est = worker.latency_ewma_s or self.default_max_wait_ms / 1000.0
        if self.slo_ms is None:
            window = min(est, self.default_max_wait_ms / 1000.0)
        else:
            window = min(self.slo_ms * MAX_WAIT_SHARE_OF_SLO / 1000.0, est)
        # No other request is expected within the window: waiting would only delay this one.
        if self._gap_ewma_s is None or self._gap_ewma_s > window:
            return 0.0
        return window

    def _any_idle(self) -> bool:
        return any(lane.idle and not lane.claimed and lane.worker.ready and not lane.retiring for lane in self._lanes)

    def _lane_free_now(self) -> _Lane | None:
        """An idle instance that would start a new request at once (nothing queued, no batching wait)."""
        if self._queue:
            return None
        for lane in self._lanes:
            w = lane.worker
            if (lane.idle and not lane.claimed and not lane.retiring and self._serving(lane)
                    and self._max_wait_s(w) == 0.0):
                return lane
        return None

    async def _run_directly(self, lane: _Lane, req: _Request) -> None:
        lane.claimed = True
        try:
            await self._run_batch(lane, [req])
        finally:
            lane.claimed = False
            if self._queue:  # requests that queued meanwhile: the instance's loop takes them
                async with self._cond():
                    self._cond().notify_all()

    async def infer(self, inputs: dict[str, np.ndarray], timing: RequestTiming | None = None,
                    reply_to: tuple | None = None) -> dict[str, np.ndarray]:
        """Queue one request (arrays with a leading batch axis for a batchable model; any shapes the model
        takes otherwise) and wait for its outputs; `timing`, when given, is filled in with where the time went.

        `reply_to` = (client socket fd, v2wire.ReplyPlan): when the request runs in a batch of its own, the
        instance answers the client itself and this returns a worker.Replied.
        Raises Overloaded (shed), NotReady (no instance), RequestRefused (the request does not fit),
        InstanceCrashed, InferenceFailed, ModelFault, ReplyBroken.
        """
        arrived = time.monotonic()
        timing = timing if timing is not None else RequestTiming()
        try:
            outputs = await self._infer(inputs, timing, reply_to, arrived)
        except BaseException:
            self.model_stats.record_failure(time.monotonic() - arrived)
            raise
        self.model_stats.record_success(timing.rows, time.monotonic() - arrived, timing.queue_s, timing.input_s,
                                        timing.compute_s, timing.output_s)
        return outputs

    def _rows(self, inputs: dict[str, np.ndarray]) -> int:
        """The request's rows for a batchable model; RequestRefused when its inputs have no common batch."""
        rows = {name: (arr.shape[0] if arr.ndim else None) for name, arr in inputs.items()}
        scalar = [name for name, n in rows.items() if n is None]
        if scalar:
            raise RequestRefused(f"input {scalar[0]!r} is a scalar (rank 0), but this model is served with a batch "
                                 "dimension: every input's first dimension is the batch",
                                 "send the input with a leading batch dimension (shape [1, ...] for one row)")
        if len(set(rows.values())) > 1:
            raise RequestRefused(f"inputs disagree on the batch size (first dimension): {rows}",
                                 "give every input the same first dimension")
        return next(iter(rows.values()), 1)

    async def _infer(self, inputs: dict[str, np.ndarray], timing: RequestTiming, reply_to: tuple | None,
                     arrived: float) -> dict[str, np.ndarray]:
        self._note_arrival(arrived)
        if self._closed:
            raise NotReady(f"job {self.name} is shutting down", "retry against the job's new address")
        if self.ready_count() == 0:
            self.stats.record_shed()
            reason = "; ".join(w.last_error for w in self.workers if w.last_error) or "instances are starting"
            raise NotReady(f"job {self.name} has no ready instance ({reason})", "retry in a few seconds")
        merging = self.merging()
        try:
            batch = self._rows(inputs) if merging else 1
        except RequestRefused:
            self.stats.record_failed()
            raise
        timing.rows = batch
        if self.slo_ms is not None and not self._any_idle():
            est = self.estimated_completion_s()
            if est is not None and est * 1000.0 > self.slo_ms:
                self.stats.record_shed()
                raise Overloaded(
                    f"job {self.name} is over capacity: estimated completion {est * 1000.0:.0f} ms exceeds its "
                    f"{self.slo_ms:g} ms SLO; request shed",
                    "retry later, lower the request rate, or give the job more cores")
        signature = tuple(sorted((k, v.dtype.str, v.shape[1:] if merging else v.shape) for k, v in inputs.items()))
        limit = self.max_batch()
        if merging and limit and batch > limit:
            return await self._infer_split(inputs, batch, limit, signature, arrived, timing)
        req = _Request(inputs, batch, signature, arrived, asyncio.get_running_loop().create_future(), timing, reply_to)
        lane = self._lane_free_now()
        if lane is not None:
            await self._run_directly(lane, req)
        else:
            cond = self._cond()
            async with cond:
                self._queue.append(req)
                cond.notify_all()
        try:
            outputs = await req.future
        except (WorkerError, NotReady):
            self.stats.record_failed()
            raise
        self.stats.record(time.monotonic() - arrived)
        return outputs

    def max_batch(self) -> int:
        """The most samples every instance takes in one batch (0 before any instance is added)."""
        return min((w.spec.max_batch for w in self.workers), default=0)

    async def _infer_split(self, inputs: dict[str, np.ndarray], batch: int, limit: int, signature: tuple,
                           arrived: float, timing: RequestTiming) -> dict[str, np.ndarray]:
        loop = asyncio.get_running_loop()
        parts = [_Request({k: v[i:i + limit] for k, v in inputs.items()}, min(limit, batch - i), signature, arrived,
                          loop.create_future()) for i in range(0, batch, limit)]
        lanes = asyncio.Semaphore(max(1, len(self.workers)))
        failed: list[BaseException] = []

        async def run(part: _Request) -> dict[str, np.ndarray]:
            async with lanes:
                if failed:  # an earlier part failed: the request fails, the rest is not run
                    raise failed[0]
                lane = self._lane_free_now()
                if lane is not None:
                    await self._run_directly(lane, part)
                else:
                    async with self._cond():
                        self._queue.append(part)
                        self._cond().notify_all()
                try:
                    return await part.future
                except BaseException as exc:
                    failed.append(exc)
                    raise

        try:
            results = await asyncio.gather(*(run(p) for p in parts))
        except (WorkerError, NotReady):
            self.stats.record_failed()
            raise
        timing.queue_s = max(p.timing.queue_s for p in parts)
        timing.compute_s = sum(p.timing.compute_s for p in parts)
        timing.input_s = sum(p.timing.input_s for p in parts)
        timing.output_s = sum(p.timing.output_s for p in parts)
        outputs = {}
        for name in results[0]:
            per_part = [np.asarray(r[name]) for r in results]
            if not all(a.ndim and a.shape[0] == p.batch for a, p in zip(per_part, parts)):
                reason = (f"output {name!r} does not have one row per input row, so a request larger than the "
                          f"max batch ({limit}) cannot be answered in parts")
                self._refute(reason)
                self.stats.record_failed()
                raise ModelFault(f"job {self.name}: {reason}", f"send at most {limit} rows per request")
            outputs[name] = np.concatenate(per_part)
        self.stats.record(time.monotonic() - arrived)
        return outputs

    # -- serving loop of one instance
    def _take(self, max_batch: int) -> list[_Request]:
        """The oldest request and the compatible ones behind it, up to max_batch samples (the oldest alone
        when requests are not merged)."""
        first = self._queue[0]
        taken, total = [first], first.batch
        verdict = self.batchability()  # known whenever requests queue (an instance is ready)
        if verdict is None or verdict.batchable:
            for req in self._queue[1:]:
                if total >= max_batch:
                    break
                if req.signature == first.signature and total + req.batch <= max_batch:
                    taken.append(req)
                    total += req.batch
        for req in taken:
            self._queue.remove(req)
        return taken

    def _compatible_samples(self) -> int:
        first = self._queue[0]
        return sum(r.batch for r in self._queue if r.signature == first.signature)

    async def _serve(self, lane: _Lane) -> None:
        while not lane.retiring:
            taken: list[_Request] = []
            try:
                done = await self._serve_once(lane, taken)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any one batch
                self._fault("batch_failed", f"instance {lane.worker.index}: the serving loop hit "
                                            f"{type(exc).__name__}: {exc}; it goes on", trace=True)
                self._fail(taken, exc)
                await asyncio.sleep(self.IDLE_CHECK_S)  # a fault that repeats must not spin the loop
                continue
            if done:
                break
        lane.idle = False

    async def _serve_once(self, lane: _Lane, taken: list[_Request]) -> bool:
        """Wait for requests, take a batch (into `taken`) and run it; True when the worker is stopping."""
        loop = asyncio.get_running_loop()
        worker = lane.worker
        cond = self._cond()
        if not (worker.ready and worker.alive):
            lane.idle = False
            if not await loop.run_in_executor(lane.executor, worker.ensure_running):
                if worker.stopping:
                    return True
                await asyncio.sleep(self.IDLE_CHECK_S)
                return False
        lane.idle = True
        async with cond:
            if not self._queue or lane.claimed:
                try:
                    await asyncio.wait_for(cond.wait(), self.IDLE_CHECK_S)
                except asyncio.TimeoutError:
                    pass
                if not self._queue or lane.retiring or lane.claimed:
                    return False
            # Wait for a fuller batch, but never past max_wait after the oldest arrived.
            max_batch = self._run_size(worker)
            deadline = self._queue[0].arrived + self._max_wait_s(worker)
            while self._queue and self._compatible_samples() < max_batch and not lane.retiring:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(cond.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            if not self._queue:
                return False
            taken.extend(self._take(max_batch))
            lane.idle = False
        await self._run_batch(lane, taken)
        return False

    @staticmethod
    def _fail(requests: list[_Request], exc: BaseException) -> None:
        err = exc if isinstance(exc, ReamerError) else ModelFault(
            f"the batch failed in the job: {type(exc).__name__}: {exc}", "retry; if it persists, see the job's log")
        for r in requests:
            if not r.future.done():
                r.future.set_exception(err)

    async def _run_batch(self, lane: _Lane, taken: list[_Request]) -> None:
        live = [r for r in taken if not r.future.done()]  # client may have gone away
        if not live:
            return
        started = time.monotonic()
        for r in live:
            r.timing.queue_s = started - r.arrived
        lane.busy_since = started
        try:
            await self._run_live(lane, live)
        except ReamerError as exc:  # explained already: the client's input, a crash (recorded by the worker)
            self._fail(live, exc)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the requests get an answer
            self._fault("batch_failed", f"instance {lane.worker.index}: a batch of {len(live)} request(s) failed: "
                                        f"{type(exc).__name__}: {exc}", trace=True)
            self._fail(live, exc)
        finally:
            lane.busy_since = None

    async def _run_alone(self, lane: _Lane, live: list[_Request]) -> None:
        for r in live:
            await self._run_batch(lane, [r])

    async def _run_live(self, lane: _Lane, live: list[_Request]) -> None:
        t0 = time.perf_counter()
        if len(live) == 1:
            batch_inputs = live[0].inputs
        else:
            try:
                batch_inputs = {n: np.concatenate([r.inputs[n] for r in live]) for n in live[0].inputs}
            except Exception as exc:  # noqa: BLE001 - requests that cannot be joined run alone
                self._fault("batch_failed", f"instance {lane.worker.index}: {len(live)} requests could not be "
                                            f"joined into one batch ({exc}); each runs alone")
                await self._run_alone(lane, live)
                return
        assemble_s = time.perf_counter() - t0
        reply_to = live[0].reply_to if len(live) == 1 else None
        if reply_to is not None:
            reply_to[1].queue_s = live[0].timing.queue_s
        worker = lane.worker
        try:
            outputs = await worker.run_async(batch_inputs, fallback=lane.executor, reply_to=reply_to)
        except InferenceFailed:
            if len(live) > 1:
                # The model refused the batch: one request it cannot take must not fail the others
                # batched with it, so each runs alone and gets its own answer.
                await self._run_alone(lane, live)
                return
            raise
        t1 = time.perf_counter()
        rows = sum(r.batch for r in live)
        if isinstance(outputs, Replied) or len(live) == 1:
            parts = [outputs]  # a request alone gets the model's outputs whole
        else:
            parts = self._split(outputs, live)
            if parts is None:  # outputs not per row: each request runs alone, and none is merged again
                await self._run_alone(lane, live)
                return
        input_s = assemble_s + worker.last_input_s
        output_s = worker.last_output_s + (time.perf_counter() - t1)
        self.model_stats.record_execution(rows, input_s, worker.last_backend_s, output_s)
        for r, part in zip(live, parts):
            r.timing.compute_s, r.timing.input_s, r.timing.output_s = worker.last_backend_s, input_s, output_s
            if not r.future.done():
                r.future.set_result(part)

    def _split(self, outputs: dict[str, np.ndarray], live: list[_Request]) -> list[dict[str, np.ndarray]] | None:
        """Each request's rows of every output, by the batch dimension; None (and the model refuted as
        batchable) when an output does not have one row per input row."""
        rows = sum(r.batch for r in live)
        for name, arr in outputs.items():
            arr = np.asarray(arr)
            if arr.ndim == 0 or arr.shape[0] != rows:
                self._refute(f"output {name!r} had shape {list(arr.shape)} for a batch of {rows} rows: it does not "
                             "have one row per input row")
                return None
        parts, offset = [], 0
        for r in live:
            parts.append({name: arr[offset:offset + r.batch] for name, arr in outputs.items()})
            offset += r.batch
        return parts
