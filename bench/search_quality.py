"""Layout-search quality (issue 4): quick search vs exhaustive search.

    python -m bench.search_quality                 # simulator study (16/32/64 cores) + real 2-core check (~10 min)
    python -m bench.search_quality --skip-real     # simulator study only (seconds)
    python -m bench.search_quality --quick         # smoke: one model, 16 cores, offline, no real check

Simulator study: bench.simulator.CalibratedModel, calibrated from this machine's real
single-instance profiles and 2-instance contention (bench/search_calibration.json, written by
python -m bench.search_calibration), stands in for 16-, 32- and 64-core machines. The quick search sees
noisy single-instance profiles and noisy layout runs, like real measurements; its pick is judged
by the noise-free truth against the exhaustive best, which is exact (the simulator is a formula:
a knapsack over core counts, cross-checked by enumerating every layout of small spaces: 16 cores
by default).
Measurements = single-instance points + layout runs the quick search asked for; the exhaustive
search's count is every layout (Cloud Reamer's space: integer partitions × one shared max batch).

Real check: on this machine's cores both searches run for real (reamer.serve.measure.profiler): every
layout of the 2-core space, and the quick search per SLO (its point and layout measurements are
shared by the searches of the different SLOs, each still counting all it asked for); when the picks
differ, both layouts are measured again, alternating, to tell a real miss from a tie within noise.
Writes OUT/search_quality.json and the "Layout search (issue 4)" section of RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import (BENCH, RESULTS_DIR, RESULTS_MD, command_and_machine, command_line, loadavg, machine_info,
                           replace_section, write_json)

from bench.simulator import CalibratedBackends, CalibratedModel, calibrated_backends, calibrated_models

from reamer.plan.layout import Layout, count_layouts, format_layout, parse_layout
from reamer.search.method import (DEFAULT_BATCHES, count_backend_layouts, exhaustive_search,
                                  quick_search, quick_search_backends)

SECTION = "## Layout search (issue 4)"
SUBSECTION = "### Search quality: quick vs exhaustive"
SUBSECTION_AUTO = "### Search quality with the backend dimension (issue 14)"
CALIBRATION = BENCH / "search_calibration.json"
QUALITY_TARGET, MEASURE_TARGET = 0.97, 0.05


def _slo(text: str) -> float | None:
    return None if text.lower() in ("none", "offline", "") else float(text)


def _slo_label(slo: float | None) -> str:
    return "offline" if slo is None else f"{slo:g} ms"


# --- simulator study ----------------------------------------------------------------------------------

def simulate_one(model: CalibratedModel, n_cores: int, slo: float | None, batches: tuple[int, ...],
                 enumerate_limit: int) -> dict[str, Any]:
    counted = {"points": 0, "layouts": 0}

    def measure(cores: int, batch: int):
        counted["points"] += 1
        return model.profile(cores, batch)

    def verify(layout: Layout):
        counted["layouts"] += 1
        return model.run_layout(layout)

    started = time.perf_counter()
    quick = quick_search(measure, n_cores, slo, batches=batches, verify=verify)
    search_s = time.perf_counter() - started
    space = count_layouts(n_cores, batches)
    paper = model.best_layout(n_cores, slo, batches)
    wide = model.best_layout(n_cores, slo, batches, per_instance_batch=True)
    row: dict[str, Any] = {
        "model": model.name, "cores": n_cores, "slo_ms": slo, "noise": model.noise, "seed": model.seed,
        "space": space, "measured": quick.measured, "points": counted["points"], "layouts": counted["layouts"],
        "measured_fraction": quick.measured / space, "search_cpu_s": round(search_s, 4),
        "exhaustive_layout": format_layout(paper[0]) if paper else None,
        "exhaustive_rps": paper[1] if paper else None,
        "wide_layout": format_layout(wide[0]) if wide else None, "wide_rps": wide[1] if wide else None,
    }
    if space <= enumerate_limit:  # the DP must equal enumerating every layout
        full = exhaustive_search(model.expected_layout, n_cores, slo, batches=batches)
        row["enumerated_rps"] = full.best.rps if full.best else None
        row["enumeration_agrees"] = (full.best is None and paper is None) or (
            full.best is not None and paper is not None and math.isclose(full.best.rps, paper[1], rel_tol=1e-9))
    if quick.best is not None:
        true_rps, true_p99 = model.expected_layout(quick.best.layout)
        row.update({"quick_layout": format_layout(quick.best.layout), "quick_true_rps": true_rps,
                    "quick_true_p99_ms": true_p99, "quick_meets_slo": slo is None or true_p99 <= slo})
    else:
        row.update({"quick_layout": None, "quick_true_rps": 0.0, "quick_true_p99_ms": None,
                    "quick_meets_slo": paper is None, "quick_note": quick.note})
    if paper is None:
        row["ratio"] = None  # nothing meets the SLO on these cores: nothing to find
        row["met"] = quick.best is None or row["quick_meets_slo"]
    else:
        rps = row["quick_true_rps"] if row["quick_meets_slo"] else 0.0
        row["ratio"] = rps / paper[1]
        row["ratio_vs_wide"] = rps / wide[1] if wide else None
        row["met"] = row["ratio"] >= QUALITY_TARGET and row["measured_fraction"] <= MEASURE_TARGET
    return row


def simulate_backends_one(model: CalibratedBackends, n_cores: int, slo: float | None,
                          batches: tuple[int, ...]) -> dict[str, Any]:
    """`--backends auto`: the quick search over every calibrated backend (screening, per-backend search,
    OpenVINO streams) against the exact best of the whole space (every backend, streams layouts)."""
    counted = {"points": 0, "layouts": 0}

    def measure(backend: str, cores: int, batch: int):
        counted["points"] += 1
        return model.profile(backend, cores, batch)

    def verify(layout: Layout):
        counted["layouts"] += 1
        return model.run_layout(layout)

    started = time.perf_counter()
    quick, screens = quick_search_backends(measure, n_cores, slo, batches, verify, backends=model.backends)
    search_s = time.perf_counter() - started
    space = count_backend_layouts(n_cores, batches, model.backends)
    paper = model.best_layout(n_cores, slo, batches)
    row: dict[str, Any] = {
        "model": model.name, "cores": n_cores, "slo_ms": slo, "noise": model.noise,
        "seed": next(iter(model.models.values())).seed, "backends": model.backends,
        "dropped": [s.backend for s in screens if s.dropped],
        "space": space, "measured": quick.measured, "points": counted["points"], "layouts": counted["layouts"],
        "measured_fraction": quick.measured / space, "search_cpu_s": round(search_s, 4),
        "exhaustive_layout": format_layout(paper[0]) if paper else None,
        "exhaustive_rps": paper[1] if paper else None,
    }
    if quick.best is not None:
        true_rps, true_p99 = model.expected_layout(quick.best.layout)
        row.update({"quick_layout": format_layout(quick.best.layout), "quick_true_rps": true_rps,
                    "quick_true_p99_ms": true_p99, "quick_meets_slo": slo is None or true_p99 <= slo})
    else:
        row.update({"quick_layout": None, "quick_true_rps": 0.0, "quick_true_p99_ms": None,
                    "quick_meets_slo": paper is None, "quick_note": quick.note})
    if paper is None:
        row["ratio"] = None
        row["met"] = quick.best is None or row["quick_meets_slo"]
    else:
        rps = row["quick_true_rps"] if row["quick_meets_slo"] else 0.0
        row["ratio"] = rps / paper[1]
        row["met"] = row["ratio"] >= QUALITY_TARGET and row["measured_fraction"] <= MEASURE_TARGET
    return row


def simulator_study(calibration: dict, models: list[str], cores: list[int], slos: list[float | None],
                    noises: list[float], seeds: int, batches: tuple[int, ...], enumerate_limit: int,
                    backends: str = "onnxruntime") -> list[dict]:
    if backends == "auto":
        load, simulate = calibrated_backends, lambda m, n, slo: simulate_backends_one(m, n, slo, batches)
        fix = "python -m bench.search_calibration --backend openvino --models {} (not calibrated on every backend)"
    else:
        load, simulate = calibrated_models, lambda m, n, slo: simulate_one(m, n, slo, batches, enumerate_limit)
        fix = "python -m bench.search_calibration --models {} first (not in the calibration)"
    rows = []
    for noise in noises:
        base = load(calibration, noise=noise)
        missing = [m for m in models if m not in base]
        if missing:
            raise SystemExit(f"error: {', '.join(missing)}: run {fix.format(','.join(missing))}")
        for name in models:
            for seed in range(seeds if noise else 1):
                model = base[name].with_noise(noise, seed)
                rows += [simulate(model, n, slo) for n in cores for slo in slos]
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """One line per (model, cores, noise): worst and mean ratio over SLOs and seeds, worst fraction."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["cores"], row["noise"]), []).append(row)
    out = []
    for (model, cores, noise), group in groups.items():
        scored = [r for r in group if r["ratio"] is not None]
        ratios = [r["ratio"] for r in scored]
        out.append({
            "model": model, "cores": cores, "noise": noise, "cases": len(group), "scored": len(scored),
            "worst_ratio": min(ratios) if ratios else None, "mean_ratio": statistics.mean(ratios) if ratios else None,
            "worst_fraction": max(r["measured_fraction"] for r in group),
            "max_measured": max(r["measured"] for r in group), "space": group[0]["space"],
            "met": all(r["met"] for r in group),
            "enumeration_agrees": all(r.get("enumeration_agrees", True) for r in group),
        })
    return out


