"""The event log's retention (count, bytes, per job), and the store on a full or read-only state disk:
real SQLite files, and real tmpfs mounts for the disk cases."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from reamer.agent import store as store_module
from reamer.agent.events import EventLog
from reamer.agent.store import MAX_EVENT_DATA_BYTES, MAX_EVENT_MESSAGE_CHARS, Retention, Store, StoreError
from tests.conftest import IS_ROOT

can_mount = pytest.mark.skipif(not IS_ROOT or not shutil.which("mount"),
                               reason="needs root to mount a small tmpfs as the state directory")


def test_one_jobs_flood_never_pushes_other_events_out(tmp_path):
    log = EventLog(Store(tmp_path / "state.db", Retention(max_count=1000, max_per_job=50)))
    mine = [log.emit("inference_deployed", "quiet deployed", job="quiet").id,
            log.emit("training_attached", "root's training", job="train").id,
            log.emit("agent_started", "agent started").id]
    for i in range(400):
        log.emit("overload", f"flood {i}", job="flood")
    kept = log.since(0, limit=5000)
    assert [e.id for e in kept if e.id in mine] == mine  # nobody else's event went
    flood = [e for e in kept if e.job == "flood"]
    assert len(flood) == 50 and flood[-1].message == "flood 399"  # the job's newest stay, its oldest go


def test_count_bound_keeps_the_newest_and_ids_monotonic(tmp_path):
    store = Store(tmp_path / "state.db", Retention(max_count=200, max_per_job=10_000))
    log = EventLog(store)
    ids = [log.emit("replanned", f"n{i}", job=f"j{i % 7}").id for i in range(1000)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    kept = log.since(0, limit=5000)
    assert 150 <= len(kept) <= 200 and kept[-1].id == ids[-1]
    assert [e.id for e in kept] == sorted(e.id for e in kept)
    # a subscriber behind the pruned part gets the oldest kept ones, in order, never an id again
    assert log.since(ids[10])[0].id == kept[0].id
    store.close()
    again = EventLog(Store(tmp_path / "state.db", Retention(max_count=200)))
    assert again.last_id == ids[-1] and again.emit("x", "after reopen").id > ids[-1]


def test_bytes_bound_and_the_size_of_one_event(tmp_path):
    store = Store(tmp_path / "state.db", Retention(max_count=100_000, max_bytes=256 * 1024))
    log = EventLog(store)
    for i in range(100):
        log.emit("replanned", "m" * 20_000, job=f"j{i}", data={"i": i})
    count, size = store.event_totals()
    assert size <= 256 * 1024 and 0 < count < 100
    real = sum(len(e.message) + len(str(e.data)) for e in log.since(0, limit=1000))
    assert real <= 256 * 1024
    big = log.emit("x", "y" * 100_000, data={"blob": "z" * 200_000})
    [stored] = [e for e in log.since(big.id - 1) if e.id == big.id]
    assert len(stored.message) == MAX_EVENT_MESSAGE_CHARS
    assert stored.data == {"truncated": True, "bytes": len('{"blob": ""}') + 200_000}
    assert MAX_EVENT_DATA_BYTES < 200_000


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 20 MiB tmpfs: the state directory of the tests below."""
    mount = Path(tempfile.mkdtemp(prefix="rmr-disk-", dir="/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m,mode=0755", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
        mount.rmdir()


def fill(directory: Path) -> Path:
    """Fill the file system of `directory` with another file, to the last block."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for block in (1 << 20, 4096, 512):
            try:
                while True:
                    os.write(fd, b"\0" * block)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


@can_mount
def test_a_full_state_disk_still_records_detach_demote_and_remove(small_disk, monkeypatch):
    monkeypatch.setattr(store_module, "RESERVE_RETRY_S", 0.0)
    store = Store(small_disk / "state.db", reserve_bytes=4 * 2**20)
    log = EventLog(store)
    assert store.reserve_path.stat().st_size == 4 * 2**20
    store.put_job("training", "train", {"cpus": [1], "demoted": False})
    store.put_job("inference", "web", {"kind": "online"})
    filler = fill(small_disk)
    # what only adds (a new job, a job's events) fails and says why; it does not take the reserve
    with pytest.raises(StoreError) as refused:
        store.put_job("inference", "new", {"kind": "online", "pad": "x" * 200_000})
    assert "full" in refused.value.message and "corrupt" not in refused.value.message
    assert "free space" in refused.value.fix and "mv " not in refused.value.fix
    for _ in range(50):  # a job's forwarded events: dropped (logged), never raising, never the reserve
        log.emit("overload", "x" * 8000, job="web")
    assert store.reserve_path.exists()
    # root's demote (an update), detach and remove (deletes) and their events get through
    store.put_job("training", "train", {"cpus": [1], "demoted": True, "pad": "y" * 100_000})
    assert log.emit("demoted_all", "demoted 3 thread(s)").id > 0
    store.delete_job("training", "train")
    store.delete_job("inference", "web")
    assert log.emit("inference_removed", "web removed", job="web").id > 0
    assert store.jobs("training") == {} and store.jobs("inference") == {}
    assert not store.reserve_path.exists()  # given up for them
    filler.unlink()
    store.put_job("inference", "later", {"kind": "online"})  # room again: the reserve is made again
    assert store.reserve_path.stat().st_size == 4 * 2**20
    store.close()


@can_mount
def test_a_read_only_state_directory_is_said_to_be_read_only_not_corrupt(small_disk):
    store = Store(small_disk / "state.db")
    store.put_job("training", "train", {"cpus": [1]})
    store.close()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    with pytest.raises(StoreError) as info:
        Store(small_disk / "state.db")
    assert "read-only" in info.value.message and "corrupt" not in info.value.message
    assert "remount,rw" in info.value.fix and "do not move" in info.value.fix
    subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    store = Store(small_disk / "state.db")
    assert store.jobs("training") == {"train": {"cpus": [1]}}  # nothing was lost
    store.close()


@can_mount
def test_a_read_only_bind_mount_of_the_state_directory_is_said_to_be_read_only(small_disk):
    state = small_disk / "state"
    Store(state / "state.db").close()
    view = Path(tempfile.mkdtemp(prefix="rmr-ro-", dir="/tmp"))
    subprocess.run(["mount", "--bind", str(state), str(view)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
        with pytest.raises(StoreError) as info:
            Store(view / "state.db")
        assert "read-only" in info.value.message and "corrupt" not in info.value.message
        assert "do not move" in info.value.fix
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False)
        view.rmdir()


def test_an_unwritable_state_file_is_not_called_corrupt(tmp_path):
    if IS_ROOT:
        pytest.skip("root writes through file modes; the read-only mount test covers root")
    store = Store(tmp_path / "state.db")
    store.close()
    os.chmod(tmp_path, 0o500)
    try:
        with pytest.raises(StoreError) as info:
            Store(tmp_path / "state.db")
        assert "corrupt" not in info.value.message
    finally:
        os.chmod(tmp_path, 0o700)
