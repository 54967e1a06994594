"""Run one inference job: `python -m reamer.serve.runtime.job --spec SPEC.json`.

The job process pins itself to `frontdoor_cpus`, starts one worker per instance, and then serves
(online: v2 REST and gRPC front doors + dynamic batcher) or works through its inputs (offline). It writes
`<run_dir>/status.json` about every 0.5 s and appends events to `<run_dir>/events.jsonl`.

Signals: SIGHUP re-reads the spec and restarts only the instances whose (cpus, threads, max_batch,
sched) changed, adding or removing others; new instances start before old ones retire and a
retiring instance finishes its batch, so online requests in flight are not dropped.
SIGTERM / SIGINT stop gracefully (exit 0). An offline job exits 0 with state "done" once every
input has a result, 1 with state "failed" when some input could not be processed.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvloop

from reamer.host.errors import ReamerError
from reamer.host.malloc import keep_large_buffers
from reamer.host.sched import ThreadGone, set_affinity, threads_of
from reamer.serve.runtime.joblog import bound_log
from reamer.serve.spec import InstanceSpec, JobSpec, JobStatus, SpecError, append_event, plan_reconcile
from reamer.serve.runtime.instances import InstanceWorker, WorkerStartError

STATUS_PERIOD_S = 0.5
OVERLOAD_SUSTAIN_S = 3.0


def pin_process(cpus: list[int]) -> None:
    """Pin every thread of this process (libraries may have started some) to `cpus`."""
    for tid in threads_of(os.getpid()):
        try:
            set_affinity(tid, cpus)
        except ThreadGone:
            pass  # a thread that just ended


class Job:
    def __init__(self, spec_path: str | os.PathLike) -> None:
        self._stop = threading.Event()
        self._hup = threading.Event()
        self._stop_reason = ""
        # Until the serving loop installs its own, note signals here: SIGHUP must never kill the job.
        signal.signal(signal.SIGTERM, lambda *_: self._request_stop("SIGTERM"))
        signal.signal(signal.SIGINT, lambda *_: self._request_stop("SIGINT"))
        signal.signal(signal.SIGHUP, lambda *_: self._hup.set())
        self.spec_path = Path(spec_path)
        self.spec = JobSpec.load(self.spec_path)
        self.run_dir = Path(self.spec.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.status = JobStatus(name=self.spec.name, pid=os.getpid(), instances_total=len(self.spec.instances))
        self.workers: list[InstanceWorker] = []  # aligned with self.spec.instances

    # -- shared
    def _event(self, kind: str, message: str, **fields) -> None:
        append_event(self.run_dir, kind, message, job=self.spec.name, **fields)

    def _write_status(self) -> None:
        try:
            self.status.write(self.run_dir)
        except OSError as exc:  # a full disk must not kill serving
            print(f"reamer job {self.spec.name}: cannot write status: {exc}", file=sys.stderr)
        bound_log(2, int(self.spec.log_max_mb * 2**20), self.run_dir)  # job.log: copied to job.log.1 past it

    def _fail(self, message: str) -> int:
        self.status.state = "failed"
        self.status.message = message
        self._write_status()
        self._event("failed", message)
        print(f"reamer job {self.spec.name}: {message}", file=sys.stderr)
        return 1

    def _new_worker(self, index: int, spec: InstanceSpec) -> InstanceWorker:
        return InstanceWorker(index, spec, self.spec.model, self.spec.backend, run_dir=str(self.run_dir),
                              samples=self.spec.samples(), precision=self.spec.precision)

    def _effective_precision(self) -> str | None:
        """What the ready instances compute in, as their backends report it ("f32+bf16" if they differ)."""
        seen = sorted({w.effective_precision for w in self.workers if w.ready and w.effective_precision})
        return "+".join(seen) or None

    def _start_workers(self, items: list[tuple[int, InstanceSpec]]) -> tuple[list[InstanceWorker], list[str]]:
        """Start workers in parallel; a worker that fails to start is returned too (its lane retries it)."""
        workers = [self._new_worker(i, s) for i, s in items]
        errors: list[str] = []

        def start(w: InstanceWorker) -> None:
            try:
                w.start()
            except WorkerStartError as exc:
                w.last_error = exc.message
                errors.append(exc.message)

        with ThreadPoolExecutor(max_workers=max(1, len(workers))) as pool:
            list(pool.map(start, workers))
        return workers, errors

    def _request_stop(self, reason: str) -> None:
        self._stop_reason = reason
        self._stop.set()

    def _reload_spec(self) -> tuple[JobSpec, list[tuple[int, int]], list[int], list[int]] | None:
        try:
            new = JobSpec.load(self.spec_path)
        except SpecError as exc:
            self._event("reload_failed", f"spec not reloaded: {exc}")
            return None
        if (new.kind != self.spec.kind or new.model != self.spec.model or new.backend != self.spec.backend
                or new.precision != self.spec.precision):
            self._event("reload_failed", "spec not reloaded: kind, model, backend and precision cannot change "
                                         "on SIGHUP; remove and redeploy the job")
            return None
        if new.frontdoor_cpus != self.spec.frontdoor_cpus and new.frontdoor_cpus:
            try:
                pin_process(new.frontdoor_cpus)
            except ReamerError as exc:
                self._event("reload_failed", f"spec not reloaded: cannot pin the job to {new.frontdoor_cpus}: {exc}")
                return None
        kept, start, retire = plan_reconcile(self.spec.instances, new.instances)
        return new, kept, start, retire

    def run(self) -> int:
        if self.spec.frontdoor_cpus:
            try:
                pin_process(self.spec.frontdoor_cpus)
            except ReamerError as exc:
                return self._fail(f"cannot pin the job to frontdoor_cpus {self.spec.frontdoor_cpus}: {exc}")
        if not os.path.isfile(self.spec.model):
            return self._fail(f"model file {self.spec.model} does not exist; build one with "
                              "`reamer models build NAME --out FILE`")
        self._write_status()
        try:
            if self.spec.kind == "online":
                # uvloop: its C loop and transports take a good part of the per-request CPU off the
                # job's core (bench/RESULTS.md)
                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                    return runner.run(self._run_online())
            return self._run_offline()
        except ReamerError as exc:
            return self._fail(str(exc))

    # -- online
    async def _run_online(self) -> int:
        from reamer.serve.runtime.batcher import DynamicBatcher
        from reamer.serve.doors.http_server import FrontDoor
        from reamer.serve.doors.limits import DoorLimits
        from reamer.serve.doors.rest import V2App
        from reamer.serve.doors.grpc import GrpcFrontDoor, GrpcV2Service
        from reamer.serve.measure.stats import FrontDoorLoad, OverloadDetector, RequestStats

        spec = self.spec
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, lambda: (self._request_stop("SIGTERM"), wake.set()))
        loop.add_signal_handler(signal.SIGINT, lambda: (self._request_stop("SIGINT"), wake.set()))
        loop.add_signal_handler(signal.SIGHUP, lambda: (self._hup.set(), wake.set()))

        stats = RequestStats(spec.slo_ms)
        door_load = FrontDoorLoad(stats.window_s)
        overload = OverloadDetector(spec.rate_rps, sustain_s=OVERLOAD_SUSTAIN_S)
        # a fault in the batch path is logged by the batcher and recorded here as an event
        batcher = DynamicBatcher(spec.slo_ms, stats, name=spec.name,
                                 on_fault=lambda kind, message: self._event(kind, message))
        platform = "onnxruntime_onnx" if spec.backend == "onnxruntime" else "openvino"
        limits = DoorLimits.from_settings(spec.max_request_mb, spec.frontdoor)
        door = FrontDoor(V2App(spec.name, batcher, platform, limits), spec.host, spec.port or 0)
        self.status.port = door.port
        # gRPC beside REST (Open Inference Protocol's gRPC form), over the same batcher and limits
        grpc_door = GrpcFrontDoor(GrpcV2Service(spec.name, batcher, platform, limits.max_request_bytes), spec.host, spec.grpc_port or 0,
                                  max_request_bytes=limits.max_request_bytes, limits=limits,
                                  budget_ledger=door)  # one max_buffered_mb for both doors
        self.status.grpc_port = await grpc_door.start()
        self._write_status()  # the ports are known now, before the workers are up
        serving = {"front door": loop.create_task(door.serve()),
                   "gRPC front door": loop.create_task(grpc_door.serve())}

        async def stop_doors() -> None:  # stop accepting; the requests in flight finish
            door.request_stop()
            grpc_door.request_stop()
            await asyncio.gather(*serving.values())

        workers, errors = await loop.run_in_executor(None, self._start_workers, list(enumerate(spec.instances)))
        if len(errors) == len(workers):
            await stop_doors()
            return self._fail(f"no instance could start: {errors[0]}")
        self.workers = workers
        for w in workers:
            batcher.add_instance(w)

        reloading: asyncio.Task | None = None
        while not self._stop.is_set():
            for what, task in serving.items():
                if task.done():
                    exc = task.exception()
                    return self._fail(f"the {what} stopped: {exc}" if exc else f"the {what} stopped")
            # Reload in the background (starting workers takes seconds) so status keeps flowing.
            if self._hup.is_set() and (reloading is None or reloading.done()):
                self._hup.clear()
                reloading = loop.create_task(self._reload_online(batcher, stats, overload))
            snap = stats.snapshot()
            ready = batcher.ready_count()
            st = self.status
            st.instances_ready, st.instances_total = ready, len(self.workers)
            st.requests, st.shed, st.rate_rps = snap.requests, snap.shed, snap.rate_rps
            st.p50_ms, st.p99_ms, st.slo_attainment = snap.p50_ms, snap.p99_ms, snap.slo_attainment
            st.state = "ready" if ready == len(self.workers) else "starting"
            st.precision = self._effective_precision()
            self._note_batchability(batcher.batchability())
            down = [w.last_error for w in self.workers if not w.ready and w.last_error]
            st.message = f"{ready} of {len(self.workers)} instances ready" + (f"; {down[0]}" if down else "")
            load = door_load.update(time.monotonic(), time.process_time(), snap.requests + snap.shed)
            st.frontdoor_busy, st.frontdoor_cpu_ms = load.busy, load.cpu_ms
            if door_load.newly_saturated(load):
                per_request = f", {load.cpu_ms:g} ms per request" if load.cpu_ms is not None else ""
                self._event("frontdoor_saturated",
                            f"job {spec.name}'s front door used {load.busy:.0%} of a cpu over the last "
                            f"{stats.window_s:g} s{per_request}: one process, it limits this job's rate before the "
                            "instances do; clients sending binary tensors (tritonclient's default) cost it a "
                            "fraction of JSON's, or split the traffic over more jobs",
                            busy=load.busy, cpu_ms=load.cpu_ms)
            rate = stats.arrival_rate(span_s=OVERLOAD_SUSTAIN_S)
            if overload.observe(rate):
                self._event("overload", f"job {spec.name} receives {rate:.1f} req/s, above its admitted "
                                        f"{overload.admitted_rps:g} req/s for {OVERLOAD_SUSTAIN_S:g} s",
                            rate_rps=rate, admitted_rps=overload.admitted_rps)
            # fsync takes ms on a busy disk: never block the event loop that serves requests with it
            await loop.run_in_executor(None, self._write_status)
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), STATUS_PERIOD_S)
            except asyncio.TimeoutError:
                pass

        # Graceful stop: stop accepting, let requests in flight finish, then stop the workers.
        if reloading is not None and not reloading.done():
            await reloading
        await stop_doors()
        await batcher.close()
        # State stays as it was: "done" would tell the agent an online job finished on its own.
        self.status.instances_ready = 0
        self.status.message = f"stopped by {self._stop_reason}"
        self._write_status()
        return 0

    def _note_batchability(self, verdict) -> None:
        """Status fields and, when it changes, an event: whether requests are merged (batchability.py)."""
        if verdict is None or (self.status.batchable, self.status.batchable_reason) == (verdict.batchable,
                                                                                        verdict.reason):
            return
        self.status.batchable, self.status.batchable_reason = verdict.batchable, verdict.reason
        how = "requests are merged into batches" if verdict.batchable else "each request runs alone (not batchable)"
        self._event("batching", f"job {self.spec.name}: {how}: {verdict.reason}", batchable=verdict.batchable)

    async def _reload_online(self, batcher, stats, overload) -> None:
        try:
            await self._reconfigure_online(batcher, stats, overload)
        except Exception as exc:  # noqa: BLE001 - a failed reload must not take serving down
            self._event("reload_failed", f"reconfiguration failed: {type(exc).__name__}: {exc}")

    async def _reconfigure_online(self, batcher, stats, overload) -> None:
        plan = self._reload_spec()
        if plan is None:
            return
        new, kept, start, retire = plan
        loop = asyncio.get_running_loop()
        started, _ = await loop.run_in_executor(None, self._start_workers, [(j, new.instances[j]) for j in start])
        old = self._realign(new, kept, started)
        for w in started:
            batcher.add_instance(w)  # new ones serve before old ones retire
        for i in retire:
            await batcher.remove_instance(old[i])
        batcher.slo_ms = stats.slo_ms = new.slo_ms
        overload.admitted_rps = new.rate_rps
        if new.port not in (self.spec.port, 0, None) and new.port != self.status.port:
            self._event("reload_failed", f"port change to {new.port} needs a restart of the job; still on {self.status.port}")
        if new.grpc_port not in (self.spec.grpc_port, 0, None) and new.grpc_port != self.status.grpc_port:
            self._event("reload_failed", f"gRPC port change to {new.grpc_port} needs a restart of the job; "
                                         f"still on {self.status.grpc_port}")
        self.spec = new
        self._event("reconfigured", f"instances: kept {len(kept)}, started {len(start)}, stopped {len(retire)}",
                    kept=len(kept), started=len(start), stopped=len(retire))

    # -- offline
    def _run_offline(self) -> int:
        from reamer.serve.runtime.offline import OfflineRunner

        spec = self.spec
        runner = OfflineRunner(spec.input_dir, spec.output_dir, self.run_dir)
        self.status.total = runner.total
        self.status.state = "running"
        started_at = time.monotonic()
        if not runner.all_done.is_set():
            workers, errors = self._start_workers(list(enumerate(spec.instances)))
            if len(errors) == len(workers):
                return self._fail(f"no instance could start: {errors[0]}")
            self.workers = workers
            for w in workers:
                runner.add_instance(w)
        try:
            while not self._stop.is_set() and not runner.all_done.is_set():
                if self._hup.is_set():
                    self._hup.clear()
                    self._reload_offline(runner)
                self._offline_status(runner)
                runner.all_done.wait(STATUS_PERIOD_S)
        finally:
            runner.stop()
        self._offline_status(runner)
        if self._stop.is_set() and not runner.all_done.is_set():
            self.status.message = (f"stopped by {self._stop_reason} with {self.status.done} of {self.status.total} "
                                   "inputs done; run again to resume")
            self._write_status()
            return 0
        if runner.failures:
            return self._fail(runner.failure_summary())
        took = time.monotonic() - started_at
        self.status.state = "done"
        self.status.message = f"all {runner.total} inputs processed"
        self._write_status()
        self._event("done", f"job {spec.name}: all {runner.total} inputs processed in {took:.1f} s", total=runner.total)
        return 0

    def _offline_status(self, runner) -> None:
        p = runner.progress()
        st = self.status
        st.done, st.total, st.throughput, st.eta_s = p.done, p.total, p.throughput, p.eta_s
        st.instances_ready = sum(1 for w in runner.workers if w.ready)
        st.instances_total = len(self.workers)
        st.precision = self._effective_precision()
        st.message = f"{p.done} of {p.total} inputs done" + (f", {p.failed} failed" if p.failed else "")
        self._write_status()

    def _reload_offline(self, runner) -> None:
        plan = self._reload_spec()
        if plan is None:
            return
        new, kept, start, retire = plan
        started, _ = self._start_workers([(j, new.instances[j]) for j in start])
        old = self._realign(new, kept, started)
        for w in started:
            runner.add_instance(w)
        for i in retire:
            runner.remove_instance(old[i])
        self.spec = new
        self._event("reconfigured", f"instances: kept {len(kept)}, started {len(start)}, stopped {len(retire)}",
                    kept=len(kept), started=len(start), stopped=len(retire))

    def _realign(self, new: JobSpec, kept: list[tuple[int, int]],
                 started: list[InstanceWorker]) -> list[InstanceWorker]:
        """Index kept and started workers by their place in the new spec; returns the old list (to retire from)."""
        old = self.workers
        aligned: list[InstanceWorker | None] = [None] * len(new.instances)
        for i, j in kept:
            old[i].index = j
            aligned[j] = old[i]
        for w in started:
            aligned[w.index] = w
        self.workers = [w for w in aligned if w is not None]
        return old


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reamer.serve.runtime.job", description="Run one reamer inference job.")
    parser.add_argument("--spec", required=True, help="path of the job spec JSON")
    args = parser.parse_args(argv)
    keep_large_buffers()  # request bodies and offline inputs: reuse heap memory, no page faults per buffer
    try:
        job = Job(args.spec)
    except (SpecError, OSError) as exc:
        print(f"reamer job: {exc}", file=sys.stderr)
        return 2
    return job.run()


if __name__ == "__main__":
    sys.exit(main())
