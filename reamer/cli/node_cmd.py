"""`reamer status`, `reamer topology`, `reamer doctor`, `reamer events`."""
from __future__ import annotations

import time

import click

from reamer.cli.common import CliContext, emit, field, pass_cli, print_json, render_fields, render_table
from reamer.host.cpulist import format_cpulist


def register(cli: click.Group) -> None:
    for command in (status, topology, doctor, events):
        cli.add_command(command)


# ---------------------------------------------------------------------------------------------- status


def render_status(node, training_jobs, inference_jobs) -> str:
    throttling = field(node, "rt_throttling")
    runtime = field(throttling, "runtime_us")
    rt_text = "disabled (reamer refuses RT)" if runtime == -1 else f"{runtime}/{field(throttling, 'period_us')} us"
    lines = [
        render_fields([
            ("host", f"{field(node, 'hostname')} ({field(node, 'cpu_model')})"),
            ("agent", f"pid {field(node, 'agent_pid')}, version {field(node, 'version')}, "
                      f"up {field(node, 'uptime_s', 0):.0f} s"),
            ("cpus", format_cpulist(field(node, "cpus", []))),
            ("reserved", format_cpulist(field(node, "reserved_cpus", [])) or "-"),
            ("training", format_cpulist(field(node, "training_cpus", [])) or "-"),
            ("idle", format_cpulist(field(node, "idle_cpus", [])) or "-"),
            ("free cores", field(node, "free_cores")),
            ("cgroup", f"v{field(node, 'cgroup_version')}"),
            ("rt throttling", rt_text),
            ("rt budget", render_rt_budget(field(node, "rt_budget"))),
            ("offline sched", field(node, "offline_sched")),
            ("gpus", field(node, "gpus", 0)),
        ]),
        "",
        "training jobs:",
        render_training_table(training_jobs),
        *(f"  {field(j, 'name')}: {field(j, 'message')}" for j in training_jobs if field(j, "message")),
        "",
        "inference jobs:",
        render_inference_table(inference_jobs),
    ]
    return "\n".join(lines)


def render_rt_budget(budget) -> str:
    """The RT budget pools and who holds what, on one line (cgroup v1 with RT group scheduling)."""
    if budget is None:
        return "-"
    if not field(budget, "enabled"):
        return "not needed on this host (no RT group scheduling)"
    pools = (f"cap {field(budget, 'cap_us')} us: root/admins {field(budget, 'privileged_pool_us')} us, "
             f"users {field(budget, 'user_pool_us')} us ({field(budget, 'user_percent')}%)")
    held = [f"{field(j, 'job')} (uid {field(j, 'owner_uid')}, {field(j, 'pool')}) {field(j, 'budget_us')} us"
            for j in field(budget, "jobs", []) or []]
    return pools + ("; held: " + ", ".join(held) if held else "; none held")


def render_training_table(jobs) -> str:
    return render_table(
        ["name", "state", "cpus", "pids", "rr threads", "priority", "source"],
        [[field(j, "name"), field(j, "state"), format_cpulist(field(j, "cpus", [])),
          " ".join(str(p) for p in field(j, "pids", [])),
          f"{field(j, 'threads_rr')}/{field(j, 'threads') or '?'}", field(j, "priority"), field(j, "source")]
         for j in jobs],
    )


FRONTDOOR_SHOWN_FROM = 0.5  # a front door busier than this is worth a look (it saturates near one cpu)


def frontdoor_share(busy: float) -> str:
    return f"{busy * 100:.0f}% of a cpu"


def inference_progress(job) -> str:
    status = field(job, "status") or {}
    if field(job, "kind") == "online":
        p99 = field(status, "p99_ms")
        attain = field(status, "slo_attainment")
        rate = field(status, "rate_rps")
        parts = []
        if rate is not None:
            parts.append(f"{rate:.1f} rps")
        if p99 is not None:
            parts.append(f"p99 {p99:.1f} ms")
        if attain is not None:
            parts.append(f"{attain * 100:.1f}% in SLO")
        busy = field(status, "frontdoor_busy")
        if busy is not None and busy >= FRONTDOOR_SHOWN_FROM:
            parts.append(f"front door {frontdoor_share(busy)}")
        return ", ".join(parts) or "-"
    done, total, tput = field(status, "done"), field(status, "total"), field(status, "throughput")
    parts = []
    if total:
        parts.append(f"{done or 0}/{total}")
    if tput is not None:
        parts.append(f"{tput:.1f}/s")
    return ", ".join(parts) or "-"


def render_inference_table(jobs) -> str:
    return render_table(
        ["name", "kind", "state", "backend", "layout", "precision", "slo ms", "cpus", "progress", "url"],
        [[field(j, "name"), field(j, "kind"), field(j, "state"), field(j, "backend"), field(j, "layout"),
          _short_precision(j), field(j, "slo_ms"),
          format_cpulist({c for i in field(j, "instances", []) for c in field(i, "cpus", [])}) or "-",
          inference_progress(j), field(j, "url")]
         for j in jobs],
    )


def _short_precision(job) -> str:
    """What the instances compute in (what was asked until they report), and what was asked where it differs."""
    asked, effective = field(job, "precision") or "f32", field(job, "effective_precision")
    return asked if effective in (None, asked) else f"{effective} (asked {asked})"


def fetch_status(cli: CliContext) -> dict:
    client = cli.client()
    return {
        "node": client.node(),
        "training_jobs": client.list_training_jobs(),
        "inference_jobs": client.list_inference_jobs(),
    }


