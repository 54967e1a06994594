"""`reamer infer deploy|list|show|remove` and `reamer models build|list`."""
from __future__ import annotations

import os
import time

import click

from reamer.cli.common import (BadInput, CliContext, ReamerGroup, emit, field, pass_cli,
                               render_fields, render_table, sample_spec, traffic_options)
from reamer.cli.node_cmd import frontdoor_share, inference_progress, render_inference_table
from reamer.cli.search_cmd import PRECISION_HELP, BackendOrAuto, PrecisionChoice, describe_precision
from reamer.host.cpulist import format_cpulist
from reamer.host.errors import ReamerError


def register(cli: click.Group) -> None:
    cli.add_command(infer)
    cli.add_command(models)


@click.group(cls=ReamerGroup)
def infer() -> None:
    """CPU inference jobs: online (latency SLO) and offline (dataset in, results out)."""


def deploy_request(name: str, model: str, online: bool, offline: bool, slo_ms, rate, port, input_dir, output_dir,
                   backend, max_batch, layout, grpc_port=None, shapes=(), input_data=None, bind=None,
                   memory_limit_mb=None, precision=None, slurm_job=None) -> dict:
    if online == offline:
        raise BadInput("say whether the job is --online or --offline", "add --online --slo-ms MS, or "
                       "--offline --input DIR --output DIR")
    if online and slo_ms is None:
        raise BadInput("an online job needs a latency target", "add --slo-ms MS (the p99 latency it must meet)")
    if offline and (input_dir is None or output_dir is None):
        raise BadInput("an offline job needs --input DIR and --output DIR",
                       "point --input at a directory of .npy/.npz files and --output at where results go")
    if online and (input_dir or output_dir):
        raise BadInput("--input/--output are for offline jobs", "drop them, or use --offline")
    if offline and (slo_ms is not None or rate is not None or port is not None or grpc_port is not None):
        raise BadInput("--slo-ms/--rate/--port/--grpc-port are for online jobs", "drop them, or use --online")
    if offline and bind is not None:
        raise BadInput("--bind is for online jobs", "drop it, or use --online")
    if grpc_port is not None and grpc_port == port:
        raise BadInput(f"--grpc-port {grpc_port} is also the REST --port", "give gRPC another port, or leave it out")
    if layout is not None:
        from reamer.plan.layout import parse_layout

        try:
            parse_layout(layout)
        except ValueError as error:
            raise BadInput(str(error), 'write a layout like "2x1:b4" or "2x1:b4+1x2:b8"') from None
    model_path = os.path.abspath(model)
    if not os.path.isfile(model_path):
        raise BadInput(f"model file {model} does not exist",
                       "build one with `reamer models build tiny --out tiny.onnx` or give the path to an ONNX file")
    request = {"name": name, "model": model_path, "kind": "online" if online else "offline",
               "slo_ms": slo_ms, "rate_rps": rate, "port": port, "grpc_port": grpc_port,
               "input_dir": os.path.abspath(input_dir) if input_dir else None,
               "output_dir": os.path.abspath(output_dir) if output_dir else None,
               "backend": backend, "max_batch": max_batch, "layout": layout, "bind_address": bind,
               "memory_limit_mb": memory_limit_mb, "precision": precision, "slurm_job": slurm_job}
    samples = sample_spec(shapes, input_data)
    if samples.shapes:
        request["shapes"] = {k: list(v) for k, v in samples.shapes.items()}
    request["input_data"] = samples.input_data
    return {k: v for k, v in request.items() if v is not None}


ONLINE_READY_TIMEOUT_S = 300.0  # an online deploy waits this long for its front doors (--timeout)
POLL_S = 0.5


def job_failed(name: str, job) -> ReamerError:
    return ReamerError(f"inference job {name} failed: {field(job, 'message') or 'no detail'}",
                       f"see `reamer infer show {name}` and `reamer events`; fix the cause and deploy it again")


def wait_until_ready(client, name: str, timeout_s: float | None, keep_pending: bool):
    """Poll the agent until the online job runs, its process reports ready, and both front doors answer as a
    client would ask them (REST /v2/health/ready, gRPC ServerReady); return the job. A job the agent keeps
    pending (no free cores) is returned at once unless `keep_pending`. Raises with the agent's reason when the job
    fails, or with what was last seen when `timeout_s` passes first."""
    from reamer.cli.readiness import front_doors

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    doors: list = []
    while True:
        job = client.get_inference_job(name)
        state = field(job, "state")
        if state == "failed":
            raise job_failed(name, job)
        if state == "pending" and not keep_pending:
            return job
        if state == "running" and field(job, "ready"):
            doors = front_doors(field(job, "bind_address"), field(job, "port"), field(job, "grpc_port"))
            if all(d.ready for d in doors):
                return job
        if deadline is not None and time.monotonic() > deadline:
            seen = "; ".join(d.detail for d in doors) or "the job has not reported ready"
            raise ReamerError(f"inference job {name} is not ready after {timeout_s:.0f} s (state {state}: "
                              f"{field(job, 'message') or 'no message'}; {seen})",
                              f"see `reamer infer show {name}` and `reamer events`; give it longer with --timeout "
                              f"SECONDS, or remove it with `reamer infer remove {name}`")
        time.sleep(POLL_S)


