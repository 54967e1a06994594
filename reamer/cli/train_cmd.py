"""`reamer train attach|detach|list` and `reamer demote-all`."""
from __future__ import annotations

import click

from reamer.cli.common import BadInput, CliContext, ReamerGroup, emit, field, pass_cli
from reamer.cli.node_cmd import render_training_table
from reamer.host.cpulist import format_cpulist


def register(cli: click.Group) -> None:
    cli.add_command(train)
    cli.add_command(demote_all)


@click.group(cls=ReamerGroup)
def train() -> None:
    """Training jobs pinned to cores and protected with SCHED_RR."""


def attach_request(name: str, pids: tuple[int, ...], cgroup: str | None, container: str | None,
                   cores: int | None, priority: int | None) -> dict:
    sources = [s for s, v in (("--pid", pids), ("--cgroup", cgroup), ("--container", container)) if v]
    if len(sources) != 1:
        raise BadInput(
            f"give exactly one of --pid, --cgroup, --container (got {', '.join(sources) or 'none'})",
            "e.g. `reamer train attach NAME --pid 1234 --pid 1240` or `--container ID`",
        )
    return {
        "name": name,
        "pids": list(pids) or None,
        "cgroup": cgroup,
        "container": container,
        "cores": cores,
        "priority": priority,
    }


@train.command("attach")
@click.argument("name")
@click.option("--pid", "pids", type=int, multiple=True, metavar="PID", help="A process of the job (repeatable).")
@click.option("--cgroup", default=None, metavar="PATH", help="Take every process of this cgroup.")
@click.option("--container", default=None, metavar="ID", help="Take the processes of this container.")
@click.option("--cores", type=click.IntRange(min=1), default=None, help="Physical cores to give it.")
@click.option("--priority", type=click.IntRange(1, 99), default=None, help="SCHED_RR priority (default: config).")
@pass_cli
def attach(cli: CliContext, name: str, pids, cgroup, container, cores, priority) -> None:
    """Pin a running training job to cores and make its threads SCHED_RR."""
    job = cli.client().attach_training(attach_request(name, pids, cgroup, container, cores, priority))
    emit(cli, job, lambda j: (f"attached {field(j, 'name')}: cpus {format_cpulist(field(j, 'cpus', []))}, "
                              f"{field(j, 'threads_rr')} thread(s) SCHED_RR at priority {field(j, 'priority')}"))


@train.command("detach")
@click.argument("name")
@pass_cli
def detach(cli: CliContext, name: str) -> None:
    """Give a training job's cores back and return its threads to normal scheduling."""
    answer = cli.client().detach_training(name)
    emit(cli, answer if answer is not None else {"name": name, "detached": True},
         lambda _: f"detached {name}: its threads are SCHED_OTHER again and its cores are free")


@train.command("list")
@pass_cli
def list_training(cli: CliContext) -> None:
    """Training jobs the agent pins."""
    jobs = cli.client().list_training_jobs()
    emit(cli, jobs, render_training_table)


@click.command("demote-all")
@click.option("--config", "config_path", default=None, metavar="FILE",
              help="Agent config, for the cgroup root and name when the agent is down (default: built-in).")
@pass_cli
def demote_all(cli: CliContext, config_path: str | None) -> None:
    """Put every reamer-managed thread back to SCHED_OTHER (works without the agent too)."""
    from reamer.api.client import AgentUnreachable

    try:
        result = cli.client().demote_all()
        data = {"via": "agent", "threads_demoted": field(result, "threads_demoted"),
                "jobs": field(result, "jobs", []), "message": field(result, "message", "")}
    except AgentUnreachable:
        from reamer.agent.config import load_config
        from reamer.agent.demote import demote_local

        # --instance NAME: that agent's cgroup and store (reamer-NAME, /var/lib/reamer-NAME), not the node's one
        config = load_config(config_path, {"instance": cli.instance} if cli.instance else None)
        click.echo("agent unreachable: demoting locally", err=True)
        result = demote_local(cgroup_root=config.cgroup_root, name=config.cgroup_name,
                              store_path=str(config.store_path))
        if isinstance(result, int):
            result = {"threads_demoted": result, "jobs": [], "message": "cpusets unchanged"}
        data = {"via": "local", "threads_demoted": field(result, "threads_demoted"),
                "jobs": field(result, "jobs", []), "message": field(result, "message", "")}
    emit(cli, data, lambda d: (f"demoted {d['threads_demoted']} thread(s) to SCHED_OTHER ({d['via']})"
                               + (f"; jobs: {', '.join(d['jobs'])}" if d["jobs"] else "")
                               + (f"\n{d['message']}" if d["message"] else "")))
