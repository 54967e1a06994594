"""A network namespace joined to this host by a veth pair on a private /30, for clients "on another host".

The host end gets .1, the namespace end .2, and the namespace routes everything through the host end, so
a client in it reaches every address of this host (the one a job's `url` names included) the way a
client elsewhere in the cluster does: over an interface that is not loopback."""
from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest


@dataclass
class Netns:
    name: str
    host_address: str  # this host's end of the veth pair
    client_address: str  # the namespace's end

    def run(self, *argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.name, *argv], capture_output=True, text=True,
                              timeout=timeout)

    def python(self, code: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run Python (this interpreter, so tritonclient and numpy are there) inside the namespace."""
        return self.run(sys.executable, "-c", code, *args, timeout=timeout)


def _ip(*argv: str) -> None:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)}: {done.stderr.strip()}")


def _free_subnet() -> ipaddress.IPv4Network:
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    used = {ipaddress.ip_network(w.split("/")[0] + "/" + (w.split("/")[1] if "/" in w else "32"), strict=False)
            for w in routes.split() if w[:1].isdigit() and w.count(".") == 3}
    for _ in range(100):
        net = ipaddress.ip_network(f"10.{secrets.randbelow(256)}.{secrets.randbelow(256)}.{4 * secrets.randbelow(64)}/30")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free private /30 found")


@pytest.fixture
def netns():
    """A namespace with a veth pair to this host; removed (with both veth ends) afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root: creates a network namespace and a veth pair")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's ip command for a network namespace")
    tag = secrets.token_hex(3)
    name, host_if, ns_if = f"reamer-t{tag}", f"rh{tag}", f"rn{tag}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"ip netns is unavailable here: {probe.stderr.strip()}")
    try:
        net = _free_subnet()
        host_addr, ns_addr = (str(a) for a in list(net.hosts())[:2])
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", name)
        _ip("addr", "add", f"{host_addr}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        for argv in (["addr", "add", f"{ns_addr}/30", "dev", ns_if], ["link", "set", ns_if, "up"],
                     ["link", "set", "lo", "up"], ["route", "add", "default", "via", host_addr]):
            _ip("netns", "exec", name, "ip", *argv)
        yield Netns(name, host_addr, ns_addr)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)  # takes the veth pair with it
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)


TRITON_CLIENT = """
import sys, numpy as np, tritonclient.http as http
url, model = sys.argv[1], sys.argv[2]
client = http.InferenceServerClient(url.split("//", 1)[1], connection_timeout=10, network_timeout=30)
x = http.InferInput("input", [2, 16], "FP32"); x.set_data_from_numpy(np.ones((2, 16), np.float32))
out = client.infer(model, [x], outputs=[http.InferRequestedOutput("output", binary_data=False)])
print(out.as_numpy("output").shape)
"""