# --- real 2-core check --------------------------------------------------------------------------------

def real_check(calibration: dict, models: list[str], slos: list[float | None], batches: tuple[int, ...],
               timing: dict[str, float], repeats: int) -> list[dict]:
    from bench.models import SEARCH_MODELS as MODELS, model_file

    from reamer.search.method import all_layouts
    from reamer.serve.measure.profiler import measure_layout, measure_point

    cpus = sorted(os.sched_getaffinity(0))
    n_cores = len(cpus)
    fixed = {"warmup_s": timing["warmup_s"], "window_s": timing["window_s"], "windows": timing["layout_windows"]}
    point_timing = {"warmup_s": timing["warmup_s"], "window_s": timing["window_s"],
                    "max_windows": timing["max_windows"]}
    model_dir = Path(timing["model_dir"])
    results = []
    for name in models:
        path = model_file(name, MODELS[name], model_dir)
        load_before = loadavg()
        started = time.monotonic()
        every = {}
        for layout in all_layouts(n_cores, batches):
            every[format_layout(layout)] = measure_layout(path, "onnxruntime", layout, cpus, **fixed)
            print(f"  {name} exhaustive {format_layout(layout)}: {every[format_layout(layout)][0]:.2f} rps, "
                  f"p99 {every[format_layout(layout)][1]:.0f} ms", flush=True)
        exhaustive_s = time.monotonic() - started
        points: dict[tuple[int, int], Any] = {}

        def measure(cores: int, batch: int):  # one profile per point, shared by the searches of every SLO
            if (cores, batch) not in points:
                points[(cores, batch)] = measure_point(path, "onnxruntime", cores, batch, cpus, **point_timing)
            return points[(cores, batch)]

        runs: dict[Layout, tuple[float, float]] = {}

        def verify(layout: Layout):  # likewise one run per layout, shared by the searches of every SLO
            key = layout.canonical()
            if key not in runs:
                runs[key] = measure_layout(path, "onnxruntime", layout, cpus, **fixed)
            return runs[key]

        for slo in slos:
            t0 = time.monotonic()
            quick = quick_search(measure, n_cores, slo, batches=batches, verify=verify)
            quick_s = time.monotonic() - t0
            feasible = {k: v for k, v in every.items() if slo is None or v[1] <= slo}
            best = max(feasible, key=lambda k: feasible[k][0]) if feasible else None
            row: dict[str, Any] = {
                "model": name, "slo_ms": slo, "space": len(every), "quick_measured": quick.measured,
                "quick_layout": format_layout(quick.best.layout.canonical()) if quick.best else None,
                "quick_rps": quick.best.rps if quick.best else None,
                "exhaustive_layout": format_layout(parse_layout(best).canonical()) if best else None,
                "exhaustive_rps": feasible[best][0] if best else None, "quick_s": round(quick_s, 1),
            }
            same = row["quick_layout"] == row["exhaustive_layout"]
            if same:
                row["verdict"] = "same layout" if best else "both: nothing meets the SLO"
            elif best is None:
                row["verdict"] = "only quick met the SLO (a layout outside the exhaustive space)"
            elif quick.best is None:
                row["verdict"] = "quick found nothing that met the SLO"
            else:
                # Different picks: measure both again, alternating, so load drifts hit both alike.
                again = {row["quick_layout"]: [], row["exhaustive_layout"]: []}
                for _ in range(repeats):
                    for text in again:
                        again[text].append(measure_layout(path, "onnxruntime", parse_layout(text), cpus, **fixed))
                q = [r for r, _ in again[row["quick_layout"]]]
                e = [r for r, _ in again[row["exhaustive_layout"]]]
                spread = max(statistics.pstdev(q) / statistics.mean(q), statistics.pstdev(e) / statistics.mean(e))
                gap = statistics.mean(q) / statistics.mean(e) - 1.0
                row.update({"remeasured_quick_rps": q, "remeasured_exhaustive_rps": e, "gap": gap, "spread": spread,
                            "remeasured_quick_p99_ms": [p for _, p in again[row["quick_layout"]]],
                            "remeasured_exhaustive_p99_ms": [p for _, p in again[row["exhaustive_layout"]]]})
                noise_band = max(0.05, 2 * spread)
                row["verdict"] = ("quick at least as good on re-measurement" if gap >= 0 else
                                  "tie within noise" if -gap <= noise_band else "quick worse")
            results.append(row)
            print(f"  {name} {_slo_label(slo)}: quick {row['quick_layout']} vs exhaustive {row['exhaustive_layout']}"
                  f" -> {row['verdict']}", flush=True)
        results.append({"model": name, "summary": True, "exhaustive_s": round(exhaustive_s, 1),
                        "load_before": load_before, "load_after": loadavg(),
                        "measured_layouts": {k: list(v) for k, v in every.items()},
                        "points": [{"cores": c, "batch": b, "throughput_rps": p.throughput_rps, "p99_ms": p.p99_ms}
                                   for (c, b), p in sorted(points.items())]})
    return results


