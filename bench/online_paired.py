"""Online, paired (issue 14): reamer against the best HTTP peer at the same rates, alternating step by step,
round after round, so that the machine's drift hits both alike; the medians of the rounds decide.

online_peers.py searches each contender's rate on its own, one after the other, in 8 % steps; on a shared 2-cpu
machine the same layout moves by up to 10 % between runs, so rows within a step of each other are not told
apart there. This bench resolves them. For each model and SLO:

1. the peers behind uvicorn (online_peers' HTTP peers, `--peers`) start, and each one's rate is searched as in
   online_peers, with steps as long as the ladder's (its coarse answer);
2. reamer's search picks its layout for the SLO, served as a real online job (online_peers' ReamerJob);
3. a ladder of rates in `--rung` steps around the best peer's coarse answer (`--below` rungs under it,
   `--above` over it); in each of `--rounds` rounds every contender climbs it, one step at a time, the
   contenders taking turns at each rung (the order rotating), each stopping at its first failed step (one
   still passing at the top climbs up to `--extra` rungs more; one failing the first rung steps down as many);
4. a contender's rate in a round is the highest rung it passed before it failed (when it failed the first, the
   first rung it passed under the ladder; when it never failed, the top: a lower bound, marked "≥"); its figure
   is the median over the rounds; the ratio is reamer's median over the best peer's, beside each round's
   ratio (the two climbed in the same minutes) and their median.

Every step is online_peers' step: the lean client, the same request, Poisson arrivals (seed: the round), the
same pass rule (p99 within the SLO with a refusal counted as late, no failure, the queue kept up), lasting
long enough for a queue growing at half a rung to fail it (`step_seconds` with the rung as precision). After
every step one more request waits for its answer (`settle`): a server past its rate keeps working on the
requests the client gave up on, and would take the cpus from the next step, whoever runs it.

    # ResNet-50, MobileNetV2 and BERT-base (~60 min on the 2-cpu machine), figures into bench/RESULTS.md:
    flock /work/coord/bench.lock .venv/bin/python -m bench.online_paired --results-md bench/RESULTS.md
    .venv/bin/python -m bench.online_paired --models tiny --quick --out /tmp/paired   # smoke run, ~2 min
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from bench.harness import RESULTS_DIR, command_line, loadavg, machine_info, publish, replace_section, rotated

from bench.online_peers import (PARENT, PEER_KINDS, SLOS_MS, HttpPeerServer, ReamerJob, Settled,
                                Step, _feeds, _searches, reference_outputs, run_models, step_seconds)

SECTION = "### Online, paired: reamer and the best HTTP peer taking turns at the same rates (issue 14)"
DEFAULT_MODELS = "resnet50,mobilenet_v2,bert-base"
PEER_NAMES = {"openvino": "OpenVINO THROUGHPUT f32 over HTTP", "onnxruntime": "ORT default over HTTP"}


# --- the ladder and its reading (pure: unit-tested) --------------------------------------------------------

def ladder(centre_rps: float, rung: float, below: int, above: int) -> list[float]:
    """Rates centre × (1 + rung)^k for k from -below to +above, ascending."""
    return [centre_rps * (1 + rung) ** k for k in range(-below, above + 1)]


def turns(contenders: Sequence[str], round_index: int, rung_index: int) -> list[str]:
    """Who runs first at this rung of this round: the order rotates at every rung and every round."""
    return rotated(contenders, round_index + rung_index)


@dataclass
class Climb:
    """One contender's climb of the ladder in one round."""

    steps: list[Step] = field(default_factory=list)
    below: list[Step] = field(default_factory=list)  # the first rung failed: rungs under the ladder, downwards

    def rate_rps(self, slo_ms: float) -> float:
        """The highest rung passed before the first failure; when the first rung failed, the first rung passed
        under the ladder (0.0: none)."""
        passed = 0.0
        for step in self.steps:
            if not step.meets(slo_ms):
                break
            passed = step.rate_rps
        if not passed:
            passed = next((s.rate_rps for s in self.below if s.meets(slo_ms)), 0.0)
        return passed

    def descending(self, slo_ms: float) -> bool:
        """It failed the first rung and has not passed one under the ladder yet."""
        return (bool(self.steps) and not self.steps[0].meets(slo_ms)
                and not any(s.meets(slo_ms) for s in self.below))

    def topped(self, slo_ms: float) -> bool:
        """It never failed (the ladder, and any rungs added over it, ran out): its rate is a lower bound."""
        return bool(self.steps) and all(s.meets(slo_ms) for s in self.steps)

    def done(self, slo_ms: float) -> bool:
        return bool(self.steps) and not self.steps[-1].meets(slo_ms)


