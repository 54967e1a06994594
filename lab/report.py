"""Per-profile results from the JUnit report the VM writes, and the summary `make test-hosts` prints.

A profile that could not run is SKIPPED, never passed: its status says so, the summary line says so,
and a JUnit file with one skipped test case and the reason is written in place of the VM's report."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from xml.sax.saxutils import quoteattr


@dataclass
class ProfileResult:
    profile: str
    status: str  # passed | failed | error | skipped
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    boot_s: float | None = None
    wall_s: float = 0.0
    reason: str = ""
    report: str = ""
    failures: list[str] = field(default_factory=list)


def read_junit(path: Path) -> tuple[int, int, int, int, list[str]]:
    """(passed, failed, errors, skipped, names of failed tests) from a pytest JUnit file."""
    root = ET.parse(path).getroot()
    passed = failed = errors = skipped = 0
    failures: list[str] = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            failed += 1
            failures.append(name)
        elif case.find("error") is not None:
            errors += 1
            failures.append(name + " (error)")
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    return passed, failed, errors, skipped, failures


def write_skip_junit(path: Path, profile: str, reason: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        '<?xml version="1.0" encoding="utf-8"?>\n'
        f'<testsuites><testsuite name="hosts-{profile}" tests="1" skipped="1" failures="0" errors="0">'
        f'<testcase classname="lab" name="{profile}"><skipped type="lab.skip" message={quoteattr(reason)}/>'
        '</testcase></testsuite></testsuites>\n')


def summary_lines(results: list[ProfileResult], total_s: float) -> list[str]:
    lines = ["", "== make test-hosts: summary ==",
             f"{'profile':<15} {'status':<8} {'pass':>4} {'fail':>4} {'err':>4} {'skip':>4} {'boot':>6} {'wall':>6}  report"]
    for r in results:
        boot = f"{r.boot_s:.0f}s" if r.boot_s is not None else "-"
        lines.append(f"{r.profile:<15} {r.status.upper():<8} {r.passed:>4} {r.failed:>4} {r.errors:>4} {r.skipped:>4} "
                     f"{boot:>6} {r.wall_s:>5.0f}s  {r.report}")
        if r.reason:
            lines.append(f"{'':<15} reason: {r.reason}")
        for name in r.failures:
            lines.append(f"{'':<15} FAILED {name}")
    bad = [r.profile for r in results if r.status in ("failed", "error")]
    skipped = [r.profile for r in results if r.status == "skipped"]
    if bad:
        verdict = f"FAILED: {', '.join(bad)}"
    elif skipped:
        verdict = (f"SKIPPED (NOT a pass): {', '.join(skipped)} did not run"
                   + ("" if len(skipped) == len(results) else "; the other profiles passed"))
    else:
        verdict = "all profiles passed"
    lines.append(f"test-hosts: {verdict} ({total_s:.0f} s)")
    return lines


def write_summary(path: Path, results: list[ProfileResult], total_s: float) -> None:
    path.write_text(json.dumps({"total_s": round(total_s, 1), "profiles": [asdict(r) for r in results]}, indent=1))
