"""Calibration for the layout-search study: real single-instance profiles and the 2-instance contention factor.

    python -m bench.search_calibration                           # resnet50, bert-base, deepspeech2 (~15 min here)
    python -m bench.search_calibration --models resnet50 --quick # smoke: batches 1,2,4 only
    python -m bench.search_calibration --models deepspeech2      # re-measure one model, keep the others

For each model: one instance alone (reamer.serve.measure.profiler.measure_point: pinned worker, warm-up,
windows until the last three are stable) on 1 and 2 cores at batches 1..32; then, per contention
batch, one 1-core instance alone and two 1-core instances running together on cpus 0 and 1
(measure_layout_detail, same fixed windows) — the ratio of per-instance throughput together vs alone
is the contention factor the simulator (bench.simulator.CalibratedModel) extrapolates.
Writes bench/search_calibration.json (kept in the repository; other models' entries are kept) and
records the load average before/after every model, since this machine is shared.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.harness import BENCH, ROOT, command_line, loadavg, machine_info, replace_section, write_json
from bench.models import SEARCH_MODELS as MODELS, model_file

from reamer.host.errors import ReamerError
from reamer.plan.layout import BACKENDS, Layout
from reamer.serve.measure.profiler import measure_layout_detail, measure_point

CALIBRATION = BENCH / "search_calibration.json"
BACKEND = "onnxruntime"


def measure_contention(path: Path, family: str, cpus: list[int], batches: list[int],
                       timing: dict[str, float]) -> list[dict[str, Any]]:
    """Per batch: a 1-core instance alone on each cpu in turn, then one on each cpu together. The alone
    reference is the mean over both cpus, so a cpu that other tenants load more hurts both sides alike."""
    fixed = {"warmup_s": timing["warmup_s"], "window_s": timing["window_s"], "windows": 4}
    found = []
    for b in batches:
        alone = [measure_layout_detail(path, BACKEND, Layout.uniform(1, 1, b), [cpu], **fixed) for cpu in cpus]
        together = measure_layout_detail(path, BACKEND, Layout.uniform(2, 1, b), cpus, **fixed)
        alone_rps = statistics.mean(m.throughput_rps for m in alone)
        windows = [w for m in alone for w in m.instances[0].window_rps]
        cv = statistics.pstdev(windows) / statistics.mean(windows) if len(windows) > 1 else 0.0
        per_instance = together.throughput_rps / 2
        found.append({
            "batch": b, "alone_rps": alone_rps, "alone_rps_per_cpu": [m.throughput_rps for m in alone],
            "alone_p99_ms": max(m.p99_ms for m in alone), "together_rps": together.throughput_rps,
            "together_rps_per_cpu": [i.overall_rps for i in together.instances],
            "together_p99_ms": together.p99_ms,
            "factor": per_instance / alone_rps if alone_rps > 0 else float("nan"), "window_cv": cv,
        })
        print(f"  {family} contention batch {b}: per-instance together/alone = {found[-1]['factor']:.3f}"
              f" (alone per cpu {[round(x, 2) for x in found[-1]['alone_rps_per_cpu']]}, window cv {cv:.3f})",
              flush=True)
    return found


def measure_streams(path: Path, family: str, cpus: list[int], batches: list[int],
                    timing: dict[str, float]) -> list[dict[str, Any]]:
    """Per batch b: one OpenVINO instance on both cpus with 2 streams at batch 2b (each stream b) against
    two 1-core instances at batch b together, alternated twice; factor = streams / instances throughput."""
    fixed = {"warmup_s": timing["warmup_s"], "window_s": timing["window_s"], "windows": 4}
    found = []
    for b in batches:
        one = Layout.uniform(1, 2, 2 * b, streams=2)
        two = Layout.uniform(2, 1, b)
        runs = {"streams": [], "instances": []}
        for _ in range(2):
            runs["streams"].append(measure_layout_detail(path, BACKEND, one, cpus, **fixed))
            runs["instances"].append(measure_layout_detail(path, BACKEND, two, cpus, **fixed))
        s_rps = statistics.mean(m.throughput_rps for m in runs["streams"])
        i_rps = statistics.mean(m.throughput_rps for m in runs["instances"])
        found.append({"batch": b, "streams_rps": s_rps, "instances_rps": i_rps,
                      "streams_p99_ms": max(m.p99_ms for m in runs["streams"]),
                      "instances_p99_ms": max(m.p99_ms for m in runs["instances"]),
                      "factor": s_rps / i_rps if i_rps > 0 else float("nan")})
        print(f"  {family} streams batch {b}: 1x2s2:b{2 * b} / 2x1:b{b} = {found[-1]['factor']:.3f}", flush=True)
    return found


def calibrate_by_ratio(family: str, options: dict[str, Any], cache_dir: Path, batches: list[int], cores: list[int],
                       contention_batches: list[int], timing: dict[str, float], reference: dict[str, Any]) -> dict[str, Any]:
    """BACKEND's points as same-run ratios to onnxruntime's: each (cores, batch) is measured on both backends
    back to back (order alternating), and BACKEND's point is the stored onnxruntime point (`reference`, taken on
    a quieter machine) times the ratio; batches beyond the measured ones hold the last ratio. A loaded machine
    slows both alike, so the ratio keeps what the absolute figures lose. Contention is onnxruntime's (assumed
    alike); the streams factor is measured (a same-run ratio itself)."""
    path = model_file(family, options, cache_dir)
    started, load_before = time.monotonic(), loadavg()
    cpus_all = sorted(os.sched_getaffinity(0))
    ratios: dict[int, dict[int, tuple[float, float]]] = {}
    raw = []
    for c in cores:
        for i, b in enumerate(batches):
            order = [BACKEND, "onnxruntime"] if i % 2 == 0 else ["onnxruntime", BACKEND]
            got = {k: measure_point(path, k, c, b, cpus=cpus_all, **timing) for k in order}
            mine, ref = got[BACKEND], got["onnxruntime"]
            ratios.setdefault(c, {})[b] = (mine.throughput_rps / ref.throughput_rps, mine.p99_ms / ref.p99_ms)
            raw.append({"cores": c, "batch": b, BACKEND: [mine.throughput_rps, mine.p99_ms],
                        "onnxruntime": [ref.throughput_rps, ref.p99_ms]})
            print(f"  {family} {c} core(s) batch {b}: {BACKEND}/onnxruntime throughput "
                  f"{ratios[c][b][0]:.3f}, p99 {ratios[c][b][1]:.3f}", flush=True)
    points = []
    for p in reference["points"]:
        table = ratios.get(p["cores"])
        if not table:
            continue
        near = min(table, key=lambda b: abs(b - p["batch"]))
        rps_ratio, p99_ratio = table[near]
        points.append({"cores": p["cores"], "batch": p["batch"], "throughput_rps": p["throughput_rps"] * rps_ratio,
                       "p99_ms": p["p99_ms"] * p99_ratio, "ratio_from_batch": near})
    cpus = cpus_all[:2]
    streams = measure_streams(path, family, cpus, contention_batches, timing) \
        if len(cpus) == 2 and BACKEND == "openvino" else []
    return {"options": options, "backend": BACKEND, "model_file": path.name, "points": points,
            "contention": reference.get("contention", []), "streams": streams, "same_run": raw,
            "method": "ratio to onnxruntime, same run", "load_before": load_before, "load_after": loadavg(),
            "seconds": round(time.monotonic() - started, 1)}


def calibrate_model(family: str, options: dict[str, Any], cache_dir: Path, batches: list[int], cores: list[int],
                    contention_batches: list[int], timing: dict[str, float],
                    previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """Profiles and contention of one model; with `previous` (--contention-only) its points are kept."""
    path = model_file(family, options, cache_dir)
    started, load_before = time.monotonic(), loadavg()
    points = list(previous["points"]) if previous else []
    for c in cores if previous is None else []:
        for b in batches:
            t0 = time.monotonic()
            p = measure_point(path, BACKEND, c, b, cpus=sorted(os.sched_getaffinity(0)), **timing)
            points.append({"cores": c, "batch": b, "throughput_rps": p.throughput_rps, "p99_ms": p.p99_ms,
                           "seconds": round(time.monotonic() - t0, 1)})
            print(f"  {family} {c} core(s) batch {b}: {p.throughput_rps:.2f} rps, p99 {p.p99_ms:.0f} ms", flush=True)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    contention = measure_contention(path, family, cpus, contention_batches, timing) if len(cpus) == 2 else []
    streams = measure_streams(path, family, cpus, contention_batches, timing) \
        if len(cpus) == 2 and BACKEND == "openvino" else []
    entry = {"options": options, "backend": BACKEND, "model_file": path.name, "points": points,
             "contention": contention, "streams": streams, "load_before": load_before, "load_after": loadavg(),
             "contention_load": [load_before, loadavg()], "seconds": round(time.monotonic() - started, 1)}
    if previous:  # the points keep the load they were measured under
        entry["load_before"], entry["load_after"] = previous["load_before"], previous["load_after"]
    return entry


SUBSECTION = "### Calibration: real single-instance profiles and contention"


def render(data: dict[str, Any]) -> str:
    """Markdown summary of a calibration document (throughput and p99 per cores × batch, contention)."""
    lines = [f"Command: `{data.get('command', 'python -m bench.search_calibration')}` · machine: "
             f"{data['machine']['cpu_model']}, {data['machine']['cpus']} cpus · {data.get('backend', BACKEND)} · "
             f"JSON: bench/search_calibration.json. Load average (1/5/15 min) before → after is listed per model "
             f"(on a shared machine the profiles carry other tenants' load).", ""]
    for family, entry in data.get("models", {}).items():
        batches = sorted({p["batch"] for p in entry["points"]})
        options = f" {entry['options']}" if entry.get("options") else ""
        lines += [f"{family}{options} (throughput/s, p99; load {entry['load_before']} → {entry['load_after']}):", "",
                  "| cores | " + " | ".join(f"b{b}" for b in batches) + " |",
                  "|---|" + "---|" * len(batches)]
        for cores in sorted({p["cores"] for p in entry["points"]}):
            cells = {p["batch"]: f"{p['throughput_rps']:.2f}/s, {p['p99_ms']:.0f} ms" for p in entry["points"]
                     if p["cores"] == cores}
            lines.append(f"| {cores} | " + " | ".join(cells.get(b, "—") for b in batches) + " |")
        contention = ", ".join(f"b{c['batch']}: {c['factor']:.2f}" for c in entry.get("contention", []))
        load = entry.get("contention_load")
        lines += ["", f"Two 1-core instances together, per-instance throughput vs alone: {contention or '—'}"
                  + (f" (load {load[0]} → {load[1]})." if load else "."), ""]
    return "\n".join(lines).rstrip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma list of " + ",".join(MODELS))
    p.add_argument("--batches", default="1,2,4,8,16,32")
    p.add_argument("--cores", default="1,2")
    p.add_argument("--contention-batches", default="1,8")
    p.add_argument("--warmup", type=float, default=0.5, help="warm-up per worker, s (at least one batch runs)")
    p.add_argument("--window", type=float, default=0.5, help="measurement window, s (at least one batch each)")
    p.add_argument("--max-windows", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="smoke: batches 1,2,4; contention at batch 1")
    p.add_argument("--ratio", action="store_true",
                   help="(--backend openvino) points as same-run ratios to onnxruntime times its stored points")
    p.add_argument("--backend", default="onnxruntime", choices=BACKENDS,
                   help="onnxruntime: the top-level models; openvino: backends.openvino.models (with streams)")
    p.add_argument("--contention-only", action="store_true", help="keep the stored points, measure contention again")
    p.add_argument("--calibration", default=None,
                   help=f"the JSON to write, entries of other models kept (default {CALIBRATION.relative_to(ROOT)}; "
                   "with --quick: OUT/search_calibration.json, so a smoke run never replaces the kept calibration)")
    p.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "reamer-bench-models"))
    p.add_argument("--out", default=None, help="also copy the JSON into this directory (bench/run_all.py)")
    p.add_argument("--results-md", default=None, help="also write the calibration summary into this RESULTS.md")
    args = p.parse_args(argv)
    global BACKEND
    BACKEND = args.backend
    batches = [int(x) for x in args.batches.split(",")]
    contention_batches = [int(x) for x in args.contention_batches.split(",")]
    if args.quick:
        batches, contention_batches = [b for b in batches if b <= 4], contention_batches[:1]
    timing = {"warmup_s": args.warmup, "window_s": args.window, "max_windows": args.max_windows}
    if args.calibration:
        out_path = Path(args.calibration)
    elif args.quick:
        out_path = Path(args.out or tempfile.mkdtemp(prefix="reamer-calibration-")) / CALIBRATION.name
        out_path.parent.mkdir(parents=True, exist_ok=True)
    else:
        out_path = CALIBRATION
    data = json.loads(out_path.read_text()) if out_path.exists() else {}
    data.setdefault("models", {})
    command = command_line("search_calibration", argv)
    target = data
    if BACKEND == "onnxruntime":
        data.update({"machine": machine_info(), "backend": BACKEND, "timing": timing, "command": command})
    else:  # the other backends' profiles sit beside the top-level (onnxruntime) ones
        target = data.setdefault("backends", {}).setdefault(BACKEND, {})
        target.setdefault("models", {})
        target.update({"machine": machine_info(), "timing": timing, "command": command})
    try:
        for family in [m for m in args.models.split(",") if m]:
            if family not in MODELS:
                raise ReamerError(f"unknown model {family!r} for the calibration", f"choose from {', '.join(MODELS)}")
            print(f"== {family} (load {loadavg()})", flush=True)
            previous = target["models"].get(family) if args.contention_only else None
            if args.contention_only and not previous:
                raise ReamerError(f"--contention-only: {family} has no stored points in {out_path}",
                                  "run the calibration of this model without --contention-only first")
            if args.ratio and BACKEND != "onnxruntime":
                entry = calibrate_by_ratio(family, MODELS[family], Path(args.model_dir), batches,
                                           [int(x) for x in args.cores.split(",")], contention_batches, timing,
                                           data["models"][family])
            else:
                entry = calibrate_model(family, MODELS[family], Path(args.model_dir), batches,
                                        [int(x) for x in args.cores.split(",")], contention_batches, timing, previous)
            entry["measured_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            target["models"][family] = entry
            write_json(out_path, data)  # after every model: a crash keeps what was measured
    except ReamerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.out and Path(args.out).resolve() != out_path.parent.resolve():
        write_json(Path(args.out) / out_path.name, data)
    if args.results_md and not args.quick:
        from bench.search_quality import SECTION

        replace_section(args.results_md, SUBSECTION, render(data), parent=SECTION)
    print(f"calibration: {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
