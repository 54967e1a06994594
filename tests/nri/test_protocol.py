"""ttRPC framing, NRI's connection multiplexing and the plugin stub, byte for byte against the specification
(containerd/ttrpc channel.go, containerd/nri pkg/net/multiplex/mux.go), with no runtime. The same code is
tested against a real containerd in test_containerd_nri.py."""
from __future__ import annotations

import socket
import threading

import pytest

from reamer.nri import mux, ttrpc
from reamer.nri.proto import api_pb2 as api
from reamer.nri.proto import ttrpc_pb2
from reamer.nri.stub import NriConnectError, Stub, check_index, event_mask
from tests.conftest import wait_for


def test_ttrpc_header_is_length_stream_type_flags_big_endian():
    frame = ttrpc.encode(ttrpc.Frame(stream_id=3, type=ttrpc.TYPE_RESPONSE, flags=0x4, payload=b"abc"))
    assert frame == b"\x00\x00\x00\x03" + b"\x00\x00\x00\x03" + b"\x02" + b"\x04" + b"abc"


def test_ttrpc_refuses_messages_over_4_mib():
    with pytest.raises(ttrpc.TtrpcError) as refused:
        ttrpc.encode(ttrpc.Frame(1, ttrpc.TYPE_REQUEST, 0, b"x" * ((4 << 20) + 1)))
    assert refused.value.code == ttrpc.RESOURCE_EXHAUSTED


def test_mux_header_is_conn_id_and_length_big_endian_and_id_0_is_reserved():
    assert mux.encode_frame(2, b"hello") == b"\x00\x00\x00\x02\x00\x00\x00\x05hello"
    with pytest.raises(ValueError):
        mux.encode_frame(0, b"")


def test_event_mask_sets_bit_event_minus_one():
    # pkg/api/event.go: mask |= 1 << (e - 1); CREATE_CONTAINER = 4, REMOVE_CONTAINER = 11
    assert event_mask(api.CREATE_CONTAINER) == 0b1000
    assert event_mask(api.CREATE_CONTAINER, api.REMOVE_CONTAINER) == (1 << 3) | (1 << 10)


def test_index_must_be_two_digits():
    assert check_index("07") == "07"
    for bad in ("7", "100", "ab"):
        with pytest.raises(NriConnectError):
            check_index(bad)


class FakeRuntime:
    """The runtime's end of one plugin connection, written from the spec with the raw primitives: it
    accepts RegisterPlugin on connection 2 and calls the plugin on connection 1."""

    def __init__(self, sock: socket.socket) -> None:
        self.trunk = mux.Mux(sock)
        self.plugin_conn = self.trunk.open(mux.PLUGIN_SERVICE_CONN)
        self.runtime_conn = self.trunk.open(mux.RUNTIME_SERVICE_CONN)
        self.registered: list[api.RegisterPluginRequest] = []
        self.trunk.start()
        threading.Thread(target=self._serve_runtime, daemon=True).start()
        self.client = ttrpc.Client(self.plugin_conn)
        threading.Thread(target=self.client.run, daemon=True).start()

    def _serve_runtime(self) -> None:
        def register(data: bytes) -> api.Empty:
            self.registered.append(api.RegisterPluginRequest.FromString(data))
            return api.Empty()

        try:
            ttrpc.Server(self.runtime_conn, {("nri.pkg.api.v1alpha1.Runtime", "RegisterPlugin"): register}).serve()
        except Exception:  # noqa: BLE001 - closed at the end of the test
            pass


class Recorder:
    events = event_mask(api.CREATE_CONTAINER)

    def __init__(self) -> None:
        self.created: list[str] = []

    def configure(self, req):
        pass

    def synchronize(self, req):
        return api.SynchronizeResponse()

    def create_container(self, req):
        self.created.append(req.container.id)
        if req.container.id == "boom":
            raise ttrpc.TtrpcError(ttrpc.INVALID_ARGUMENT, "no cores — fix: fewer")
        adjust = api.ContainerAdjustment(linux=api.LinuxContainerAdjustment(
            resources=api.LinuxResources(cpu=api.LinuxCPU(cpus="3"))))
        return api.CreateContainerResponse(adjust=adjust)

    def update_container(self, req):
        return api.UpdateContainerResponse()

    def stop_container(self, req):
        return api.StopContainerResponse()

    def state_change(self, req):
        pass

    def shutdown(self):
        pass


