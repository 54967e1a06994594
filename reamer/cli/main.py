"""The `reamer` command: talks to the agent over its Unix socket, and runs local-only commands
(topology, doctor, models, profile, search, demo) in-process."""
from __future__ import annotations

import click

from reamer.cli import daemon_cmd, demo_cmd, gpu_cmd, infer_cmd, node_cmd, nri_cmd, search_cmd, slurm_cmd, train_cmd
from reamer.cli.common import (DEFAULT_SOCKET, OUTPUT_FORMATS, CliContext, ReamerGroup, add_output_option,
                               checked_instance)


@click.group(cls=ReamerGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--socket",
    "socket_path",
    envvar="REAMER_SOCKET",
    default=DEFAULT_SOCKET,
    show_default=True,
    metavar="PATH",
    help="The agent's API socket (env REAMER_SOCKET).",
)
@click.option(
    "--instance", envvar="REAMER_INSTANCE", default=None, metavar="NAME",
    help="Talk to (or, with `daemon`, run) agent NAME: its socket /run/reamer-NAME/reamer.sock unless --socket "
         "is given (env REAMER_INSTANCE).",
)
@click.option(
    "-o", "--output", type=click.Choice(OUTPUT_FORMATS), default="table", show_default=True,
    help="Output format; json is for scripts.",
)
@click.version_option(package_name="reamer")
@click.pass_context
def cli(ctx: click.Context, socket_path: str, output: str, instance: str | None = None) -> None:
    """reamer: co-locate CPU inference with GPU training on one node."""
    if instance is not None:
        instance = checked_instance(instance)
        if ctx.get_parameter_source("socket_path") in (None, click.core.ParameterSource.DEFAULT):
            from reamer.agent.config import instance_defaults

            socket_path = instance_defaults(instance)["socket"]
    ctx.obj = CliContext(socket_path=socket_path, output=output, instance=instance)


for module in (daemon_cmd, node_cmd, train_cmd, infer_cmd, search_cmd, gpu_cmd, slurm_cmd, nri_cmd, demo_cmd):
    module.register(cli)
add_output_option(cli)


def main() -> None:
    cli(prog_name="reamer")


if __name__ == "__main__":
    main()
