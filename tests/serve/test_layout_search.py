"""The layout search shared by `reamer search` and the agent: measured on real cores (tiny model, one
cpu, short windows), points cached and reused, a time budget that ends the search early."""
from __future__ import annotations

import os
import time

import pytest

from reamer.plan.layout import format_layout
from reamer.search.on_cores import MeasureSettings, batch_choices, cached_points, search_layout
from reamer.serve.models import build_model

FAST = MeasureSettings(warmup_s=0.05, window_s=0.05, max_windows=4, verify_windows=2)
CPU = [max(os.sched_getaffinity(0))]  # one cpu, away from cpu 0 where it can be


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_model("tiny", tmp_path_factory.mktemp("models") / "tiny.onnx").path


def test_batch_choices():
    assert batch_choices(1) == [1]
    assert batch_choices(8) == [1, 2, 4, 8]
    assert batch_choices(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError):
        batch_choices(0)


def test_search_measures_then_reuses_the_cache(tiny, tmp_path):
    cache = tmp_path / "profiles"
    first = search_layout(tiny, "onnxruntime", CPU, 1000.0, cache_dir=cache, batches=[1, 2], settings=FAST)
    assert first.complete and not first.from_cache and first.new_points
    assert first.best is not None and format_layout(first.best.layout) in {"1x1:b1", "1x1:b2"}
    assert first.best.measured_rps is not None and first.best.rps > 0  # verified with a real run
    assert first.baseline is not None and first.baseline.layout == "1x1:b2"
    assert first.gain is not None and first.gain >= 1.0  # the best is at least as fast as the baseline
    assert {r.kind for r in first.rows} == {"point"}  # on one cpu every layout is one instance: its point
    assert not any(r.cached for r in first.rows)
    stored = {(p.cores, p.batch) for p in cached_points(cache, tiny, "onnxruntime")}
    assert stored == {(p.cores, p.batch) for p in first.new_points}

    second = search_layout(tiny, "onnxruntime", CPU, 1000.0, cache_dir=cache, batches=[1, 2], settings=FAST)
    assert second.from_cache and second.new_points == []  # zero new single-instance measurements
    points = [r for r in second.rows if r.kind == "point"]
    assert points and all(r.cached for r in points)
    assert {(p.cores, p.batch) for p in second.points} == stored
    assert second.best is not None


def test_search_measures_only_the_points_the_cache_lacks(tiny, tmp_path):
    cache = tmp_path / "profiles"
    search_layout(tiny, "onnxruntime", CPU, None, cache_dir=cache, batches=[1], settings=FAST)
    before = {(p.cores, p.batch) for p in cached_points(cache, tiny, "onnxruntime")}
    assert before == {(1, 1)}
    wider = search_layout(tiny, "onnxruntime", CPU, None, cache_dir=cache, batches=[1, 2], settings=FAST)
    assert {(p.cores, p.batch) for p in wider.new_points} == {(1, 2)}  # (1, 1) came from the cache
    assert [r.cached for r in wider.rows if r.kind == "point"] == [True, False]
    assert {(p.cores, p.batch) for p in cached_points(cache, tiny, "onnxruntime")} == {(1, 1), (1, 2)}


def test_a_spent_budget_plans_from_the_points_measured_so_far(tiny, tmp_path):
    cache = tmp_path / "profiles"
    # the budget is gone before the first run: nothing is measured, and nothing can be planned
    empty = search_layout(tiny, "onnxruntime", CPU, 1000.0, cache_dir=cache, batches=[1, 2], settings=FAST,
                          budget_s=1e-9)
    assert not empty.complete and empty.best is None and empty.rows == [] and "budget" in empty.note
    # with cached points, a spent budget still gives a (predicted) layout, without measuring
    search_layout(tiny, "onnxruntime", CPU, None, cache_dir=cache, batches=[1], settings=FAST)
    planned = search_layout(tiny, "onnxruntime", CPU, 1000.0, cache_dir=cache, batches=[1, 2], settings=FAST,
                            budget_s=1e-9)
    assert not planned.complete and planned.best is not None
    assert planned.best.measured_rps is None and planned.best.rps > 0
    assert "planned from the single-instance points" in planned.note


def test_the_slo_no_shape_meets_gives_no_best_and_no_cache_dir_writes_nothing(tiny, tmp_path):
    outcome = search_layout(tiny, "onnxruntime", CPU, 1e-6, cache_dir=None, batches=[1], settings=FAST)
    assert outcome.best is None and outcome.note and outcome.new_points
    assert outcome.candidates and all(c.p99_ms > 1e-6 for c in outcome.candidates)
    assert list(tmp_path.iterdir()) == []


