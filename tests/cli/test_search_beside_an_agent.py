"""`reamer search`/`reamer profile` beside the agent they talk to: its profile cache, never its training cores,
and (no reserved cpu) the front door's cpu charged to layouts that leave it no core."""
from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from reamer.cli.common import CliContext
from reamer.cli.main import cli
from reamer.cli.search_cmd import AgentView, agent_view, choose_cpus, default_cache_dir
from reamer.serve.models import build_model
from tests.agent.conftest import needs_rt_host, started_daemon

FAST = ["--warmup-s", "0.1", "--window-s", "0.05", "--max-windows", "4", "--verify-windows", "2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_model("tiny", tmp_path_factory.mktemp("models") / "tiny.onnx").path


def test_the_cache_is_the_agents_then_the_instances_then_the_users(tmp_path, monkeypatch):
    monkeypatch.delenv("REAMER_PROFILE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    mine = tmp_path / "agent-state" / "profiles"
    assert default_cache_dir(AgentView(profile_dir=str(mine), answered=True)) == str(mine)
    # an agent's cache this process may not write: the user's own (not the agent's, not /var/lib/reamer)
    if os.geteuid() != 0:
        assert default_cache_dir(AgentView(profile_dir="/proc/1/profiles", answered=True)).startswith(
            str(tmp_path / "xdg"))
    monkeypatch.setenv("REAMER_PROFILE_DIR", str(tmp_path / "env"))
    assert default_cache_dir(AgentView(profile_dir=str(mine), answered=True)) == str(tmp_path / "env")


@pytest.mark.skipif(os.geteuid() != 0, reason="an instance's default cache is under /var/lib: root's to write")
def test_no_agent_answering_gives_the_instances_cache(monkeypatch):
    monkeypatch.delenv("REAMER_PROFILE_DIR", raising=False)
    assert default_cache_dir(AgentView(), "b") == "/var/lib/reamer-b/profiles"
    assert default_cache_dir(AgentView(), None) == "/var/lib/reamer/profiles"


def test_cores_the_agent_gave_away_are_never_measured_on():
    from reamer.host.topology import read_topology

    allowed = set(os.sched_getaffinity(0))
    cores = [c for c in read_topology().physical_cores() if set(c) <= allowed]
    if len(cores) < 2:
        pytest.skip("needs 2 physical cores")
    held = frozenset(cores[-1])  # the far end: where choose_cpus starts
    chosen = choose_cpus(None, None, held)
    assert chosen and held.isdisjoint(chosen)
    with pytest.raises(Exception) as info:
        choose_cpus(len(cores), None, held)
    assert "more are held by the agent's training or online jobs" in str(info.value)


@needs_rt_host
@pytest.mark.root
def test_search_and_profile_use_the_agents_cache_and_avoid_its_training_cores(tiny, trainer_factory):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cpus: one for training, one to measure on")
    with started_daemon() as agent:
        trainer = trainer_factory(threads=1)
        train = agent.client.attach_training({"name": "tr", "pids": [trainer.pid], "cores": 1})
        view = agent_view(CliContext(socket_path=agent.socket))
        assert view.answered and view.profile_dir == str(agent.state_dir / "profiles")
        assert set(train.cpus) <= view.busy_cpus and view.reserved_cpus == []
        result = CliRunner().invoke(cli, ["--socket", agent.socket, "-o", "json", "search", tiny, "--cores", "1",
                                          "--backend", "onnxruntime", "--max-batch", "2", *FAST])
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert data["cache_dir"] == str(agent.state_dir / "profiles")
        assert set(int(c) for c in data["cpus"].split(",")).isdisjoint(train.cpus)
        assert list((agent.state_dir / "profiles").glob("*.json")), "the points went to the agent's cache"
        profiled = CliRunner().invoke(cli, ["--socket", agent.socket, "-o", "json", "profile", tiny,
                                            "--batches", "1", "--max-windows", "3", "--window-s", "0.05",
                                            "--warmup-s", "0.05"])
        assert profiled.exit_code == 0, profiled.output
        # of the 2 cores, training holds one: profile measured on the other alone
        assert max(p["cores"] for p in json.loads(profiled.stdout)["points"]) == 1
        agent.client.detach_training("tr")


@pytest.fixture
def trainer_factory():
    from tests.agent.conftest import Trainer

    made = []

    def make(threads: int = 2):
        made.append(Trainer(threads))
        return made[-1]

    yield make
    for trainer in made:
        trainer.stop()


def test_a_layout_that_leaves_the_front_door_no_core_is_charged(tiny, tmp_path):
    # (Which layout wins is left out: on a loaded machine the final ranking does not always keep the layout on
    # one core fewer; see the session 12 closing note.)
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cpus")
    # 50 ms of front door per request: far above what the tiny model costs an instance (a 2-core layout at
    # 400 rps carries 36 once charged; one core left to the front door carries about 200)
    result = CliRunner().invoke(cli, ["--socket", str(tmp_path / "no-agent.sock"), "-o", "json", "search", tiny,
                                      "--cores", "2", "--slo-ms", "1000", "--backend", "onnxruntime", "--max-batch",
                                      "2", "--no-cache", "--frontdoor-cpu-ms", "50", *FAST])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["frontdoor_cpu_ms"] == 50
    from reamer.plan.layout import parse_layout

    # every layout on both cores carries at most what one 50 ms front door leaves: 2 cores x 1000 / 50 per second
    full = [c for c in data["candidates"] if parse_layout(c["layout"]).total_cores == 2]
    assert all(c["throughput_rps"] < 2 * 1000 / 50 for c in full)
    assert "--frontdoor-cpu-ms" in CliRunner().invoke(cli, ["search", "--help"]).output


def test_a_failed_search_prints_its_error_as_json_on_stdout(tmp_path):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    result = CliRunner().invoke(cli, ["--socket", str(tmp_path / "none.sock"), "-o", "json", "search", str(broken),
                                      "--cores", "1", "--no-cache", *FAST])
    assert result.exit_code != 0
    error = json.loads(result.stdout)["error"]
    assert error["message"] and error["fix"] and error["exit_code"] == result.exit_code
    assert "Traceback" not in result.output