def wait_until_done(client, name: str, timeout_s: float | None = None, show_progress: bool = True):
    """Poll an offline job until it is done, with a progress bar drawn once per change; raise if it fails."""
    from tqdm import tqdm

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    bar = None
    try:
        while True:
            job = client.get_inference_job(name)
            state = field(job, "state")
            status = field(job, "status") or {}
            if state == "failed":
                raise job_failed(name, job)
            total, done = field(status, "total"), field(status, "done") or 0
            if total and show_progress:
                # Each line is drawn once: when the count changes, and the last one by close() alone (a bar
                # drawn at creation, or at the total, and again by close() showed the same line twice). A delay
                # keeps tqdm from drawing at creation; without one close() draws, drawn before or not.
                if bar is None:
                    bar = tqdm(total=total, initial=0, desc=name, unit="input", delay=1e-6)
                if done >= total or state == "done":
                    bar.n = done
                elif done > bar.n:
                    bar.update(done - bar.n)
            if state == "done":
                if bar is not None:
                    bar.delay = 0
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise ReamerError(f"inference job {name} is still {state} after {timeout_s:.0f} s",
                                  f"check `reamer infer show {name}`")
            time.sleep(POLL_S)
    finally:
        if bar is not None:
            bar.close()


def deploy_state_text(job) -> str:
    """What the deploy achieved, in the words an operator acts on: "running" only for a job that answers."""
    state = field(job, "state")
    if field(job, "kind") == "online" and state == "running" and not field(job, "ready"):
        return "starting (not answering yet)"
    return state


@infer.command("deploy")
@click.argument("name")
@click.option("--model", required=True, metavar="FILE", help="ONNX model file on this node.")
@click.option("--online", is_flag=True, help="Serve requests (KServe v2 REST) under a latency SLO.")
@click.option("--offline", is_flag=True, help="Run a dataset through the model on spare cycles.")
@click.option("--slo-ms", type=click.FloatRange(min=0, min_open=True), default=None, help="Online: p99 target (ms).")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Online: expected request rate (rps), used for admission.")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Online: REST port (default: a free one).")
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=None,
              help="Online: gRPC port (Open Inference Protocol, tritonclient.grpc; default: a free one).")
@click.option("--input", "input_dir", default=None, metavar="DIR", help="Offline: directory of .npy/.npz inputs.")
@click.option("--output", "output_dir", default=None, metavar="DIR", help="Offline: directory for results.")
@click.option("--backend", type=BackendOrAuto(), default=None,
              help="Inference runtime; auto: the layout search picks it (default: config, auto).")
@click.option("--max-batch", type=click.IntRange(min=1), default=None, help="Largest dynamic batch.")
@click.option("--precision", type=PrecisionChoice(), default=None, help=PRECISION_HELP)
@click.option("--layout", default=None, metavar="SPEC", help='Instances, e.g. "2x1:b4+1x2:b8" (see `reamer search`).')
@click.option("--bind", default=None, metavar="ADDRESS",
              help="Online: listen on this one address of the node (default: inference.bind_address, 0.0.0.0 = all).")
