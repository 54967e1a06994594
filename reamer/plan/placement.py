"""Placement of inference jobs on CPUs (Cloud Reamer §III-A/§III-B).

- Online jobs get exclusive idle CPUs, all-or-nothing, in priority order (the order of `demands`:
  earlier deploys first). A job keeps the CPUs it had when they are still idle (stable placement:
  no needless worker restarts); it takes fresh CPUs next, and only then CPUs another, lower-priority
  job had. A job that does not fit goes to `pending`.
- Offline jobs get one single-thread instance per remaining idle CPU and per training CPU
  (`on_training=True`: training preempts them there through SCHED_RR). Several offline jobs share
  the CPUs evenly; a CPU stays with the offline job that had it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Mapping, Sequence

from reamer.plan.layout import InstanceShape, Layout


@dataclass(frozen=True)
class InferenceDemand:
    job: str
    kind: Literal["online", "offline"]
    layout: Layout | None = None  # online: the instances; offline: its largest batch is used
    cores: int | None = None  # online without a layout: one instance on this many cores
    batch: int = 1  # max batch when no layout gives one
    # Only these cpus (a cluster scheduler's allocation for the job); None: any idle cpu
    allowed_cpus: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("online", "offline"):
            raise ValueError(f"job {self.job!r}: kind must be 'online' or 'offline', got {self.kind!r}")
        if self.kind == "online":
            if self.layout is None and (self.cores is None or self.cores < 1):
                raise ValueError(f"online job {self.job!r} needs a layout or a core count ≥ 1")
            if self.layout is not None and not self.layout.instances:
                raise ValueError(f"online job {self.job!r} has a layout with no instances")

    def shapes(self) -> tuple[InstanceShape, ...]:
        """The online instances this demand asks for."""
        if self.layout is not None:
            return self.layout.instances
        assert self.cores is not None
        return (InstanceShape(self.cores, self.cores, self.batch),)

    @property
    def needed_cpus(self) -> int:
        return sum(shape.cores for shape in self.shapes())

    @property
    def offline_batch(self) -> int:
        if self.layout is not None and self.layout.instances:
            return max(shape.batch for shape in self.layout.instances)
        return self.batch


@dataclass(frozen=True)
class PlacedInstance:
    cpus: tuple[int, ...]
    threads: int
    batch: int
    on_training: bool = False
    streams: int = 1


@dataclass
class PlacementResult:
    assignments: dict[str, list[PlacedInstance]] = field(default_factory=dict)
    pending: list[str] = field(default_factory=list)

    def cpus_of(self, job: str) -> set[int]:
        return {cpu for instance in self.assignments.get(job, []) for cpu in instance.cpus}


def place(
    idle_cpus: Sequence[int],
    training_cpus: Iterable[int],
    demands: Sequence[InferenceDemand],
    previous: Mapping[str, Sequence[PlacedInstance]] | None = None,
) -> PlacementResult:
    """Decide which CPUs every inference job's instances run on. `idle_cpus` in allocation
    (topology) order; `previous` is the last placement, for stability."""
    previous = previous or {}
    training = sorted(set(training_cpus))
    training_set = set(training)
    idle = [cpu for cpu in dict.fromkeys(idle_cpus) if cpu not in training_set]
    names = [demand.job for demand in demands]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"inference jobs {duplicates} appear more than once; give every job one demand")

    result = PlacementResult()
    online = [d for d in demands if d.kind == "online"]
    claimed: set[int] = set()
    for position, demand in enumerate(online):
        available = [cpu for cpu in idle if cpu not in claimed and _allowed(demand, cpu)]
        # CPUs lower-priority jobs had, and the priority of the job that had each
        later_held = {
            cpu: rank
            for rank, d in enumerate(online[position + 1 :])
            for cpu in _cpus_in(previous.get(d.job, ()))
        }
        placed = _place_online(demand, available, later_held, previous.get(demand.job, ()))
        if placed is None:
            result.pending.append(demand.job)
            continue
        result.assignments[demand.job] = placed
        claimed.update(cpu for instance in placed for cpu in instance.cpus)

    offline = [d for d in demands if d.kind == "offline"]
    if offline:
        left = [cpu for cpu in idle if cpu not in claimed]
        owners = {}
        for demand in [d for d in offline if d.allowed_cpus is not None]:  # scoped jobs keep their cpus to themselves
            owners[demand.job] = [cpu for cpu in left + training if _allowed(demand, cpu)]
        scoped = {cpu for mine in owners.values() for cpu in mine}
        shared = [d for d in offline if d.allowed_cpus is None]
        if shared:
            owners.update(_share_offline(shared, [c for c in left + training if c not in scoped], previous))
        for demand in offline:
            mine = owners[demand.job]
            if not mine:
                result.pending.append(demand.job)
                continue
            result.assignments[demand.job] = [
                PlacedInstance((cpu,), threads=1, batch=demand.offline_batch, on_training=cpu in training_set)
                for cpu in mine
            ]
    return result


def _allowed(demand: InferenceDemand, cpu: int) -> bool:
    return demand.allowed_cpus is None or cpu in demand.allowed_cpus


def _cpus_in(instances: Iterable[PlacedInstance]) -> list[int]:
    return [cpu for instance in instances for cpu in instance.cpus]


def _place_online(
    demand: InferenceDemand,
    available: list[int],
    later_held: dict[int, int],
    before: Sequence[PlacedInstance],
) -> list[PlacedInstance] | None:
    shapes = demand.shapes()
    need = demand.needed_cpus
    if need > len(available):
        return None
    available_set = set(available)
    # Unchanged shapes on CPUs that are all still free: keep the exact instances.
    if before and all(set(i.cpus) <= available_set for i in before):
        if sorted((len(i.cpus), i.threads, i.batch, i.streams) for i in before) == sorted(
            (s.cores, s.threads, s.batch, s.streams) for s in shapes
        ):
            return list(before)
    own = [cpu for cpu in _cpus_in(before) if cpu in available_set][:need]
    own_set = set(own)
    fresh = [cpu for cpu in available if cpu not in own_set and cpu not in later_held]
    # from the lowest-priority job first
    taken_from_later = sorted(
        (cpu for cpu in available if cpu not in own_set and cpu in later_held), key=lambda cpu: -later_held[cpu]
    )
    chosen = (own + fresh + taken_from_later)[:need]
    # Keep each instance on neighbouring CPUs: cut the chosen set in allocation order.
    order = {cpu: index for index, cpu in enumerate(available)}
    chosen.sort(key=order.__getitem__)
    placed, start = [], 0
    for shape in shapes:
        placed.append(PlacedInstance(tuple(chosen[start : start + shape.cores]), shape.threads, shape.batch,
                                     streams=shape.streams))
        start += shape.cores
    return placed


def _share_offline(
    offline: list[InferenceDemand], cpus: list[int], previous: Mapping[str, Sequence[PlacedInstance]]
) -> dict[str, list[int]]:
    owners: dict[str, list[int]] = {d.job: [] for d in offline}
    had = {cpu: d.job for d in offline for cpu in _cpus_in(previous.get(d.job, ()))}
    fair = -(-len(cpus) // len(offline))  # ceil: no job keeps more than an even share
    unowned = []
    for cpu in cpus:
        job = had.get(cpu)
        if job is not None and len(owners[job]) < fair:
            owners[job].append(cpu)
        else:
            unowned.append(cpu)
    for cpu in unowned:  # round-robin to whoever has fewest (ties: earlier job)
        job = min(owners, key=lambda name: len(owners[name]))
        owners[job].append(cpu)
    position = {cpu: index for index, cpu in enumerate(cpus)}
    return {job: sorted(mine, key=position.__getitem__) for job, mine in owners.items()}
