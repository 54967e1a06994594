"""MpsDaemon against the fake control binary (a real process speaking the text protocol)."""
from __future__ import annotations

import os
import subprocess

import pytest

from reamer.gpu.errors import MpsError, NoGpuDriver
from reamer.gpu.mps import MpsDaemon, format_mem_limit, pinned_mem_env
from tests.conftest import wait_for
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
    first = fake_mps.connect_client(run_dir / "p", 1001, process=False)
    assert first["active_thread_percentage"] == 60.0 and first["pinned_mem_limit"] == {"0": "2048M"}
    [server] = daemon.servers()
    assert server.status == "ACTIVE" and server.clients == (1001,)
    daemon.set_active_thread_percentage(server.pid, 30)
    daemon.set_device_pinned_mem_limit(server.pid, 0, 1024)
    second = fake_mps.connect_client(run_dir / "p", 1002, env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"},
                                     process=False)
    # The server limit (30) wins over a larger client request; the first client keeps what it had.
    assert second["active_thread_percentage"] == 30.0 and second["pinned_mem_limit"] == {"0": "1024M"}
    st = fake_mps.read_state(run_dir / "p")
    assert st["servers"][str(server.pid)]["clients"]["1001"]["active_thread_percentage"] == 60.0
    assert sorted(daemon.client_pids(server.pid)) == [1001, 1002]
    daemon.terminate_client(server.pid, 1001)
    # As on the H100: "0", and the client stays listed until its process exits.
    assert daemon.client_pids(server.pid) == [1001, 1002]
    assert fake_mps.read_state(run_dir / "p")["terminated_clients"] == [[server.pid, 1001]]
    fake_mps.disconnect_client(run_dir / "p", 1001)
    assert daemon.client_pids(server.pid) == [1002]
    with pytest.raises(MpsError, match="terminate_client"):
        daemon.terminate_client(server.pid, 1001)  # no longer a client


def test_fault_shows_in_server_status_until_its_clients_exit(daemon, run_dir):
    daemon.start()
    c = fake_mps.connect_client(run_dir / "p", 2001, process=False)
    fake_mps.fault(run_dir / "p", c["server_pid"])
    assert daemon.server_status(c["server_pid"]) == "FAULT"
    assert fake_mps.connect_client(run_dir / "p", 2002, process=False)["error"] == 807
    fake_mps.disconnect_client(run_dir / "p", 2001)
    assert daemon.servers()[0].status == "ACTIVE"  # the same server, as on the H100
    assert "error" not in fake_mps.connect_client(run_dir / "p", 2003, process=False)


def test_refusals_exit_0_on_stdout_and_still_raise(daemon, run_dir, fake_control):
    """The real binary exits 0 when it refuses a command and prints the reason on stdout."""
    daemon.start()
    env = {**os.environ, **daemon.env()}
    for line, reply in [("get_server_status 999999", "Server 999999 not found"),
                        ("foo", 'Unknown command "foo"'),
                        ("set_default_active_thread_percentage 0", "100.0")]:
        done = subprocess.run([fake_control], input=line + "\n", capture_output=True, text=True, env=env, timeout=30)
        assert (done.returncode, done.stdout.strip(), done.stderr) == (0, reply, "")
        assert fake_mps.REAL_REPLIES[line] == reply
    with pytest.raises(MpsError, match="Server 999999 not found"):
        daemon.server_status(999999)
    with pytest.raises(MpsError, match="Server 999999 not found"):
        daemon.client_pids(999999)  # not [999999], parsed from the refusal
    with pytest.raises(MpsError, match="Unknown command"):
        daemon.command("foo")
    with pytest.raises(MpsError, match="not applied"):
        daemon.set_default_active_thread_percentage(0)  # ignored by the daemon, which keeps 100
    with pytest.raises(MpsError, match="not found"):
        daemon.set_active_thread_percentage(999999, 50)
    assert daemon.get_default_active_thread_percentage() == 100.0
    again = subprocess.run([fake_control, "-d"], capture_output=True, text=True, env=env, timeout=30)
    assert (again.returncode, again.stdout.strip()) == (1, "An instance of this daemon is already running")
    spid = fake_mps.connect_client(run_dir / "p", 4001, process=False)["server_pid"]
    with pytest.raises(MpsError, match="201"):
        daemon.terminate_client(spid, os.getpid())  # a running process that is not its client
    with pytest.raises(MpsError, match="Invalid process 4000000"):
        daemon.terminate_client(spid, 4000000)
    nodir = {**env, "CUDA_MPS_PIPE_DIRECTORY": str(run_dir / "missing")}
    done = subprocess.run([fake_control, "-d"], capture_output=True, text=True, env=nodir, timeout=30)
    assert (done.returncode, done.stdout.strip()) == (1, f"Cannot access CUDA_MPS_PIPE_DIRECTORY={run_dir / 'missing'}")


def test_stop_refuses_while_clients_are_connected(daemon, run_dir):
    """`quit` with clients connected blocks, and the daemon answers nothing meanwhile (seen on the H100)."""
    daemon.start()
    fake_mps.connect_client(run_dir / "p", 3001, process=False)
    with pytest.raises(MpsError, match="still has clients 3001") as exc:
        daemon.stop()
    assert "stop those processes" in exc.value.fix
    assert daemon.healthy()  # no quit was sent
    impatient = MpsDaemon(UUID, run_dir / "p", run_dir / "l", control_path=daemon.control_path, timeout_s=1)
    with pytest.raises(MpsError, match="did not answer"):
        impatient.command("quit")
    with pytest.raises(MpsError, match="did not answer"):
        impatient.command("get_server_list")  # the quit holds the daemon
    fake_mps.disconnect_client(run_dir / "p", 3001)
    wait_for(lambda: not daemon.is_running(), timeout=20, what="the daemon to quit once its client left")


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
