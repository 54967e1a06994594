"""`reamer gpu status`: GPUs, their MPS daemons and per-job shares, from the agent."""
from __future__ import annotations

import click

from reamer.cli.common import CliContext, ReamerGroup, emit, field, pass_cli, render_table


def register(cli: click.Group) -> None:
    cli.add_command(gpu)


@click.group(cls=ReamerGroup)
def gpu() -> None:
    """NVIDIA GPUs and MPS sharing."""


def _pct(value) -> str:
    return "-" if value is None else f"{value:.0f}%"


def render_gpu_status(data) -> str:
    """GPUs (health, MPS daemon, utilisation) and jobs (desired vs applied share) from GpuManager.status()."""
    if not field(data, "enabled", False):
        return f"GPU management is off: {field(data, 'message') or 'disabled in the config'}"
    lines = []
    reason = field(data, "message") or field(data, "reason")
    if field(data, "available") is False or reason:
        lines.append(f"GPUs: {reason or 'not available'}")
    gpus = field(data, "gpus") or []
    if gpus:
        rows = []
        for g in gpus:
            health = field(g, "health") or {}
            daemon = field(g, "daemon")
            latest = field(g, "latest") or {}
            mps = ("-" if daemon is None else
                   f"running (pid {field(daemon, 'pid')})" if field(daemon, "running") else
                   f"stopped{': ' + field(daemon, 'error') if field(daemon, 'error') else ''}")
            rows.append([field(g, "index"), field(g, "name"), field(health, "state", health), mps,
                         _pct(field(latest, "util_pct")), _pct(field(latest, "memory_pct")),
                         field(g, "sm_percent_desired_total"), ",".join(field(g, "jobs") or []) or "-"])
        lines.append(render_table(["gpu", "name", "health", "mps daemon", "util", "memory", "sm % asked", "jobs"],
                                  rows))
    elif not lines:
        lines.append("no GPUs")
    jobs = field(data, "jobs") or []
    if jobs:
        lines += ["", "GPU jobs (MPS applies limits only to clients started afterwards):"]
        lines.append(render_table(
            ["name", "gpu", "kind", "state", "sm % desired", "sm % applied", "limits"],
            [[field(j, "name"), field(j, "gpu_index"), field(j, "kind"), field(j, "state"),
              field(field(j, "desired") or {}, "sm_percent"), field(field(j, "applied") or {}, "sm_percent"),
              field(j, "limits_state")] for j in jobs]))
    return "\n".join(lines)


@gpu.command("status")
@pass_cli
def status(cli: CliContext) -> None:
    """GPU health, MPS daemons and job shares (desired, applied, pending restart)."""
    emit(cli, cli.client().gpus(), render_gpu_status)

