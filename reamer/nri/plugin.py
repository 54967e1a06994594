"""reamer's NRI plugin: training containers get whole cores from the agent before they start; inference
containers get the idle cores; every other container is left exactly as the runtime made it.

Decisions (see docs/scheduler-authors.md, "Kubernetes (NRI)"):
- The agent owns every reservation (keyed by container id, durable in its store); the plugin keeps only a
  cache it rebuilds at Synchronize, so a restart of either loses nothing.
- cpuset.cpus only: memory placement (cpuset.mems) stays the kernel's, as with reamer's other pinning, so a
  training job never runs out of memory on one NUMA node while another has plenty.
- No RT runtime in the adjustment: on cgroup v1 the runtime would have to write cpu.rt_runtime_us into a new
  cgroup whose pod-level parents hold no RT budget, and the container would fail to start. The agent gives
  the budget in place (container cgroup and its ancestors) at StartContainer, when the container's init
  process exists but has not yet run the entrypoint, and makes it SCHED_RR, which the entrypoint inherits.
- A training container the agent cannot place (too few free cores, a malformed annotation, agent down) is
  refused: the runtime fails CreateContainer with the reason and the kubelet retries with back-off; a
  training job never silently runs unpinned.
- Inference containers get the agent's spare cores (no training, no online inference, no housekeeping), or
  the housekeeping cores when there are none; they follow the pool as training comes and goes (updates sent
  from a background thread, never from inside an event the runtime is waiting on).
- An UpdateContainer (e.g. the kubelet's UpdateContainerResources) of a container reamer placed gets reamer's
  cpuset back in the reply, so nothing widens it behind the agent's back.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from reamer.api.client import AgentUnreachable, ApiClient, ApiError
from reamer.host.cpulist import format_cpulist, parse_cpulist
from reamer.host.errors import ReamerError
from reamer.nri import annotations
from reamer.nri.proto import api_pb2 as api
from reamer.nri.stub import event_mask
from reamer.nri.ttrpc import INVALID_ARGUMENT, UNKNOWN, TtrpcError

log = logging.getLogger("reamer.nri")

JOB_PREFIX = "k8s-"
ID_CHARS = 12
POOL_REFRESH_S = 5.0
# containerd closes a plugin that misses plugin_request_timeout (2 s by default): every agent call answers
# (or fails) well inside it
CALL_TIMEOUT_S = 1.5
START_WAIT_S = 1.0  # at StartContainer: how long the runtime waits for the pinning (the agent's pass follows up)
ORPHAN_GRACE_S = 30.0  # an agent record no live container of this plugin's matches, older than this, is stale


def job_name(container_id: str) -> str:
    return JOB_PREFIX + container_id[:ID_CHARS]


def refuse(error: ReamerError, code: int = INVALID_ARGUMENT) -> TtrpcError:
    return TtrpcError(code, f"reamer: {error.message} — fix: {error.fix}")


@dataclass
class Placed:
    """A container reamer placed: its role and cpus."""

    role: str
    cpus: list[int] = field(default_factory=list)


def cpuset_resources(cpus: list[int]) -> api.LinuxResources:
    return api.LinuxResources(cpu=api.LinuxCPU(cpus=format_cpulist(cpus)))


def container_update(container_id: str, cpus: list[int]) -> api.ContainerUpdate:
    # the id must be set: containerd ignores an update without one (koordinator#3129)
    return api.ContainerUpdate(container_id=container_id, linux=api.LinuxContainerUpdate(resources=cpuset_resources(cpus)))


class ReamerPlugin:
    events = event_mask(api.CREATE_CONTAINER, api.START_CONTAINER, api.UPDATE_CONTAINER, api.STOP_CONTAINER,
                        api.REMOVE_CONTAINER)

    def __init__(self, agent: ApiClient, stale_after_s: float = ORPHAN_GRACE_S) -> None:
        self.agent = agent
        self.stale_after_s = stale_after_s
        self.placed: dict[str, Placed] = {}  # container id -> what reamer gave it
        self._lock = threading.Lock()
        self._pool_changed = threading.Event()
        self.send_updates: Any = None  # Stub.update_containers, set once connected

    # --- the agent ---

    def _attach(self, container: api.Container, pod: api.PodSandbox, request: annotations.PodRequest) -> list[int]:
        body: dict[str, Any] = {"name": job_name(container.id), "k8s_container": container.id,
                                "k8s_pod": f"{pod.namespace}/{pod.name}", "cores": request.cores}
        if request.priority is not None:
            body["priority"] = request.priority
        try:
            return list(self.agent.request("POST", "/v1/training-jobs", json=body, timeout=CALL_TIMEOUT_S)["cpus"])
        except ApiError as error:
            raise refuse(error) from None
        except AgentUnreachable as error:
            raise refuse(error, UNKNOWN) from None

    def _release(self, container_id: str) -> None:
        try:
            self.agent.request("DELETE", f"/v1/training-jobs/{job_name(container_id)}", timeout=CALL_TIMEOUT_S)
        except ApiError as error:
            if error.status != 404:  # 404: it ended already (its processes exited)
                log.warning("giving back the cores of %s: %s", container_id[:12], error)
        except AgentUnreachable as error:
            log.warning("giving back the cores of %s: %s (the agent ends the job when its processes are gone)",
                        container_id[:12], error.message)

    def inference_pool(self) -> list[int]:
        """Spare cores (none held by training, online inference or housekeeping), else the housekeeping ones."""
        capacity = self.agent.request("GET", "/v1/capacity", timeout=CALL_TIMEOUT_S)
        jobs = self.agent.request("GET", "/v1/training-jobs", timeout=CALL_TIMEOUT_S)["jobs"]
        taken = {c for job in jobs for c in job["cpus"]}
        spare = sorted(set(capacity["spare_cpus"]) - taken)
        return spare or sorted(set(capacity["reserved_cpus"]) - taken)

    # --- NRI events ---

    def configure(self, req: api.ConfigureRequest) -> None:
        pass

    def synchronize(self, req: api.SynchronizeRequest) -> api.SynchronizeResponse:
        """Adopt what runs: every annotated container gets (or keeps) its record at the agent; records of
        containers that no longer exist give their cores back."""
        pods = {p.id: p for p in req.pods}
        updates, live = [], set()
        for container in req.containers:
            live.add(container.id)
            if container.state == api.CONTAINER_STOPPED:
                continue
            pod = pods.get(container.pod_sandbox_id)
            request = self._request_of(pod, container) if pod is not None else None
            if request is None:
                continue
            try:
                cpus = self._attach(container, pod, request) if request.role == "training" else self.inference_pool()
            except (TtrpcError, ReamerError) as error:
                log.error("adopting container %s of pod %s/%s: %s", container.id[:12], pod.namespace, pod.name, error)
                continue
            with self._lock:
                self.placed[container.id] = Placed(request.role, cpus)
            current = parse_cpulist(container.linux.resources.cpu.cpus) if container.linux.resources.cpu.cpus else []
            if cpus and sorted(current) != cpus:
                updates.append(container_update(container.id, cpus))
        self._forget_gone(live)
        return api.SynchronizeResponse(update=updates)

    def create_container(self, req: api.CreateContainerRequest) -> api.CreateContainerResponse:
        request = self._request_of(req.pod, req.container)
        if request is None:
            return api.CreateContainerResponse()  # not reamer's: exactly as the runtime made it
        if request.role == "training":
            cpus = self._attach(req.container, req.pod, request)
        else:
            try:
                cpus = self.inference_pool()
            except ReamerError as error:
                raise refuse(error, UNKNOWN) from None
            if not cpus:
                raise TtrpcError(INVALID_ARGUMENT, "reamer: no idle cores on this node for an inference pod — fix: "
                                 "schedule it by the reamer.io/spare-cores resource, or configure reserved_cpus")
        with self._lock:
            self.placed[req.container.id] = Placed(request.role, cpus)
        if request.role == "training":
            self._pool_changed.set()
        adjust = api.ContainerAdjustment(linux=api.LinuxContainerAdjustment(resources=cpuset_resources(cpus)))
        return api.CreateContainerResponse(adjust=adjust)

    def update_container(self, req: api.UpdateContainerRequest) -> api.UpdateContainerResponse:
        with self._lock:
            placed = self.placed.get(req.container.id)
        if placed is None or not placed.cpus:
            return api.UpdateContainerResponse()
        return api.UpdateContainerResponse(update=[container_update(req.container.id, placed.cpus)])

    def stop_container(self, req: api.StopContainerRequest) -> api.StopContainerResponse:
        return api.StopContainerResponse()

    def state_change(self, req: api.StateChangeEvent) -> None:
        container_id = req.container.id
        with self._lock:
            placed = self.placed.get(container_id)
        if placed is None or placed.role != "training":
            if req.event == api.REMOVE_CONTAINER:
                with self._lock:
                    self.placed.pop(container_id, None)
            return
        if req.event == api.START_CONTAINER:
            # the task exists and has not run the entrypoint yet: the agent pins its init process now
            request = self._request_of(req.pod, req.container)
            if request is not None:
                pinning = threading.Thread(target=self._pin_at_start, args=(req.container, req.pod, request),
                                           daemon=True)
                pinning.start()
                pinning.join(START_WAIT_S)  # answer in time even when the agent is slow: it finishes anyway
        elif req.event == api.REMOVE_CONTAINER:
            self._release(container_id)
            with self._lock:
                self.placed.pop(container_id, None)
            self._pool_changed.set()

    def shutdown(self) -> None:
        pass

    # --- helpers ---

    def _pin_at_start(self, container: api.Container, pod: api.PodSandbox, request: annotations.PodRequest) -> None:
        try:
            self._attach(container, pod, request)
        except TtrpcError as error:
            log.warning("pinning %s at start: %s (the agent's next pass retries)", container.id[:12], error)

    def _request_of(self, pod: api.PodSandbox, container: api.Container) -> annotations.PodRequest | None:
        try:
            request = annotations.parse(pod.annotations)
        except annotations.BadAnnotation as error:
            raise refuse(error) from None
        if request is None or not request.covers(container.name):
            return None
        return request

    def _forget_gone(self, live: set[str]) -> None:
        """Agent records of Kubernetes containers the runtime no longer has: their cores go back."""
        try:
            jobs = self.agent.request("GET", "/v1/training-jobs")["jobs"]
        except ReamerError as error:
            log.warning("listing the agent's jobs: %s", error)
            return
        for job in jobs:
            scheduler = job.get("scheduler") or {}
            if job.get("source") == "k8s" and scheduler.get("container_id") not in live:
                log.info("container %s is gone: its cores go back", scheduler.get("container_id", "")[:12])
                self._release(scheduler["container_id"])
        with self._lock:
            for container_id in set(self.placed) - live:
                self.placed.pop(container_id)

    def collect_orphans(self) -> None:
        """Records whose container never came to be (the runtime gave up on a CreateContainer whose answer came
        too late, or failed it after the plugin answered): their cores go back. Every live container reamer
        placed is in `placed` (rebuilt at each Synchronize), so a record missing there is stale."""
        try:
            jobs = self.agent.request("GET", "/v1/training-jobs", timeout=CALL_TIMEOUT_S)["jobs"]
        except ReamerError as error:
            log.warning("listing the agent's jobs: %s", error)
            return
        now = time.time()
        with self._lock:
            known = set(self.placed)
        for job in jobs:
            container_id = (job.get("scheduler") or {}).get("container_id", "")
            if job.get("source") == "k8s" and container_id not in known and now - job["created_at"] > self.stale_after_s:
                log.info("no container %s runs here: its cores go back", container_id[:12])
                self._release(container_id)

    def refresh_inference(self, stop: threading.Event) -> None:
        """Background: keep inference containers on the current pool (never on a training container's cores)."""
        while not stop.is_set():
            self._pool_changed.wait(POOL_REFRESH_S)
            self._pool_changed.clear()
            if stop.is_set() or self.send_updates is None:
                continue
            self.collect_orphans()
            with self._lock:
                inference = {cid: p for cid, p in self.placed.items() if p.role == "inference"}
            if not inference:
                continue
            try:
                pool = self.inference_pool()
            except ReamerError as error:
                log.warning("reading the inference pool: %s", error)
                continue
            changed = [cid for cid, p in inference.items() if pool and p.cpus != pool]
            if not changed:
                continue
            try:
                failed = self.send_updates([container_update(cid, pool) for cid in changed])
            except Exception as error:  # noqa: BLE001 - the connection may have closed; the next one resyncs
                log.warning("moving inference containers to cpus %s: %s", format_cpulist(pool), error)
                continue
            failed_ids = {u.container_id for u in failed}
            with self._lock:
                for cid in changed:
                    if cid not in failed_ids and cid in self.placed:
                        self.placed[cid].cpus = pool
