"""The front door's cpu as part of an online job's layout: where its process runs, and what it costs the
instances when it has to share their cores.

Where it runs (`frontdoor_cpus`): the node's reserved cpus when it has any; else the idle cpus no instance of
any job uses (the front door is one process: it needs one cpu, and never one an instance computes on while such
a cpu is idle); only when there is none, the job's own cpus, shared with its instances.

What sharing costs (`share_of_cores`, `charged_rps`): the front door spends `cpu_ms` of cpu per request (the job
measures it live as `frontdoor_cpu_ms`; DEFAULT_FRONTDOOR_CPU_MS before it has served). At `rate` requests a
second that is rate × cpu_ms / 1000 cpus taken from the layout's `cores`, so the instances keep
1 − rate × cpu_ms / (1000 × cores) of their capacity. The layout search charges a layout that covers every cpu
the job has, when no cpu is reserved, at the rate it would carry; admission charges the rate asked for.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    from reamer.plan.partition import Candidate

# cpu ms per request before the job has measured its own: a small request (docs/model-owners.md's measurements, 2-cpu
# Xeon VM: 0.7 ms for a BERT request as JSON, 2.7 ms for a ResNet-50 image as binary tensors, 8.5 ms as JSON)
DEFAULT_FRONTDOOR_CPU_MS = 1.0


def frontdoor_cpus(reserved: Sequence[int], spare: Iterable[int], own: Iterable[int],
                   instance_cpus: Iterable[int]) -> list[int]:
    """The cpus the job's own process (its front doors) is pinned to: reserved, else spare (idle, no
    instance on them), else the job's own (not on training cores), else wherever its instances are."""
    for choice in (reserved, spare, own, instance_cpus):
        cpus = sorted(set(choice))
        if cpus:
            return cpus
    return []


def share_of_cores(rate_rps: float, cpu_ms: float, cores: int) -> float:
    """The fraction of `cores` cpus the front door takes at `rate_rps` (capped at 1)."""
    if cores <= 0 or rate_rps <= 0 or cpu_ms <= 0:
        return 0.0
    return min(1.0, rate_rps * cpu_ms / 1000.0 / cores)


def charged_rps(rps: float, cpu_ms: float, cores: int) -> float:
    """What a layout that carries `rps` alone carries with the front door on its `cores`: the rate X at which
    the instances' share left, 1 − X × cpu_ms / (1000 × cores), carries X (X = rps / (1 + rps × cpu_ms /
    (1000 × cores)))."""
    if cores <= 0 or cpu_ms <= 0 or rps <= 0:
        return rps
    return rps / (1.0 + rps * cpu_ms / 1000.0 / cores)


def charge_candidates(candidates: Sequence["Candidate"], n_cores: int, cpu_ms: float) -> list["Candidate"]:
    """`candidates` of a search on `n_cores` cpus with no cpu reserved for the front door: those whose layout
    covers all of them carry the front door too (rps, measured and predicted, charged by charged_rps; the
    sustained rate is dropped, to be simulated again from the charged figures); the others leave it a cpu and
    keep their figures."""
    from dataclasses import replace

    charged = []
    for c in candidates:
        if c.layout.total_cores < n_cores:
            charged.append(c)
            continue

        def cut(rps: float | None) -> float | None:
            return rps if rps is None or rps != rps else charged_rps(rps, cpu_ms, n_cores)

        charged.append(replace(c, predicted_rps=cut(c.predicted_rps), measured_rps=cut(c.measured_rps),
                               sustained_rps=None))
    return charged