@click.command()
@pass_cli
def status(cli: CliContext) -> None:
    """Node state from the agent: cores, training and inference jobs."""
    state = fetch_status(cli)
    emit(cli, state, lambda s: render_status(s["node"], s["training_jobs"], s["inference_jobs"]))


# -------------------------------------------------------------------------------------------- topology


def topology_as_dict(topo) -> dict:
    return {
        "model_name": topo.model_name,
        "cpus": [{"id": c.id, "core_id": c.core_id, "package_id": c.package_id,
                  "numa_node": c.numa_node, "l3_id": c.l3_id} for c in sorted(topo.cpus, key=lambda c: c.id)],
        "physical_cores": [list(core) for core in topo.physical_cores()],
        "numa_nodes": {str(k): v for k, v in topo.numa_nodes().items()},
        "l3_groups": {str(k): v for k, v in topo.l3_groups().items()},
        "isa_flags": list(topo.isa_flags),
    }


def render_topology(data: dict) -> str:
    interesting = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "avx_vnni")
                   if f in data["isa_flags"]]
    head = render_fields([
        ("model", data["model_name"]),
        ("cpus", f"{len(data['cpus'])} online, {len(data['physical_cores'])} physical cores"),
        ("numa nodes", "; ".join(f"{k}: {format_cpulist(v)}" for k, v in data["numa_nodes"].items())),
        ("l3 groups", "; ".join(f"{k}: {format_cpulist(v)}" for k, v in data["l3_groups"].items())),
        ("isa", " ".join(interesting) or "-"),
    ])
    table = render_table(["cpu", "core", "package", "numa", "l3"],
                         [[c["id"], c["core_id"], c["package_id"], c["numa_node"], c["l3_id"]] for c in data["cpus"]])
    return f"{head}\n\n{table}"


@click.command()
@click.option("--sys-root", default="/sys", show_default=True, hidden=True, help="sysfs root (for tests).")
@pass_cli
def topology(cli: CliContext, sys_root: str) -> None:
    """CPUs, physical cores, NUMA nodes and L3 groups of this machine (local, no agent needed)."""
    from reamer.host.topology import read_topology

    emit(cli, topology_as_dict(read_topology(sys_root)), render_topology)


# ---------------------------------------------------------------------------------------------- doctor


def check_required(check) -> bool:
    return bool(getattr(check, "required", True))


def training_conflict_checks(cli: CliContext) -> list:
    """With a running agent: one warning per training job whose cpuset another manager changed."""
    from reamer.host.errors import ReamerError
    from reamer.host.probe import Check

    try:
        jobs = cli.client().list_training_jobs()
    except ReamerError:
        return []  # no agent here: nothing attached to check
    conflicts = [j for j in jobs if "conflict:" in (field(j, "message") or "")]
    if not conflicts:
        return [Check("training-cpusets", True, f"{len(jobs)} training job(s), no other manager changed their cpusets",
                      required=False)]
    return [Check("training-cpusets", False, f"{field(j, 'name')}: {field(j, 'message')}",
                  "let one manager own that cgroup's cpuset: turn kubelet's static CPU manager (or the runtime's "
                  "update) off for it, or detach the job from reamer", required=False) for j in conflicts]


@click.command()
@pass_cli
def doctor(cli: CliContext) -> None:
    """What this host can do for reamer; exits 1 if a required check fails (local, no agent needed)."""
    from reamer.host.probe import run_checks

    checks = run_checks()
    checks.extend(training_conflict_checks(cli))
    failed_required = [c for c in checks if not c.ok and check_required(c)]
    data = {
        "ok": not failed_required,
        "checks": [{"name": c.name, "ok": c.ok, "required": check_required(c), "detail": c.detail, "fix": c.fix}
                   for c in checks],
    }

    def render(d: dict) -> str:
        rows = []
        for c in d["checks"]:
            mark = "ok" if c["ok"] else ("FAIL" if c["required"] else "warn")
            rows.append([mark, c["name"], c["detail"] + ("" if c["ok"] or not c["fix"] else f" — fix: {c['fix']}")])
        verdict = ("all required checks pass" if d["ok"]
                   else f"{len(failed_required)} required check(s) failed: "
                        + ", ".join(c.name for c in failed_required))
        return render_table(["", "check", "detail"], rows) + "\n\n" + verdict

    emit(cli, data, render)
    if failed_required:
        raise SystemExit(1)


# ---------------------------------------------------------------------------------------------- events


def render_event(event) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(field(event, "ts", 0)))
    job = field(event, "job")
    return f"{field(event, 'id'):>5}  {stamp}  {field(event, 'kind'):<20} {(job or '-'):<16} {field(event, 'message')}"


@click.command()
@click.option("--follow", "-f", is_flag=True, help="Keep waiting for new events (Ctrl-C to stop).")
@click.option("--since", type=int, default=0, show_default=True, help="Only events with a higher id.")
@pass_cli
def events(cli: CliContext, follow: bool, since: int) -> None:
    """The agent's event log (training attached, re-plans, overload, crashed workers, …)."""
    client = cli.client()
    answer = client.events(since=since)
    if not follow:
        emit(cli, answer, lambda a: "\n".join(render_event(e) for e in field(a, "events", [])) or "(no events)")
        return
    last = since
    try:
        while True:
            for event in field(answer, "events", []):
                if cli.json:
                    print_json(event)
                else:
                    click.echo(render_event(event))
                last = max(last, field(event, "id", last))
            last = max(last, field(answer, "last_id", last) or last)
            answer = client.events(since=last, wait=True)
    except KeyboardInterrupt:
        pass
