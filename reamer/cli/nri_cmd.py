"""`reamer nri`: the NRI plugin beside the node's container runtime, and the node's capacity for Kubernetes.

`reamer nri run` connects to the runtime's NRI socket (containerd 1.7+, CRI-O 1.26+), registers as
`<index>-<name>` and hands annotated pods to the agent (reamer/nri/plugin.py); it reconnects when the runtime
restarts. `reamer nri capacity` prints the agent's capacity as Kubernetes extended resources, and with
`--kubectl-patch NODE` the `kubectl patch` that publishes them to the node's status (`--apply` runs it,
`--every S` keeps doing so: a sidecar loop).
"""
from __future__ import annotations

import json
import logging
import shlex
import subprocess
import sys
import threading
import time

import click

from reamer.cli.common import CliContext, ReamerGroup, emit, pass_cli, render_fields, wait_for_capacity_change

RECONNECT_S = 2.0
SYNC_WAIT_S = 60.0


def register(cli: click.Group) -> None:
    cli.add_command(nri)


@click.group(cls=ReamerGroup)
def nri() -> None:
    """Kubernetes: the NRI plugin (pods' cores at container creation) and the node's extended resources."""


@nri.command("run")
@click.option("--nri-socket", default="/var/run/nri/nri.sock", show_default=True, metavar="PATH",
              help="The runtime's NRI socket (containerd: socket_path of [plugins.\"io.containerd.nri.v1.nri\"]).")
@click.option("--name", default="reamer", show_default=True, help="Plugin name registered with the runtime.")
@click.option("--index", default="90", show_default=True,
              help="Two-digit plugin index: plugins are called in ascending order; a later one can override "
                   "an earlier one's cpuset, so no other resource policy may claim reamer's pods.")
@click.option("--once", is_flag=True, help="Exit when the runtime closes the connection (default: reconnect).")
@click.option("--stale-after", default=30.0, show_default=True, type=click.FloatRange(min=1.0), metavar="S",
              help="Give back the cores of an agent record older than S seconds whose container the runtime "
                   "does not have (a CreateContainer the runtime gave up on).")
@pass_cli
def run(cli: CliContext, nri_socket: str, name: str, index: str, once: bool, stale_after: float) -> None:
    """Run the NRI plugin (as root, beside the runtime and the agent)."""
    from reamer.nri.plugin import ReamerPlugin
    from reamer.nri.stub import NriConnectError, Stub, check_index

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    check_index(index)
    stop = threading.Event()
    with cli.client() as client:
        plugin = ReamerPlugin(client, stale_after_s=stale_after)
        threading.Thread(target=plugin.refresh_inference, args=(stop,), name="nri-pool", daemon=True).start()
        try:
            while True:
                stub = Stub(plugin, name, index, nri_socket)
                try:
                    stub.connect()
                except NriConnectError as error:
                    if once:
                        raise
                    logging.getLogger("reamer.nri").warning("%s; retrying in %.0f s", error.message, RECONNECT_S)
                    time.sleep(RECONNECT_S)
                    continue
                click.echo(f"registered NRI plugin {index}-{name} on {nri_socket}")
                sys.stdout.flush()
                if stub.synchronized.wait(SYNC_WAIT_S):  # only then is the plugin's view of the node whole
                    plugin.send_updates = stub.update_containers
                stub.run()
                plugin.send_updates = None
                if once:
                    return
                time.sleep(RECONNECT_S)
        finally:
            stop.set()


def kubectl_patch(node: str, resources: dict[str, str]) -> list[str]:
    """`kubectl patch node NODE --subresource=status` adding the extended resources to its capacity (JSON
    patch; "/" in a resource name is "~1"). kubectl 1.24+; older ones: see
    docs/scheduler-authors.md's proxy + curl form."""
    ops = [{"op": "add", "path": "/status/capacity/" + name.replace("~", "~0").replace("/", "~1"), "value": value}
           for name, value in sorted(resources.items())]
    return ["kubectl", "patch", "node", node, "--subresource=status", "--type=json", "-p", json.dumps(ops)]


@nri.command("capacity")
@click.option("--kubectl-patch", "node", default=None, metavar="NODE",
              help="Print the kubectl command that publishes the capacity to NODE's status.")
@click.option("--apply", is_flag=True, help="Run that command (needs kubectl and a kubeconfig allowed to "
                                            "patch nodes/status).")
@click.option("--every", default=None, type=click.FloatRange(min=1.0), metavar="S",
              help="With --apply: again every S seconds and at every capacity change (a sidecar loop).")
@pass_cli
def capacity(cli: CliContext, node: str | None, apply: bool, every: float | None) -> None:
    """The node's capacity as Kubernetes extended resources (reamer.io/spare-cores: whole cores;
    reamer.io/batch-cpu: milli-cores for batch work)."""
    from reamer.host.errors import ReamerError

    if (apply or every) and not node:
        raise ReamerError("--apply and --every publish to a node", "give --kubectl-patch NODE (the node's name "
                                                                  "in Kubernetes, `kubectl get nodes`)")
    with cli.client() as client:
        since = client.events(since=0).last_id if every else 0
        while True:
            resources = client.capacity()["kubernetes"]
            if node is None:
                emit(cli, resources, lambda r: render_fields(sorted(r.items())))
                return
            command = kubectl_patch(node, resources)
            if not apply:
                emit(cli, {"command": command}, lambda d: shlex.join(d["command"]))
                return
            _run_kubectl(command)
            click.echo(f"{time.strftime('%H:%M:%S')} node {node}: "
                       + ", ".join(f"{k}={v}" for k, v in sorted(resources.items())))
            sys.stdout.flush()
            if not every:
                return
            since = wait_for_capacity_change(client, since, every)


def _run_kubectl(command: list[str]) -> None:
    from reamer.host.errors import ReamerError

    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise ReamerError("kubectl is not installed", "install kubectl 1.24+ (or run the printed command where "
                                                      "it is), and give it a kubeconfig") from None
    except subprocess.TimeoutExpired:
        raise ReamerError("kubectl did not answer in 60 s", "check the API server and the kubeconfig") from None
    if done.returncode != 0:
        raise ReamerError(f"kubectl patch failed: {done.stderr.strip() or done.stdout.strip()}",
                          "the kubeconfig's user needs `patch` on nodes/status; kubectl must be 1.24+ for "
                          "--subresource")
