"""A private containerd 1.7 with NRI enabled (its own root, state and sockets), and a small CRI client in
the kubelet's place: host-network pods (no CNI), images built here.

containerd comes from $REAMER_CONTAINERD_DIR (default /opt/containerd17/usr/bin: Debian 13's package
extracted with dpkg-deb -x by scripts/get_containerd17.sh, which `make test-packages` runs); runc and
busybox from the host.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import wait_for
from tests.nri.images import BUSYBOX, build_image

CONTAINERD_DIR = Path(os.environ.get("REAMER_CONTAINERD_DIR", "/opt/containerd17/usr/bin"))
PAUSE_IMAGE = "reamer.local/pause:1"
BUSYBOX_IMAGE = "reamer.local/busybox:1"
CGROUP_PARENT = "reamer-nri-test"  # cgroupfs driver: pods' cgroups go below it in every hierarchy

CONFIG = """version = 2
root = "{d}/root"
state = "{d}/state"
[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[plugins."io.containerd.nri.v1.nri"]
  disable = false
  disable_connections = false
  plugin_config_path = "{d}/nri/conf.d"
  plugin_path = "{d}/nri/plugins"
  plugin_registration_timeout = "10s"
  plugin_request_timeout = "10s"
  socket_path = "{d}/nri.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  restrict_oom_score_adj = true  # a container host without CAP_SYS_RESOURCE cannot give the pause -998
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{runc}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{d}/cni/bin"
    conf_dir = "{d}/cni/conf"
"""


def missing() -> str:
    """Why a real containerd 1.7 with NRI cannot run here ('' when it can)."""
    if os.geteuid() != 0:
        return "needs root (containerd, runc and cgroups)"
    binary = CONTAINERD_DIR / "containerd"
    if not binary.exists():
        return (f"no containerd at {binary}: run scripts/get_containerd17.sh (Debian 13's containerd 1.7), "
                "or set REAMER_CONTAINERD_DIR")
    try:
        version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{binary} does not run: {error}"
    match = re.search(r"\s(\d+)\.(\d+)\.", version)
    if not match or (int(match.group(1)), int(match.group(2))) < (1, 7):
        return f"{binary} is not containerd 1.7+ (NRI v2): {version.strip()}"
    if not shutil.which("runc"):
        return "runc is not installed (apt-get install runc)"
    if not Path(BUSYBOX).exists():
        return "busybox is not installed (apt-get install busybox-static): the test images are built from it"
    try:
        import grpc  # noqa: F401

        from tests.hosts.cri import api_pb2_grpc  # noqa: F401
    except ImportError as error:
        return f"the CRI client cannot be imported: {error}"
    return ""


@dataclass
class Containerd:
    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="c17-", dir="/tmp")))
    proc: subprocess.Popen | None = None

    @property
    def socket(self) -> str:
        return str(self.base / "containerd.sock")

    @property
    def nri_socket(self) -> str:
        return str(self.base / "nri.sock")

    def start(self) -> "Containerd":
        for sub in ("nri/conf.d", "nri/plugins", "cni/bin", "cni/conf"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        (self.base / "config.toml").write_text(CONFIG.format(d=self.base, pause=PAUSE_IMAGE, runc=shutil.which("runc")))
        log = open(self.base / "containerd.log", "ab")
        env = {**os.environ, "PATH": f"{CONTAINERD_DIR}:{os.environ.get('PATH', '')}"}
        self.proc = subprocess.Popen([str(CONTAINERD_DIR / "containerd"), "--config", str(self.base / "config.toml")],
                                     stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        wait_for(lambda: os.path.exists(self.nri_socket) and "containerd successfully booted" in self.log(),
                 timeout=60, what=f"containerd to start; log {self.base / 'containerd.log'}")
        image = build_image(self.base / "busybox.tar", [PAUSE_IMAGE, BUSYBOX_IMAGE], ["/bin/sleep", "100000"])
        subprocess.run([str(CONTAINERD_DIR / "ctr"), "--address", self.socket, "-n", "k8s.io", "images", "import",
                        str(image)], check=True, capture_output=True, timeout=120)
        return self

    def log(self) -> str:
        try:
            return (self.base / "containerd.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cleanup(self) -> None:
        """Stop containerd, then everything it left: shims, mounts, cgroups, files."""
        self.stop()
        for line in subprocess.run(["pgrep", "-f", f"containerd-shim-runc-v2 .*-address {self.socket}"],
                                   capture_output=True, text=True).stdout.split():
            try:
                os.killpg(int(line), signal.SIGKILL)
            except (ProcessLookupError, PermissionError, ValueError):
                pass
        mounts = [m.split()[1] for m in Path("/proc/mounts").read_text().splitlines() if str(self.base) in m]
        for mount in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True)
        remove_cgroups(CGROUP_PARENT)
        shutil.rmtree(self.base, ignore_errors=True)


def remove_cgroups(name: str) -> None:
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        top = hierarchy / name
        if not top.is_dir():
            continue
        for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            try:
                path.rmdir()
            except OSError:
                pass
        try:
            top.rmdir()
        except OSError:
            pass


class Cri:
    """The CRI calls a kubelet makes for one pod, over containerd's CRI socket."""

    def __init__(self, socket: str) -> None:
        import grpc

        from tests.hosts.cri import api_pb2 as cri
        from tests.hosts.cri import api_pb2_grpc as cri_grpc

        self.cri = cri
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        self.runtime = cri_grpc.RuntimeServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def run_pod(self, name: str, annotations: dict[str, str] | None = None) -> tuple[str, object]:
        cri = self.cri
        uid = uuid.uuid4().hex
        config = cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name=name, uid=uid, namespace="default", attempt=0),
            annotations=annotations or {}, labels={"app": name},
            linux=cri.LinuxPodSandboxConfig(
                cgroup_parent=f"/{CGROUP_PARENT}/pod{uid}",
                security_context=cri.LinuxSandboxSecurityContext(
                    namespace_options=cri.NamespaceOption(network=cri.NODE, pid=cri.CONTAINER, ipc=cri.POD))))
        reply = self.runtime.RunPodSandbox(cri.RunPodSandboxRequest(config=config), timeout=120)
        return reply.pod_sandbox_id, config

    def create_container(self, pod_id: str, pod_config: object, name: str, command: list[str],
                         memory_bytes: int = 256 << 20):
        cri = self.cri
        config = cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name=name, attempt=0), image=cri.ImageSpec(image=BUSYBOX_IMAGE),
            command=command, log_path=f"{name}.log",
            linux=cri.LinuxContainerConfig(resources=cri.LinuxContainerResources(memory_limit_in_bytes=memory_bytes)))
        return self.runtime.CreateContainer(cri.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=config, sandbox_config=pod_config), timeout=120).container_id

    def start(self, container_id: str) -> None:
        self.runtime.StartContainer(self.cri.StartContainerRequest(container_id=container_id), timeout=120)

    def stop(self, container_id: str) -> None:
        self.runtime.StopContainer(self.cri.StopContainerRequest(container_id=container_id, timeout=5), timeout=120)

    def remove(self, container_id: str) -> None:
        self.runtime.RemoveContainer(self.cri.RemoveContainerRequest(container_id=container_id), timeout=120)

    def status(self, container_id: str):
        return self.runtime.ContainerStatus(self.cri.ContainerStatusRequest(container_id=container_id),
                                            timeout=60).status

    def remove_pod(self, pod_id: str) -> None:
        self.runtime.StopPodSandbox(self.cri.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=120)
        self.runtime.RemovePodSandbox(self.cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=120)

    def pid_of(self, container_id: str) -> int:
        import json

        info = self.runtime.ContainerStatus(self.cri.ContainerStatusRequest(container_id=container_id, verbose=True),
                                            timeout=60).info
        return int(json.loads(info["info"])["pid"])