@dataclass(frozen=True)
class Reading:
    """A contender's figure: the median of its rounds' rates, and whether every round topped the ladder."""

    rates_rps: tuple[float, ...]
    median_rps: float
    lower_bound: bool  # the median round passed the top rung: the true rate may be higher


def read_climbs(climbs: Sequence[Climb], slo_ms: float) -> Reading:
    per_round = [c.rate_rps(slo_ms) for c in climbs]
    median = statistics.median_low(per_round) if per_round else 0.0
    topped = [c.rate_rps(slo_ms) for c in climbs if c.topped(slo_ms)]
    return Reading(tuple(per_round), median, median in topped)


def paired_ratio(readings: dict[str, Reading], mine: str = "reamer") -> dict[str, Any]:
    """reamer's median over the best peer's ("≥"/"≤" where the ladder bounded one of them), and the ratio in
    each round (the two climbed side by side: the same minutes of the machine) with its median."""
    peers = {name: r for name, r in readings.items() if name != mine}
    if mine not in readings or not peers:
        return {"best_peer": None, "ratio": None, "bound": "", "per_round": [], "median_per_round": None}
    best = max(peers, key=lambda name: peers[name].median_rps)
    ours, theirs = readings[mine], peers[best]
    per_round = [a / b for a, b in zip(ours.rates_rps, theirs.rates_rps) if b > 0]
    doc = {"best_peer": best, "ratio": None, "bound": "", "per_round": per_round,
           "median_per_round": statistics.median(per_round) if per_round else None}
    if theirs.median_rps <= 0:
        return doc
    bound = "≥" if ours.lower_bound and not theirs.lower_bound else "≤" if theirs.lower_bound and not \
        ours.lower_bound else "=" if ours.lower_bound else ""
    return {**doc, "ratio": ours.median_rps / theirs.median_rps, "bound": bound}


def climb_ladder(drive: Callable[[str, float, int], Step], contenders: Sequence[str], rates: Sequence[float],
                 rounds: int, slo_ms: float, log: Callable[[str], None], extra: int = 0) -> dict[str, list[Climb]]:
    """Every contender climbs the ladder `rounds` times, taking turns at each rung, each stopping at its first
    failed step; one still climbing at the top goes on up to `extra` rungs more, and one that failed the first
    rung steps down up to `extra` rungs under the ladder until it passes one (the ladder's own ratio: a machine
    slower than when the ladder was placed still gives figures). `drive(contender, rate, seed)` runs one step."""
    climbs: dict[str, list[Climb]] = {c: [] for c in contenders}
    ratio = rates[-1] / rates[-2] if len(rates) > 1 else 1.04
    rungs = [*rates, *(rates[-1] * ratio ** (k + 1) for k in range(extra))]
    under = [rates[0] / ratio ** (k + 1) for k in range(extra)]

    def run(c: str, rate: float, r: int, into: list[Step]) -> None:
        step = drive(c, rate, r)
        into.append(step)
        log(f"    round {r + 1}  {rate:9.2f}/s  {c:34} p99 {step.p99_judged_ms():9.1f} ms  ok "
            f"{step.ok}/{step.sent}  {'meets' if step.meets(slo_ms) else step.why_not(slo_ms)}")

    for r in range(rounds):
        now = {c: Climb() for c in contenders}
        for i, rate in enumerate(rungs):
            for c in turns(contenders, r, i):
                if not now[c].done(slo_ms):
                    run(c, rate, r, now[c].steps)
            if all(now[c].done(slo_ms) for c in contenders):
                break
        for i, rate in enumerate(under):
            for c in turns(contenders, r, i):
                if now[c].descending(slo_ms):
                    run(c, rate, r, now[c].below)
        for c in contenders:
            climbs[c].append(now[c])
    return climbs


