"""`reamer profile MODEL` (scale-up or scale-out?) and `reamer search MODEL --cores N` (best layout,
measured on real cores)."""
from __future__ import annotations

import csv
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from reamer.cli.common import (BackendChoice, BadInput, CliContext, cpulist_option_value, emit, pass_cli, render_table, sample_spec,
                               traffic_options)
from reamer.host.cpulist import format_cpulist

if TYPE_CHECKING:
    from reamer.search.on_cores import MeasurementRow


class BackendOrAuto(BackendChoice):
    """A backend as BackendChoice takes it, or "auto": every installed backend competes in the search."""

    def __init__(self) -> None:
        super().__init__()
        self.choices = (*self.choices, "auto")


class PrecisionChoice(click.Choice):
    """f32 | bf16, also as users write them (FP32, float32, BF16, bfloat16); a bad value names both."""

    def __init__(self) -> None:
        from reamer.serve.spec import PRECISIONS

        super().__init__(PRECISIONS)

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> object:
        from reamer.serve.spec import PRECISION_FIX, canonical_precision

        precision = canonical_precision(value)
        if precision is None:
            self.fail(f"{value!r} is not a precision reamer runs; {PRECISION_FIX}", param, ctx)
        return precision


PRECISION_HELP = ("f32: answers as ONNX Runtime computes them (default). bf16: OpenVINO computes in bfloat16 "
                  "where the CPU supports it (faster; answers differ slightly); ONNX Runtime stays f32.")


def describe_precision(asked: str, effective: str | None, backend: str) -> str:
    """`effective` as operators read it, with why it differs from `asked` (e.g. "f32 (asked bf16: ...)")."""
    if effective is None:
        return f"{asked} (asked; no instance reports yet)"
    if effective == asked:
        return effective
    why = ("onnxruntime computes in f32" if backend == "onnxruntime"
           else "this CPU has no native bf16, OpenVINO runs f32" if effective == "f32" else "the runtime's choice")
    return f"{effective} (asked {asked}: {why})"


def register(cli: click.Group) -> None:
    cli.add_command(profile)
    cli.add_command(search)


# --------------------------------------------------------------------------------------- shared helpers


@dataclass
class AgentView:
    """What the agent the CLI talks to says about the node, for measuring beside it (None fields: no agent)."""

    profile_dir: str | None = None
    reserved_cpus: list[int] | None = None
    busy_cpus: frozenset[int] = frozenset()  # training's cpus and online jobs' instances: never measured on
    answered: bool = False


def agent_view(cli: CliContext) -> AgentView:
    """Ask the agent on the CLI's socket (briefly); an agent that does not answer leaves the defaults."""
    from reamer.api.client import ApiClient
    from reamer.host.errors import ReamerError

    if not os.path.exists(cli.socket_path):
        return AgentView()
    try:
        with ApiClient(cli.socket_path, timeout=10.0) as client:
            node = client.node()
            online = [c for job in client.list_inference_jobs() if job.kind == "online" for i in job.instances
                      for c in i.cpus]
    except ReamerError:
        return AgentView()
    return AgentView(node.profile_dir, list(node.reserved_cpus), frozenset(node.training_cpus) | frozenset(online),
                     answered=True)


def _writable(directory: str) -> bool:
    path = Path(directory)
    while not path.exists():  # where it would be created
        path = path.parent
    return os.access(path, os.W_OK | os.X_OK)


def default_cache_dir(agent: AgentView | None = None, instance: str | None = None) -> str:
    """Where profiles are cached: REAMER_PROFILE_DIR; else the profile cache of the agent the CLI talks to (the one
    it reports, or, with no agent answering, --instance's default) when we may write it; else the user's cache."""
    env = os.environ.get("REAMER_PROFILE_DIR")
    if env:
        return env
    if agent is not None and agent.profile_dir:
        agent_dir = agent.profile_dir
    else:
        from reamer.agent.config import instance_defaults

        agent_dir = str(Path(instance_defaults(instance)["state_dir"]) / "profiles")
    if _writable(agent_dir):
        return agent_dir
    return str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "reamer" / "profiles")


def resolve_model(model: str, workdir: str) -> str:
    """MODEL is an ONNX file, or a built-in family name (built into `workdir` with default options)."""
    if os.path.isfile(model):
        return os.path.abspath(model)
    from reamer.serve.models import MODEL_FAMILIES, build_model, canonical_family

    family = canonical_family(model)
    if family is not None:
        return build_model(family, Path(workdir) / f"{family}.onnx").path
    raise BadInput(f"model {model} is neither a file nor a built-in family",
                   f"give the path to an ONNX file, or one of {', '.join(MODEL_FAMILIES)}")


