"""`reamer slurm report`: keeps the node's spare cores visible to Slurm (a GRES count and a node feature).

It follows the agent's `capacity_changed` events and runs `scontrol update nodename=N gres=NAME:K
availablefeatures=... activefeatures=...` whenever the spare cores change, and again every --every seconds
(`scontrol reconfigure`, and slurmctld reading slurm.conf again, put back the configured GRES count). Run it as root on the node, beside the agent
(for example as a second systemd unit). slurm.conf must declare the GRES: `GresTypes=reamer_spare` and the
node's `Gres=reamer_spare:<its cores>` (gres.conf `Name=reamer_spare Count=<its cores>`).
"""
from __future__ import annotations

import sys
import time

import click

from reamer.cli.common import CliContext, ReamerGroup, pass_cli, wait_for_capacity_change


def register(cli: click.Group) -> None:
    cli.add_command(slurm)


@click.group(cls=ReamerGroup)
def slurm() -> None:
    """Slurm: publish the node's spare cores (the Prolog/Epilog scripts are in contrib/slurm)."""


def node_features(base: list[str], feature: str, spare: int) -> list[str]:
    """The node's features with reamer's: `feature` while it has spare cores, never twice."""
    kept = [f for f in base if f != feature]
    return kept + [feature] if spare > 0 else kept


@slurm.command("report")
@click.option("--node", default=None, help="Slurm's NodeName of this node (default: the short host name).")
@click.option("--gres", "gres_name", default="reamer_spare", show_default=True,
              help="The GRES whose count is the spare cores.")
@click.option("--feature", default="reamer", show_default=True,
              help="A node feature present while the node has spare cores ('' for none).")
@click.option("--base-features", default="", help="The node's own features to keep, comma-separated.")
@click.option("--every", default=30.0, show_default=True, type=click.FloatRange(min=1.0),
              help="Seconds between re-assertions (a reconfigure puts back slurm.conf's GRES count).")
@click.option("--once", is_flag=True, help="Report once and exit.")
@pass_cli
def report(cli: CliContext, node: str | None, gres_name: str, feature: str, base_features: str, every: float,
           once: bool) -> None:
    """Keep Slurm's GRES count and feature for this node in step with the agent's spare cores."""
    import socket

    from reamer.host.slurm import update_node

    node = node or socket.gethostname().split(".")[0]
    base = [f for f in base_features.split(",") if f]
    with cli.client() as client:
        since = client.events(since=0).last_id
        while True:
            spare = client.capacity()["spare_cores"]
            features = node_features(base, feature, spare) if feature else None
            update_node(node, gres=f"{gres_name}:{spare}", features=features)
            click.echo(f"{time.strftime('%H:%M:%S')} node {node}: gres {gres_name}:{spare}"
                       + (f", features {','.join(features) or '(none)'}" if features is not None else ""))
            sys.stdout.flush()  # a line per report, also when stdout is a pipe (the journal)
            if once:
                return
            since = wait_for_capacity_change(client, since, every)
