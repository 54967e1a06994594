"""Co-location strategies compared by bench/colocation.py (Cloud Reamer §IV, Fig. 8, 10, 11).

Each strategy says where the training job, the online instance and the offline instances run
and with which scheduling policy. Cores come from a `CoreLayout`:

- training cores: the training job's cores (reamer binds them with a cpuset);
- online cores: idle cores given exclusively to the online instance (one instance, threads = cores);
- idle cores: the rest; offline single-thread instances run on every training core and every
  idle core (never on online cores).

On the 2-core machine this bench was written on: training = cpu 1, online = cpu 0 (shared with the
HTTP front door and the load generator — the only core left for them), offline = one single-thread
instance on cpu 1. Online on its own core and offline only where training is is exactly reamer's
rule (online gets exclusive idle cores, offline harvests the training cores).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from reamer.host.errors import ReamerError


class LayoutError(ReamerError):
    """The cores given to the bench cannot hold the strategies."""


@dataclass(frozen=True)
class Placement:
    """Where one process runs: cpus=None floats over every cpu; sched: other | idle | rr:PRIO."""

    cpus: tuple[int, ...] | None
    sched: str = "other"
    frozen_by_gang: bool = False


@dataclass(frozen=True)
class Strategy:
    name: str
    title: str
    description: str
    training: Placement | None
    online: Placement | None
    offline: tuple[Placement, ...] = ()
    gang: tuple[float, float] | None = None  # (training seconds, inference seconds) per freezer cycle
    baseline: bool = False  # a measurement the others are compared with, not a co-location strategy
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def offline_on_training_cores(self) -> tuple[int, ...]:
        """Indexes of offline instances pinned to training cores (their CPU time is harvest)."""
        if self.training is None or self.training.cpus is None:
            return ()
        train = set(self.training.cpus)
        return tuple(i for i, p in enumerate(self.offline) if p.cpus is not None and set(p.cpus) <= train)


@dataclass(frozen=True)
class CoreLayout:
    all_cpus: tuple[int, ...]
    training_cpus: tuple[int, ...]
    online_cpus: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.training_cpus or not self.online_cpus:
            raise LayoutError("the bench needs at least one training cpu and one online cpu",
                              "pass --training-cpus and --online-cpus (e.g. 1 and 0)")
        if set(self.training_cpus) & set(self.online_cpus):
            raise LayoutError(f"training cpus {self.training_cpus} and online cpus {self.online_cpus} overlap",
                              "give them disjoint cpus")
        missing = (set(self.training_cpus) | set(self.online_cpus)) - set(self.all_cpus)
        if missing:
            raise LayoutError(f"cpus {sorted(missing)} are not online on this machine ({self.all_cpus})",
                              "use cpus from /sys/devices/system/cpu/online")

    @property
    def idle_cpus(self) -> tuple[int, ...]:
        used = set(self.training_cpus) | set(self.online_cpus)
        return tuple(c for c in self.all_cpus if c not in used)

    @property
    def offline_cpus(self) -> tuple[int, ...]:
        return self.training_cpus + self.idle_cpus


STRATEGY_ORDER = ("training_alone", "inference_alone", "shared", "no_consolidation", "gang", "reamer", "reamer_idle")


def build_strategies(layout: CoreLayout, rr_priority: int = 10, gang_s: tuple[float, float] = (0.8, 0.2)) -> list[Strategy]:
    train, online = layout.training_cpus, layout.online_cpus
    offline_pinned = tuple(Placement((c,)) for c in layout.offline_cpus)
    n_off = len(offline_pinned)
    return [
        Strategy(
            "training_alone", "Training alone",
            "training on its cores, nothing else: the baseline for iteration time and for idle CPU time",
            training=Placement(train), online=None, baseline=True,
        ),
        Strategy(
            "inference_alone", "Inference alone",
            "online instance on its cores and offline instances on the other cores, no training: the "
            "baseline for latency and offline throughput",
            training=None, online=Placement(online), offline=offline_pinned, baseline=True,
        ),
        Strategy(
            "shared", "Shared",
            "training, the online instance and the offline instances all bound to the training cores, "
            "default scheduling (CFS)",
            training=Placement(train), online=Placement(train),
            offline=tuple(Placement(train) for _ in range(n_off)),
        ),
        Strategy(
            "no_consolidation", "No consolidation",
            "nothing pinned: training, online and offline float over every cpu, default scheduling",
            training=Placement(None), online=Placement(None),
            offline=tuple(Placement(None) for _ in range(n_off)),
        ),
        Strategy(
            "gang", "Gang (freezer)",
            f"training cpuset, online on its own cores; offline instances on the training cores take turns "
            f"with training through the cgroup freezer ({gang_s[0]:g} s training / {gang_s[1]:g} s inference)",
            training=Placement(train, frozen_by_gang=True), online=Placement(online),
            offline=tuple(Placement(p.cpus, frozen_by_gang=set(p.cpus or ()) <= set(train)) for p in offline_pinned),
            gang=gang_s,
        ),
        Strategy(
            "reamer", "reamer (SCHED_RR)",
            "training cpuset + SCHED_RR on every training thread; online on exclusive idle cores; "
            "single-thread offline instances on every other core, training cores included",
            training=Placement(train, sched=f"rr:{rr_priority}"), online=Placement(online), offline=offline_pinned,
        ),
        Strategy(
            "reamer_idle", "reamer (SCHED_IDLE offline)",
            "as reamer, but training stays SCHED_OTHER and the offline instances run SCHED_IDLE",
            training=Placement(train), online=Placement(online),
            offline=tuple(Placement(p.cpus, sched="idle") for p in offline_pinned),
        ),
    ]


def select(strategies: list[Strategy], names: list[str] | None) -> list[Strategy]:
    """Keep the named strategies (baselines are always kept: every comparison needs them)."""
    if not names:
        return strategies
    known = {s.name for s in strategies}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise LayoutError(f"unknown strateg{'y' if len(unknown) == 1 else 'ies'}: {', '.join(unknown)}",
                          f"choose from: {', '.join(s.name for s in strategies)}")
    return [s for s in strategies if s.baseline or s.name in names]
