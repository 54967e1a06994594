"""The plugin side of NRI (what containerd/nri pkg/stub does in Go): connect, register, serve the runtime.

Order on the wire: the plugin connects to the runtime's NRI socket, multiplexes it, serves ttRPC service
`nri.pkg.api.v1alpha1.Plugin` on connection 1, calls `nri.pkg.api.v1alpha1.Runtime/RegisterPlugin` (its name
and two-digit index) on connection 2; the runtime then calls Configure (the plugin answers with the events it
wants), Synchronize (every pod and container that exists) and from then on the subscribed events.
"""
from __future__ import annotations

import logging
import socket
import threading
from typing import Callable, Protocol

from reamer.host.errors import ReamerError
from reamer.nri import ttrpc
from reamer.nri.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, Mux
from reamer.nri.proto import api_pb2 as api

log = logging.getLogger("reamer.nri")

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
DEFAULT_SOCKET = "/var/run/nri/nri.sock"


def event_mask(*events: int) -> int:
    """NRI's EventMask: bit (event - 1) for each api.Event."""
    mask = 0
    for event in events:
        mask |= 1 << (event - 1)
    return mask


class Plugin(Protocol):
    """What the stub calls. Every method runs on a worker thread and must answer within the runtime's
    plugin_request_timeout (containerd: 2 s by default)."""

    events: int  # event_mask(...) of what it handles

    def configure(self, req: api.ConfigureRequest) -> None: ...
    def synchronize(self, req: api.SynchronizeRequest) -> api.SynchronizeResponse: ...
    def create_container(self, req: api.CreateContainerRequest) -> api.CreateContainerResponse: ...
    def update_container(self, req: api.UpdateContainerRequest) -> api.UpdateContainerResponse: ...
    def stop_container(self, req: api.StopContainerRequest) -> api.StopContainerResponse: ...
    def state_change(self, req: api.StateChangeEvent) -> None: ...
    def shutdown(self) -> None: ...


class NriConnectError(ReamerError):
    pass


def check_index(index: str) -> str:
    if len(index) != 2 or not index.isdigit():
        raise NriConnectError(f"NRI plugin index {index!r} is not two digits",
                              "give --index 00..99 (plugins are called in ascending index order)")
    return index


class Stub:
    """One connection to the runtime. `run()` returns when the runtime closes it (or `close()`)."""

    def __init__(self, plugin: Plugin, name: str, index: str, socket_path: str = DEFAULT_SOCKET,
                 on_registered: Callable[[], None] | None = None) -> None:
        self.plugin, self.name, self.index = plugin, name, check_index(index)
        self.socket_path = socket_path
        self.on_registered = on_registered
        self.mux: Mux | None = None
        self.runtime: ttrpc.Client | None = None
        self.configured = threading.Event()
        self.synchronized = threading.Event()

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.socket_path)
        except OSError as error:
            sock.close()
            raise NriConnectError(
                f"cannot connect to the runtime's NRI socket {self.socket_path} ({error})",
                "enable NRI in the runtime (containerd: [plugins.\"io.containerd.nri.v1.nri\"] disable = false, "
                "then restart it) or pass --socket with its socket_path") from None
        self.mux = Mux(sock)
        server = ttrpc.Server(self.mux.open(PLUGIN_SERVICE_CONN), self._handlers())
        self.runtime = ttrpc.Client(self.mux.open(RUNTIME_SERVICE_CONN))
        self.mux.start()
        threading.Thread(target=self._serve, args=(server,), name="nri-serve", daemon=True).start()
        threading.Thread(target=self.runtime.run, name="nri-runtime", daemon=True).start()
        try:
            self.runtime.call(RUNTIME_SERVICE, "RegisterPlugin",
                              api.RegisterPluginRequest(plugin_name=self.name, plugin_idx=self.index), api.Empty,
                              timeout=10.0)
        except (ttrpc.TtrpcError, ConnectionError, TimeoutError) as error:
            self.close()
            raise NriConnectError(f"the runtime refused to register NRI plugin {self.index}-{self.name}: {error}",
                                  "check the runtime's log; another plugin may hold this name and index") from None
        if self.on_registered is not None:
            self.on_registered()

    def run(self) -> None:
        assert self.mux is not None, "connect() first"
        self.mux.wait_closed()

    def close(self) -> None:
        if self.mux is not None:
            self.mux.close()

    def update_containers(self, updates: list[api.ContainerUpdate]) -> list[api.ContainerUpdate]:
        """Unsolicited updates (the runtime applies them now); returns the ones it failed to apply."""
        assert self.runtime is not None, "connect() first"
        reply = self.runtime.call(RUNTIME_SERVICE, "UpdateContainers", api.UpdateContainersRequest(update=updates),
                                  api.UpdateContainersResponse)
        return list(reply.failed)

    def _serve(self, server: ttrpc.Server) -> None:
        try:
            server.serve()
        except Exception as error:  # noqa: BLE001 - the connection is gone either way
            log.info("NRI connection closed: %s", error)
        finally:
            self.close()

    def _handlers(self) -> dict[tuple[str, str], ttrpc.Handler]:
        plugin = self.plugin

        def configure(data: bytes) -> api.ConfigureResponse:
            req = api.ConfigureRequest.FromString(data)
            log.info("configured by %s %s", req.runtime_name, req.runtime_version)
            plugin.configure(req)
            self.configured.set()
            return api.ConfigureResponse(events=plugin.events)

        def synchronize(data: bytes) -> api.SynchronizeResponse:
            reply = plugin.synchronize(api.SynchronizeRequest.FromString(data))
            self.synchronized.set()
            return reply

        def state_change(data: bytes) -> api.Empty:
            plugin.state_change(api.StateChangeEvent.FromString(data))
            return api.Empty()

        def shutdown(data: bytes) -> api.Empty:
            plugin.shutdown()
            return api.Empty()

        return {
            (PLUGIN_SERVICE, "Configure"): configure,
            (PLUGIN_SERVICE, "Synchronize"): synchronize,
            (PLUGIN_SERVICE, "Shutdown"): shutdown,
            (PLUGIN_SERVICE, "CreateContainer"):
                lambda data: plugin.create_container(api.CreateContainerRequest.FromString(data)),
            (PLUGIN_SERVICE, "UpdateContainer"):
                lambda data: plugin.update_container(api.UpdateContainerRequest.FromString(data)),
            (PLUGIN_SERVICE, "StopContainer"):
                lambda data: plugin.stop_container(api.StopContainerRequest.FromString(data)),
            (PLUGIN_SERVICE, "StateChange"): state_change,
        }
