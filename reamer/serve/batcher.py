"""Dynamic batching of online requests over instance workers, with SLO-based load shedding.

Requests wait in one queue. Every instance has a serving loop: when it is idle it takes the oldest
request and, up to its max batch, the compatible ones that arrived; it waits for more at most
`max_wait = min(0.2 * SLO, estimated batch latency)` after the oldest arrived — but only while requests
arrive densely enough (recent mean gap between arrivals within that window) for waiting to fill the
batch. At a low rate an idle instance starts at once: waiting would add latency and batch nothing.
Under load batches still form, from the requests that queue while every instance is busy.
Inputs are concatenated along axis 0 (a request may carry a batch), outputs split back. A request whose
batch is larger than the instances' max_batch is split into parts of at most max_batch samples, queued
as separate requests, at most one per instance at a time (so a huge request neither floods the queue
nor holds every instance while others wait), and answered as one; it is never answered by the instance
itself (reply-through needs the whole answer in one batch).
A request that finds nothing queued, an idle instance and no reason to wait for a fuller batch runs
on that instance straight from the request's own task (no hand-off to the instance's loop and back:
each hand-off is an event-loop turn, about 0.1 ms on a cold core).

A new request is shed (Overloaded) when no instance is idle and its estimated completion —
what is left of the soonest batch in flight + the whole batches queued ahead at the measured service rate +
a full batch of its own (it fills while it waits) — would exceed the SLO.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from reamer.host.errors import ReamerError
from reamer.plan.online_sim import MAX_WAIT_SHARE_OF_SLO
from reamer.serve.stats import RequestStats
from reamer.serve.worker import InferenceFailed, InstanceWorker, Replied, WorkerError

if TYPE_CHECKING:
    from reamer.serve.tensors import TensorInfo


class Overloaded(ReamerError):
    """The job cannot serve this request within its SLO right now."""


class NotReady(ReamerError):
    """No instance of the job is ready to serve."""


@dataclass
class RequestTiming:
    """Where one request's time went inside the job (seconds): waiting for an instance, and the
    backend run of the batch it was in (the rest is decode, batching and the hop to the instance)."""

    queue_s: float = 0.0
    compute_s: float = 0.0


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


class DynamicBatcher:
    IDLE_CHECK_S = 0.25

    def __init__(self, slo_ms: float | None, stats: RequestStats | None = None, name: str = "job",
                 default_max_wait_ms: float = 5.0) -> None:
        self.slo_ms = slo_ms
        self.stats = stats or RequestStats(slo_ms)
        self.name = name
        self.default_max_wait_ms = default_max_wait_ms
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

    def ready_count(self) -> int:
        return sum(1 for w in self.workers if w.ready and w.alive)

    def all_ready(self) -> bool:
        workers = self.workers
        return bool(workers) and all(w.ready and w.alive for w in workers)

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
        self._lanes.append(lane)

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
        measured = [(w.spec.max_batch, rate) for w in self.workers if w.ready and (rate := w.service_rate())]
        if not measured:
            return None
        rates = [rate for _, rate in measured]
        # its own batch fills up to the instance's max batch while it waits: count a full one at the measured rate
        full_batch_s = [max_batch / rate for max_batch, rate in measured]
        now = time.monotonic()
        # an overdue batch is still counted at a quarter of its usual time: when it ends is unknown
        left = [max(lane.worker.latency_ewma_s - (now - lane.busy_since), 0.25 * lane.worker.latency_ewma_s)
                for lane in self._lanes if lane.busy_since is not None and lane.worker.latency_ewma_s]
        batch = max(self.max_batch(), 1)
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
        if worker.spec.max_batch <= 1:
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
            if (lane.idle and not lane.claimed and not lane.retiring and w.ready and w.alive
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
        """Queue one request (arrays with a leading batch axis) and wait for its outputs; `timing`, when
        given, is filled in with where the time went.

        `reply_to` = (client socket fd, v2wire.ReplyPlan): when the request runs in a batch of its own, the
        instance answers the client itself and this returns a worker.Replied.
        Raises Overloaded (shed), NotReady (no instance), InstanceCrashed, InferenceFailed, ReplyBroken.
        """
        arrived = time.monotonic()
        self._note_arrival(arrived)
        if self._closed:
            raise NotReady(f"job {self.name} is shutting down", "retry against the job's new address")
        if self.ready_count() == 0:
            self.stats.record_shed()
            reason = "; ".join(w.last_error for w in self.workers if w.last_error) or "instances are starting"
            raise NotReady(f"job {self.name} has no ready instance ({reason})", "retry in a few seconds")
        batch = int(next(iter(inputs.values())).shape[0]) if inputs else 1
        if self.slo_ms is not None and not self._any_idle():
            est = self.estimated_completion_s()
            if est is not None and est * 1000.0 > self.slo_ms:
                self.stats.record_shed()
                raise Overloaded(
                    f"job {self.name} is over capacity: estimated completion {est * 1000.0:.0f} ms exceeds its "
                    f"{self.slo_ms:g} ms SLO; request shed",
                    "retry later, lower the request rate, or give the job more cores")
        signature = tuple(sorted((k, v.dtype.str, v.shape[1:]) for k, v in inputs.items()))
        limit = self.max_batch()
        if limit and batch > limit:
            return await self._infer_split(inputs, batch, limit, signature, arrived,
                                           timing if timing is not None else RequestTiming())
        req = _Request(inputs, batch, signature, arrived, asyncio.get_running_loop().create_future(),
                       timing if timing is not None else RequestTiming(), reply_to)
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
        self.stats.record(time.monotonic() - arrived)
        outputs = {}
        for name, first in results[0].items():
            per_part = [r[name] for r in results]
            # outputs along the batch axis are joined; per-batch values (no batch axis) are the first part's
            joined = all(a.ndim and a.shape[0] == p.batch for a, p in zip(per_part, parts))
            outputs[name] = np.concatenate(per_part) if joined else first
        return outputs

    # -- serving loop of one instance
    def _take(self, max_batch: int) -> list[_Request]:
        """The oldest request and the compatible ones behind it, up to max_batch samples."""
        first = self._queue[0]
        taken, total = [first], first.batch
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
        loop = asyncio.get_running_loop()
        worker = lane.worker
        cond = self._cond()
        while not lane.retiring:
            if not (worker.ready and worker.alive):
                lane.idle = False
                if not await loop.run_in_executor(lane.executor, worker.ensure_running):
                    if worker.stopping:
                        return
                    await asyncio.sleep(self.IDLE_CHECK_S)
                    continue
            lane.idle = True
            async with cond:
                if not self._queue or lane.claimed:
                    try:
                        await asyncio.wait_for(cond.wait(), self.IDLE_CHECK_S)
                    except asyncio.TimeoutError:
                        pass
                    if not self._queue or lane.retiring or lane.claimed:
                        continue
                # Wait for a fuller batch, but never past max_wait after the oldest arrived.
                max_batch = worker.spec.max_batch
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
                    continue
                taken = self._take(max_batch)
                lane.idle = False
            await self._run_batch(lane, taken)
        lane.idle = False

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
        finally:
            lane.busy_since = None

    async def _run_live(self, lane: _Lane, live: list[_Request]) -> None:
        names = list(live[0].inputs)
        batch_inputs = {n: (live[0].inputs[n] if len(live) == 1 else np.concatenate([r.inputs[n] for r in live]))
                        for n in names}
        reply_to = live[0].reply_to if len(live) == 1 else None
        if reply_to is not None:
            reply_to[1].queue_s = live[0].timing.queue_s
        try:
            outputs = await lane.worker.run_async(batch_inputs, fallback=lane.executor, reply_to=reply_to)
        except (WorkerError, Exception) as exc:  # noqa: BLE001 - every failure goes to the waiting clients
            if isinstance(exc, InferenceFailed) and len(live) > 1:
                # The model refused the batch: one request it cannot take must not fail the others
                # batched with it, so each runs alone and gets its own answer.
                for r in live:
                    await self._run_batch(lane, [r])
                return
            err = exc if isinstance(exc, ReamerError) else InferenceFailed(f"batch failed: {exc}")
            for r in live:
                if not r.future.done():
                    r.future.set_exception(err)
            return
        if isinstance(outputs, Replied):
            live[0].timing.compute_s = lane.worker.last_backend_s
            if not live[0].future.done():
                live[0].future.set_result(outputs)
            return
        offset = 0
        for r in live:
            r.timing.compute_s = lane.worker.last_backend_s
            part = {}
            for name, arr in outputs.items():
                # Outputs without the batch axis (scalars, per-batch values) go to everyone unchanged.
                if arr.ndim and arr.shape[0] == sum(x.batch for x in live):
                    part[name] = arr[offset:offset + r.batch]
                else:
                    part[name] = arr
            offset += r.batch
            if not r.future.done():
                r.future.set_result(part)
