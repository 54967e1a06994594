"""Layouts: how an inference job's cores are cut into instances (cores × threads × max batch).

Text form, one group per distinct shape, groups joined by ``+``, the backend after ``@``::

    2x1:b4              two instances, 1 core each (threads = cores), max batch 4
    1x2t1:b8            one instance on 2 cores running 1 thread, max batch 8
    2x1:b4+1x2:b8       mixed shapes
    2x1:b4@openvino     the same two instances, on OpenVINO
    1x4s4:b8@openvino   one instance on 4 cores, 4 OpenVINO streams (1 thread each) sharing each batch

A layout names at most one backend: every instance of a job runs the same runtime (see `Layout`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from itertools import groupby
from typing import Iterable

LAYOUT_SYNTAX = (
    "INSTANCESxCORES[tTHREADS][sSTREAMS]:bMAXBATCH, groups joined by '+', optionally '@BACKEND' at the end, "
    "e.g. '2x1:b4' (2 instances × 1 core, max batch 4), '2x1:b4+1x2t2:b8' or '1x2s2:b4@openvino'"
)
BACKENDS: tuple[str, ...] = ("onnxruntime", "openvino")

_GROUP = re.compile(r"^(\d{1,9})x(\d{1,9})(?:t(\d{1,9}))?(?:s(\d{1,9}))?:b(\d{1,9})$")
# No machine has more: a layout asking for more cores than this (or than `max_cores`) is refused
# before any instance is made, so a short text cannot make the parser allocate without bound.
MAX_LAYOUT_CORES = 8192
MAX_BATCH = 65536


@dataclass(frozen=True, order=True)
class InstanceShape:
    """One instance: the cores it owns, the threads its runtime uses, its max batch, and the streams
    (OpenVINO's parallel inference requests, threads shared among them) that split each batch."""

    cores: int
    threads: int
    batch: int
    streams: int = 1

    def __post_init__(self) -> None:
        for name in ("cores", "threads", "batch", "streams"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"instance {name} must be a positive integer, got {value!r}")
        if self.streams > self.threads:
            raise ValueError(f"an instance cannot run more streams ({self.streams}) than threads ({self.threads})")


@dataclass(frozen=True)
class Layout:
    """A set of instances of one job; order is kept as given (see `canonical`).

    `backend`: the runtime every instance runs (None: the job's). One per layout, never mixed: a job
    answers each request from whichever instance is free, and runtimes differ in their last bits (and
    in what they refuse), so a client would see answers depend on the instance; each runtime also
    loads its own copy of the weights and libraries."""

    instances: tuple[InstanceShape, ...]
    backend: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "instances", tuple(self.instances))
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r} in a layout; one of {', '.join(BACKENDS)}")
        if self.backend == "onnxruntime" and any(s.streams > 1 for s in self.instances):
            raise ValueError("streams are OpenVINO's: an onnxruntime instance runs one stream")

    @property
    def total_cores(self) -> int:
        return sum(shape.cores for shape in self.instances)

    @property
    def instance_count(self) -> int:
        return len(self.instances)

    def canonical(self) -> "Layout":
        """The same multiset of instances, biggest first: equal layouts compare equal."""
        return Layout(tuple(sorted(self.instances, reverse=True)), self.backend)

    def on(self, backend: str | None) -> "Layout":
        """The same instances on `backend`."""
        return Layout(self.instances, backend)

    @classmethod
    def uniform(cls, count: int, cores: int, batch: int, threads: int | None = None, *, streams: int = 1,
                backend: str | None = None) -> "Layout":
        """`count` identical instances (threads default to cores)."""
        return cls(tuple(InstanceShape(cores, threads or cores, batch, streams) for _ in range(count)), backend)

    def __str__(self) -> str:
        return format_layout(self)


def _syntax_error(text: str, why: str) -> ValueError:
    return ValueError(f"bad layout {text!r}: {why}; expected {LAYOUT_SYNTAX}")


