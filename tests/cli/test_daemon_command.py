"""`reamer daemon`: flags override the config file; a real agent answers `reamer status` on its socket."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from reamer.cli.demo_cmd import remove_cgroups
from reamer.cli.main import cli
from tests.conftest import needs_root, unique_name, wait_for


def test_daemon_passes_flags_as_overrides(monkeypatch, tmp_path):
    import reamer.node as daemon

    seen = {}

    def fake_run_daemon(config, overrides):
        seen.update(config=config, overrides=overrides)
        return 0

    monkeypatch.setattr(daemon, "run_daemon", fake_run_daemon)
    result = CliRunner().invoke(cli, ["daemon", "--config", "c.yaml", "--socket", "/tmp/s.sock",
                                      "--state-dir", str(tmp_path), "--reserved-cpus", "0-1,3"])
    assert result.exit_code == 0, result.output
    assert seen == {"config": "c.yaml",
                    "overrides": {"socket": "/tmp/s.sock", "state_dir": str(tmp_path), "reserved_cpus": [0, 1, 3]}}
    # the global --socket counts when the daemon's own is not given; an empty list means "none reserved"
    result = CliRunner().invoke(cli, ["--socket", "/tmp/g.sock", "daemon", "--reserved-cpus", ""])
    assert result.exit_code == 0, result.output
    assert seen["overrides"] == {"socket": "/tmp/g.sock", "reserved_cpus": []}


def test_daemon_bad_flags_and_config_are_exit_2(tmp_path):
    result = CliRunner().invoke(cli, ["daemon", "--reserved-cpus", "zero"])
    assert result.exit_code == 2 and "error: bad CPU list 'zero'" in result.output and "fix: " in result.output
    result = CliRunner().invoke(cli, ["daemon", "--config", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2
    assert "does not exist" in result.output and "fix: " in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("reserved_cpus: [0]\nreconcile_intervall_s: 2\n")
    result = CliRunner().invoke(cli, ["daemon", "--config", str(bad)])
    assert result.exit_code == 2
    assert "unknown config key 'reconcile_intervall_s'" in result.output


def test_demote_all_falls_back_to_local_when_the_agent_is_down(tmp_path):
    config = tmp_path / "reamer.yaml"
    config.write_text(f"cgroup_name: {unique_name()}\n")
    result = CliRunner().invoke(cli, ["--socket", str(tmp_path / "none.sock"), "-o", "json", "demote-all",
                                      "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert "agent unreachable: demoting locally" in result.output
    data = json.loads(result.stdout)
    assert data["via"] == "local" and data["threads_demoted"] == 0


@needs_root
@pytest.mark.root
def test_real_daemon_serves_status_with_flag_overrides(tmp_path):
    name = unique_name()
    config = tmp_path / "reamer.yaml"
    config.write_text(f"cgroup_name: {name}\nrun_dir: {tmp_path / 'run'}\nreserved_cpus: [0]\ngpu: {{enabled: false}}\n"
                      "training: {rt_runtime_us: 50000}\n")
    socket_path = tmp_path / "agent.sock"
    with open(tmp_path / "agent.log", "wb") as log:
        agent = subprocess.Popen([sys.executable, "-m", "reamer.cli.main", "daemon", "--config", str(config),
                                  "--socket", str(socket_path), "--state-dir", str(tmp_path / "state"),
                                  "--reserved-cpus", ""], stdout=log, stderr=subprocess.STDOUT)
    try:
        runner = CliRunner()

        def status():
            if agent.poll() is not None:
                pytest.fail(f"the agent exited with {agent.returncode}: {(tmp_path / 'agent.log').read_text()}")
            result = runner.invoke(cli, ["--socket", str(socket_path), "-o", "json", "status"])
            return result if result.exit_code == 0 else None

        result = wait_for(status, timeout=180, interval=0.3, what="the agent to answer on its socket")
        data = json.loads(result.stdout)
        assert data["node"]["reserved_cpus"] == []  # the flag won over the file's [0]
        assert data["node"]["agent_pid"] == agent.pid
        assert (tmp_path / "state").is_dir()
        table = runner.invoke(cli, ["--socket", str(socket_path), "status"])
        assert table.exit_code == 0 and f"pid {agent.pid}" in table.output
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        remove_cgroups(name)
    assert agent.returncode == 0, (tmp_path / "agent.log").read_text()
