"""Commands that run in-process without the agent: topology, doctor, models build/list, and the
error contract (message + fix, exit code, no traceback)."""
from __future__ import annotations

import json

import onnx
import pytest
from click.testing import CliRunner

from reamer.cli.main import cli
from reamer.host.topology import read_topology


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_topology_table_lists_every_online_cpu(runner):
    result = runner.invoke(cli, ["topology"])
    assert result.exit_code == 0, result.output
    topo = read_topology()
    lines = result.output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("CPU"))
    rows = [line.split() for line in lines[header + 1:] if line.strip()]
    assert [int(r[0]) for r in rows] == topo.cpu_ids()
    assert f"{len(topo.cpu_ids())} online" in result.output


def test_topology_json_matches_sysfs(runner):
    result = runner.invoke(cli, ["-o", "json", "topology"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    topo = read_topology()
    assert [c["id"] for c in data["cpus"]] == topo.cpu_ids()
    assert data["physical_cores"] == [list(core) for core in topo.physical_cores()]
    assert data["model_name"] == topo.model_name


def test_doctor_exit_code_follows_required_checks(runner):
    from reamer.host import probe

    checks = probe.run_checks()
    result = runner.invoke(cli, ["-o", "json", "doctor"])
    data = json.loads(result.output)
    names = [c["name"] for c in data["checks"]]
    assert names == [c.name for c in checks]
    failed = [c for c in data["checks"] if c["required"] and not c["ok"]]
    assert result.exit_code == (1 if failed else 0)
    assert data["ok"] == (not failed)


def test_doctor_fails_with_exit_1_when_a_required_check_fails(runner, monkeypatch):
    from reamer.host import probe

    real = probe.run_checks()
    broken = type(real[0])(**{**real[0].__dict__, "ok": False, "fix": "do the thing"}) if real else None
    if broken is None:
        pytest.skip("run_checks returned no checks")
    monkeypatch.setattr(probe, "run_checks", lambda: [broken, *real[1:]])
    result = runner.invoke(cli, ["doctor"])
    assert result.exit_code == 1
    assert "FAIL" in result.output and "do the thing" in result.output
    assert "Traceback" not in result.output


def test_models_list_names_every_family(runner):
    from reamer.serve.models import MODEL_FAMILIES

    result = runner.invoke(cli, ["-o", "json", "models", "list"])
    assert result.exit_code == 0, result.output
    families = json.loads(result.output)["families"]
    assert [f["family"] for f in families] == list(MODEL_FAMILIES)
    tiny = next(f for f in families if f["family"] == "tiny")
    assert "hidden" in tiny["options"]
    table = runner.invoke(cli, ["models", "list"])
    assert all(name in table.output for name in MODEL_FAMILIES)


def test_models_build_writes_a_valid_onnx_with_options(runner, tmp_path):
    out = tmp_path / "tiny.onnx"
    result = runner.invoke(cli, ["models", "build", "tiny", "--out", str(out), "--option", "hidden=8"])
    assert result.exit_code == 0, result.output
    assert f"wrote tiny to {out}" in result.output
    model = onnx.load(str(out))
    onnx.checker.check_model(model)
    as_json = runner.invoke(cli, ["-o", "json", "models", "build", "tiny", "--out", str(out), "--seed", "3"])
    info = json.loads(as_json.output)
    assert info["family"] == "tiny" and info["path"] == str(out) and info["params"] > 0


@pytest.mark.parametrize("args, message", [
    (["models", "build", "nope", "--out", "x.onnx"], "unknown model family 'nope'"),
    (["models", "build", "tiny", "--out", "x.onnx", "--option", "bogus=1"], "model family tiny has no option bogus"),
    (["models", "build", "tiny", "--out", "x.onnx", "--option", "novalue"], "bad --option"),
])
def test_bad_input_is_exit_2_with_message_and_fix(runner, tmp_path, args, message):
    args = [str(tmp_path / a) if a.endswith(".onnx") else a for a in args]
    result = runner.invoke(cli, args)
    assert result.exit_code == 2
    assert f"error: {message}" in result.output
    assert "fix: " in result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)  # handled, not an escaped exception
    assert not list(tmp_path.iterdir())