# --- one model ---------------------------------------------------------------------------------------------

def _pick(model: str, cpus: list[int], slo: float, args: argparse.Namespace, cache: Path) -> tuple[Any, dict]:
    from reamer.plan.layout import format_layout
    from reamer.search.on_cores import MeasureSettings, batch_choices, search_layout

    started = time.monotonic()
    outcome = search_layout(model, "auto", cpus, slo, cache_dir=cache, batches=batch_choices(args.max_batch),
                            budget_s=args.search_budget, settings=MeasureSettings(warmup_s=0.5, window_s=0.25),
                            strict_cache=False, cache_source="online_paired")
    info = {"search_s": round(time.monotonic() - started, 1), "runs": len(outcome.rows)}
    if outcome.best is None:
        return None, {**info, "error": outcome.note or f"no layout meets {slo:g} ms"}
    return outcome.best.layout, {**info, "layout": format_layout(outcome.best.layout),
                                 "search_rps": outcome.best.rps, "sustained_rps": outcome.best.sustained_rps}


def compare_model(name: str, model: str, cpus: list[int], args: argparse.Namespace, work: Path,
                  log: Callable[[str], None]) -> dict[str, Any]:
    inputs = _feeds(model)
    reference = reference_outputs(model, inputs)
    peer_names = [PEER_NAMES[p] for p in args.peers.split(",")]
    row: dict[str, Any] = {"model": name, "file": os.path.basename(model), "slos": {}, "coarse": {}, "info": {}}
    peers: dict[str, HttpPeerServer] = {}
    try:
        for peer in peer_names:
            log(f"  {peer}: coarse search")
            peers[peer] = HttpPeerServer(PEER_KINDS[peer], model, cpus, args.warmup, inputs, reference)
            row["info"][peer] = peers[peer].info
            # steps as long as the ladder's (a queue growing at half a rung shows): shorter ones pass rates
            # that a longer step fails
            coarse = argparse.Namespace(**{**vars(args), "precision": args.rung})
            found = _searches(peers[peer], peers[peer].info["closed_loop_rps"], coarse, args.slos, log)
            row["coarse"][peer] = {slo: doc["rate_rps"] for slo, doc in found.items()}
        for slo in args.slos:
            key = f"{slo:g}"
            centre = max(row["coarse"][p][key] for p in peer_names)
            if centre <= 0:
                row["slos"][key] = {"skipped": "no peer sustains any rate under this SLO"}
                log(f"  {key} ms: skipped (no peer sustains it)")
                continue
            layout, pick = _pick(model, cpus, slo, args, work / "profiles")
            row["info"][f"reamer {key}"] = pick
            if layout is None:
                row["slos"][key] = {"skipped": pick["error"]}
                continue
            log(f"  {key} ms: reamer picked {pick['layout']} ({pick['search_s']} s); ladder from {centre:.2f}/s")
            job = ReamerJob(model, layout, cpus, slo, work / f"job-{key}", inputs)
            try:
                job.step(max(centre * 0.3, 0.5), args.warmup, 99, 10.0)  # warm-up, discarded
                servers = {name: Settled(server) for name, server in {"reamer": job, **peers}.items()}
                rates = ladder(centre, args.rung, args.below, args.above)
                give_up = max(5.0, 5 * slo / 1e3)

                def drive(contender: str, rate: float, seed: int) -> Step:
                    duration = step_seconds(rate, slo, step_s=args.step, min_requests=args.min_requests,
                                            precision=args.rung, max_step_s=args.max_step)
                    return servers[contender].step(rate, duration, args.seed + seed, give_up)

                climbs = climb_ladder(drive, list(servers), rates, args.rounds, slo, log, args.extra)
            finally:
                job.close()
            readings = {c: read_climbs(cl, slo) for c, cl in climbs.items()}
            row["slos"][key] = {"rates_rps": rates, "readings": {c: asdict(r) for c, r in readings.items()},
                                "ratio": paired_ratio(readings),
                                "climbs": {c: [[asdict(s) for s in cl.steps] for cl in cls]
                                           for c, cls in climbs.items()}}
            log(f"  {key} ms: {json.dumps(row['slos'][key]['ratio'], default=str)}")
    finally:
        for server in peers.values():
            server.close()
    return row


