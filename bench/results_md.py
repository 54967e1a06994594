"""Edit one heading's section of bench/RESULTS.md and keep every other section as it is.

A section runs from its heading line to the next heading of the same or a higher level (``## `` ends
a ``## `` or ``### `` section), to a ``<!-- bench:`` marker line (sections other benches keep between
markers), or to the end of the file. Lines inside ``` fences never count as headings.
"""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_TITLE = "# reamer benchmark results\n"


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
