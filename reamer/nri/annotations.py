"""What a pod asks of reamer, from its annotations (the only input a pod author controls)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

from reamer.host.errors import ReamerError

ROLE = "reamer.io/role"
CORES = "reamer.io/cores"
PRIORITY = "reamer.io/priority"
CONTAINERS = "reamer.io/containers"
MAX_CORES = 4096


class BadAnnotation(ReamerError):
    pass


@dataclass(frozen=True)
class PodRequest:
    role: Literal["training", "inference"]
    cores: int = 0  # training: whole cores per container
    priority: int | None = None  # training: SCHED_RR priority (None: the agent's training.priority)
    containers: frozenset[str] | None = None  # None: every container of the pod

    def covers(self, container_name: str) -> bool:
        return self.containers is None or container_name in self.containers


def parse(annotations: Mapping[str, str]) -> PodRequest | None:
    """The pod's request, or None when it asks reamer for nothing. Raises BadAnnotation (the runtime then
    refuses to create the container, and the kubelet shows the message in the pod's events)."""
    role = annotations.get(ROLE)
    if role is None:
        return None
    containers = None
    if annotations.get(CONTAINERS, "").strip():
        containers = frozenset(n.strip() for n in annotations[CONTAINERS].split(",") if n.strip())
    if role == "inference":
        return PodRequest("inference", containers=containers)
    if role != "training":
        raise BadAnnotation(f"annotation {ROLE}={role!r} is neither training nor inference",
                            f"set {ROLE}: training (with {CORES}: \"N\") or {ROLE}: inference, or remove it")
    cores = _integer(annotations, CORES, 1, MAX_CORES, required=True)
    priority = _integer(annotations, PRIORITY, 1, 99, required=False)
    return PodRequest("training", cores=cores or 0, priority=priority, containers=containers)


def _integer(annotations: Mapping[str, str], key: str, low: int, high: int, required: bool) -> int | None:
    text = annotations.get(key)
    if text is None:
        if required:
            raise BadAnnotation(f"a training pod needs annotation {key}",
                                f"add {key}: \"N\" (whole cores, {low}..{high}) to the pod's annotations")
        return None
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise BadAnnotation(f"annotation {key}={text!r} is not a whole number in {low}..{high}",
                            f"set {key} to a whole number in {low}..{high}")
    return value
