"""The kernel's CPU-list syntax ("0-3,8,10-11"), as used by sysfs and cpuset files."""
from __future__ import annotations

from typing import Iterable

_SYNTAX = 'a comma-separated list of CPU numbers and ranges, e.g. "0-3,8,10-11"'


def parse_cpulist(text: str) -> list[int]:
    """Parse a kernel CPU list into sorted unique CPU ids; "" (an empty cpuset) gives []."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                first_text, last_text = part.split("-", 1)
                first, last = int(first_text), int(last_text)
                if first < 0 or last < first:
                    raise ValueError
                cpus.update(range(first, last + 1))
            else:
                cpu = int(part)
                if cpu < 0:
                    raise ValueError
                cpus.add(cpu)
        except ValueError:
            raise ValueError(f"bad CPU list {text!r}: {part!r} is not a CPU number or range; expected {_SYNTAX}") from None
    return sorted(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """Format CPU ids as the shortest kernel CPU list: [0,1,2,3,8] -> "0-3,8"."""
    ordered = sorted(set(cpus))
    if any(cpu < 0 for cpu in ordered):
        raise ValueError(f"CPU ids must be >= 0, got {ordered}")
    ranges: list[str] = []
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        first, last = ordered[start], ordered[end]
        ranges.append(str(first) if first == last else f"{first}-{last}")
        start = end + 1
    return ",".join(ranges)
