"""Admission of an online job (Cloud Reamer §III-C): take it only if the spare cores can carry its
request rate within its latency SLO, with a safety margin."""
from __future__ import annotations

from dataclasses import dataclass

from reamer.plan.partition import Candidate

# An online request can arrive just after an instance has started a batch and wait for it before its own batch
# runs, so a layout's batch latency (p99, all instances running together) gets half the SLO: the other half is
# for that wait. With the whole SLO, a layout whose batch takes 0.9 s "meets" 1 s and sustains almost no rate.
BATCH_SHARE_OF_SLO = 0.5


def batch_latency_target_ms(slo_ms: float | None) -> float | None:
    """The p99 batch latency an online layout must keep to meet `slo_ms` end to end (None: no SLO)."""
    return None if slo_ms is None else slo_ms * BATCH_SHARE_OF_SLO


@dataclass(frozen=True)
class AdmissionDecision:
    accepted: bool
    achievable_rps: float  # what the layout can carry after the margin
    reason: str


def admit(candidate: Candidate | None, rate_rps: float, slo_ms: float, margin: float = 0.10) -> AdmissionDecision:
    """Accept iff the rate the layout carries ≥ `rate_rps` and its batch p99 ≤ the batch latency target of
    `slo_ms` (half of it). The rate it carries is its closed-loop throughput less the margin, or, when the
    candidate carries a lower one (`Candidate.sustained_rps`), the open-loop rate it sustains under the SLO,
    simulated: the margin covers the queueing of short batches, the simulation that of long ones. Measured
    figures are used when the candidate was verified, predicted ones otherwise."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"admission margin must be in [0, 1), got {margin}")
    if rate_rps < 0 or slo_ms <= 0:
        raise ValueError(f"rate must be ≥ 0 and SLO > 0, got rate {rate_rps} rps, SLO {slo_ms} ms")
    if candidate is None:
        return AdmissionDecision(
            False, 0.0,
            f"no layout on the free cores meets the {slo_ms:g} ms SLO; deploy the job on another node, "
            "relax the SLO, or free cores (detach a training job)",
        )
    with_margin = candidate.rps * (1.0 - margin)
    by_sustained = candidate.sustained_rps is not None and candidate.sustained_rps < with_margin
    achievable = candidate.sustained_rps if by_sustained else with_margin
    basis = (f"the open-loop rate it sustains under the SLO, simulated from its {candidate.rps:.1f} rps closed "
             f"loop" if by_sustained else f"{candidate.rps:.1f} rps less a {margin:.0%} margin")
    target = slo_ms * BATCH_SHARE_OF_SLO
    if candidate.p99_ms > target:
        return AdmissionDecision(
            False, achievable,
            f"layout {candidate.layout} has batch p99 {candidate.p99_ms:.1f} ms, over {target:g} ms (half the "
            f"{slo_ms:g} ms SLO: a request may wait for the batch before its own); "
            "deploy the job on another node, relax the SLO, or free cores",
        )
    if achievable < rate_rps:
        return AdmissionDecision(
            False, achievable,
            f"layout {candidate.layout} can carry {achievable:.1f} rps within the {slo_ms:g} ms SLO "
            f"({basis}), below the requested {rate_rps:g} rps; "
            f"deploy the job on another node, lower the rate to ≤ {achievable:.1f} rps, or free cores",
        )
    return AdmissionDecision(
        True, achievable,
        f"layout {candidate.layout} carries {achievable:.1f} rps ({basis}) ≥ {rate_rps:g} rps "
        f"at batch p99 {candidate.p99_ms:.1f} ms ≤ {target:g} ms (half the {slo_ms:g} ms SLO)",
    )
