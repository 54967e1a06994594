"""Offline throughput side by side (issue 14): reamer's chosen layout (`--backend auto` search) against what a
user picks instead, one run, same cpus, same model, same sample inputs:

- OpenVINO's THROUGHPUT hint: one process, OpenVINO's own streams and threads, an AsyncInferQueue with
  OPTIMAL_NUMBER_OF_INFER_REQUESTS requests of batch 1 (static shapes, as OpenVINO's benchmark_app runs it);
- ONNX Runtime's default session: InferenceSession(model) with no options (all cores, spinning on), a loop of
  run() at batch 1 and at the batch of reamer's pick (the better counts);
- the best layout of each single backend (what `reamer search --backend X` finds): from the same auto search,
  its best verified layout per backend (a backend dropped at screening: its best screening shape, filled);
- at bf16 numerics (where the CPU computes bf16 natively): reamer's pick of `search_layout(..., precision="bf16")`
  (`reamer search --precision bf16`: OpenVINO instances in bfloat16, ONNX Runtime's in f32) against OpenVINO's
  THROUGHPUT hint at its default precision, which is bf16 on such CPUs (`--no-bf16` skips this pair).

Every contender runs pinned to the same cpus, in rotated order, `--rounds` times; each figure is the median,
and ratios are reamer / best peer within the run. Layouts run through reamer's profiler (pinned worker processes
running batches back to back, the layout verification of the search), not the offline job runner, whose
overhead over that loop is bench/serving_overhead.py's subject.

    .venv/bin/python -m bench.peers --results-md bench/RESULTS.md
    .venv/bin/python -m bench.peers --quick --out /tmp/peers        # tiny model, seconds
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import (RESULTS_DIR, ROOT, bench_command, command_and_machine, command_line, loadavg, machine_info,
                           replace_section, spread, write_json)
from bench.models import resolve_model

PARENT = "## Against each runtime's own tuning (issue 14)"
SECTION = "### Offline: reamer's pick against OpenVINO THROUGHPUT, ONNX Runtime's default session, one backend alone"
EXPORTED = ("bert", "resnet", "int8", "fp16", "gpt2")


# --- peers, each in a pinned process of its own -------------------------------------------------------------

def _feeds(model: str, batch: int) -> dict:
    from reamer.serve.backends import open_backend, sample_inputs

    import numpy as np

    with open_backend("onnxruntime", model, 1) as probe:
        return sample_inputs(probe, batch, np.random.default_rng(0))


def peer_main(doc: dict) -> dict:
    os.sched_setaffinity(0, doc["cpus"])  # before the runtime starts its threads
    feeds = _feeds(doc["model"], doc["batch"])
    warmup_s, window_s = doc["warmup_s"], doc["window_s"]
    if doc["kind"] in ("ov-throughput", "ov-throughput-f32"):
        import openvino as ov
        import openvino.properties.hint as hints

        core = ov.Core()
        model = core.read_model(doc["model"])
        model.reshape({port.get_any_name(): ov.PartialShape(list(feeds[port.get_any_name()].shape))
                       for port in model.inputs})
        config = {hints.performance_mode(): hints.PerformanceMode.THROUGHPUT}
        if doc["kind"] == "ov-throughput-f32":  # reamer's and ONNX Runtime's numerics (no bf16 on CPUs that have it)
            config[hints.inference_precision()] = ov.Type.f32
        compiled = core.compile_model(model, "CPU", config)
        nireq = int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))
        queue = ov.AsyncInferQueue(compiled, nireq)
        done = [0]
        queue.set_callback(lambda request, userdata: done.__setitem__(0, done[0] + 1))
        arrays = [feeds[p.get_any_name()] for p in model.inputs]

        def run_for(seconds: float) -> int:
            start_count, until = done[0], time.perf_counter() + seconds
            while time.perf_counter() < until:
                queue.start_async(arrays)
            queue.wait_all()
            return done[0] - start_count
        run_for(warmup_s)
        started = time.perf_counter()
        count = run_for(window_s)
        elapsed = time.perf_counter() - started
        return {"rps": count * doc["batch"] / elapsed, "streams": int(compiled.get_property("NUM_STREAMS")),
                "precision": str(compiled.get_property("INFERENCE_PRECISION_HINT")),
                "threads": int(compiled.get_property("INFERENCE_NUM_THREADS")), "requests": nireq}
    if doc["kind"] == "ort-default":
        import onnxruntime as ort

        session = ort.InferenceSession(doc["model"], providers=["CPUExecutionProvider"])  # its defaults
        names = [o.name for o in session.get_outputs()]
        until = time.perf_counter() + warmup_s
        session.run(names, feeds)
        while time.perf_counter() < until:
            session.run(names, feeds)
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < window_s or count == 0:
            session.run(names, feeds)
            count += 1
        return {"rps": count * doc["batch"] / (time.perf_counter() - started),
                "threads": session.get_session_options().intra_op_num_threads or len(doc["cpus"])}
    raise SystemExit(f"unknown peer {doc['kind']}")


def run_peer(kind: str, model: str, cpus: list[int], batch: int, warmup_s: float, window_s: float) -> dict:
    doc = {"kind": kind, "model": model, "cpus": cpus, "batch": batch, "warmup_s": warmup_s, "window_s": window_s}
    out = subprocess.run(bench_command("peers", "--peer", json.dumps(doc)), capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- one model ----------------------------------------------------------------------------------------------

def best_per_backend(outcome) -> dict[str, Any]:
    """Each backend's best measured layout of the auto search (dropped: its best screening shape, filled)."""
    from reamer.plan.layout import Layout

    found: dict[str, Any] = {}
    for c in outcome.candidates:
        backend = c.layout.backend
        if c.measured_rps is not None and backend and (backend not in found or c.rps > found[backend].rps):
            found[backend] = c
    n = len(outcome.cpus)
    for screen in outcome.screens:
        if screen.backend not in found and screen.throughput:
            (cores, batch), _ = max(screen.throughput.items(), key=lambda item: item[1] * (n // item[0][0]))
            found[screen.backend] = Layout.uniform(n // cores, cores, batch, backend=screen.backend)
    return {b: (c.layout if hasattr(c, "layout") else c) for b, c in found.items()}


def compare_model(name: str, model: str, cpus: list[int], args: argparse.Namespace) -> dict[str, Any]:
    from reamer.plan.layout import format_layout
    from reamer.search.on_cores import MeasureSettings, search_layout
    from reamer.serve.measure.profiler import measure_layout

    row: dict[str, Any] = {"model": name, "file": os.path.basename(model), "cpus": cpus, "load_before": loadavg()}
    settings = MeasureSettings(warmup_s=args.warmup, window_s=args.window, max_windows=args.max_windows,
                               verify_windows=args.verify_windows)
    started = time.monotonic()
    outcome = search_layout(model, "auto", cpus, None, batches=args.batches, settings=settings)
    row["search_s"] = round(time.monotonic() - started, 1)
    pick_bf16 = None
    if args.bf16:
        from reamer.serve.backends import effective_precision

        row["bf16_effective"] = effective_precision("openvino", "bf16")
        if row["bf16_effective"] == "bf16":  # else OpenVINO runs f32: the pair would repeat the f32 comparison
            started = time.monotonic()
            bf16 = search_layout(model, "auto", cpus, None, batches=args.batches, settings=settings,
                                 precision="bf16")
            row["search_bf16_s"] = round(time.monotonic() - started, 1)
            pick_bf16 = bf16.best.layout if bf16.best is not None else None
            row["pick_bf16"] = format_layout(pick_bf16) if pick_bf16 is not None else None
    row["search_runs"] = len(outcome.rows)
    row["screening"] = {s.backend: {"dropped": s.dropped, "why": s.why} for s in outcome.screens}
    if outcome.best is None:
        row["error"] = outcome.note or "no layout"
        return row
    pick = outcome.best.layout
    row["pick"] = format_layout(pick)
    singles = best_per_backend(outcome)
    row["single"] = {b: format_layout(layout) for b, layout in singles.items()}
    pick_batch = max(s.batch for s in pick.instances)
    contenders: dict[str, Any] = {"reamer": ("layout", pick, "f32")}
    for backend, layout in singles.items():
        if layout != pick:
            contenders[f"best {backend} layout"] = ("layout", layout, "f32")
    if pick_bf16 is not None:
        contenders["reamer bf16"] = ("layout", pick_bf16, "bf16")
    contenders["OpenVINO THROUGHPUT hint"] = ("peer", "ov-throughput-f32", 1)
    contenders["OpenVINO THROUGHPUT hint, default precision"] = ("peer", "ov-throughput", 1)
    contenders["ORT default session b1"] = ("peer", "ort-default", 1)
    if pick_batch > 1:
        contenders[f"ORT default session b{pick_batch}"] = ("peer", "ort-default", pick_batch)
    runs: dict[str, list[float]] = {k: [] for k in contenders}
    info: dict[str, dict] = {}
    order = list(contenders)
    for r in range(args.rounds):
        for key in order[r % len(order):] + order[:r % len(order)]:
            spec = contenders[key]
            if spec[0] == "layout":
                rps, _ = measure_layout(model, spec[1].backend, spec[1], cpus, warmup_s=args.warmup,
                                        window_s=args.window, windows=args.verify_windows, precision=spec[2])
                runs[key].append(rps)
            else:
                got = run_peer(spec[1], model, cpus, spec[2], args.warmup, args.window * args.verify_windows)
                if "error" in got:
                    info[key] = got
                    continue
                info[key] = got
                runs[key].append(got["rps"])
    medians = {k: statistics.median(v) for k, v in runs.items() if v}
    row["runs"] = runs
    row["median_rps"] = medians
    row["peer_info"] = info
    # same numerics only: OpenVINO's default precision is bf16 on CPUs with AVX512-BF16/AMX (reamer and ONNX
    # Runtime compute in f32), reported beside, not as the peer
    peers = {k: v for k, v in medians.items()
             if k not in ("reamer", "reamer bf16", "OpenVINO THROUGHPUT hint, default precision")}
    best_peer = max(peers, key=peers.get) if peers else None
    row["best_peer"] = best_peer
    row["ratio"] = medians["reamer"] / peers[best_peer] if best_peer and "reamer" in medians else None
    ort = max((v for k, v in medians.items() if k.startswith("ORT default")), default=None)
    row["ratio_vs_ov_hint"] = medians["reamer"] / medians["OpenVINO THROUGHPUT hint"] \
        if "OpenVINO THROUGHPUT hint" in medians else None
    row["ratio_vs_ort_default"] = medians["reamer"] / ort if ort else None
    default = medians.get("OpenVINO THROUGHPUT hint, default precision")
    row["ratio_vs_ov_default_precision"] = medians["reamer"] / default if default else None
    # the same numerics at bf16: reamer's bf16 pick against OpenVINO's hint at its own (bf16) default
    row["ratio_bf16"] = medians["reamer bf16"] / default if default and "reamer bf16" in medians else None
    row["spread"] = {k: spread(v) for k, v in runs.items() if v}
    row["load_after"] = loadavg()
    return row


def render(data: dict) -> str:
    lines = [
        command_and_machine(data) + f", "
        f"all of them given to every contender ({data['cpus']}) · load average per row (1 min, at the model's start and "
        "end): the machine may be shared, so read same-run ratios · "
        f"{data['rounds']} rounds, rotated order, medians; windows {data['window_s']} s × {data['verify_windows']}.",
        "",
        "reamer = the pick of `search_layout(model, \"auto\", cpus)` (both backends screened, OpenVINO streams tried); "
        "best X layout = the best verified layout on backend X alone in the same search; OpenVINO THROUGHPUT = one "
        "process, OpenVINO's streams/threads, OPTIMAL_NUMBER_OF_INFER_REQUESTS async requests of batch 1; ORT default = "
        "InferenceSession with no options (all cores, spinning), batch 1 and reamer's batch; reamer at bf16 = the "
        "pick of `search_layout(model, \"auto\", cpus, precision=\"bf16\")` (OpenVINO instances in bfloat16), "
        "compared with OpenVINO's THROUGHPUT hint at its default precision (bf16 on this CPU): the same numerics.",
        "",
        "| model | reamer pick | reamer /s | OpenVINO THROUGHPUT f32 /s (streams) | ORT default /s | best single-backend "
        "layouts /s | reamer / best peer | OpenVINO THROUGHPUT at its default precision /s (reamer f32 / it) | "
        "reamer at bf16: pick /s | reamer bf16 / OpenVINO default precision | search s (f32; bf16) | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['error']} | | | | | | | | | | |")
            continue
        m = r["median_rps"]
        ov = m.get("OpenVINO THROUGHPUT hint")
        ov_info = r["peer_info"].get("OpenVINO THROUGHPUT hint", {})
        ov_text = f"{ov:.2f} ({ov_info.get('streams')} streams, {ov_info.get('requests')} requests)" if ov else \
            f"refused: {str(ov_info.get('error', '-'))[:60]}"
        default = m.get("OpenVINO THROUGHPUT hint, default precision")
        d_info = r["peer_info"].get("OpenVINO THROUGHPUT hint, default precision", {})
        precision = str(d_info.get("precision", "?")).replace("<Type: '", "").replace("'>", "")
        d_text = f"{default:.2f}, {precision} ({m['reamer'] / default:.2f}×)" if default else "-"
        ort = "; ".join(f"{k.split()[-1]} {v:.2f}" for k, v in m.items() if k.startswith("ORT default"))
        singles = "; ".join(f"{r['single'][k.split()[1]]} {v:.2f}" for k, v in m.items() if k.startswith("best "))
        ratio = f"{r['ratio']:.2f}× ({r['best_peer']})" if r.get("ratio") else "-"
        bf16 = m.get("reamer bf16")
        bf16_text = f"{r['pick_bf16']} {bf16:.2f}" if bf16 else \
            (f"(OpenVINO runs {r['bf16_effective']} here)" if r.get("bf16_effective", "bf16") != "bf16" else "-")
        bf16_ratio = f"{r['ratio_bf16']:.2f}×" if r.get("ratio_bf16") else "-"
        searched = f"{r['search_s']}" + (f"; {r['search_bf16_s']}" if r.get("search_bf16_s") is not None else "")
        lines.append(f"| {r['model']} | {r['pick']} | {m['reamer']:.2f} | {ov_text} | {ort} | {singles or '(pick)'} | "
                     f"{ratio} | {d_text} | {bf16_text} | {bf16_ratio} | {searched} | "
                     f"{r['load_before'][0]}→{r['load_after'][0]} |")
    met = [r for r in data["rows"] if r.get("ratio") is not None]
    lines += ["", f"Target reamer / best peer ≥ 1.0: met in {sum(r['ratio'] >= 1.0 for r in met)} of {len(met)} "
                  f"models; within the run's spread (≥ 0.95) in {sum(r['ratio'] >= 0.95 for r in met)}."]
    at_bf16 = [r for r in data["rows"] if r.get("ratio_bf16") is not None]
    if at_bf16:
        lines += [f"At bf16 numerics, reamer bf16 / OpenVINO THROUGHPUT at its default precision ≥ 1.0: met in "
                  f"{sum(r['ratio_bf16'] >= 1.0 for r in at_bf16)} of {len(at_bf16)} models; within the run's spread "
                  f"(≥ 0.95) in {sum(r['ratio_bf16'] >= 0.95 for r in at_bf16)}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    p.add_argument("--models", default="resnet50,mobilenet_v2,bert-base,deepspeech2,exported:bert,exported:resnet,"
                                       "exported:int8")
    p.add_argument("--cpus", default=None, help="cpu list (default: every cpu this process may use)")
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--window", type=float, default=0.5)
    p.add_argument("--max-windows", type=int, default=5)
    p.add_argument("--verify-windows", type=int, default=4)
    p.add_argument("--model-dir", default="/tmp/reamer-bench-models")
    p.add_argument("--quick", action="store_true", help="tiny model, one round: a smoke run")
    p.add_argument("--no-bf16", dest="bf16", action="store_false",
                   help="skip reamer at bf16 (its own search) and its comparison")
    p.add_argument("--out", default=str(RESULTS_DIR / "peers"))
    p.add_argument("--results-md", default=None)
    p.add_argument("--render", default=None, metavar="JSON", help="write the section from a peers.json of a run")
    args = p.parse_args(argv)
    if args.peer:
        print(json.dumps(peer_main(json.loads(args.peer))))
        return 0
    if args.render:
        text = render(json.loads(Path(args.render).read_text()))
        print(text)
        if args.results_md:
            replace_section(args.results_md, SECTION, text, parent=PARENT)
        return 0

    args.batches = [int(b) for b in args.batches.split(",")]
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else sorted(os.sched_getaffinity(0))
    names = ["tiny"] if args.quick else [m for m in args.models.split(",") if m]
    if args.quick:
        args.rounds, args.batches, args.window, args.warmup = 1, [1, 2], 0.1, 0.1
    data: dict[str, Any] = {"command": command_line("peers", argv),
                            "machine": machine_info(), "cpus": cpus, "rounds": args.rounds, "window_s": args.window,
                            "verify_windows": args.verify_windows, "load_start": loadavg(), "rows": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = resolve_model(name, Path(args.model_dir))
        print(f"== {name} (load {loadavg()})", flush=True)
        try:
            row = compare_model(name, path, cpus, args)
        except Exception as exc:  # noqa: BLE001 - one model failing must not lose the others' figures
            row = {"model": name, "error": f"{type(exc).__name__}: {exc}"[:200]}
        print(json.dumps({k: row.get(k) for k in ("model", "pick", "median_rps", "ratio", "best_peer", "pick_bf16",
                                                  "ratio_bf16", "error")}),
              flush=True)
        data["rows"].append(row)
        write_json(out / "peers.json", data)
    text = render(data)
    print(text)
    if args.results_md and not args.quick:
        replace_section(args.results_md, SECTION, text, parent=PARENT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
