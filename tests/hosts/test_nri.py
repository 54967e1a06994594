"""Kubernetes nodes without a kubelet (lab VM `v2-k8s`: Debian 13, cgroup v2 under systemd): Debian's containerd
1.7 with NRI enabled and its CRI plugin, driven by a small CRI client in the kubelet's place
(tests/hosts/cri/), reamer's agent as the systemd service and reamer's NRI plugin (`reamer nri`) beside the
runtime. Images are built here from the lab's busybox rootfs and imported with `ctr -n k8s.io images import`;
pods use the host's network, so no CNI is needed.

What must hold: a pod annotated `reamer.io/role: training` gets its cores in the container's OCI spec at
CreateContainer (before its first process runs), its threads run SCHED_RR on those cores once it starts, its
memory and pids limits stay what the runtime set, and RemoveContainer gives the cores back; a pod without the
annotation is left exactly as the runtime made it; killing the plugin between create and start, or after
start, loses nothing."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.hosts.helpers import PROFILE, REPO, SOCKET, api_get, sh, wait_for

pytestmark = pytest.mark.profiles("v2-k8s")

CRI_ENDPOINT = "unix:///run/containerd/containerd.sock"
NRI_SOCKET = "/var/run/nri/nri.sock"
BUSYBOX = "docker.io/reamer/busybox:1"
PAUSE = "docker.io/reamer/pause:1"
TRAINING = {"reamer.io/role": "training", "reamer.io/cores": "1"}
COMMAND = ["/bin/sh", "-c", "sleep 100000 & sleep 100000 & wait"]
MEMORY_LIMIT = 96 << 20
POD_TASKS_MAX = 77  # the pod-level pids limit the kubelet sets (podPidsLimit) on the pod's slice
# The runtime's configuration an operator writes (README "Kubernetes (NRI)"): NRI on, the CRI plugin with the
# systemd cgroup driver, a local sandbox image. The request timeout is the lab's: Python under emulation is
# about 13x slower than on a real host, where containerd's default (2 s) is what plugins get.
CONTAINERD_CONFIG = f"""\
version = 2
[plugins."io.containerd.nri.v1.nri"]
  disable = false
  disable_connections = false
  socket_path = "{NRI_SOCKET}"
  plugin_config_path = "/etc/nri/conf.d"
  plugin_path = "/opt/nri/plugins"
  plugin_registration_timeout = "60s"
  plugin_request_timeout = "30s"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = true
