"""job.log under the agent sits in root's directory: its rotated copy goes to the job's own io/ directory."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from reamer.serve.runtime.joblog import bound_log
from tests.conftest import IS_ROOT

NOBODY = 65534
SYSTEM_PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
JOBLOG = Path(__file__).resolve().parents[2] / "reamer" / "serve" / "runtime" / "joblog.py"


def test_the_copy_goes_to_keep_dir(tmp_path: Path) -> None:
    (tmp_path / "io").mkdir()
    fd = os.open(tmp_path / "job.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    try:
        os.write(fd, b"old\n" * 2000)
        assert bound_log(fd, 4096, tmp_path / "io")
        assert (tmp_path / "io" / "job.log.1").read_bytes() == b"old\n" * 2000
        assert not (tmp_path / "job.log.1").exists()
        assert (tmp_path / "job.log").read_bytes() == b""
    finally:
        os.close(fd)


@pytest.fixture
def reachable():
    """A directory other users can traverse (pytest's tmp_path sits under a 0700 directory)."""
    made = Path(tempfile.mkdtemp(prefix="rmr-joblog-", dir="/tmp"))
    os.chmod(made, 0o711)
    yield made
    shutil.rmtree(made, ignore_errors=True)


@pytest.mark.skipif(not IS_ROOT or not SYSTEM_PYTHON, reason="needs root to run a writer as another user")
def test_a_job_user_bounds_its_log_in_roots_directory(reachable: Path) -> None:
    """As the agent lays it out: job.log (the user's) in a root 0755 directory, io/ the user's."""
    base = reachable / "job@abc"
    base.mkdir(mode=0o755)
    (base / "io").mkdir()
    os.chown(base / "io", NOBODY, NOBODY)
    fd = os.open(base / "job.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o640)
    os.fchown(fd, NOBODY, NOBODY)
    os.write(fd, b"line\n" * 1000)
    code = ("import runpy, sys; bound_log = runpy.run_path(sys.argv[1])['bound_log']; "
            "print(bound_log(2, 1024, sys.argv[2]))")
    try:
        done = subprocess.run([SYSTEM_PYTHON, "-I", "-c", code, str(JOBLOG), str(base / "io")], stderr=fd,
                              stdout=subprocess.PIPE, text=True, user=NOBODY, group=NOBODY, extra_groups=[],
                              cwd="/", timeout=60)
    finally:
        os.close(fd)
    assert done.stdout.strip() == "True", done
    assert (base / "io" / "job.log.1").read_bytes() == b"line\n" * 1000
    assert (base / "io" / "job.log.1").stat().st_uid == NOBODY
    assert (base / "job.log").stat().st_size == 0
    assert sorted(p.name for p in base.iterdir()) == ["io", "job.log"]  # nothing written beside it
