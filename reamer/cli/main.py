"""The `reamer` command: talks to the agent over its Unix socket, and runs local-only commands
(topology, doctor, models, profile, search, demo) in-process."""
from __future__ import annotations

import click

from reamer.cli import daemon_cmd, demo_cmd, gpu_cmd, infer_cmd, node_cmd, search_cmd, train_cmd
from reamer.cli.common import DEFAULT_SOCKET, OUTPUT_FORMATS, CliContext, ReamerGroup, add_output_option


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
    "-o", "--output", type=click.Choice(OUTPUT_FORMATS), default="table", show_default=True,
    help="Output format; json is for scripts.",
)
@click.version_option(package_name="reamer")
@click.pass_context
def cli(ctx: click.Context, socket_path: str, output: str) -> None:
    """reamer: co-locate CPU inference with GPU training on one node."""
    ctx.obj = CliContext(socket_path=socket_path, output=output)


for module in (daemon_cmd, node_cmd, train_cmd, infer_cmd, search_cmd, gpu_cmd, demo_cmd):
    module.register(cli)
add_output_option(cli)


def main() -> None:
    cli(prog_name="reamer")


if __name__ == "__main__":
    main()
