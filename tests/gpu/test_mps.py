"""MpsDaemon against the fake control binary (a real process speaking the text protocol)."""
from __future__ import annotations

import os

import pytest

from reamer.gpu.errors import MpsError, NoGpuDriver
from reamer.gpu.mps import MpsDaemon, format_mem_limit, pinned_mem_env
from tests.gpu.fakes import fake_mps

UUID = "GPU-11111111-2222-3333-4444-555555555555"


@pytest.fixture
def daemon(run_dir, fake_control):
    d = MpsDaemon(UUID, run_dir / "p", run_dir / "l", control_path=fake_control, timeout_s=20)
    yield d


def test_start_health_stop(daemon, run_dir):
    assert not daemon.is_running()
    pid = daemon.start(default_active_thread_percentage=100)
    assert daemon.pid() == pid and daemon.is_running()
    assert daemon.check_health() == 100.0
    st = fake_mps.read_state(run_dir / "p")
    # The daemon sees exactly its GPU, by UUID.
    assert st["visible_devices"] == UUID
    assert st["log_dir"] == str(run_dir / "l")
    # Starting again adopts the running daemon instead of failing.
    assert daemon.start() == pid
    assert daemon.stop() is True
    assert not daemon.is_running()
    assert daemon.stop() is False
    assert not daemon.healthy()
    assert "Shutdown" in daemon.log_tail()[-1]


def test_commands_and_limits_apply_only_to_new_clients(daemon, run_dir):
    daemon.start()
    daemon.set_default_active_thread_percentage(60)
    daemon.set_default_device_pinned_mem_limit(0, 2048)
    assert daemon.get_default_active_thread_percentage() == 60.0
    first = fake_mps.connect_client(run_dir / "p", 1001)
    assert first["active_thread_percentage"] == 60.0 and first["pinned_mem_limit"] == {"0": "2048M"}
    [server] = daemon.servers()
    assert server.status == "ACTIVE" and server.clients == (1001,)
    daemon.set_active_thread_percentage(server.pid, 30)
    daemon.set_device_pinned_mem_limit(server.pid, 0, 1024)
    second = fake_mps.connect_client(run_dir / "p", 1002, env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"})
    # The server limit (30) wins over a larger client request; the first client keeps what it had.
    assert second["active_thread_percentage"] == 30.0 and second["pinned_mem_limit"] == {"0": "1024M"}
    st = fake_mps.read_state(run_dir / "p")
    assert st["servers"][str(server.pid)]["clients"]["1001"]["active_thread_percentage"] == 60.0
    assert sorted(daemon.client_pids(server.pid)) == [1001, 1002]
    daemon.terminate_client(server.pid, 1001)
    assert daemon.client_pids(server.pid) == [1002]
    assert fake_mps.read_state(run_dir / "p")["terminated_clients"] == [[server.pid, 1001]]


def test_fault_shows_in_server_status(daemon, run_dir):
    daemon.start()
    c = fake_mps.connect_client(run_dir / "p", 2001)
    fake_mps.fault(run_dir / "p", c["server_pid"])
    assert daemon.server_status(c["server_pid"]) == "FAULT"
    assert fake_mps.connect_client(run_dir / "p", 2002)["error"] == 807


def test_bad_command_and_absent_daemon_raise_with_fix(daemon):
    with pytest.raises(MpsError) as exc:
        daemon.command("get_server_list")
    assert "Cannot find MPS control daemon" in exc.value.message and exc.value.fix
    daemon.start()
    with pytest.raises(MpsError, match="terminate_client"):
        daemon.terminate_client(123, 456)


def test_missing_binary_names_the_fix(run_dir):
    d = MpsDaemon(UUID, run_dir / "p", run_dir / "l", control_path=str(run_dir / "nope"))
    with pytest.raises(NoGpuDriver) as exc:
        d.start()
    assert "nvidia-cuda-mps-control not found" in exc.value.message
    assert "mps_control_path" in exc.value.fix


def test_long_pipe_dir_is_refused(run_dir, fake_control):
    d = MpsDaemon(UUID, run_dir / ("x" * 90), run_dir / "l", control_path=fake_control)
    with pytest.raises(MpsError, match="Unix sockets"):
        d.start()


def test_env_and_formats(daemon):
    env = daemon.env()
    assert env["CUDA_VISIBLE_DEVICES"] == UUID
    assert os.path.isabs(env["CUDA_MPS_PIPE_DIRECTORY"])
    assert format_mem_limit(2048) == "2048M"
    assert pinned_mem_env({1: 512, 0: 2048}) == "0=2048M,1=512M"