def checked_samples(model_path: str, shapes: tuple[str, ...], input_data: str | None):
    """--shape/--input-data as a samples.SampleSpec, checked against the model's inputs before measuring."""
    from reamer.serve.samples import check_against_model

    samples = sample_spec(shapes, input_data)
    check_against_model(model_path, samples)
    return samples


def choose_cpus(n_cores: int | None, cpus_text: str | None, busy: frozenset[int] = frozenset()) -> list[int]:
    """The CPUs to measure on: --cpus, else whole physical cores from the far end of the machine
    (away from CPU 0, where the OS and the agent live), within this process's affinity, and on none of `busy`
    (cores the agent gave training or online jobs: measuring there would slow them and be slowed)."""
    allowed = set(os.sched_getaffinity(0))
    if cpus_text is not None:
        cpus = cpulist_option_value(cpus_text)
        outside = sorted(set(cpus) - allowed)
        if outside:
            raise BadInput(f"CPUs {format_cpulist(outside)} are not available to this process",
                           f"pick from {format_cpulist(allowed)}")
        if n_cores is not None and len(cpus) < n_cores:
            raise BadInput(f"--cores {n_cores} needs at least {n_cores} CPUs, --cpus gives {len(cpus)}",
                           "list more CPUs or ask for fewer cores")
        return cpus[:n_cores] if n_cores is not None else cpus
    from reamer.host.topology import read_topology

    usable = [core for core in read_topology().physical_cores() if set(core) <= allowed]
    cores = [core for core in usable if not set(core) & busy]
    wanted = len(cores) if n_cores is None else n_cores
    held = f" ({len(usable) - len(cores)} more are held by the agent's training or online jobs)" \
        if len(cores) < len(usable) else ""
    if not cores:
        raise BadInput(f"no physical core is available here to measure on{held}",
                       "wait until cores are free, or name cores with --cpus LIST to measure there anyway")
    if wanted > len(cores):
        raise BadInput(f"--cores {n_cores} is more than the {len(cores)} physical cores available here{held}",
                       f"use --cores {len(cores)} or fewer")
    # one CPU per physical core: threads = cores, like the layouts the agent deploys
    return sorted(core[0] for core in cores[len(cores) - wanted:])


# ---------------------------------------------------------------------------------------------- profile


@click.command()
@click.argument("model")
@click.option("--backend", type=BackendChoice(), default="onnxruntime", show_default=True)
@click.option("--cpus", "cpus_text", default=None, metavar="LIST", help="CPUs to measure on (default: all usable).")
@click.option("--batches", default="1,4,16", show_default=True, metavar="LIST", help="Batch sizes to compare.")
@click.option("--warmup-s", type=click.FloatRange(min=0), default=1.0, show_default=True, help="Warm-up per run.")
@click.option("--window-s", type=click.FloatRange(min=0.01), default=0.5, show_default=True, help="Window length.")
@click.option("--max-windows", type=click.IntRange(min=3), default=10, show_default=True,
              help="Windows per point before giving up on stability.")
@click.option("--precision", type=PrecisionChoice(), default="f32", show_default=True, help=PRECISION_HELP)
@traffic_options
@pass_cli
def profile(cli: CliContext, model: str, backend: str, cpus_text: str | None, batches: str, warmup_s: float,
            window_s: float, max_windows: int, shapes: tuple[str, ...] = (), input_data: str | None = None,
            precision: str = "f32") -> None:
    """Characterise MODEL: does it scale up (one big instance) or out (many small ones)?

    Uses IPC and cache-miss rate from hardware counters where the host has them, else measured
    throughput scaling (and says so)."""
    from reamer.serve.measure.characterise import characterise

    # the "no hardware counters" notice is part of the evidence printed below; do not log it twice
    logging.getLogger("reamer.serve.measure.characterise").setLevel(logging.ERROR)
    batch_list = cpulist_option_value(batches)  # same syntax: "1,4,16" or "1-4"
    if not batch_list or batch_list[0] < 1:
        raise BadInput(f"--batches {batches!r} has no positive batch size", 'write e.g. --batches 1,4,16')
    with tempfile.TemporaryDirectory(prefix="reamer-profile-") as workdir:
        model_path = resolve_model(model, workdir)
        samples = checked_samples(model_path, shapes, input_data)
        cpus = choose_cpus(None, cpus_text, agent_view(cli).busy_cpus)
        result = characterise(model_path, backend=backend, cpus=cpus, batches=batch_list, warmup_s=warmup_s,
                              window_s=window_s, max_windows=max_windows, samples=samples, precision=precision)
        result.model = model if not os.path.isfile(model) else os.path.abspath(model)
    emit(cli, result, render_characterisation)