# --- the section -------------------------------------------------------------------------------------------

def _figure(reading: dict) -> str:
    rounds = "/".join(f"{r:.1f}" for r in reading["rates_rps"])
    return f"{'≥' if reading['lower_bound'] else ''}{reading['median_rps']:.1f} ({rounds})"


def render(data: dict) -> str:
    lines = [f"{data['machine']}; cpus {','.join(map(str, data['cpus']))}; {data['started']}–{data.get('ended', '?')} "
             f"UTC; load {data['load_start']} → {data.get('load_end', '?')}; `{data['command']}`.", "",
             f"Ladder: rungs {data['rung'] * 100:g} % apart, {data['below']} under and {data['above']} over the best "
             f"HTTP peer's coarse rate{_extra(data.get('extra', 0))}; {data['rounds']} rounds; the contenders take "
             "turns at every rung, the order rotating. A figure is the median of the rounds' highest rung passed "
             "before the first failure (each round's in brackets; ≥: never failed, a lower bound); reamer / peer is "
             "the ratio of the medians, then each round's ratio and their median.", "",
             "| model | SLO | reamer's layout | reamer, requests/s | best HTTP peer | its requests/s | reamer / peer "
             "| per round (median) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        if "error" in row:
            lines.append(f"| {row['model']} | | error: {row['error']} | | | | |")
            continue
        for key, doc in row["slos"].items():
            if "skipped" in doc:
                lines.append(f"| {row['model']} | {key} ms | {doc['skipped']} | | | | |")
                continue
            ratio, readings = doc["ratio"], doc["readings"]
            peer = ratio["best_peer"]
            value = "—" if ratio["ratio"] is None else f"{ratio['bound'] if ratio['bound'] != '=' else ''}" \
                                                      f"{ratio['ratio']:.2f}×"
            per_round = [a / b for a, b in zip(readings["reamer"]["rates_rps"], readings[peer]["rates_rps"]) if b > 0]
            rounds = "/".join(f"{r:.2f}" for r in per_round)
            median = f" ({statistics.median(per_round):.2f}×)" if per_round else ""
            lines.append(f"| {row['model']} | {key} ms | `{row['info'][f'reamer {key}']['layout']}` | "
                         f"{_figure(readings['reamer'])} | {peer} | {_figure(readings[peer])} | {value} | "
                         f"{rounds}{median} |")
    return "\n".join(lines)


def _extra(rungs: int) -> str:
    return f", up to {rungs} more over the top for a contender still passing there" if rungs else \
        ", no rung over the top"


def write_section(path: str, text: str) -> None:
    replace_section(path, SECTION, text, parent=PARENT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog=__doc__[__doc__.index("    # ResNet-50"):],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated (default {DEFAULT_MODELS})")
    p.add_argument("--slos", default=",".join(f"{s:g}" for s in SLOS_MS), help="ms, comma-separated (1000,200)")
    p.add_argument("--peers", default="openvino", help="HTTP peers: openvino, onnxruntime or both (default "
                                                       "openvino, the best HTTP peer of every online_peers run)")
    p.add_argument("--rung", type=float, default=0.04, help="ladder step (default 0.04 = 4 %%)")
    p.add_argument("--below", type=int, default=3, help="rungs under the best peer's coarse rate (default 3)")
    p.add_argument("--above", type=int, default=3, help="rungs over it (default 3)")
    p.add_argument("--extra", type=int, default=3, help="rungs a contender still passing at the top may go on "
                                                         "climbing (default 3)")
    p.add_argument("--rounds", type=int, default=3, help="climbs of the ladder (default 3)")
    p.add_argument("--step", type=float, default=4.0, help="least seconds of arrivals per step (default 4)")
    p.add_argument("--min-requests", type=int, default=200, help="least arrivals per step (default 200)")
    p.add_argument("--max-step", type=float, default=20.0, help="the longest step, seconds (default 20)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of discarded load on each server first")
    p.add_argument("--steps", type=int, default=5, help="rate steps of a peer's first coarse search (default 5)")
    p.add_argument("--more-steps", type=int, default=3, help="rate steps of its later coarse searches (default 3)")
    p.add_argument("--max-rate", type=float, default=2000.0, help="the highest coarse rate tried (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="the Poisson arrivals' seed of the first round")
    p.add_argument("--search-budget", type=float, default=90.0, help="reamer's search budget s (the agent's default)")
    p.add_argument("--max-batch", type=int, default=8, help="reamer's search: batches up to this (default 8)")
    p.add_argument("--model-dir", default="/tmp/reamer-bench-models")
    p.add_argument("--cpus", default=None, help="cpu list (default: every cpu this process may use)")
    p.add_argument("--quick", action="store_true", help="short steps, two rounds, 3 rungs, a 20 s search budget")
    p.add_argument("--out", default=str(RESULTS_DIR / "online_paired"))
    p.add_argument("--results-md", default=None, help="write the section into this RESULTS.md (full runs only)")
    p.add_argument("--render", default=None, nargs="+", metavar="JSON",
                   help="write the section from online_paired.json files (one table each, in this order)")
    p.add_argument("--notes", default=None, metavar="MD", help="with --render: text to put under the tables")
    args = p.parse_args(argv)
    if args.render:
        text = "\n\n".join(render(json.loads(Path(path).read_text())) for path in args.render)
        if args.notes:  # what the runs show, written by whoever read them
            text += "\n\n" + Path(args.notes).read_text().strip()
        print(text)
        if args.results_md:
            write_section(args.results_md, text)
        return 0
    if args.quick:
        quick = {"step": 1.0, "warmup": 0.5, "steps": 3, "more_steps": 2, "search_budget": 20.0, "max_batch": 2,
                 "min_requests": 20, "max_step": 3.0, "rounds": 2, "below": 1, "above": 1,
                 "rung": 0.2}
        for key, value in quick.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    unknown = [x for x in args.peers.split(",") if x not in PEER_NAMES]
    if unknown:
        raise SystemExit(f"--peers: unknown peer {', '.join(unknown)}; use openvino, onnxruntime or both")
    args.slos = [float(s) for s in args.slos.split(",") if s]
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else sorted(os.sched_getaffinity(0))
    command = command_line("online_paired", argv)
    data: dict[str, Any] = {"command": command, "machine": machine_info(), "cpus": cpus, "rung": args.rung,
                            "below": args.below, "above": args.above, "extra": args.extra,
                            "rounds": args.rounds, "seed": args.seed,
                            "load_start": loadavg(), "started": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                            "rows": []}
    run_models([m for m in args.models.split(",") if m],
               lambda _, name, model, work: compare_model(name, model, cpus, args, work,
                                                          lambda text: print(text, flush=True)),
               args.model_dir, data, Path(args.out) / "online_paired.json")
    return publish(render(data), None if args.quick else args.results_md, write_section)


if __name__ == "__main__":
    sys.exit(main())
