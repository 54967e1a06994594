"""Run every bench script and collect their sections into bench/RESULTS.md (`make bench`).

Each entry of SCRIPTS is a bench that accepts `--out DIR` and `--results-md FILE` and writes its own
"## " section into RESULTS.md (bench/results_md.py), leaving the others alone. To add a bench, append a
`Script(...)` line; extra args go in `args`. Scripts whose file is missing are skipped.

    python bench/run_all.py                 # the default set: co-location (about 15 minutes on 2 cores)
    python bench/run_all.py --all           # also serving overhead and layout search (about 1 hour more)
    python bench/run_all.py --only colocation --quick
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


@dataclass(frozen=True)
class Script:
    name: str
    path: str  # relative to the repository root
    args: tuple[str, ...] = field(default_factory=tuple)
    quick_args: tuple[str, ...] = ("--quick",)
    default: bool = True  # False: only with --all or --only (long real-core measurements)


SCRIPTS: list[Script] = [
    Script("colocation", "bench/colocation.py"),
    Script("serving_overhead", "bench/serving_overhead.py", default=False),
    Script("search_calibration", "bench/search_calibration.py", default=False),
    Script("search_quality", "bench/search_quality.py", default=False),
    Script("search_baseline", "bench/search_baseline.py", default=False),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", help="run only this bench (repeatable)")
    p.add_argument("--quick", action="store_true", help="pass each bench its smoke-run flags")
    p.add_argument("--all", action="store_true", help="also run the long real-core measurements")
    p.add_argument("--results-md", default=str(BENCH / "RESULTS.md"))
    p.add_argument("--out", default=str(BENCH / "results"), help="each bench writes to OUT/NAME")
    args = p.parse_args(argv)
    failed = []
    for script in SCRIPTS:
        if args.only and script.name not in args.only:
            continue
        if not (args.only or args.all or script.default):
            continue
        if not (ROOT / script.path).exists():
            print(f"skip {script.name}: {script.path} not present")
            continue
        cmd = [sys.executable, script.path, *script.args, *(script.quick_args if args.quick else ()),
               "--out", str(Path(args.out) / script.name), "--results-md", args.results_md]
        print(f"== {script.name}: {' '.join(cmd)}", flush=True)
        started = time.monotonic()
        code = subprocess.call(cmd, cwd=ROOT)
        print(f"== {script.name}: exit {code} after {time.monotonic() - started:.0f} s", flush=True)
        if code != 0:
            failed.append(script.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"results: {args.results_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
