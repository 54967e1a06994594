"""What a cluster scheduler asks a node: its spare capacity, and whether it could take a job (dry run).

Capacity is in the units schedulers count: whole cores (a Slurm GRES count, a Kubernetes extended resource)
and core-equivalents for batch work (koordinator's batch-cpu). Spare cores are whole cores held by no
training job, no online inference job and no housekeeping; offline inference uses them and gives them
up at once. Batch capacity adds the idle share of training's own cores, measured over the last pass.

Dry-run admission answers with what the agent would do and changes nothing.
"""
from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from reamer.plan.coretable import AllocationError, CoreTable


K8S_SPARE_CORES = "reamer.io/spare-cores"  # whole cores (an extended resource: integers only)
K8S_BATCH_CPU = "reamer.io/batch-cpu"  # milli-cores for batch work, like koordinator's kubernetes.io/batch-cpu


@dataclass(frozen=True)
class Capacity:
    spare_cores: int  # whole cores a scheduler may hand to new work on this node
    spare_cpus: list[int]
    offline_capacity_cores: float  # core-equivalents for batch work: spare cores + training cores' idle share
    offline_capacity_millicores: int
    training_cores: int
    reserved_cpus: list[int]
    generation: int  # increases whenever spare_cores or offline capacity (to 0.1 core) changes
    ts: float = field(default_factory=time.time)
    # the same in Kubernetes node-status units: extended resource name -> quantity (integers, as strings)
    kubernetes: dict[str, str] = field(default_factory=dict)

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)

    def key(self) -> tuple[int, float]:
        return self.spare_cores, round(self.offline_capacity_cores, 1)


class CapacityTracker:
    """Capacity from the core table, the online jobs' cpus and the measured idle share of training cpus."""

    def __init__(self) -> None:
        self.generation = 0
        self._last_key: tuple[int, float] | None = None
        self._last_times: list[Any] | None = None
        self._idle_share: dict[int, float] = {}

    def sample(self) -> None:
        """Per-cpu idle share since the previous sample (called once per reconcile pass)."""
        times = psutil.cpu_times(percpu=True)
        if self._last_times is not None and len(times) == len(self._last_times):
            for cpu, (now, before) in enumerate(zip(times, self._last_times)):
                total = sum(now) - sum(before)
                idle = (now.idle + getattr(now, "iowait", 0.0)) - (before.idle + getattr(before, "iowait", 0.0))
                if total > 0:
                    self._idle_share[cpu] = min(1.0, max(0.0, idle / total))
        self._last_times = times

    def compute(self, cores: CoreTable, online_cpus: set[int]) -> tuple[Capacity, bool]:
        """(capacity, changed since the last call)."""
        spare = [core for core in cores.free_cores() if not online_cpus.intersection(core)]
        spare_cpus = sorted(cpu for core in spare for cpu in core)
        training = sorted(cores.training_cpus())
        per_core = len(spare_cpus) / len(spare) if spare else 1.0
        idle_training = sum(self._idle_share.get(cpu, 0.0) for cpu in training) / max(per_core, 1.0)
        offline = round(len(spare) + idle_training, 3)
        training_cores = sum(1 for core in cores.topology.physical_cores() if set(core) & set(training))
        capacity = Capacity(spare_cores=len(spare), spare_cpus=spare_cpus,
                            offline_capacity_cores=offline, offline_capacity_millicores=int(offline * 1000),
                            training_cores=training_cores, reserved_cpus=sorted(cores.reserved),
                            generation=self.generation,
                            kubernetes={K8S_SPARE_CORES: str(len(spare)), K8S_BATCH_CPU: str(int(offline * 1000))})
        changed = capacity.key() != self._last_key
        if changed:
            self.generation += 1
            self._last_key = capacity.key()
            capacity = Capacity(**{**capacity.to_doc(), "generation": self.generation})
        return capacity, changed


@dataclass(frozen=True)
class TrainingAdmission:
    admit: bool
    cpus: list[int]  # what it would take
    evicts: list[dict[str, str]]  # inference jobs it would move: {"job", "kind", "action": pending|shrunk|moved}
    reason: str

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)


def admit_training(cores: CoreTable, supervisor: Any, n_cores: int, within: list[int] | None = None
                   ) -> TrainingAdmission:
    """Would a training job of `n_cores` fit (inside `within`, a scheduler's allocation, if given), and which
    inference jobs would give way? Works on copies: nothing changes."""
    from reamer.plan.placement import place

    trial = copy.deepcopy(cores)
    try:
        cpus = list(trial.allocate("\0dry-run", n_cores, within=within))
    except AllocationError as error:
        return TrainingAdmission(False, [], [], f"{error.message}; {error.fix}")
    demands = supervisor.demands()
    evicts = []
    if demands:
        now = {n: sorted(c for i in insts for c in i.cpus) for n, insts in supervisor.previous().items()}
        result = place(trial.idle_cpus(), trial.training_cpus(), demands, supervisor.previous())
        for demand in demands:
            placed = result.assignments.get(demand.job) or []
            after = sorted(c for i in placed for c in i.cpus)
            before = now.get(demand.job, [])
            if not placed and before:
                evicts.append({"job": demand.job, "kind": demand.kind, "action": "pending"})
            elif len(after) < len(before):
                evicts.append({"job": demand.job, "kind": demand.kind, "action": "shrunk"})
            elif after != before and before:
                evicts.append({"job": demand.job, "kind": demand.kind, "action": "moved"})
    reason = f"{n_cores} core(s) free" + (f"; {len(evicts)} inference job(s) would give way" if evicts else "")
    return TrainingAdmission(True, cpus, evicts, reason)