"""
OUT = Path(os.environ.get("REAMER_LAB_OUT", "/tmp"))


# --- the runtime ---------------------------------------------------------------------------------

def _import_images() -> None:
    from tests.hosts.cri.images import oci_image_tar

    ctr = ["ctr", "-n", "k8s.io", "images", "import"]
    for ref, cmd in ((BUSYBOX, ["/bin/sh"]),
                     # the pause container only has to stay alive; the CRI plugin kills it with SIGKILL
                     (PAUSE, ["/bin/sleep", "2147483647"])):
        tar = oci_image_tar(Path("/opt/ctr-rootfs"), Path("/var/tmp") / (ref.rsplit("/", 1)[1].replace(":", "-") + ".tar"),
                            ref, cmd)
        sh([*ctr, str(tar)], timeout=300)


@pytest.fixture(scope="module")
def cri():
    from tests.hosts.cri.client import CriClient

    if not Path("/etc/hosts").exists():  # every real node has one (the CRI plugin copies it into each pod);
        Path("/etc/hosts").write_text("127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n")  # minbase has none
    Path("/etc/containerd").mkdir(exist_ok=True)
    Path("/etc/containerd/config.toml").write_text(CONTAINERD_CONFIG)
    for d in ("/etc/nri/conf.d", "/opt/nri/plugins"):
        Path(d).mkdir(parents=True, exist_ok=True)
    sh("systemctl restart containerd", timeout=300)
    client = CriClient(CRI_ENDPOINT, systemd_cgroup=True)

    def runtime_ready() -> bool:
        import grpc
        try:
            return any(c.type == "RuntimeReady" and c.status for c in client.status().status.conditions)
        except grpc.RpcError:
            return False
    wait_for(runtime_ready, timeout=240, interval=2, what="containerd's CRI plugin ready")
    assert client.version().runtime_version.startswith("1.7"), client.version()
    _import_images()
    assert client.image_present(BUSYBOX) and client.image_present(PAUSE)
    try:
        yield client
    finally:
        client.close()
        sh(f"journalctl -b --no-pager -u containerd > {OUT}/journal-containerd.txt", check=False)


# --- reamer's NRI plugin -------------------------------------------------------------------------

class NriPlugin:
    """`reamer nri` started the way an operator starts it beside the runtime, its output kept in the report."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.log = OUT / "nri-plugin.log"

    def start(self) -> None:
        self.starts += 1
        with self.log.open("a") as log:
            log.write(f"--- start {self.starts} ---\n")
            log.flush()
            self.proc = subprocess.Popen(
                [str(REPO / ".venv/bin/reamer"), "--socket", SOCKET, "nri", "run", "--nri-socket", NRI_SOCKET,
                 "--index", "90", "--name", "reamer"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        marker = f"--- start {self.starts} ---"

        def registered() -> bool:
            assert self.proc.poll() is None, f"reamer nri exited with {self.proc.returncode}: {self._tail()}"
            text = self.log.read_text()
            return "registered NRI plugin 90-reamer" in text[text.rindex(marker):]
        wait_for(registered, timeout=240, interval=1, what="reamer nri registered with containerd")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)

    def _tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else "(no log)"


@pytest.fixture(scope="module")
def agent(request):
    """The agent as the systemd service (conftest's `service`), with a longer start timeout: on a loaded 2-core
    CI machine the emulated guest's Python needs more than systemd's default 90 s to reach READY=1."""
    dropin = Path("/etc/systemd/system/reamer.service.d/lab-start-timeout.conf")
    dropin.parent.mkdir(parents=True, exist_ok=True)
    dropin.write_text("[Service]\nTimeoutStartSec=600\n")
    return request.getfixturevalue("service")


@pytest.fixture(scope="module")
def plugin(cri, agent):
    probe = subprocess.run([str(REPO / ".venv/bin/reamer"), "nri", "run", "--help"], capture_output=True,
                           text=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"this checkout's reamer has no `nri` command ({probe.stderr.strip()[-200:]})")
    nri = NriPlugin()
    nri.start()
    try:
        yield nri
    finally:
        nri.kill()


# --- what the tests look at -----------------------------------------------------------------------

def spec_cpus(cri, container_id: str) -> str:
    """The cpuset in the container's OCI spec as the runtime holds it (what runc applies at start)."""
    info = json.loads(cri.container_status(container_id).info.get("info", "{}"))
    return info.get("runtimeSpec", {}).get("linux", {}).get("resources", {}).get("cpu", {}).get("cpus", "")


def cpuset(text: str) -> frozenset[int]:
    from reamer.host.cpulist import parse_cpulist
    return frozenset(parse_cpulist(text)) if text.strip() else frozenset()


def cgroup_dir(pid: int) -> Path:
    line = next(l for l in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if l.startswith("0::"))
    return Path("/sys/fs/cgroup") / line[3:].lstrip("/")


def cgroup_cpus(pid: int) -> str:
    """The container cgroup's own cpuset.cpus ("" when empty, or when no unit on the path asked for cpuset)."""
    try:
        return (cgroup_dir(pid) / "cpuset.cpus").read_text().strip()
    except FileNotFoundError:
        return ""


def threads(pid: int) -> list[tuple[int, int, frozenset[int]]]:
    """(tid, policy, affinity) of every thread of the container's processes (it runs a shell and two sleeps)."""
    import psutil
    out = []
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return out
    for proc in procs:
        try:
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                out.append((int(tid), os.sched_getscheduler(int(tid)), frozenset(os.sched_getaffinity(int(tid)))))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def node() -> dict:
    return api_get("/v1/node")


def training_cpus() -> frozenset[int]:
    return frozenset(node()["training_cpus"])


def run_training_pod(cri, name: str):
    pod = cri.run_pod(name, annotations=TRAINING)
    # What the kubelet does for podPidsLimit: a pids limit on the pod's own cgroup (here its systemd slice).
    sh(["systemctl", "set-property", "--runtime", pod.config.linux.cgroup_parent, f"TasksMax={POD_TASKS_MAX}"])
    cid = cri.create(pod, "train", BUSYBOX, COMMAND, memory_limit=MEMORY_LIMIT)
    return pod, cid


def assert_placed_and_rr(cri, cid: str, cpus: frozenset[int]) -> int:
    pid = wait_for(lambda: cri.container_pid(cid), timeout=120, what="the training container's pid")
    wait_for(lambda: len(threads(pid)) >= 3, timeout=120, what="the container's shell and two sleeps")
    assert cpuset(cgroup_cpus(pid)) == cpus

    def rr_on_cores() -> bool:
        for tid, policy, affinity in threads(pid):
            assert policy == os.SCHED_RR, f"thread {tid} policy {policy}"
            assert affinity <= cpus, f"thread {tid} on {sorted(affinity)}, not within {sorted(cpus)}"
        return True
    wait_for(rr_on_cores, timeout=180, interval=1, what=f"every container thread SCHED_RR on {sorted(cpus)}")
    job = k8s_job(cid)
    assert job and job["state"] == "running" and frozenset(job["cpus"]) == cpus, job
    return pid


def assert_placed(cri, cid: str, cpus: frozenset[int]) -> int:
    """Started on the cores of its spec (runc applied the cpuset before the first process ran)."""
    pid = wait_for(lambda: cri.container_pid(cid), timeout=120, what="the training container's pid")
    wait_for(lambda: len(threads(pid)) >= 3, timeout=120, what="the container's shell and two sleeps")
    assert cpuset(cgroup_cpus(pid)) == cpus
    for tid, _policy, affinity in threads(pid):
        assert affinity <= cpus, f"thread {tid} on {sorted(affinity)}, not within {sorted(cpus)}"
    return pid


def assert_limits_kept(pid: int) -> None:
    scope = cgroup_dir(pid)
    assert (scope / "memory.max").read_text().strip() == str(MEMORY_LIMIT), "the container's memory limit changed"
    pod_slice = scope.parent
    assert (pod_slice / "pids.max").read_text().strip() == str(POD_TASKS_MAX), "the pod's pids limit changed"


def assert_given_back(cpus: frozenset[int], cid: str) -> None:
    def free() -> bool:
        job = k8s_job(cid)
        assert job is None or job["state"] == "ended", f"the container's job is still {job}"
        held = training_cpus()
        assert not held & cpus, f"cpus {sorted(held & cpus)} still held for training: {node()['allocations']}"
        return True
    wait_for(free, timeout=180, interval=1, what=f"cpus {sorted(cpus)} given back")


def k8s_job(cid: str) -> dict | None:
    """The agent's training job for a container (the plugin names it k8s-<first 12 of the container id>)."""
    return api_get(f"/v1/training-jobs/k8s-{cid[:12]}", quiet=True)


def created_with_cores(cri, cid: str) -> frozenset[int]:
    cpus = cpuset(spec_cpus(cri, cid))
    assert cpus, "no cpuset in the container's spec after CreateContainer: the plugin placed nothing"
    assert len(cpus) == PROFILE.threads, f"{sorted(cpus)} is not one whole physical core"
    job = k8s_job(cid)
    assert job and job["source"] == "k8s" and frozenset(job["cpus"]) == cpus, (sorted(cpus), job)
    assert cpus <= training_cpus(), f"spec cpus {sorted(cpus)} are not the agent's training cpus {node()}"
    return cpus


# --- the tests -------------------------------------------------------------------------------------

def test_the_runtime_runs_a_host_network_pod_from_local_images_with_nri_listening(cri):
    assert Path(NRI_SOCKET).is_socket(), f"containerd did not open {NRI_SOCKET}: NRI is not enabled"
    pod = cri.run_pod("smoke")
    try:
        cid = cri.create(pod, "app", BUSYBOX, COMMAND, memory_limit=MEMORY_LIMIT)
        cri.start(cid)
        pid = wait_for(lambda: cri.container_pid(cid), timeout=120, what="the container's pid")
        scope = cgroup_dir(pid)
        # the systemd cgroup driver: the container is a scope in the pod's slice below kubepods.slice
        assert scope.name == f"cri-containerd-{cid}.scope" and scope.parent.name == pod.config.linux.cgroup_parent
        assert (scope / "memory.max").read_text().strip() == str(MEMORY_LIMIT)
        from tests.hosts.cri.api_pb2 import ContainerState
        assert cri.container_status(cid).status.state == ContainerState.CONTAINER_RUNNING
    finally:
        cri.remove_pod(pod)


def test_a_pod_without_the_annotation_is_left_as_the_runtime_made_it(cri, plugin):
    online = frozenset(node()["cpus"])
    pod = cri.run_pod("plain")
    try:
        cid = cri.create(pod, "app", BUSYBOX, COMMAND, memory_limit=MEMORY_LIMIT)
        assert spec_cpus(cri, cid) == "", "the plugin set a cpuset on a pod that asked for nothing"
        before = training_cpus()
        cri.start(cid)
        pid = wait_for(lambda: cri.container_pid(cid), timeout=120, what="the plain container's pid")
        wait_for(lambda: len(threads(pid)) >= 3, timeout=120, what="the container's shell and two sleeps")
        assert cgroup_cpus(pid) == "", "the plain container's cgroup has a cpuset"
        for tid, policy, affinity in threads(pid):
            assert policy == os.SCHED_OTHER and affinity == online, (tid, policy, sorted(affinity))
        assert training_cpus() == before and not any(pid in j.get("pids", []) for j in
                                                     api_get("/v1/training-jobs")["jobs"])
        assert (cgroup_dir(pid) / "memory.max").read_text().strip() == str(MEMORY_LIMIT)
    finally:
        cri.remove_pod(pod)


def test_a_training_pod_gets_its_cores_at_create_runs_rr_there_and_gives_them_back(cri, plugin):
    pod, cid = run_training_pod(cri, "train-a")
    removed = False
    try:
        cpus = created_with_cores(cri, cid)
        cri.start(cid)
        pid = assert_placed_and_rr(cri, cid, cpus)
        assert_limits_kept(pid)
        cri.remove_pod(pod)
        removed = True
        assert_given_back(cpus, cid)
    finally:
        if not removed:
            cri.remove_pod(pod)
    # The one core a training pod can have here (core 0 is reserved) goes to the next training pod.
    pod, cid = run_training_pod(cri, "train-b")
    try:
        assert created_with_cores(cri, cid) == cpus
    finally:
        cri.remove_pod(pod)
    assert_given_back(cpus, cid)


@pytest.mark.parametrize("kill_at", ["between-create-and-start", "after-start"])
def test_killing_the_plugin_loses_nothing(cri, plugin, kill_at):
    pod, cid = run_training_pod(cri, f"train-kill-{kill_at.split('-')[0]}")
    removed = False
    try:
        cpus = created_with_cores(cri, cid)
        if kill_at == "between-create-and-start":
            plugin.kill()
            cri.start(cid)  # the runtime goes on without the plugin
            pid = assert_placed(cri, cid, cpus)
            plugin.start()
        else:
            cri.start(cid)
            pid = assert_placed_and_rr(cri, cid, cpus)
            plugin.kill()
            assert_placed_and_rr(cri, cid, cpus)
            plugin.start()
        # Synchronize adopted it: same cores, still real-time, limits untouched.
        assert_placed_and_rr(cri, cid, cpus)
        assert cpus <= training_cpus()
        assert_limits_kept(pid)
        cri.remove_pod(pod)
        removed = True
        assert_given_back(cpus, cid)
    finally:
        if not removed:
            cri.remove_pod(pod)
