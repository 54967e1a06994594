"""The process trees of jobs, from one scan of the process table (real processes)."""
from __future__ import annotations

import subprocess
import time

import psutil

from reamer.agent.training import job_process_trees, job_processes


def _tree() -> subprocess.Popen:
    """A shell with a child shell with a sleeping grandchild."""
    return subprocess.Popen(["sh", "-c", "sh -c 'sleep 30 & wait' & wait"])


def _wait_for_descendants(proc: subprocess.Popen, n: int) -> list[int]:
    for _ in range(100):
        found = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        if len(found) >= n:
            return found
        time.sleep(0.05)
    raise AssertionError(f"the test's process tree under {proc.pid} did not start")


def test_each_job_gets_its_own_tree_and_nothing_else():
    a, b = _tree(), _tree()
    try:
        under_a, under_b = _wait_for_descendants(a, 2), _wait_for_descendants(b, 2)
        trees = job_process_trees({"a": [a.pid], "b": [b.pid], "gone": [2 ** 22 + 7]})
        assert trees["a"] == sorted([a.pid, *under_a]) and trees["b"] == sorted([b.pid, *under_b])
        assert trees["gone"] == []
        assert job_processes([a.pid, b.pid]) == sorted(trees["a"] + trees["b"])
    finally:
        for proc in (a, b):
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
