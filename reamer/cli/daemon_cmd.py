"""`reamer daemon`: run the node agent in the foreground (systemd runs this)."""
from __future__ import annotations

import click

from reamer.cli.common import cpulist_option_value


def register(cli: click.Group) -> None:
    cli.add_command(daemon)


def daemon_overrides(socket: str | None, state_dir: str | None, reserved_cpus: str | None,
                     instance: str | None = None) -> dict:
    """Flags that were given, as config overrides (flags win over the file)."""
    overrides: dict = {}
    if instance is not None:
        overrides["instance"] = instance
    if socket is not None:
        overrides["socket"] = socket
    if state_dir is not None:
        overrides["state_dir"] = state_dir
    if reserved_cpus is not None:
        overrides["reserved_cpus"] = cpulist_option_value(reserved_cpus)
    return overrides


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Agent config (YAML); see configs/reamer.yaml. Default: built-in defaults.")
@click.option("--socket", "socket_path", default=None, metavar="PATH",
              help="API socket to listen on (overrides the config; default: the global --socket if given).")
@click.option("--state-dir", default=None, metavar="DIR", help="Store and job run directories (overrides the config).")
@click.option("--reserved-cpus", default=None, metavar="LIST",
              help='Housekeeping CPUs never given to jobs, e.g. "0" or "" for none (overrides the config).')
@click.option("--instance", default=None, metavar="NAME",
              help="Run a second agent, NAME, beside the node's one: its own socket (/run/reamer-NAME/reamer.sock), "
                   "state and profile cache (/var/lib/reamer-NAME), run directory (/run/reamer-NAME) and cgroup "
                   "(reamer-NAME), each unless set otherwise (the config key `instance`).")
@click.pass_context
def daemon(ctx: click.Context, config_path: str | None, socket_path: str | None, state_dir: str | None,
           reserved_cpus: str | None, instance: str | None = None) -> None:
    """Run the agent in the foreground until SIGTERM."""
    from reamer.node import run_daemon
    from reamer.cli.common import CliContext, checked_instance

    parent = ctx.find_root()
    if socket_path is None:
        if parent.get_parameter_source("socket_path") not in (None, click.core.ParameterSource.DEFAULT):
            socket_path = parent.params["socket_path"]
    if instance is None:
        obj = ctx.find_object(CliContext)
        instance = obj.instance if obj is not None else None
    overrides = daemon_overrides(socket_path, state_dir, reserved_cpus,
                                 checked_instance(instance) if instance is not None else None)
    code = run_daemon(config_path, overrides)
    ctx.exit(code or 0)
