"""A real online job process (`python -m reamer.serve.runtime.job`) started from a JobSpec, as the agent starts one."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from reamer.serve.spec import InstanceSpec, JobSpec, JobStatus
from tests.conftest import wait_for

CPUS = sorted(os.sched_getaffinity(0))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_status(run_dir: Path) -> JobStatus | None:
    """The job's status.json; None before the job has written it."""
    try:
        return JobStatus.load(Path(run_dir) / "status.json")
    except (FileNotFoundError, ValueError):
        return None


def job_workers(proc: subprocess.Popen) -> list[psutil.Process]:
    """The job's live instance worker processes."""
    try:
        return [p for p in psutil.Process(proc.pid).children() if p.status() != psutil.STATUS_ZOMBIE]
    except psutil.NoSuchProcess:
        return []


class RunningJob:
    """An online job serving `model` as `name`: one instance of `max_batch` on the last cpu, the front door on
    the first, run_dir `tmp_path/run_name` (emptied first), `spec_fields` for the rest of the JobSpec.

    The constructor waits until status.json says one of `settle` (`status` is then that status), and fails
    the test with the job's log if the process exits first. `log_path` takes the job's stdout and stderr
    (its job.log, as the agent keeps one); without it they go to the test's."""

    def __init__(self, model: str, tmp_path: Path, name: str = "mio", *, max_batch: int = 4, run_name: str = "run",
                 log_path: Path | None = None, settle: tuple[str, ...] = ("ready",), **spec_fields) -> None:
        self.name = name
        self.run_dir = tmp_path / run_name
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.spec = JobSpec(name=name, kind="online", model=model, port=0, run_dir=str(self.run_dir),
                            instances=[InstanceSpec([CPUS[-1]], 1, max_batch)], frontdoor_cpus=[CPUS[0]],
                            **spec_fields)
        self.spec.save(tmp_path / "spec.json")
        self.log_path = log_path
        command = [sys.executable, "-m", "reamer.serve.runtime.job", "--spec", str(tmp_path / "spec.json")]
        if log_path is None:
            self.proc = subprocess.Popen(command, cwd=REPO)
        else:
            with open(log_path, "ab") as log:
                self.proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        self.status = wait_for(lambda: self._settled(settle), timeout=120, what=f"the job to be {' or '.join(settle)}")
        self.rest = f"127.0.0.1:{self.status.port}"
        self.grpc = f"127.0.0.1:{self.status.grpc_port}"
        self.workers = self.live_workers()

    def _settled(self, states: tuple[str, ...]) -> JobStatus | None:
        status = self.read_status()
        if status is not None and status.state in states:
            return status
        if self.proc.poll() is not None:
            log = self.log_path.read_text(errors="replace")[-2000:] if self.log_path else "(see the test's output)"
            pytest.fail(f"the job exited with {self.proc.returncode}: {log}")
        return None

    def read_status(self) -> JobStatus | None:
        return read_status(self.run_dir)

    def live_workers(self) -> list[psutil.Process]:
        return job_workers(self.proc)

    def stop(self) -> int | None:
        """SIGTERM the job (its workers resumed first, in case a test stopped one) and kill what is left; the
        job's exit code, or None if it had exited already or had to be killed."""
        children = self.workers + self.live_workers()
        for p in children:
            try:
                p.resume()
            except psutil.NoSuchProcess:
                pass
        code = None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                code = self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for p in children:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        return code