def test_an_online_layout_gets_half_the_slo_for_its_batch(tiny, tmp_path):
    """A request may wait for the batch before its own: a batch of 400 ms meets a 1 s SLO, not a 500 ms one,
    though its p99 alone is under 500."""
    from reamer.plan.partition import ProfilePoint
    from reamer.search.on_cores import store_points

    cache = tmp_path / "cache"
    store_points(cache, tiny, "onnxruntime", [ProfilePoint(1, 1, 100.0, 20.0), ProfilePoint(1, 2, 150.0, 200.0),
                                               ProfilePoint(1, 4, 300.0, 400.0)])
    relaxed = search_layout(tiny, "onnxruntime", CPU, 1000.0, cache_dir=cache, batches=[1, 2, 4], settings=FAST)
    assert relaxed.batch_target_ms == 500.0 and format_layout(relaxed.best.layout) == "1x1:b4"
    tight = search_layout(tiny, "onnxruntime", CPU, 500.0, cache_dir=cache, batches=[1, 2, 4], settings=FAST)
    assert tight.batch_target_ms == 250.0 and format_layout(tight.best.layout) == "1x1:b2"
    assert tight.from_cache and not tight.new_points  # decided on the cached figures, nothing re-measured
    offline = search_layout(tiny, "onnxruntime", CPU, None, cache_dir=cache, batches=[1, 2, 4], settings=FAST)
    assert offline.batch_target_ms is None and format_layout(offline.best.layout) == "1x1:b4"



def test_near_equal_leaders_are_run_off_in_finals_whose_means_decide(tiny):
    """Three measured layouts within 10 % of each other (made-up search figures): the finals load them
    together, run each in turn twice with the order rotating, and their means replace the search figures.
    A layout half as fast is no finalist; with time for one round only, one round runs; with none, nothing."""
    import math

    from reamer.plan.layout import parse_layout
    from reamer.plan.partition import Candidate
    from reamer.search.on_cores import FinalsSettings, _run_finals, _Runs

    finals = FinalsSettings(window_s=0.05, windows=2, rewarm_s=0.01)
    searched = [Candidate(parse_layout(text), math.nan, math.nan, rps, 1.0)
                for text, rps in (("1x1:b2", 104.0), ("1x1:b1", 100.0), ("1x1:b4", 96.0), ("1x1:b8", 50.0))]
    runs = _Runs(tiny, "onnxruntime", CPU, FAST, [], None)
    rows = []
    ranked, finalists = _run_finals(searched, None, lambda layout: runs, finals, None, rows, False, None)
    assert [r.layout for r in rows] == ["1x1:b2", "1x1:b1", "1x1:b4", "1x1:b1", "1x1:b4", "1x1:b2"]
    assert {r.kind for r in rows} == {"final"} and finalists == 3
    assert {format_layout(c.layout) for c in ranked[:3]} == {"1x1:b1", "1x1:b2", "1x1:b4"}
    for c in ranked[:3]:
        mine = [r for r in rows if r.layout == format_layout(c.layout)]
        assert c.measured_rps == pytest.approx(sum(r.throughput_rps for r in mine) / 2)
        assert c.measured_p99_ms == pytest.approx(sum(r.p99_ms for r in mine) / 2)
    assert [c.rps for c in ranked[:3]] == sorted((c.rps for c in ranked[:3]), reverse=True)
    assert ranked[3] == searched[3]  # not a finalist: its search figures stand
    # a deadline that leaves time for one round of two finalists only (each one's start-up costs 5 s here)
    runs.overheads = [5.0]
    rows = []
    run_s = runs.finals_run_s(searched[0].layout, finals)
    soon = time.monotonic() + 2 * (5.0 + FAST.warmup_s) + 3 * run_s  # 2 runs fit, 4 do not
    ranked, finalists = _run_finals(searched, None, lambda layout: runs, finals, soon, rows, False, None)
    assert [r.layout for r in rows] == ["1x1:b2", "1x1:b1"] and finalists == 2
    rows = []
    assert _run_finals(searched, None, lambda layout: runs, finals, time.monotonic() + 1.0, rows, False, None) \
        == (searched, 0) and rows == []


def test_an_online_pick_is_the_near_equal_layout_that_sustains_most_under_the_slo(tiny):
    out = search_layout(tiny, "onnxruntime", CPU, 1000.0, cache_dir=None, batches=[1, 2, 4], settings=FAST)
    judged = [c for c in out.candidates if c.sustained_rps is not None]
    assert judged and out.best is judged[0]
    assert out.best.sustained_rps == max(c.sustained_rps for c in judged) > 0
    offline = search_layout(tiny, "onnxruntime", CPU, None, cache_dir=None, batches=[1, 2, 4], settings=FAST)
    assert all(c.sustained_rps is None for c in offline.candidates)
