"""Run every benchmark that has a figure in bench/RESULTS.md (`make bench`, `make bench-full`).

    python -m bench.run_all                  # make bench: every bench at its smoke settings, or its full run
                                             #   where that takes a minute or so; nothing written to RESULTS.md
    python -m bench.run_all --full           # make bench-full: every figure's own command (hours on 2 cores);
                                             #   benches with a RESULTS.md section rewrite it
    python -m bench.run_all --list           # each bench: the command of its figure, its time, what it needs
    python -m bench.run_all --only peers --only loopback_floor [--full]

Each run writes under OUT/NAME (default bench/results/smoke/NAME; --full: bench/results/NAME). A bench whose
needs are not met here (root and cgroup v1, perf, MLServer's virtualenv, a commit in git history) is left out
with the reason and the command to run where they are. To add a bench: write bench/NAME.py with a `main()`
(runnable as `python -m bench.NAME`, using bench.harness), then add a `Bench(...)` line to BENCHES below with
the command of its figure in RESULTS.md and its smoke settings.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench.harness import RESULTS_DIR, RESULTS_MD, ROOT, bench_command


def _root_and_cgroup_v1() -> str | None:
    if os.geteuid() != 0:
        return "needs root (cgroups, SCHED_RR)"
    if not Path("/sys/fs/cgroup/freezer").is_dir():
        return "needs the cgroup v1 cpuset, cpu and freezer controllers (the gang strategy freezes)"
    return None


def _perf() -> str | None:
    return None if shutil.which("perf") else "needs perf (linux-perf) to sample the processes"


def _mlserver_venv() -> str | None:
    if Path("/tmp/reamer-mlserver-venv/bin/mlserver").exists():
        return None
    return ("needs MLServer 1.7.1 in /tmp/reamer-mlserver-venv (the bench makes it with pip on its first run: "
            "needs the package index)")


def _git_commit(rev: str) -> Callable[[], str | None]:
    def check() -> str | None:
        found = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{rev}^{{commit}}"], capture_output=True)
        return None if found.returncode == 0 else f"needs commit {rev} in git history (its front door is 'before')"
    return check


def _gpu_and_torch() -> str | None:
    import importlib.util

    if importlib.util.find_spec("torch") is None or not Path("/dev/nvidia0").exists():
        return "needs an NVIDIA GPU and torch (its figure: docs/operators.md, taken on an H100)"
    return None


def _two_cpus() -> str | None:
    return None if len(os.sched_getaffinity(0)) >= 2 else "needs two cpus"


@dataclass(frozen=True)
class Bench:
    name: str
    full: tuple[str, ...]  # the arguments of the command that produced its figure in RESULTS.md
    full_minutes: float  # about how long `full` takes on a 2-cpu machine
    smoke: tuple[str, ...] | None = None  # `make bench` settings; None: `make bench` runs `full` (short)
    out: str | None = "--out"  # the flag that takes a folder for the run's files (None: the bench prints only)
    results_md: bool = False  # `full` rewrites its own section of RESULTS.md
    needs: tuple[Callable[[], str | None], ...] = field(default_factory=tuple)

    def command(self, full: bool, out: Path, results_md: str) -> list[str]:
        args = list(self.full if full or self.smoke is None else self.smoke)
        if self.out:
            args += [self.out, str(out / f"{self.name}.json" if self.out in ("--json", "--report") else out)]
        if self.results_md:
            args += ["--results-md", results_md if full else ""]  # a smoke run never writes RESULTS.md
        return bench_command(self.name, *args)

    def missing(self) -> str | None:
        return next((reason for check in self.needs if (reason := check()) is not None), None)


# One line per benchmark with a figure in bench/RESULTS.md; `full` is the command quoted beside that figure.
BENCHES: list[Bench] = [
    Bench("colocation", (), 15, ("--quick", "--duration", "2"), results_md=True, needs=(_root_and_cgroup_v1, _two_cpus)),
    Bench("serving_overhead", ("--models", "resnet50,bert-base"), 35, ("--quick",), results_md=True,
          needs=(_two_cpus,)),
    Bench("search_calibration", (), 15, ("--quick", "--models", "resnet50"), results_md=True),
    Bench("search_quality", (), 10, ("--quick", "--skip-real"), results_md=True),
    Bench("search_baseline", (), 12, ("--quick", "--models", "resnet50", "--slos", "500"), results_md=True),
    Bench("search_time", ("--models", "resnet50,bert-base"), 5,
          ("--models", "tiny", "--no-probe", "--batches", "1,2", "--budget-s", "20")),
    Bench("peers", ("--models", "resnet50,exported:bert,mobilenet_v2,deepspeech2,exported:resnet,bert-base",
                    "--batches", "1,2,4,8", "--max-windows", "4", "--verify-windows", "3", "--rounds", "3"), 25,
          ("--quick",), results_md=True),
    Bench("online_peers", ("--models", "resnet50,mobilenet_v2,bert-base", "--peers", "http"), 50,
          ("--quick", "--models", "tiny", "--max-rate", "60", "--step", "1"), results_md=True),
    Bench("online_paired", (), 45, ("--quick", "--models", "tiny", "--slos", "1000"), results_md=True),
    Bench("mlserver_peer", ("--models", "resnet50,exported:bert", "--floating", "--requests", "30"), 20,
          ("--models", "resnet50", "--rounds", "1", "--seconds", "2", "--requests", "5"), results_md=True,
          needs=(_mlserver_venv,)),
    Bench("online_layouts", ("--model", "resnet50", "--slo", "1000", "--layouts",
                             "2x1:b4@onnxruntime,1x2:b8@onnxruntime,2x1:b8@openvino,1x2:b8@openvino,2x1:b1@onnxruntime",
                             "--rates", "30,34,38,30,34,38", "--seconds", "12"), 8,
          ("--model", "tiny", "--layouts", "1x1:b1@onnxruntime", "--rates", "20", "--seconds", "2"), out=None),
    Bench("search_picks", ("--model", "resnet50", "--slo", "1000", "--runs", "2"), 6,
          ("--model", "tiny", "--runs", "1", "--budget", "15"), out=None),
    Bench("online_sim_time", (), 0.2, out=None),
    Bench("shed_accuracy", (), 3, ("--model", "tiny", "--layout", "1x1:b1@onnxruntime", "--rates", "50",
                                   "--seconds", "2"), out=None, needs=(_two_cpus,)),
    Bench("serving_cost", ("--model", "mobilenet_v2", "--backend", "onnxruntime", "--rate", "200"), 1,
          ("--model", "tiny", "--rate", "100", "--seconds", "2"), out="--json", needs=(_two_cpus,)),
    Bench("cpu_split", ("--rounds", "2"), 4, ("--model", "tiny", "--contenders", "onnxruntime", "--rate", "50",
                                              "--seconds", "2", "--rounds", "1"), out="--json", needs=(_perf, _two_cpus)),
    Bench("ov_static_shapes", (), 2, ("--model", "tiny", "--rounds", "2"), out=None),
    Bench("json_request_breakdown", (), 1, ("--seconds", "2"), out=None, needs=(_two_cpus,)),
    Bench("grpc_server_modes", ("--requests", "1000", "--rounds", "3"), 2, ("--requests", "50", "--rounds", "1"),
          out=None, needs=(_two_cpus,)),
    Bench("frontdoor_json", (), 1, ("--rounds", "3"), out=None, needs=(_git_commit("a32fa24"),)),
    Bench("loopback_floor", (), 0.2, out=None),
    # no figure in RESULTS.md: a real PyTorch training loop for the GPU machines (docs/gpu-verification/)
    Bench("train_gpu_pytorch", ("--iterations", "40"), 1, out="--report", needs=(_gpu_and_torch,)),
]


def _list(benches: list[Bench]) -> None:
    for b in benches:
        full = " ".join(["python -m bench." + b.name, *b.full] + (["--results-md bench/RESULTS.md"] if b.results_md
                                                                   else []))
        smoke = "its full run" if b.smoke is None else " ".join(["python -m bench." + b.name, *b.smoke])
        print(f"{b.name}: ~{b.full_minutes:g} min full on 2 cpus\n  figure: {full}\n  make bench: {smoke}"
              + (f"\n  left out here: {b.missing()}" if b.missing() else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", help="run only this bench (repeatable)")
    p.add_argument("--full", action="store_true", help="each figure's own command (hours; rewrites RESULTS.md)")
    p.add_argument("--list", action="store_true", help="print each bench's command, time and needs, run nothing")
    p.add_argument("--results-md", default=str(RESULTS_MD), help="with --full: the RESULTS.md to rewrite")
    p.add_argument("--out", default=None, help="each bench writes to OUT/NAME (default bench/results[/smoke])")
    args = p.parse_args(argv)
    unknown = set(args.only or ()) - {b.name for b in BENCHES}
    if unknown:
        p.error(f"no bench {', '.join(sorted(unknown))}; choose from {', '.join(b.name for b in BENCHES)}")
    benches = [b for b in BENCHES if not args.only or b.name in args.only]
    if args.list:
        _list(benches)
        return 0
    out = Path(args.out) if args.out else RESULTS_DIR if args.full else RESULTS_DIR / "smoke"
    failed, left_out, started_all = [], [], time.monotonic()
    for b in benches:
        reason = b.missing()
        if reason:
            left_out.append(b.name)
            print(f"== {b.name}: left out: {reason}; where it can run: python -m bench.{b.name} {' '.join(b.full)}",
                  flush=True)
            continue
        cmd = b.command(args.full, out / b.name, args.results_md)
        if b.out:
            (out / b.name).mkdir(parents=True, exist_ok=True)
        print(f"== {b.name}: {' '.join(cmd[1:])}", flush=True)
        started = time.monotonic()
        code = subprocess.call(cmd, cwd=ROOT)
        print(f"== {b.name}: exit {code} after {time.monotonic() - started:.0f} s", flush=True)
        if code != 0:
            failed.append(b.name)
    print(f"== {len(benches) - len(left_out) - len(failed)} passed, {len(failed)} failed"
          f"{': ' + ', '.join(failed) if failed else ''}, {len(left_out)} left out"
          f"{': ' + ', '.join(left_out) if left_out else ''}; {time.monotonic() - started_all:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
