"""`--instance NAME` alone separates a second agent: its own socket, state directory (profile cache), run
directory and cgroup, and `reamer --instance NAME ...` talks to it. Two real agents, side by side."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from reamer.agent.config import instance_defaults, load_config
from reamer.cli.main import cli
from reamer.serve import models
from tests.agent.conftest import REPO, cleanup_cgroups, kill_jobs_under, needs_rt_host
from tests.conftest import wait_for


def test_one_name_derives_everything_an_agent_owns_and_explicit_keys_still_win():
    a, b = load_config(None, {"instance": "a"}), load_config(None, {"instance": "b"})
    for key in ("socket", "state_dir", "run_dir", "cgroup_name"):
        assert getattr(a, key) != getattr(b, key) != getattr(load_config(None), key)
    assert (b.socket, b.state_dir, b.run_dir, b.cgroup_name) == (
        "/run/reamer-b/reamer.sock", "/var/lib/reamer-b", "/run/reamer-b", "reamer-b")
    assert load_config(None, {"instance": "b", "state_dir": "/srv/b"}).state_dir == "/srv/b"
    assert load_config(None).instance is None


def test_the_cli_talks_to_the_instances_socket(tmp_path):
    result = CliRunner().invoke(cli, ["--instance", "b", "status"])
    assert result.exit_code == 1 and "/run/reamer-b/reamer.sock" in result.output
    env = CliRunner().invoke(cli, ["status"], env={"REAMER_INSTANCE": "c"})
    assert "/run/reamer-c/reamer.sock" in env.output
    # --socket still wins
    given = CliRunner().invoke(cli, ["--instance", "b", "--socket", str(tmp_path / "s.sock"), "status"])
    assert str(tmp_path / "s.sock") in given.output
    bad = CliRunner().invoke(cli, ["--instance", "../etc", "status"])
    assert bad.exit_code == 2 and "not an agent instance name" in bad.output


@needs_rt_host
@pytest.mark.root
def test_two_agents_with_one_flag_each_run_side_by_side(tmp_path):
    names = [f"t{os.getpid()}{secrets.token_hex(2)}{i}" for i in "ab"]
    procs: list[subprocess.Popen] = []
    paths = [instance_defaults(n) for n in names]
    try:
        for name in names:
            log = open(tmp_path / f"{name}.log", "wb")
            procs.append(subprocess.Popen([sys.executable, "-m", "reamer.cli.main", "--instance", name, "daemon",
                                           "--reserved-cpus", ""], stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
            log.close()

        def answers(name: str):
            result = CliRunner().invoke(cli, ["--instance", name, "-o", "json", "status"])
            return json.loads(result.stdout) if result.exit_code == 0 else None

        status = {}
        for name, proc in zip(names, procs):
            status[name] = wait_for(lambda: proc.poll() is None and answers(name), timeout=90,
                                    what=f"agent {name}: {(tmp_path / f'{name}.log').read_text(errors='replace')}")
        # each CLI call reached its own agent
        assert [status[n]["node"]["agent_pid"] for n in names] == [p.pid for p in procs]
        assert [status[n]["node"]["profile_dir"] for n in names] == [f"{p['state_dir']}/profiles" for p in paths]
        for p in paths:
            assert Path(p["socket"]).is_socket() and (Path(p["state_dir"]) / "state.db").is_file()

        # a job on each: its run directory and cgroup are its agent's
        model = models.build_model("tiny", tmp_path / "tiny.onnx").path
        for name in names:
            deploy = CliRunner().invoke(cli, ["--instance", name, "-o", "json", "infer", "deploy", "web", "--model",
                                              model, "--online", "--slo-ms", "500", "--layout", "1x1:b1",
                                              "--bind", "127.0.0.1"])
            assert deploy.exit_code == 0, deploy.output
        for name, p in zip(names, paths):
            job = json.loads(CliRunner().invoke(cli, ["--instance", name, "-o", "json", "infer", "show", "web"]).stdout)
            cmdline = " ".join(Path(f"/proc/{job['pid']}/cmdline").read_text().split("\0"))
            assert p["run_dir"] in cmdline, cmdline
            cgroups = Path(f"/proc/{job['pid']}/cgroup").read_text()
            assert f"/{p['cgroup_name']}/" in cgroups, cgroups
        for name in names:
            assert CliRunner().invoke(cli, ["--instance", name, "infer", "remove", "web"]).exit_code == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for p in paths:
            kill_jobs_under(Path(p["run_dir"]))
            cleanup_cgroups(p["cgroup_name"])
            shutil.rmtree(p["run_dir"], ignore_errors=True)
            shutil.rmtree(p["state_dir"], ignore_errors=True)
