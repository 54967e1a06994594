"""The composition root (reamer.node): what its documented start order promises, checked on the real parts.
Nothing here starts the agent (no cgroups are made): building is enough to see what was wired to what."""
from __future__ import annotations

import json
import socket

import pytest

from reamer.agent.config import config_from_dict
from reamer.agent.gpu_state import GPU_DOCUMENT, StoreGpuEvents, StoreGpuState
from reamer.api.server import SocketInUse, bind_unix_socket
from reamer.node import build_agent, run_daemon
from tests.conftest import unique_name


def _config(tmp_path, **extra):
    return config_from_dict({"socket": str(tmp_path / "r.sock"), "state_dir": str(tmp_path / "state"),
                             "run_dir": str(tmp_path / "run"), "cgroup_name": unique_name("reamer-test"),
                             "reserved_cpus": [], "log_level": "warning", **extra})


def test_a_taken_socket_is_refused_before_anything_else_is_touched(tmp_path):
    """Step 2 before 3–9: a second agent on the same socket opens no store and makes no run directory."""
    listener = bind_unix_socket(tmp_path / "r.sock")
    try:
        with pytest.raises(SocketInUse) as caught:
            run_daemon(_config(tmp_path))
        assert "already listens" in caught.value.message and caught.value.fix
        assert not (tmp_path / "state").exists() and not (tmp_path / "run").exists()
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(str(tmp_path / "r.sock"))  # the first agent's socket is still there and listening
        probe.close()
    finally:
        listener.close()


def test_every_part_is_built_once_and_shared(tmp_path):
    agent = build_agent(_config(tmp_path))
    try:
        # one executor of host changes for training and the memory guard
        assert agent.pinner.host is agent.host and agent.memory.host is agent.host
        assert agent.driver is agent.host.driver
        # one store and one event log: the inference supervisor and memory guard report to the agent's log
        assert agent.supervisor.emit == agent.events.emit and agent.memory.emit == agent.events.emit
        assert agent.supervisor.save == agent._save_inference
        # the GPU side writes through the same store and event log
        assert isinstance(agent.gpu._state, StoreGpuState) and agent.gpu._state.store is agent.store
        assert isinstance(agent.gpu._events, StoreGpuEvents) and agent.gpu._events.events is agent.events
    finally:
        agent.store.close()


def test_an_old_gpu_jobs_file_is_found_where_the_previous_version_wrote_it(tmp_path):
    """build_gpu points the migration at <run_dir>/gpu/gpu_jobs.json, the previous version's file."""
    old = tmp_path / "run" / "gpu" / "gpu_jobs.json"
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps({"version": 1, "boot_id": "", "jobs": [], "compute_modes": {}}))
    agent = build_agent(_config(tmp_path))
    try:
        assert agent.gpu._state.legacy_file == old
        assert agent.gpu._state.load() == {"version": 1, "boot_id": "", "jobs": [], "compute_modes": {}}
        assert agent.store.get_document(GPU_DOCUMENT)["version"] == 1 and not old.exists()
    finally:
        agent.store.close()