# --- report -------------------------------------------------------------------------------------------

def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def render(data: dict) -> str:
    auto = data.get("backends") == "auto"
    lines = [
        command_and_machine(data) + f" · "
        f"load average at start {data['load_start']} · calibration: bench/search_calibration.json "
        f"(its load averages are in the Calibration section).",
        "",
        ("Simulator study with the backend dimension (CalibratedBackends: onnxruntime's CalibratedModel, and "
         "OpenVINO's from same-run OpenVINO/onnxruntime ratios times onnxruntime's profile, with the measured factor "
         "of one 2-stream instance against two 1-core instances; the quick search screens both backends, searches "
         "those not clearly behind and tries streams; the exhaustive best is exact over every layout on every backend "
         "and every streams layout, a knapsack checked against enumeration in tests/plan). " if auto else
         "Simulator study (CalibratedModel from real 1-/2-core profiles + measured 2-instance contention; quick "
         "search sees noisy measurements, its pick is scored by the noise-free truth; exhaustive best is exact). ")
        + "Quick search sees noisy measurements, its pick is scored by the noise-free truth. "
        f"Target: ≥ {100 * QUALITY_TARGET:.0f} % of the exhaustive best with ≤ {100 * MEASURE_TARGET:.0f} % of its "
        f"measurements. SLOs: {', '.join(_slo_label(s) for s in data['slos'])}; "
        f"batches {', '.join(map(str, data['batches']))}; {data['seeds']} noise seeds.",
        "",
        "| model | cores | noise | worst ratio | mean ratio | quick measurements (max) | exhaustive layouts | "
        "worst fraction | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in data["summary"]:
        lines.append(f"| {s['model']} | {s['cores']} | ±{100 * s['noise']:.0f} % | {_pct(s['worst_ratio'])} | "
                     f"{_pct(s['mean_ratio'])} | {s['max_measured']} | {s['space']:,} | "
                     f"{100 * s['worst_fraction']:.3f} % | {'yes' if s['met'] else 'NO'} |")
    scored = [r for r in data["rows"] if r["ratio"] is not None]
    met = sum(1 for r in data["rows"] if r["met"])
    lines += ["", f"{met} of {len(data['rows'])} cases met both targets ({len(scored)} had a feasible layout). "
              f"Exact exhaustive = enumeration where enumerated: "
              f"{'yes' if all(s['enumeration_agrees'] for s in data['summary']) else 'NO'}."]
    if auto:
        picked: dict[str, int] = {}
        for r in data["rows"]:
            if r.get("quick_layout"):
                key = parse_layout(r["quick_layout"]).backend or "?"
                key += " with streams" if any(s.streams > 1 for s in parse_layout(r["quick_layout"]).instances) else ""
                picked[key] = picked.get(key, 0) + 1
        exact: dict[str, int] = {}
        for r in data["rows"]:
            if r.get("exhaustive_layout"):
                key = parse_layout(r["exhaustive_layout"]).backend or "?"
                exact[key] = exact.get(key, 0) + 1
        dropped = sum(1 for r in data["rows"] if r.get("dropped"))
        lines += [f"Picks by backend: {', '.join(f'{k} {v}' for k, v in sorted(picked.items()))}; exact best by "
                  f"backend: {', '.join(f'{k} {v}' for k, v in sorted(exact.items()))}; a backend dropped at "
                  f"screening in {dropped} of {len(data['rows'])} cases."]
    misses = [r for r in data["rows"] if not r["met"]]
    for r in misses[:8]:
        lines.append(f"- miss: {r['model']} {r['cores']} cores {_slo_label(r['slo_ms'])} noise {r['noise']} "
                     f"seed {r['seed']}: quick {r['quick_layout']} {_pct(r['ratio'])} of {r['exhaustive_layout']}, "
                     f"{r['measured']} measurements")
    real = [r for r in data.get("real", []) if not r.get("summary")]
    if real:
        lines += ["", "Real 2-core check (both searches measured for real on this machine; batches "
                  f"{', '.join(map(str, data['real_batches']))}):", "",
                  "| model | SLO | quick pick | exhaustive pick | rps quick / exhaustive | quick measurements | "
                  "exhaustive layouts | verdict |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in real:
            verdict = r["verdict"]
            if verdict == "differ: one found nothing":  # label of earlier runs
                verdict = ("only quick met the SLO (a layout outside the exhaustive space)"
                           if r["exhaustive_layout"] is None else "quick found nothing that met the SLO")
            if "gap" in r:
                verdict += f" (re-measured ×{len(r['remeasured_quick_rps'])}: quick {100 * r['gap']:+.1f} %, spread " \
                           f"{100 * r['spread']:.1f} %)"
            rates = " / ".join("—" if x is None else f"{x:.2f}" for x in (r["quick_rps"], r["exhaustive_rps"]))
            lines.append(f"| {r['model']} | {_slo_label(r['slo_ms'])} | {r['quick_layout']} | {r['exhaustive_layout']}"
                         f" | {rates} | {r['quick_measured']} | {r['space']} | {verdict} |")
        if data.get("real_reused_from"):
            lines += ["", f"(Real check taken from an earlier run: `{data['real_reused_from']['command']}`.)"]
        loads = [f"{r['model']} {r['load_before']}→{r['load_after']}" for r in data["real"] if r.get("summary")]
        lines.append("")
        lines.append("Load average (1/5/15 min) during the real check: " + "; ".join(loads) + ".")
    elif data.get("real_skipped"):
        lines += ["", "Real 2-core check: skipped (--skip-real)."]
    return "\n".join(lines)


def write_section(results_md: Path, subsection: str, body: str) -> None:
    replace_section(results_md, subsection, body, parent=SECTION)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibration", default=str(CALIBRATION))
    p.add_argument("--models", default=None, help="comma list (default: every calibrated model)")
    p.add_argument("--cores", default="16,32,64")
    p.add_argument("--slos", default="none,200,500,1000", help="comma list of ms; 'none' = offline")
    p.add_argument("--real-slos", default="none,500,1000", help="SLOs of the real check")
    p.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    p.add_argument("--noise", default="0,0.02,0.05", help="comma list of ± relative measurement noise")
    p.add_argument("--seeds", type=int, default=3, help="noise seeds per noisy setting")
    p.add_argument("--enumerate-limit", type=int, default=2_000,
                   help="also enumerate every layout when the space is at most this (cross-check)")
    p.add_argument("--skip-real", action="store_true", help="simulator study only")
    p.add_argument("--real-models", default=None, help="comma list for the real check (default: --models)")
    p.add_argument("--reuse-real", default=None, metavar="JSON",
                   help="take the real check from an earlier search_quality.json instead of measuring again")
    p.add_argument("--real-batches", default="1,2,4,8", help="batches of the real 2-core space")
    p.add_argument("--real-repeats", type=int, default=3, help="re-measurements of differing picks")
    p.add_argument("--warmup", type=float, default=0.3)
    p.add_argument("--window", type=float, default=0.5)
    p.add_argument("--max-windows", type=int, default=5)
    p.add_argument("--layout-windows", type=int, default=3)
    p.add_argument("--model-dir", default="/tmp/reamer-bench-models")
    p.add_argument("--quick", action="store_true", help="smoke: first model, 16 cores, offline, one seed, no real")
    p.add_argument("--backends", default="onnxruntime", choices=("onnxruntime", "auto"),
                   help="auto: the search over every calibrated backend and OpenVINO streams (issue 14); "
                        "simulator only, its own RESULTS subsection")
    p.add_argument("--out", default=str(RESULTS_DIR / "search_quality"))
    p.add_argument("--results-md", default=str(RESULTS_MD), help="'' to skip writing RESULTS.md")
    args = p.parse_args(argv)

    calibration = json.loads(Path(args.calibration).read_text())
    if args.backends == "auto":
        args.skip_real = True
        calibrated = calibrated_backends(calibration)
        models = [m for m in (args.models or ",".join(calibrated)).split(",") if m]
    else:
        models = [m for m in (args.models or ",".join(calibration.get("models", {}))).split(",") if m]
    cores = [int(x) for x in args.cores.split(",")]
    slos = [_slo(x) for x in args.slos.split(",")]
    noises = [float(x) for x in args.noise.split(",")]
    seeds = args.seeds
    if args.quick:
        models, cores, slos, noises, seeds, args.skip_real = models[:1], [16], [None], noises[-1:], 1, True
    batches = tuple(int(x) for x in args.batches.split(","))

    data: dict[str, Any] = {
        "command": command_line("search_quality", argv),
        "machine": machine_info(), "load_start": loadavg(), "models": models, "cores": cores, "slos": slos,
        "noises": noises, "seeds": seeds, "batches": list(batches), "targets": {
            "ratio": QUALITY_TARGET, "measured_fraction": MEASURE_TARGET},
    }
    data["backends"] = args.backends
    data["rows"] = simulator_study(calibration, models, cores, slos, noises, seeds, batches, args.enumerate_limit,
                                   args.backends)
    data["summary"] = summarise(data["rows"])
    data["real_skipped"] = args.skip_real and not args.reuse_real
    if args.reuse_real:
        earlier = json.loads(Path(args.reuse_real).read_text())
        data.update({k: earlier[k] for k in ("real", "real_batches") if k in earlier})
        data["real_reused_from"] = {"path": args.reuse_real, "command": earlier.get("command")}
    elif not args.skip_real:
        real_batches = tuple(int(x) for x in args.real_batches.split(","))
        data["real_batches"] = list(real_batches)
        timing = {"warmup_s": args.warmup, "window_s": args.window, "max_windows": args.max_windows,
                  "layout_windows": args.layout_windows, "model_dir": args.model_dir}
        real_models = [m for m in (args.real_models or ",".join(models)).split(",") if m]
        real_slos = [_slo(x) for x in args.real_slos.split(",")]
        data["real"] = real_check(calibration, real_models, real_slos, real_batches, timing, args.real_repeats)
    data["load_end"] = loadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "search_quality_auto.json" if args.backends == "auto" else "search_quality.json"
    write_json(out / name, data)
    body = render(data)
    print(body)
    if args.results_md:
        write_section(Path(args.results_md), SUBSECTION_AUTO if args.backends == "auto" else SUBSECTION, body)
    print(f"results: {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