@click.option("--memory-limit-mb", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Memory limit of all the job's processes (default: inference.memory_limit_mb, none).")
@click.option("--slurm-job", type=click.IntRange(min=1), default=None, metavar="ID",
              help="Placed by Slurm: run only on this Slurm job's cpus here and end with it (inside a batch "
                   "script: --slurm-job $SLURM_JOB_ID).")
@traffic_options
@click.option("--wait", is_flag=True,
              help="Online: wait until ready also while the job waits for free cores. Offline: wait until done "
                   "(progress bar).")
@click.option("--no-wait", is_flag=True, help="Online: return once the agent took the job, without waiting for "
                                              "its front doors to answer.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help=f"Longest wait (default: {ONLINE_READY_TIMEOUT_S:g} s for an online job's front doors; none for "
                   "--wait on an offline job).")
@pass_cli
def deploy(cli: CliContext, name, model, online, offline, slo_ms, rate, port, input_dir, output_dir, backend,
           max_batch, layout, wait, grpc_port=None, bind=None, memory_limit_mb=None, shapes=(),
           input_data=None, precision=None, no_wait=False, timeout_s=None, slurm_job=None) -> None:
    """Deploy an inference job on the idle cores.

    An online deploy returns when the job's REST and gRPC front doors answer ready ("running"), with the
    agent's reason when the job fails first, or "pending" when it waits for free cores (--wait: wait on).

    --shape and --input-data describe the traffic as perf_analyzer takes it: the layout search, admission
    and the instances' warm-up run on them (default: every dynamic dim 16, zeros for integer inputs)."""
    if wait and no_wait:
        raise BadInput("--wait and --no-wait contradict each other", "give one of them")
    request = deploy_request(name, model, online, offline, slo_ms, rate, port, input_dir, output_dir, backend,
                             max_batch, layout, grpc_port=grpc_port, shapes=shapes, input_data=input_data,
                             bind=bind, memory_limit_mb=memory_limit_mb, precision=precision, slurm_job=slurm_job)
    client = cli.client()
    job = client.deploy_inference(request)
    if request["kind"] == "online" and not no_wait:
        job = wait_until_ready(client, name, timeout_s or ONLINE_READY_TIMEOUT_S, keep_pending=wait)
    elif wait:
        job = wait_until_done(client, name, timeout_s, show_progress=not cli.json)
    emit(cli, job, lambda j: f"deployed {field(j, 'name')} ({field(j, 'kind')}): {deploy_state_text(j)}"
                             + (f", layout {field(j, 'layout')}" if field(j, "layout") else "")
                             + (f", precision {_precision_text(j)}" if field(j, "precision") not in (None, "f32")
                                else "")
                             + (f", {field(j, 'url')}" if field(j, "url") else
                                (f", port {field(j, 'port')}" if field(j, "port") else ""))
                             + (f", gRPC {field(j, 'grpc_target') or field(j, 'grpc_port')}" if field(j, "grpc_port") else "")
                             + (f" — {field(j, 'message')}" if field(j, "message") else ""))


@infer.command("list")
@pass_cli
def list_inference(cli: CliContext) -> None:
    """Inference jobs the agent runs."""
    emit(cli, cli.client().list_inference_jobs(), render_inference_table)


def render_job(job) -> str:
    head = render_fields([
        ("name", field(job, "name")), ("kind", field(job, "kind")), ("state", field(job, "state")),
        *([("ready", field(job, "ready"))] if field(job, "kind") == "online" else []),
        ("model", field(job, "model")), ("backend", field(job, "backend")), ("layout", field(job, "layout")),
        ("precision", _precision_text(job)),
        ("slo ms", field(job, "slo_ms")), ("rate rps", field(job, "rate_rps")), ("port", field(job, "port")),
        ("grpc port", field(job, "grpc_port")), ("url", field(job, "url")), ("grpc target", field(job, "grpc_target")), ("listens on", field(job, "bind_address")),
        ("shapes", " ".join(f"{k}:{','.join(map(str, v))}" for k, v in (field(job, "shapes") or {}).items()) or None),
        ("input data", field(job, "input_data")),
        ("input", field(job, "input_dir")), ("output", field(job, "output_dir")), ("pid", field(job, "pid")),
        ("progress", inference_progress(job)),
        *([("front door", _frontdoor_text(job) or "-")] if field(job, "kind") == "online" else []),
        *([("batching", _batching_text(job))] if field(job, "kind") == "online" else []),
        ("message", field(job, "message") or "-"),
    ])
    instances = render_table(["cpus", "threads", "max batch", "on training"],
                             [[format_cpulist(field(i, "cpus", [])), field(i, "threads"), field(i, "max_batch"),
                               field(i, "on_training")] for i in field(job, "instances", [])])
    return f"{head}\n\ninstances:\n{instances}"


def _frontdoor_text(job) -> str | None:
    """The front door's own cpu over the last 10 s and the rate it could carry at that cost per request."""
    status = field(job, "status") or {}
    busy, per_request = field(status, "frontdoor_busy"), field(status, "frontdoor_cpu_ms")
    if busy is None:
        return None
    text = frontdoor_share(busy)
    if per_request:
        text += f", {per_request:g} ms of cpu per request: about {1000 / per_request:,.0f} requests/s at most"
    return text


def _batching_text(job) -> str:
    """Whether the job merges requests into batches, and why (not)."""
    status = field(job, "status") or {}
    batchable = field(status, "batchable")
    if batchable is None:
        return "-"
    reason = field(status, "batchable_reason") or ""
    head = "requests merged into batches" if batchable else "one request per run (max_batch_size 0)"
    return f"{head}: {reason}" if reason else head


def _precision_text(job) -> str:
    return describe_precision(field(job, "precision") or "f32", field(job, "effective_precision"),
                              field(job, "backend") or "")


@infer.command("show")
@click.argument("name")
@pass_cli
def show(cli: CliContext, name: str) -> None:
    """One inference job in detail: instances, latency or progress."""
    emit(cli, cli.client().get_inference_job(name), render_job)


@infer.command("remove")
@click.argument("name")
@pass_cli
def remove(cli: CliContext, name: str) -> None:
    """Stop an inference job and free its cores."""
    answer = cli.client().remove_inference(name)
    emit(cli, answer if answer is not None else {"name": name, "removed": True}, lambda _: f"removed {name}")


# ---------------------------------------------------------------------------------------------- models


@click.group(cls=ReamerGroup)
def models() -> None:
    """Built-in ONNX model families (random weights) for trying reamer out and for benchmarks."""


def parse_options(options: tuple[str, ...]) -> dict:
    """`--option k=v` pairs; values become int/float/bool where they look like one."""
    parsed: dict = {}
    for item in options:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise BadInput(f"bad --option {item!r}", "write options as key=value, e.g. --option seq_len=64")
        value: object = text
        if text.lower() in ("true", "false"):
            value = text.lower() == "true"
        else:
            for kind in (int, float):
                try:
                    value = kind(text)
                    break
                except ValueError:
                    pass
        parsed[key.replace("-", "_")] = value
    return parsed


@models.command("build")
@click.argument("family")
@click.option("--out", "out_path", required=True, metavar="FILE", help="Where to write the ONNX model.")
@click.option("--option", "options", multiple=True, metavar="K=V", help="Family option, e.g. seq_len=64 (repeatable).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@pass_cli
def build(cli: CliContext, family: str, out_path: str, options: tuple[str, ...], seed: int) -> None:
    """Write model FAMILY as an ONNX file (see `reamer models list`)."""
    from reamer.serve.models import MODEL_FAMILIES, build_model, canonical_family, canonical_options

    if canonical_family(family) is None:
        raise BadInput(f"unknown model family {family!r}", f"pick one of {', '.join(MODEL_FAMILIES)}")
    family = canonical_family(family)
    family_opts = canonical_options(family, parse_options(options))
    known = family_options(family)
    unknown = sorted(set(family_opts) - set(known))
    if known and unknown:
        raise BadInput(f"model family {family} has no option {', '.join(unknown)}",
                       f"its options are {', '.join(known) or 'none'} (see `reamer models list`)")
    info = build_model(family, out_path, seed=seed, **family_opts)
    emit(cli, info, lambda i: f"wrote {family} to {out_path}" + _model_summary(i))


def _model_summary(info) -> str:
    params = field(info, "params")
    inputs = ", ".join(f"{field(t, 'name')} {field(t, 'datatype')} {field(t, 'shape')}" for t in field(info, "inputs", []))
    size = (f"{params / 1e6:.1f} M" if params >= 1e6 else f"{params:,}") if params else None
    parts = [f"{size} parameters" if size else None, f"inputs: {inputs}" if inputs else None]
    parts = [p for p in parts if p]
    return f" ({'; '.join(parts)})" if parts else ""


FAMILY_DESCRIPTIONS = {
    "resnet50": "ResNet-50 image classifier (25.6 M parameters, 224x224)",
    "mobilenet_v2": "MobileNetV2 image classifier (3.5 M parameters, 224x224; also: mobilenetv2)",
    "bert-base": "BERT-base encoder (token ids in, hidden states out)",
    "deepspeech2": "DeepSpeech2-style speech model (convolutions + GRU layers)",
    "tiny": "a two-layer MLP: builds and runs in milliseconds (tests, quick searches)",
    "multi-io": "two inputs (FP32 and INT64) and two outputs (protocol tests)",
}


def family_options(family: str) -> dict[str, object]:
    """The options `models build FAMILY --option k=v` accepts, with their defaults."""
    import inspect

    from reamer.serve import models as models_module

    builder = getattr(models_module, "_BUILDERS", {}).get(family)
    if builder is None:
        return {}
    params = list(inspect.signature(builder).parameters.values())[1:]  # the first is the graph builder
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


@models.command("list")
@pass_cli
def list_models(cli: CliContext) -> None:
    """The built-in model families and their options."""
    from reamer.serve.models import MODEL_FAMILIES

    rows = [{"family": f, "description": FAMILY_DESCRIPTIONS.get(f, ""), "options": family_options(f)}
            for f in MODEL_FAMILIES]
    emit(cli, {"families": rows}, lambda d: render_table(
        ["family", "description", "options (default)"],
        [[r["family"], r["description"] or "-", " ".join(f"{k}={v}" for k, v in r["options"].items()) or "-"]
         for r in d["families"]]))