def parse_layout(text: str, max_cores: int | None = None) -> Layout:
    """Parse '2x1:b4+1x2t2:b8' into a Layout; ValueError shows the syntax on bad input.

    The cores of all instances together may not exceed `max_cores` (default and upper bound:
    MAX_LAYOUT_CORES); that is checked group by group before the group's instances are made."""
    if not isinstance(text, str) or not text.strip():
        raise _syntax_error(str(text), "it is empty")
    limit = MAX_LAYOUT_CORES if max_cores is None else min(max_cores, MAX_LAYOUT_CORES)
    body, at, backend_text = text.partition("@")
    backend = backend_text.strip().lower() if at else None
    if at and backend not in BACKENDS:
        raise _syntax_error(text, f"backend {backend_text.strip()!r} is unknown (one of {', '.join(BACKENDS)}; "
                                  "one backend per layout)")
    if not body.strip():
        raise _syntax_error(text, "it has no instances")
    total_cores = 0
    shapes: list[InstanceShape] = []
    for raw in body.split("+"):
        group = raw.strip().replace(" ", "").lower()
        match = _GROUP.match(group)
        if not match:
            raise _syntax_error(text, f"cannot read group {raw.strip()!r}")
        count, cores, threads, streams, batch = match.groups()
        count_i, cores_i, batch_i = int(count), int(cores), int(batch)
        threads_i = int(threads) if threads is not None else cores_i
        streams_i = int(streams) if streams is not None else 1
        if min(count_i, cores_i, threads_i, batch_i, streams_i) < 1:
            raise _syntax_error(text, f"group {raw.strip()!r} has a zero; every number must be ≥ 1")
        total_cores += count_i * cores_i
        if total_cores > limit:
            raise ValueError(f"bad layout {text!r}: it asks for {total_cores if total_cores < 10**7 else 'over 10^7'} "
                             f"cores, more than the {limit} it may have; give fewer or smaller instances")
        if threads_i > cores_i * 64 or batch_i > MAX_BATCH:
            raise ValueError(f"bad layout {text!r}: group {raw.strip()!r} has over 64 threads per core or a batch "
                             f"over {MAX_BATCH}")
        if streams_i > threads_i:
            raise _syntax_error(text, f"group {raw.strip()!r} has more streams than threads")
        shapes.extend(InstanceShape(cores_i, threads_i, batch_i, streams_i) for _ in range(count_i))
    try:
        return Layout(tuple(shapes), backend)
    except ValueError as exc:
        raise _syntax_error(text, str(exc)) from None


def format_layout(layout: Layout) -> str:
    """Text form of a layout; `parse_layout(format_layout(x)) == x` (runs of equal shapes grouped)."""
    parts = []
    for shape, run in groupby(layout.instances):
        count = sum(1 for _ in run)
        threads = "" if shape.threads == shape.cores else f"t{shape.threads}"
        streams = "" if shape.streams == 1 else f"s{shape.streams}"
        parts.append(f"{count}x{shape.cores}{threads}{streams}:b{shape.batch}")
    return "+".join(parts) + (f"@{layout.backend}" if layout.backend else "")


@lru_cache(maxsize=None)
def integer_partitions(n: int) -> int:
    """p(n): the number of ways to write n as a sum of positive integers, order ignored."""
    if n < 0:
        return 0
    ways = [1] + [0] * n
    for part in range(1, n + 1):
        for total in range(part, n + 1):
            ways[total] += ways[total - part]
    return ways[n]


def _batch_choices(batches: int | Iterable[int]) -> int:
    if isinstance(batches, int):
        if batches < 1:
            raise ValueError(f"max batch must be ≥ 1, got {batches}")
        return batches
    choices = set(batches)
    if not choices or min(choices) < 1:
        raise ValueError(f"batch choices must be positive integers, got {sorted(choices)}")
    return len(choices)


def count_layouts(n_cores: int, batches: int | Iterable[int], per_instance_batch: bool = False) -> int:
    """Size of the layout search space on `n_cores` cores (all cores used, threads = cores).

    `batches` is a max batch B (choices 1..B) or a collection of batch choices.
    Default (the Cloud Reamer paper's count, §II): every integer partition of the cores into
    instances, times one max batch shared by all instances — 32 cores, batch ≤ 32:
    8,349 × 32 = 267,168.
    `per_instance_batch=True`: each instance picks its own batch, so a layout is a multiset of
    (cores, batch) shapes whose cores sum to `n_cores` (a much larger space).
    """
    if n_cores < 0:
        raise ValueError(f"core count must be ≥ 0, got {n_cores}")
    choices = _batch_choices(batches)
    if not per_instance_batch:
        return integer_partitions(n_cores) * choices if n_cores else 0
    if n_cores == 0:
        return 0
    ways = [1] + [0] * n_cores
    for cores in range(1, n_cores + 1):
        for _ in range(choices):  # each (cores, batch) shape is its own part kind
            for total in range(cores, n_cores + 1):
                ways[total] += ways[total - cores]
    return ways[n_cores]
