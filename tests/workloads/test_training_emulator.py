"""The training emulator runs real loader processes and threads and reports per-iteration times."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import psutil
import pytest

from reamer.host.errors import ReamerError
from reamer.workloads.training_emulator import (
    Calibration,
    EmulatorConfig,
    EmulatorConfigError,
    EmulatorReport,
    plan_work,
    run_emulator,
)

FAST_CAL = Calibration(image_ms=0.4, kernel_unit_ms=0.01, sync_unit_ms=0.08, image_size=32)


def small_config(**overrides) -> EmulatorConfig:
    base = dict(
        iterations=12,
        gpu_step_ms=30.0,
        kernel_ms=3.0,
        kernels_per_iteration=4,
        loader_workers=2,
        sync_every=3,
        sync_ms=3.0,
        duty=0.3,
        image_size=32,
        calibration=FAST_CAL,
    )
    base.update(overrides)
    return EmulatorConfig(**base)


def test_reports_every_iteration_and_uses_less_cpu_than_wall_time():
    report = run_emulator(small_config())
    assert report.stopped_by == "iterations"
    assert [r.index for r in report.iterations] == list(range(12))
    ms = report.iteration_ms()
    # each iteration contains the 30 ms "GPU step" sleep
    assert all(m >= 30.0 for m in ms)
    assert [r.synced for r in report.iterations] == [(i + 1) % 3 == 0 for i in range(12)]
    assert all(r.end >= r.start for r in report.iterations)
    assert 0 < report.cpu_s < report.wall_s * len(report.cpus)
    assert 0 < report.duty_measured < 1.0
    assert report.plan["images_per_batch"] >= 1


def test_loader_workers_are_real_processes_and_sync_is_a_thread():
    seen: dict[str, object] = {}
    stop = threading.Event()

    def watch() -> None:
        me = psutil.Process()
        while not stop.is_set():
            kids = [c for c in me.children() if c.is_running()]
            seen["children"] = max(len(kids), seen.get("children", 0))
            seen["threads"] = max(me.num_threads(), seen.get("threads", 0))
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        run_emulator(small_config(iterations=20, loader_workers=3))
    finally:
        stop.set()
        watcher.join(5)
    assert seen["children"] >= 3  # three loader workers (plus the queue's helpers)
    assert seen["threads"] >= 3  # main + grad-sync + watcher at least


def test_stop_event_ends_an_open_ended_run(tmp_path):
    stop = threading.Event()
    ready = tmp_path / "ready"

    def stop_after_first_iteration() -> None:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()

    stopper = threading.Thread(target=stop_after_first_iteration, daemon=True)
    stopper.start()
    report = run_emulator(small_config(iterations=None, ready_file=str(ready)), stop=stop)
    stopper.join(5)
    assert report.stopped_by == "signal"
    assert len(report.iterations) >= 1


def test_duty_sizes_preprocessing_and_rejects_impossible_settings():
    low = plan_work(small_config(duty=0.2), FAST_CAL, cpus=1)
    high = plan_work(small_config(duty=0.5), FAST_CAL, cpus=1)
    assert high.images_per_batch > low.images_per_batch
    with pytest.raises(EmulatorConfigError) as err:
        plan_work(small_config(duty=0.01), FAST_CAL, cpus=1)
    assert "raise --duty" in str(err.value)
    with pytest.raises(ReamerError):
        plan_work(small_config(duty=0.95, loader_workers=1, gpu_step_ms=5.0), FAST_CAL, cpus=4)
    with pytest.raises(EmulatorConfigError):
        plan_work(small_config(duty=0.3, preprocess_ms=5.0), FAST_CAL, cpus=1)


def test_cli_writes_a_json_report(tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(FAST_CAL.to_dict()))
    out = tmp_path / "report.json"
    ready = tmp_path / "ready"
    proc = subprocess.run(
        [
            sys.executable, "-m", "reamer.workloads.training_emulator",
            "--iterations", "6", "--gpu-step-ms", "20", "--kernel-ms", "2", "--kernels", "4",
            "--loader-workers", "1", "--sync-every", "2", "--sync-ms", "2", "--duty", "0.3",
            "--image-size", "32", "--calibration", str(cal), "--ready-file", str(ready),
            "--report", str(out),
        ],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["source"] == "emulator"
    assert len(data["iteration_ms"]) == 6
    assert ready.exists()
    report = EmulatorReport.read(out)
    assert report.iteration_ms() == pytest.approx(data["iteration_ms"])
    assert report.cpu_s < report.wall_s * len(report.cpus)


def test_cli_explains_bad_settings(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "reamer.workloads.training_emulator", "--iterations", "2",
         "--duty", "0.3", "--preprocess-ms", "4", "--report", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "fix:" in proc.stderr