def render_characterisation(result) -> str:
    lines = [f"{Path(result.model).name}: {result.classification}",
             "  start the layout search from " + ("one large instance" if result.classification == "scale-up"
                                                   else "many small instances")]
    lines += [f"  - {line}" for line in result.evidence]
    if result.counters:
        lines += ["", render_table(["batch", "ipc", "cache miss rate", "scaled"],
                                   [[c.batch, c.ipc, c.cache_miss_rate, c.scaled] for c in result.counters])]
    lines += ["", render_table(["cores", "batch", "inferences/s", "p99 ms"],
                               [[p.cores, p.batch, p.throughput_rps, p.p99_ms] for p in result.points])]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- search


class ProgressBar:
    """A tqdm bar on stderr fed by the search's progress(done, total, label) callback."""

    def __init__(self, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=1, desc="measuring", unit="run", disable=not enabled, leave=False)

    def __call__(self, done: int, total: int, label: str) -> None:
        self.bar.total = max(total, done)
        self.bar.n = done
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def candidate_dict(candidate, batch_target_ms: float | None) -> dict:
    from reamer.plan.layout import format_layout

    def known(value: float) -> float | None:  # a layout measured only (the baseline) has no prediction
        return value if math.isfinite(value) else None

    return {
        "layout": format_layout(candidate.layout),
        "throughput_rps": candidate.rps,
        "p99_ms": candidate.p99_ms,
        "verified": candidate.measured_rps is not None,
        "predicted_rps": known(candidate.predicted_rps),
        "predicted_p99_ms": known(candidate.predicted_p99_ms),
        "meets_slo": batch_target_ms is None or candidate.p99_ms <= batch_target_ms,
        "sustained_rps": candidate.sustained_rps,
    }


def headline(data: dict) -> str:
    best, slo = data["best"], data["slo_ms"]
    searched = (f"measured {data['measured']} of {data['space']:,} possible layouts on {data['cores']} core(s) "
                f"(CPUs {data['cpus']}), guided by {data['single_instance_points']} single-instance point(s)")
    if best is None:
        return f"no layout meets the {slo:g} ms SLO: {data['note'] or 'every measured shape missed it'}; {searched}."
    slo_text = (f" against the {slo:g} ms SLO (batch p99 ≤ {data['batch_target_ms']:g} ms: half of it, the other half "
                "for waiting on the batch before)") if slo is not None else ""
    if data.get("precision", "f32") != "f32" or data.get("effective_precision", "f32") != "f32":
        slo_text += f", precision {describe_precision(data['precision'], data['effective_precision'], data['backend'])}"
    text = (f"best layout {best['layout']}: {best['throughput_rps']:.1f} inferences/s, "
            f"p99 {best['p99_ms']:.1f} ms{slo_text}; {searched}")
    base = data["baseline"]
    if base and base["throughput_rps"] > 0:
        text += (f"; {data['gain']:.2f}x the throughput of one instance at max batch ({base['layout']}: "
                 f"{base['throughput_rps']:.1f}/s, p99 {base['p99_ms']:.1f} ms)")
    return text + "."


def write_csv(path: str, rows: list[MeasurementRow]) -> None:
    from reamer.search.on_cores import MeasurementRow

    names = list(MeasurementRow.__dataclass_fields__)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(names)
        for row in rows:
            writer.writerow([getattr(row, n) for n in names])


