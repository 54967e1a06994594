"""Layout search vs the paper's baseline (issue 4), measured for real on this machine's cores.

    python -m bench.search_baseline                       # resnet50, bert-base, deepspeech2 × SLO 200/500/1000 ms
    python -m bench.search_baseline --models resnet50 --slos 500 --quick

Per model and SLO: the quick search (reamer.search.method.quick_search with the real profiler:
pinned workers, warm-up, windows) on every core of this machine, timed from its first measurement
to its answer (the model file is built beforehand). The baseline is Cloud Reamer's "one instance,
maximum batch": one instance on all cores with the largest batch whose p99 meets the SLO alone
(reusing the search's points where it measured them). Then the baseline and the search's pick are
measured again as whole layouts, alternating, and the gain is the ratio of their mean throughputs.
Writes OUT/search_baseline.json and its part of the "Layout search (issue 4)" section of RESULTS.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import command_and_machine, RESULTS_DIR, RESULTS_MD, command_line, loadavg, machine_info, write_json
from bench.models import SEARCH_MODELS as MODELS, model_file
from bench.search_quality import SECTION, write_section

from reamer.plan.layout import Layout, format_layout
from reamer.plan.partition import ProfilePoint
from reamer.search.method import DEFAULT_BATCHES, quick_search
from reamer.serve.measure.profiler import measure_layout, measure_point

SUBSECTION = "### Against one instance with the maximum batch (real, this machine)"
SEARCH_TIME_TARGET_S = 120.0


def baseline_batch(points: dict[tuple[int, int], ProfilePoint], measure, n_cores: int, slo_ms: float,
                   batches: tuple[int, ...]) -> int | None:
    """Largest batch whose single instance on all cores meets the SLO (p99 rises with batch)."""
    chosen = None
    for batch in sorted(batches):
        point = points.get((n_cores, batch)) or measure(n_cores, batch)
        if point.p99_ms > slo_ms:
            break
        chosen = batch
    return chosen


def run_one(name: str, path: Path, slo: float, cpus: list[int], batches: tuple[int, ...],
            timing: dict[str, Any], repeats: int) -> dict[str, Any]:
    n_cores = len(cpus)
    fixed = {"warmup_s": timing["warmup_s"], "window_s": timing["window_s"], "windows": timing["layout_windows"]}
    point_timing = {k: timing[k] for k in ("warmup_s", "window_s", "max_windows")}
    points: dict[tuple[int, int], ProfilePoint] = {}

    def measure(cores: int, batch: int) -> ProfilePoint:
        points[(cores, batch)] = measure_point(path, "onnxruntime", cores, batch, cpus, **point_timing)
        return points[(cores, batch)]

    def verify(layout: Layout) -> tuple[float, float]:
        return measure_layout(path, "onnxruntime", layout, cpus, **fixed)

    load_before = loadavg()
    started = time.monotonic()
    result = quick_search(measure, n_cores, slo, batches=batches, verify=verify)
    search_s = time.monotonic() - started
    row: dict[str, Any] = {"model": name, "slo_ms": slo, "search_s": round(search_s, 1),
                           "measured": result.measured, "space": result.space, "load_before": load_before,
                           "quick_layout": format_layout(result.best.layout) if result.best else None,
                           "note": result.note}
    b = baseline_batch(points, measure, n_cores, slo, batches)
    row["baseline_layout"] = format_layout(Layout.uniform(1, n_cores, b)) if b else None
    if result.best is None or b is None:
        row.update({"gain": None, "load_after": loadavg()})
        return row
    layouts = {"quick": result.best.layout, "baseline": Layout.uniform(1, n_cores, b)}
    runs: dict[str, list[tuple[float, float]]] = {"quick": [], "baseline": []}
    for _ in range(repeats):  # alternate, so drifting load hits both alike
        for key, layout in layouts.items():
            if key == "quick" and layout.canonical() == layouts["baseline"].canonical():
                continue
            runs[key].append(verify(layout))
    if not runs["quick"]:
        runs["quick"] = runs["baseline"]  # the search picked the baseline itself
    for key in runs:
        row[f"{key}_rps"] = [r for r, _ in runs[key]]
        row[f"{key}_p99_ms"] = [p for _, p in runs[key]]
    q, base = statistics.mean(row["quick_rps"]), statistics.mean(row["baseline_rps"])
    row["gain"] = q / base if base > 0 else None
    row["quick_meets_slo"] = max(row["quick_p99_ms"]) <= slo
    row["baseline_meets_slo"] = max(row["baseline_p99_ms"]) <= slo
    row["load_after"] = loadavg()
    return row


def render(data: dict) -> str:
    lines = [
        command_and_machine(data) + f", "
        f"shared with other engineers' test runs (load average per row) · onnxruntime · batches "
        f"{', '.join(map(str, data['batches']))} · warm-up {data['timing']['warmup_s']} s, windows "
        f"{data['timing']['window_s']} s (≤ {data['timing']['max_windows']} per point, "
        f"{data['timing']['layout_windows']} per layout run).",
        "",
        "Baseline = one instance on all cores, the largest batch whose p99 meets the SLO. Gain = mean throughput of "
        f"the search's pick / the baseline's, each re-measured ×{data['repeats']} alternating. Search time target: "
        f"≤ {SEARCH_TIME_TARGET_S:.0f} s per model and SLO.",
        "",
        "| model | SLO | search pick | baseline | gain | p99 pick / baseline (ms) | measurements | search time | "
        "load before→after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        gain = "—" if r.get("gain") is None else f"{r['gain']:.2f}×"
        p99 = "—" if "quick_p99_ms" not in r else f"{max(r['quick_p99_ms']):.0f} / {max(r['baseline_p99_ms']):.0f}"
        lines.append(f"| {r['model']} | {r['slo_ms']:g} ms | {r['quick_layout'] or '— (' + r['note'] + ')'} | "
                     f"{r['baseline_layout'] or '—'} | {gain} | {p99} | {r['measured']} | {r['search_s']:.0f} s | "
                     f"{r['load_before'][0]}→{r['load_after'][0]} |")
    per_model: dict[str, float] = {}
    for r in data["rows"]:
        per_model[r["model"]] = max(per_model.get(r["model"], 0.0), r["search_s"])
    lines += ["", "Longest search per model: " + ", ".join(f"{m} {s:.0f} s" for m, s in per_model.items()) + "."]
    if data.get("notes"):
        lines += [""] + [f"- {n}" for n in data["notes"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--slos", default="200,500,1000")
    p.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    p.add_argument("--warmup", type=float, default=0.3)
    p.add_argument("--window", type=float, default=0.5)
    p.add_argument("--max-windows", type=int, default=5)
    p.add_argument("--layout-windows", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2, help="re-measurements of the pick and the baseline")
    p.add_argument("--model-dir", default="/tmp/reamer-bench-models")
    p.add_argument("--quick", action="store_true", help="smoke: first model, SLO 1000 ms, one repeat")
    p.add_argument("--out", default=str(RESULTS_DIR / "search_baseline"))
    p.add_argument("--results-md", default=str(RESULTS_MD), help="'' to skip writing RESULTS.md")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    slos = [float(x) for x in args.slos.split(",")]
    repeats = args.repeats
    if args.quick:
        models, slos, repeats = models[:1], slos[-1:], 1
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        print(f"error: unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}", file=sys.stderr)
        return 2
    batches = tuple(int(x) for x in args.batches.split(","))
    timing = {"warmup_s": args.warmup, "window_s": args.window, "max_windows": args.max_windows,
              "layout_windows": args.layout_windows}
    cpus = sorted(os.sched_getaffinity(0))
    data: dict[str, Any] = {
        "command": command_line("search_baseline", argv),
        "machine": machine_info(), "batches": list(batches), "timing": timing, "repeats": repeats, "rows": [],
        "notes": [f"bert-base is the full encoder: {MODELS['bert-base']}"],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in models:
        path = model_file(name, MODELS[name], Path(args.model_dir))
        for slo in slos:
            row = run_one(name, path, slo, cpus, batches, timing, repeats)
            data["rows"].append(row)
            print(f"  {name} {slo:g} ms: pick {row['quick_layout']} vs {row['baseline_layout']}, gain "
                  f"{row.get('gain')}, search {row['search_s']} s, load {row['load_before']}", flush=True)
            write_json(out / "search_baseline.json", data)
    body = render(data)
    print(body)
    if args.results_md:
        write_section(Path(args.results_md), SUBSECTION, body)
    print(f"results: {out / 'search_baseline.json'} (section {SECTION!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
