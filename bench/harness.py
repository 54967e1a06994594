"""The benches' shared harness: where results go, what machine and load a figure was taken on, the command
that reproduces it, rounds in rotated order with medians and same-run ratios, and the writing of a run's JSON
and of one bench's section of bench/RESULTS.md (every other section kept as it is).

A RESULTS.md section runs from its heading line to the next heading of the same or a higher level (``## ``
ends a ``## `` or ``### `` section), to a ``<!-- bench:`` marker line, or to the end of the file. Lines inside
``` fences never count as headings.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS_DIR = BENCH / "results"  # each bench writes its JSON (and plots) to RESULTS_DIR / NAME
RESULTS_MD = BENCH / "RESULTS.md"
DEFAULT_TITLE = "# reamer benchmark results\n"

T = TypeVar("T")


# --- the machine, its load, the command ---------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """CPU model, usable cpus, Python and kernel: the line every figure is read against."""
    from reamer.host.topology import read_topology

    model = read_topology().model_name
    return {"cpu_model": model, "cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "kernel": platform.release()}


def loadavg() -> list[float]:
    """1/5/15-minute load average, rounded: on a shared machine it says what else ran beside a figure."""
    return [round(x, 2) for x in os.getloadavg()]


def command_line(bench: str, argv: Sequence[str] | None = None) -> str:
    """The command that reproduces this run, as RESULTS.md quotes it: ``python -m bench.NAME ARGS``."""
    return f"python -m bench.{bench} " + " ".join(sys.argv[1:] if argv is None else argv)


def bench_command(bench: str, *args: str) -> list[str]:
    """argv that runs another bench module (or a bench's own child mode) in a new process; run it with
    ``cwd=ROOT`` so that ``bench`` is importable."""
    return [sys.executable, "-m", f"bench.{bench}", *args]


# --- rounds, medians, ratios --------------------------------------------------------------------------------


def rotated(items: Sequence[T], k: int) -> list[T]:
    """`items` starting at index k (mod len): contenders take turns first, so machine drift hits all alike."""
    if not items:
        return []
    k %= len(items)
    return [*items[k:], *items[:k]]


def median(values: Iterable[float]) -> float:
    """Median, NaN for no values (a contender that produced nothing must not end a whole run)."""
    found = list(values)
    return statistics.median(found) if found else float("nan")


def spread(values: Sequence[float]) -> float:
    """(max − min) / median of a contender's rounds; 0.0 for a single round."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def ratio(value: float | None, baseline: float | None) -> float | None:
    """value / baseline, or None where either is missing or the baseline is not positive."""
    if value is None or not baseline or baseline <= 0:
        return None
    return value / baseline


# --- writing results ----------------------------------------------------------------------------------------


def write_json(path: str | os.PathLike, data: Any, indent: int = 1) -> Path:
    """Write a run's JSON atomically (a crash mid-run keeps the previous file whole), making its folder."""
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".{file.name}.tmp")
    tmp.write_text(json.dumps(data, indent=indent, default=str))
    os.replace(tmp, file)
    return file


def _level(line: str) -> int:
    """Heading level of a markdown line (0: not a heading)."""
    stripped = line.rstrip("\n")
    hashes = len(stripped) - len(stripped.lstrip("#"))
    return hashes if 0 < hashes <= 6 and stripped[hashes:hashes + 1] == " " else 0


def _find(lines: list[str], heading: str) -> tuple[int, int] | None:
    """(start, end) line indexes of the section under `heading`, end exclusive."""
    level, fenced, start = _level(heading), False, None
    for index, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if start is None:
            if line.rstrip("\n").rstrip() == heading.rstrip():
                start = index
            continue
        found = _level(line)
        if (found and found <= level) or line.startswith("<!-- bench:"):
            return start, index
    return (start, len(lines)) if start is not None else None


def read_section(path: str | os.PathLike, heading: str) -> str | None:
    """The body under `heading` (without the heading line), or None when the file or heading is missing."""
    file = Path(path)
    if not file.exists():
        return None
    lines = file.read_text().splitlines(keepends=True)
    span = _find(lines, heading)
    return "".join(lines[span[0] + 1:span[1]]).strip("\n") if span else None


def replace_section(path: str | os.PathLike, heading: str, body: str, parent: str | None = None) -> None:
    """Write `heading` + `body` in place of the current section under `heading`.

    A missing section is appended at the end of `parent`'s section (created at the end of the file
    when missing too), or at the end of the file. The file is replaced atomically."""
    if _level(heading) == 0:
        raise ValueError(f"heading {heading!r} must start with '#'s and a space, like '## Layout search'")
    file = Path(path)
    text = file.read_text() if file.exists() else DEFAULT_TITLE
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    block = [heading.rstrip() + "\n", "\n", body.strip("\n") + "\n", "\n"]
    span = _find(lines, heading)
    if span is None and parent is not None:
        if _find(lines, parent) is None:
            lines += ["\n", parent.rstrip() + "\n", "\n"]
        span = (_find(lines, parent)[1],) * 2  # type: ignore[index]
    if span is None:
        if lines and lines[-1].strip():
            lines.append("\n")
        lines += block
    else:
        start, end = span
        before = lines[:start]
        if before and before[-1].strip():
            before.append("\n")
        lines = before + block + lines[end:]
    out = "".join(lines).rstrip("\n") + "\n"
    tmp = file.with_name(f".{file.name}.tmp")
    tmp.write_text(out)
    os.replace(tmp, file)


def command_and_machine(data: dict[str, Any]) -> str:
    """The first words of a RESULTS.md section: the run's command and the machine it ran on."""
    return f"Command: `{data['command']}` · machine: {data['machine']['cpu_model']}, {data['machine']['cpus']} cpus"


def publish(text: str, results_md: str | None, write_section: Callable[[str, str], None]) -> int:
    """Print a run's RESULTS.md section and write it into `results_md` when one is given (a smoke run passes
    None); 0, main()'s exit status."""
    print(text)
    if results_md:
        write_section(results_md, text)
    return 0
