"""The GPU manager on the agent's store and event log, as the composition root builds it (reamer.node.build_gpu):
registrations are the store's "gpu" document, events are the agent's events, and the gpu_jobs.json of a node
upgraded in place is read once, copied into the store and set aside. Real sqlite store, fake NVML and MPS."""
from __future__ import annotations

import json

import pytest

from reamer.agent.events import EventLog
from reamer.agent.gpu_state import GPU_DOCUMENT, StoreGpuEvents, StoreGpuState
from reamer.agent.store import Store
from reamer.gpu.errors import GpuError
from reamer.gpu.manager import GpuManager
from reamer.gpu.state import JOBS_FILE
from tests.gpu.fakes.fake_pynvml import FakeGpu, FakeNvml

U0 = "GPU-aaaaaaaa-1111-2222-3333-444444444444"


@pytest.fixture
def node(run_dir, fake_control):
    """(make a manager on the store, the store, the legacy file): as reamer.node wires them."""
    store = Store(run_dir / "state.db")
    events = EventLog(store)
    gpu_dir = run_dir / "gpu"
    gpu_dir.mkdir()
    made: list[GpuManager] = []

    def make(previous_version: bool = False) -> GpuManager:
        """previous_version: a manager of its own (the previous version's: gpu_jobs.json, events in memory)."""
        config = {"mps_control_path": fake_control, "command_timeout_s": 30, "stop_daemons_on_exit": True}
        on_store = {} if previous_version else {"state": StoreGpuState(store, legacy_file=gpu_dir / JOBS_FILE),
                                                "events": StoreGpuEvents(events, store)}
        m = GpuManager(config, gpu_dir, nvml=FakeNvml([FakeGpu(U0, memory_total_mb=16000)]), **on_store)
        made.append(m)
        m.start()
        return m

    yield make, store, gpu_dir / JOBS_FILE
    for m in made:
        m.close()
    store.close()


def test_registrations_live_in_the_store_and_events_in_the_agents_log(node):
    make, store, legacy = node
    m = make()
    m.register_job("train", U0, 30, mem_limit_mb=2048, kind="training")
    assert [j["name"] for j in store.get_document(GPU_DOCUMENT)["jobs"]] == ["train"]
    assert not legacy.exists()  # no second place
    stored = [e for e in store.events_since(0) if e["kind"] == "gpu_job_registered"]
    assert [(e["job"], e["data"]["gpu"]) for e in stored] == [("train", U0)]
    # the manager's own view of its events is the agent's log, not a list of its own
    assert [e["kind"] for e in m.events()] == [e["kind"] for e in store.last_events_of(
        {e["kind"] for e in m.events()}, 200)]
    assert any(e["kind"] == "gpu_job_registered" and e["job"] == "train" for e in m.status()["events"])
    m.remove_job("train")
    assert store.get_document(GPU_DOCUMENT)["jobs"] == []
    m.close()

    again = make()  # a restarted agent: the store has the registrations, and the log what happened before
    assert again.jobs() == []
    assert ("gpu_job_removed", "train") in [(e["kind"], e["job"]) for e in again.events()]


def test_a_node_upgraded_in_place_keeps_its_gpu_jobs(node):
    make, store, legacy = node
    # What the manager of the previous version left: registrations in <run_dir>/gpu/gpu_jobs.json.
    old = make(previous_version=True)
    old.register_job("train", U0, 40, mem_limit_mb=1024, kind="training")
    old.close()
    old_doc = json.loads(legacy.read_text())
    assert store.get_document(GPU_DOCUMENT) is None

    m = make()
    view = m.job("train")
    assert view["desired"] == {"sm_percent": 40, "mem_limit_mb": 1024} and view["kind"] == "training"
    assert store.get_document(GPU_DOCUMENT)["jobs"] == old_doc["jobs"]
    migrated = legacy.with_name(JOBS_FILE + ".migrated")
    assert not legacy.exists() and json.loads(migrated.read_text()) == old_doc  # read once, kept aside
    m.remove_job("train")
    m.close()

    after = make()  # the set-aside file is not read again: what the store says counts
    assert after.jobs() == [] and migrated.exists()


def test_an_unreadable_old_file_names_itself_and_the_fix(node):
    make, store, legacy = node
    legacy.write_text("{not json")
    with pytest.raises(GpuError) as info:
        make()
    assert str(legacy) in info.value.message and "remove" in info.value.fix
    assert store.get_document(GPU_DOCUMENT) is None and legacy.exists()  # nothing half-moved