def write_plot(path: str, data: dict, rows: list[MeasurementRow]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    points = [r for r in rows if r.kind == "point"]
    for cores in sorted({r.cores for r in points}):
        mine = sorted((r for r in points if r.cores == cores), key=lambda r: int(r.batch))
        left.plot([int(r.batch) for r in mine], [r.throughput_rps for r in mine], marker="o", label=f"{cores} core(s)")
    left.set_xscale("log", base=2)
    left.set_xlabel("max batch")
    left.set_ylabel("throughput (inferences/s)")
    left.set_title("one instance alone")
    if points:
        left.legend()
    for kind, marker, label in (("point", "o", "single instance"), ("layout", "s", "layout (together)"),
                                ("final", "^", "finals run")):
        mine = [r for r in rows if r.kind == kind]
        if mine:
            right.scatter([r.p99_ms for r in mine], [r.throughput_rps for r in mine], marker=marker, label=label,
                          alpha=0.7)
    if data["batch_target_ms"] is not None:
        right.axvline(data["batch_target_ms"], color="red", linestyle="--",
                      label=f"batch p99 target {data['batch_target_ms']:g} ms (half the SLO)")
    if data["best"] is not None:
        right.scatter([data["best"]["p99_ms"]], [data["best"]["throughput_rps"]], marker="*", s=250, color="gold",
                      edgecolors="black", zorder=5, label=f"best {data['best']['layout']}")
    right.set_xlabel("p99 latency (ms)")
    right.set_ylabel("throughput (inferences/s)")
    right.set_title(f"{data['measured']} of {data['space']:,} layouts measured")
    right.legend(fontsize="small")
    fig.suptitle(f"{Path(data['model']).name} on {data['cores']} core(s), {data['backend']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@click.command()
@click.argument("model")
@click.option("--cores", type=click.IntRange(min=1), required=True, help="Cores the job will have.")
@click.option("--slo-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="p99 latency target (online); without it: maximise throughput (offline).")
@click.option("--backend", type=BackendOrAuto(), default="auto", show_default=True,
              help="Runtime; auto: every installed one is screened and the best layout names its backend.")
@click.option("--precision", type=PrecisionChoice(), default="f32", show_default=True, help=PRECISION_HELP)
@click.option("--exhaustive", is_flag=True, help="Measure every layout (the paper's search; slow).")
@click.option("--max-batch", type=click.IntRange(min=1), default=32, show_default=True,
              help="Largest batch tried (batches are powers of two up to it).")
@click.option("--top", "top_n", type=click.IntRange(min=1), default=5, show_default=True, help="Layouts to list.")
@click.option("--csv", "csv_path", default=None, metavar="FILE", help="Write every measurement as CSV.")
@click.option("--plot", "plot_path", default=None, metavar="FILE.png", help="Write a plot of the measurements.")
@click.option("--cache-dir", default=None, metavar="DIR",
              help="Profile cache (default: that of the agent on --socket/--instance when writable, else "
                   "~/.cache/reamer/profiles).")
@click.option("--frontdoor-cpu-ms", type=click.FloatRange(min=0), default=None, metavar="MS",
              help="With --slo-ms: the front door's cpu per request, charged to layouts that leave it no core of its "
                   "own (default: 1 ms when the agent reserves no cpu, else 0; the job measures its own: "
                   "`reamer infer show`).")
@click.option("--no-cache", is_flag=True, help="Measure everything again; do not read or write the cache.")
@click.option("--cpus", "cpus_text", default=None, metavar="LIST", help="CPUs to measure on (default: the last N cores).")
@click.option("--warmup-s", type=click.FloatRange(min=0), default=1.0, show_default=True, help="Warm-up per run.")
@click.option("--window-s", type=click.FloatRange(min=0.01), default=0.5, show_default=True, help="Window length.")
@click.option("--max-windows", type=click.IntRange(min=3), default=10, show_default=True,
              help="Windows per point before giving up on stability.")
@click.option("--verify-windows", type=click.IntRange(min=1), default=4, show_default=True,
              help="Windows per layout verification.")
@click.option("--budget-s", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Stop measuring after this long and plan from what was measured (default: 100 for the quick "
                   "search, none for --exhaustive).")
@click.option("--no-budget", is_flag=True, help="Let the quick search measure until it is done.")
@traffic_options
@pass_cli
def search(cli: CliContext, model, cores, slo_ms, backend, exhaustive, max_batch, top_n, csv_path, plot_path,
           cache_dir, no_cache, cpus_text, warmup_s, window_s, max_windows, verify_windows, budget_s=None,
           no_budget=False, shapes=(), input_data=None, precision="f32", frontdoor_cpu_ms=None) -> None:
    """Find the best layout (instances x cores x batch) for MODEL on N cores, measured on real cores.

    --precision bf16 measures OpenVINO computing in bfloat16 (where the CPU supports it) and caches those
    points apart from f32 ones: deploy the result with the same --precision."""
    from reamer.serve.backends import effective_precision
    from reamer.search.on_cores import MeasureSettings, ProfileCacheUnwritable, batch_choices, search_layout

    if plot_path is not None and not plot_path.lower().endswith(".png"):
        raise BadInput(f"--plot {plot_path} is not a .png file", "name the plot FILE.png")
    if no_budget and budget_s is not None:
        raise BadInput("--budget-s and --no-budget contradict each other", "give one of them")
    budget = None if no_budget else ("default" if budget_s is None else budget_s)
    agent = agent_view(cli)
    cpus = choose_cpus(cores, cpus_text, agent.busy_cpus)
    cache_dir = None if no_cache else (cache_dir or default_cache_dir(agent, cli.instance))
    if frontdoor_cpu_ms is None and slo_ms is not None and agent.reserved_cpus == []:
        from reamer.plan.frontdoor import DEFAULT_FRONTDOOR_CPU_MS  # the agent has no cpu of its own for it

        frontdoor_cpu_ms = DEFAULT_FRONTDOOR_CPU_MS
    frontdoor_cpu_ms = frontdoor_cpu_ms if slo_ms is not None and frontdoor_cpu_ms else None
    settings = MeasureSettings(warmup_s=warmup_s, window_s=window_s, max_windows=max_windows,
                               verify_windows=verify_windows)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="reamer-search-") as workdir:
        model_path = resolve_model(model, workdir)
        samples = checked_samples(model_path, shapes, input_data)
        progress = ProgressBar(enabled=True)
        try:
            outcome = search_layout(model_path, backend, cpus, slo_ms, cache_dir=cache_dir, exhaustive=exhaustive,
                                    batches=batch_choices(max_batch), settings=settings, top_k=top_n,
                                    progress=progress, cache_source="reamer search", samples=samples,
                                    precision=precision, budget_s=budget, frontdoor_cpu_ms=frontdoor_cpu_ms)
        except ProfileCacheUnwritable as error:
            raise BadInput(error.message, "pass a writable --cache-dir, or --no-cache") from None
        finally:
            progress.close()
    rows, base, best = outcome.rows, outcome.baseline, outcome.best
    data = {
        "model": model if not os.path.isfile(model) else os.path.abspath(model),
        "backend": outcome.backend,
        "backends_searched": outcome.backends,
        "precision": precision,
        "effective_precision": effective_precision(outcome.backend, precision),
        "screening": [{"backend": s.backend, "dropped": s.dropped, "why": s.why,
                       "throughput_rps": {f"{c}x{b}": rps for (c, b), rps in s.throughput.items()}}
                      for s in outcome.screens if s.throughput],
        "cores": cores,
        "cpus": format_cpulist(cpus),
        "slo_ms": slo_ms,
        "batch_target_ms": outcome.batch_target_ms,
        "samples": samples.to_doc(),
        "search": "exhaustive" if exhaustive else "quick",
        "best": candidate_dict(best, outcome.batch_target_ms) if best is not None else None,
        "measured": outcome.layouts_measured,
        "space": outcome.result.space,
        "runs": len(rows),
        "single_instance_points": sum(r.kind == "point" for r in rows),
        "baseline": ({"layout": base.layout, "throughput_rps": base.throughput_rps, "p99_ms": base.p99_ms}
                     if base is not None else None),
        "gain": outcome.gain,
        "candidates": [candidate_dict(c, outcome.batch_target_ms) for c in outcome.candidates[:top_n]],
        "measurements": [vars(r) for r in rows],
        "cached_points": outcome.cached_point_count,
        "elapsed_s": time.monotonic() - started,
        "complete": outcome.complete,
        "note": outcome.note,
        "cache_dir": cache_dir,
        # cpu ms per request charged to layouts leaving the front door no core (None: not charged)
        "frontdoor_cpu_ms": frontdoor_cpu_ms,
    }
    if csv_path:
        write_csv(csv_path, rows)
    if plot_path:
        write_plot(plot_path, data, rows)

    def render(d: dict) -> str:
        online = d["slo_ms"] is not None
        table = render_table(
            ["rank", "layout", "inferences/s", "p99 ms", "meets slo", "verified"] + (["sustains/s"] if online else []),
            [[i + 1, c["layout"], c["throughput_rps"], c["p99_ms"], c["meets_slo"], c["verified"]]
             + ([c["sustained_rps"] if c["sustained_rps"] is not None else "-"] if online else [])
             for i, c in enumerate(d["candidates"])])
        extra = [f"measurements written to {csv_path}" if csv_path else "",
                 f"plot written to {plot_path}" if plot_path else "",
                 f"{d['cached_points']} point(s) came from the profile cache {cache_dir}" if d["cached_points"] else "",
                 f"{d['note']}: give --budget-s SECONDS or --no-budget to search on" if not d["complete"] else "",
                 (f"no cpu is reserved for the front door: layouts on all {d['cores']} core(s) are charged its "
                  f"{d['frontdoor_cpu_ms']:g} ms of cpu per request (--frontdoor-cpu-ms)")
                 if d.get("frontdoor_cpu_ms") else ""]
        return "\n".join([headline(d), "", table] + [e for e in extra if e])

    emit(cli, data, render)
    if best is None:
        raise SystemExit(1)