@pytest.fixture
def connected(tmp_path):
    path = str(tmp_path / "nri.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    accepted: list[FakeRuntime] = []
    threading.Thread(target=lambda: accepted.append(FakeRuntime(listener.accept()[0])), daemon=True).start()
    plugin = Recorder()
    stub = Stub(plugin, "reamer", "42", path)
    stub.connect()
    # the runtime end answers the registration from inside its constructor: the list fills just after
    wait_for(lambda: accepted, timeout=10, what="the fake runtime to be accepted")
    yield stub, plugin, accepted[0]
    stub.close()
    accepted[0].trunk.close()
    listener.close()


def test_stub_registers_with_name_and_index_then_serves_configure_and_events(connected):
    stub, plugin, runtime = connected
    assert [(r.plugin_name, r.plugin_idx) for r in runtime.registered] == [("reamer", "42")]
    configured = runtime.client.call("nri.pkg.api.v1alpha1.Plugin", "Configure",
                                     api.ConfigureRequest(runtime_name="fake"), api.ConfigureResponse)
    assert configured.events == plugin.events and stub.configured.is_set()
    reply = runtime.client.call("nri.pkg.api.v1alpha1.Plugin", "CreateContainer",
                                api.CreateContainerRequest(container=api.Container(id="c1")),
                                api.CreateContainerResponse)
    assert reply.adjust.linux.resources.cpu.cpus == "3" and plugin.created == ["c1"]


def test_a_refusal_reaches_the_runtime_as_a_status_and_the_plugin_keeps_serving(connected):
    stub, plugin, runtime = connected
    with pytest.raises(ttrpc.TtrpcError) as refused:
        runtime.client.call("nri.pkg.api.v1alpha1.Plugin", "CreateContainer",
                            api.CreateContainerRequest(container=api.Container(id="boom")),
                            api.CreateContainerResponse)
    assert refused.value.code == ttrpc.INVALID_ARGUMENT and "fix: fewer" in refused.value.message
    with pytest.raises(ttrpc.TtrpcError) as unknown:
        runtime.client.call("nri.pkg.api.v1alpha1.Plugin", "NoSuchMethod", api.Empty(), api.Empty)
    assert unknown.value.code == ttrpc.UNIMPLEMENTED
    reply = runtime.client.call("nri.pkg.api.v1alpha1.Plugin", "CreateContainer",
                                api.CreateContainerRequest(container=api.Container(id="c2")),
                                api.CreateContainerResponse)
    assert reply.adjust.linux.resources.cpu.cpus == "3"


def test_frames_split_across_reads_and_interleaved_connections_are_reassembled():
    left, right = socket.socketpair()
    trunk = mux.Mux(left)
    one, two = trunk.open(1), trunk.open(2)
    trunk.start()
    request = ttrpc.encode(ttrpc.Frame(1, ttrpc.TYPE_REQUEST, 0, ttrpc_pb2.Request(service="s", method="m").SerializeToString()))
    wire = mux.encode_frame(1, request[:5]) + mux.encode_frame(2, b"zz") + mux.encode_frame(1, request[5:])
    for i in range(0, len(wire), 3):  # three bytes at a time
        right.sendall(wire[i:i + 3])
    frame = ttrpc.read_frame(one)
    assert ttrpc_pb2.Request.FromString(frame.payload).method == "m" and frame.stream_id == 1
    assert two.recv_exact(2) == b"zz"
    right.close()
    wait_for(lambda: trunk.closed, timeout=10, what="the mux to see the trunk close")
    with pytest.raises(mux.MuxClosed):
        one.recv_exact(1)


def test_connect_to_a_missing_socket_says_how_to_enable_nri(tmp_path):
    with pytest.raises(NriConnectError) as failed:
        Stub(Recorder(), "reamer", "90", str(tmp_path / "none.sock")).connect()
    assert "io.containerd.nri.v1.nri" in failed.value.fix
