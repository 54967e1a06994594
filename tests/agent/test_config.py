"""AgentConfig from YAML: defaults, overrides, and errors that name the key and the fix."""
from __future__ import annotations

import subprocess
import sys

import pytest

from reamer.agent.config import AgentConfig, ConfigError, load_config


def test_defaults_without_a_file():
    config = load_config(None)
    assert config.socket == "/run/reamer/reamer.sock"
    assert config.reserved_cpus == [0]
    assert config.training.priority == 50 and config.training.rt_runtime_us <= 950000
    assert config.inference.offline_sched == "rr-preempt"
    assert config.store_path.name == "state.db"


def test_file_and_dotted_overrides(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("socket: /tmp/x.sock\nreserved_cpus: '0-1'\ntraining:\n  priority: 30\n"
                    "inference:\n  offline_sched: idle\n")
    config = load_config(path, {"training.rt_runtime_us": 200000, "reserved_cpus": []})
    assert config.socket == "/tmp/x.sock"
    assert config.reserved_cpus == []
    assert config.training.priority == 30 and config.training.rt_runtime_us == 200000
    assert config.inference.offline_sched == "idle"
    assert load_config(path).reserved_cpus == [0, 1]


@pytest.mark.parametrize("text, key", [
    ("sokcet: /tmp/x.sock\n", "sokcet"),
    ("training:\n  prio: 3\n", "training.prio"),
    ("training:\n  rt_runtime_us: 960000\n", "training.rt_runtime_us"),
    ("inference:\n  offline_sched: fifo\n", "inference.offline_sched"),
    ("reserved_cpus: 'zero'\n", ""),
])
def test_errors_name_the_key_and_the_fix(tmp_path, text, key):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert key in info.value.message and str(path) in info.value.message
    assert info.value.fix


def test_file_problems(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("socket: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_daemon_with_a_bad_config_prints_no_traceback(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("log_levle: debug\n")
    result = subprocess.run([sys.executable, "-m", "reamer.node", "--config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "unknown config key 'log_levle'" in result.stderr and "fix:" in result.stderr
    assert "Traceback" not in result.stderr


def test_model_is_strict():
    with pytest.raises(Exception):
        AgentConfig.model_validate({"nope": 1})


def test_the_shipped_example_config_loads():
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "configs" / "reamer.yaml"
    if not example.exists():
        pytest.skip("configs/reamer.yaml not written yet")
    config = load_config(example)
    assert config == load_config(None, {"gpu": config.gpu})
