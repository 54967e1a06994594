"""Outputs never replace what the job did not write, and cleanup never deletes what is not its own."""
from __future__ import annotations

import os

import pytest

from reamer.serve.runtime.offline import OfflineRunner
from reamer.serve.spec import write_atomic
from tests.conftest import IS_ROOT


def test_write_without_replace_leaves_an_existing_file_and_a_symlink_alone(tmp_path):
    target = tmp_path / "victim"
    target.write_text("theirs")
    with pytest.raises(FileExistsError):
        write_atomic(tmp_path / "victim", b"mine", replace=False)
    assert target.read_text() == "theirs"
    link = tmp_path / "result.npz"
    link.symlink_to(target)
    with pytest.raises(FileExistsError):
        write_atomic(link, b"mine", replace=False)
    assert link.is_symlink() and target.read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.npz", "victim"]  # no temp file left
    write_atomic(tmp_path / "new.npz", b"mine", replace=False)
    assert (tmp_path / "new.npz").read_bytes() == b"mine"


@pytest.mark.skipif(not IS_ROOT, reason="needs root to make a file another user owns")
def test_startup_cleanup_deletes_only_its_own_plain_temp_files(tmp_path):
    inputs, outputs = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    outputs.mkdir()
    own = outputs / ".x.npz.tmp-1-abcd"
    own.write_bytes(b"cut off")
    theirs = outputs / ".y.npz.tmp-2-abcd"
    theirs.write_bytes(b"someone else's")
    os.chown(theirs, 65534, 65534)
    planted = outputs / ".z.npz.tmp-3-abcd"
    planted.symlink_to(tmp_path / "elsewhere")
    OfflineRunner(inputs, outputs)
    assert not own.exists() and theirs.exists() and planted.is_symlink()


def test_the_agent_does_not_follow_symlinks_planted_in_a_job_directory(tmp_path):
    from reamer.serve.spec import EVENTS_FILE, STATUS_FILE, JobStatus, read_events

    secret = tmp_path / "secret.json"
    secret.write_text('{"name": "x", "pid": 1, "message": "root-only content"}\n')
    (tmp_path / STATUS_FILE).symlink_to(secret)
    (tmp_path / EVENTS_FILE).symlink_to(secret)
    with pytest.raises(OSError):
        JobStatus.load(tmp_path / STATUS_FILE)
    assert read_events(tmp_path) == ([], 0)
