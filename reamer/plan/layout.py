"""Layouts: how an inference job's cores are cut into instances (cores × threads × max batch).

Text form, one group per distinct shape, groups joined by ``+``::

    2x1:b4          two instances, 1 core each (threads = cores), max batch 4
    1x2t1:b8        one instance on 2 cores running 1 thread, max batch 8
    2x1:b4+1x2:b8   mixed shapes
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from itertools import groupby
from typing import Iterable

LAYOUT_SYNTAX = (
    "INSTANCESxCORES[tTHREADS]:bMAXBATCH, groups joined by '+', "
    "e.g. '2x1:b4' (2 instances × 1 core, max batch 4) or '2x1:b4+1x2t2:b8'"
)

_GROUP = re.compile(r"^(\d{1,9})x(\d{1,9})(?:t(\d{1,9}))?:b(\d{1,9})$")
# No machine has more: a layout asking for more cores than this (or than `max_cores`) is refused
# before any instance is made, so a short text cannot make the parser allocate without bound.
MAX_LAYOUT_CORES = 8192
MAX_BATCH = 65536


@dataclass(frozen=True, order=True)
class InstanceShape:
    """One instance: the cores it owns, the threads its runtime uses, its max batch."""

    cores: int
    threads: int
    batch: int

    def __post_init__(self) -> None:
        for name in ("cores", "threads", "batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"instance {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Layout:
    """A set of instances of one job; order is kept as given (see `canonical`)."""

    instances: tuple[InstanceShape, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "instances", tuple(self.instances))

    @property
    def total_cores(self) -> int:
        return sum(shape.cores for shape in self.instances)

    @property
    def instance_count(self) -> int:
        return len(self.instances)

    def canonical(self) -> "Layout":
        """The same multiset of instances, biggest first: equal layouts compare equal."""
        return Layout(tuple(sorted(self.instances, reverse=True)))

    @classmethod
    def uniform(cls, count: int, cores: int, batch: int, threads: int | None = None) -> "Layout":
        """`count` identical instances (threads default to cores)."""
        return cls(tuple(InstanceShape(cores, threads or cores, batch) for _ in range(count)))

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
    total_cores = 0
    shapes: list[InstanceShape] = []
    for raw in text.split("+"):
        group = raw.strip().replace(" ", "").lower()
        match = _GROUP.match(group)
        if not match:
            raise _syntax_error(text, f"cannot read group {raw.strip()!r}")
        count, cores, threads, batch = match.groups()
        count_i, cores_i, batch_i = int(count), int(cores), int(batch)
        threads_i = int(threads) if threads is not None else cores_i
        if min(count_i, cores_i, threads_i, batch_i) < 1:
            raise _syntax_error(text, f"group {raw.strip()!r} has a zero; every number must be ≥ 1")
        total_cores += count_i * cores_i
        if total_cores > limit:
            raise ValueError(f"bad layout {text!r}: it asks for {total_cores if total_cores < 10**7 else 'over 10^7'} "
                             f"cores, more than the {limit} it may have; give fewer or smaller instances")
        if threads_i > cores_i * 64 or batch_i > MAX_BATCH:
            raise ValueError(f"bad layout {text!r}: group {raw.strip()!r} has over 64 threads per core or a batch "
                             f"over {MAX_BATCH}")
        shapes.extend(InstanceShape(cores_i, threads_i, batch_i) for _ in range(count_i))
    return Layout(tuple(shapes))


def format_layout(layout: Layout) -> str:
    """Text form of a layout; `parse_layout(format_layout(x)) == x` (runs of equal shapes grouped)."""
    parts = []
    for shape, run in groupby(layout.instances):
        count = sum(1 for _ in run)
        threads = "" if shape.threads == shape.cores else f"t{shape.threads}"
        parts.append(f"{count}x{shape.cores}{threads}:b{shape.batch}")
    return "+".join(parts)


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
