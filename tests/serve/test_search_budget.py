"""The quick search's time budget (issue 14): a run that would end after the deadline is not started."""
import time

import pytest

from reamer.plan.partition import ProfilePoint
from reamer.search.on_cores import MeasureSettings, _BudgetSpent, _Runs

SETTINGS = MeasureSettings(warmup_s=1.0, window_s=0.5, max_windows=10, verify_windows=4)


def _runs(deadline_in_s: float | None, cached=()) -> _Runs:
    deadline = None if deadline_in_s is None else time.monotonic() + deadline_in_s
    return _Runs("model.onnx", "onnxruntime", [0, 1], SETTINGS, list(cached), deadline)


def test_batch_latency_is_scaled_from_the_nearest_measured_batch_on_the_same_cores():
    runs = _runs(None, [ProfilePoint(1, 4, 40.0, 120.0), ProfilePoint(1, 16, 80.0, 250.0)])
    assert runs.batch_ms(1, 4) == pytest.approx(100.0)
    assert runs.batch_ms(1, 32) == pytest.approx(400.0)  # from batch 16: 200 ms, twice the batch
    assert runs.batch_ms(1, 2) == pytest.approx(50.0)
    assert runs.batch_ms(2, 4) is None  # nothing known on 2 cores


def test_expected_seconds_count_warmup_and_windows_of_at_least_one_batch():
    runs = _runs(None)
    assert runs.expected_s(None, 3) == 0.0
    assert runs.expected_s(100.0, 3) == pytest.approx(0.1 + 1.0 + 3 * 0.5)
    assert runs.expected_s(4000.0, 3) == pytest.approx(4.0 + 4.0 + 3 * 4.0)  # each window is one long batch


def test_a_run_that_would_end_after_the_deadline_is_not_started():
    runs = _runs(3600.0)
    assert runs._timeout_s(10.0) > 3600.0 - 60.0
    with pytest.raises(_BudgetSpent):
        runs._timeout_s(7200.0)
    assert _runs(None)._timeout_s(1e9) == 600.0  # no budget: nothing is refused


def test_a_layout_run_is_expected_to_be_slowed_by_its_instances_running_together():
    from reamer.plan.layout import parse_layout

    # batch 32 on one core takes 10 s: alone the run would take 60 s and fit the 75 s left; together it would not
    runs = _runs(75.0, [ProfilePoint(1, 32, 3.2, 10_000.0)])
    with pytest.raises(_BudgetSpent):
        runs.verify(parse_layout("2x1:b32"))
