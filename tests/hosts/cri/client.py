"""A small CRI client in the kubelet's place: the calls the kubelet makes to start and stop a pod, against
the container runtime's CRI gRPC endpoint (runtime.v1, stubs generated from kubernetes/cri-api)."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import grpc

from tests.hosts.cri import api_pb2 as cri
from tests.hosts.cri.api_pb2_grpc import ImageServiceStub, RuntimeServiceStub

NODE = cri.NamespaceMode.NODE  # host network and PIDs of the pod's own: no CNI needed
CALL_TIMEOUT_S = 240.0  # the runtime waits for NRI plugins at create; under emulation everything is slow


@dataclass
class Pod:
    id: str
    config: cri.PodSandboxConfig
    containers: list[str] = field(default_factory=list)


class CriClient:
    def __init__(self, endpoint: str = "unix:///run/containerd/containerd.sock", *, systemd_cgroup: bool = True) -> None:
        self.systemd_cgroup = systemd_cgroup  # the runtime's cgroup driver, as the kubelet's must match it
        self.channel = grpc.insecure_channel(endpoint)
        self.runtime = RuntimeServiceStub(self.channel)
        self.images = ImageServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "CriClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def version(self) -> cri.VersionResponse:
        return self.runtime.Version(cri.VersionRequest(version="v1"), timeout=CALL_TIMEOUT_S)

    def status(self) -> cri.StatusResponse:
        return self.runtime.Status(cri.StatusRequest(verbose=False), timeout=CALL_TIMEOUT_S)

    def image_present(self, ref: str) -> bool:
        reply = self.images.ImageStatus(cri.ImageStatusRequest(image=cri.ImageSpec(image=ref)),
                                        timeout=CALL_TIMEOUT_S)
        return reply.HasField("image") and bool(reply.image.id)

    def run_pod(self, name: str, *, namespace: str = "default", annotations: dict[str, str] | None = None,
                labels: dict[str, str] | None = None) -> Pod:
        """RunPodSandbox as the kubelet does for a host-network pod. With the systemd cgroup driver the pod's
        cgroup parent is a slice of its own below kubepods.slice (kubelet's naming; '-' is systemd's level
        separator, so the uid's dashes become underscores); with cgroupfs, /kubepods/pod<uid>. A host-network
        pod shares the host's UTS namespace, so it sets no hostname (runc refuses one)."""
        uid = str(uuid.uuid4())
        parent = (f"kubepods-pod{uid.replace('-', '_')}.slice" if self.systemd_cgroup else f"/kubepods/pod{uid}")
        config = cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name=name, namespace=namespace, uid=uid, attempt=0),
            log_directory=f"/var/log/pods/{namespace}_{name}_{uid}",
            labels=labels or {}, annotations=annotations or {},
            linux=cri.LinuxPodSandboxConfig(
                cgroup_parent=parent,
                security_context=cri.LinuxSandboxSecurityContext(
                    namespace_options=cri.NamespaceOption(network=NODE, pid=cri.NamespaceMode.POD,
                                                          ipc=cri.NamespaceMode.POD))))
        reply = self.runtime.RunPodSandbox(cri.RunPodSandboxRequest(config=config), timeout=CALL_TIMEOUT_S)
        return Pod(reply.pod_sandbox_id, config)

    def create(self, pod: Pod, name: str, image: str, command: list[str], *,
               annotations: dict[str, str] | None = None, memory_limit: int = 0, cpu_shares: int = 0) -> str:
        config = cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name=name, attempt=0), image=cri.ImageSpec(image=image),
            command=command, log_path=f"{name}.log", annotations=annotations or {},
            labels={"io.kubernetes.container.name": name},
            linux=cri.LinuxContainerConfig(
                resources=cri.LinuxContainerResources(memory_limit_in_bytes=memory_limit, cpu_shares=cpu_shares),
                security_context=cri.LinuxContainerSecurityContext(
                    namespace_options=cri.NamespaceOption(network=NODE, pid=cri.NamespaceMode.POD,
                                                          ipc=cri.NamespaceMode.POD))))
        reply = self.runtime.CreateContainer(
            cri.CreateContainerRequest(pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config),
            timeout=CALL_TIMEOUT_S)
        pod.containers.append(reply.container_id)
        return reply.container_id

    def start(self, container_id: str) -> None:
        self.runtime.StartContainer(cri.StartContainerRequest(container_id=container_id), timeout=CALL_TIMEOUT_S)

    def stop(self, container_id: str, timeout_s: int = 10) -> None:
        self.runtime.StopContainer(cri.StopContainerRequest(container_id=container_id, timeout=timeout_s),
                                   timeout=CALL_TIMEOUT_S)

    def remove(self, container_id: str) -> None:
        self.runtime.RemoveContainer(cri.RemoveContainerRequest(container_id=container_id), timeout=CALL_TIMEOUT_S)

    def container_status(self, container_id: str) -> cri.ContainerStatus:
        reply = self.runtime.ContainerStatus(cri.ContainerStatusRequest(container_id=container_id, verbose=True),
                                             timeout=CALL_TIMEOUT_S)
        return reply

    def container_pid(self, container_id: str) -> int:
        """The container's first process on the host (from the runtime's verbose info, as crictl inspect shows)."""
        import json
        info = self.container_status(container_id).info.get("info", "{}")
        return int(json.loads(info).get("pid", 0))

    def remove_pod(self, pod: Pod) -> None:
        """What the kubelet does when a pod goes: stop and remove its containers, then the sandbox."""
        for cid in pod.containers:
            try:
                self.stop(cid, timeout_s=0)
                self.remove(cid)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
        self.runtime.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod.id), timeout=CALL_TIMEOUT_S)
        self.runtime.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod.id), timeout=CALL_TIMEOUT_S)
