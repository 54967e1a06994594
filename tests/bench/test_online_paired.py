"""The paired online bench: its ladder, turns and reading against simulated servers (no timing), and a smoke run
of the whole bench (real reamer job, real OpenVINO behind uvicorn) on the tiny model."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.online_paired import (SECTION, Climb, climb_ladder, ladder, paired_ratio, read_climbs, render,
                                 turns, write_section)
from bench.online_peers import step_from

ROOT = Path(__file__).resolve().parents[2]

SLO_MS = 1000.0


def _step(rate: float, passes: bool):
    latency = 100.0 if passes else 5000.0
    return step_from(rate, 5.0, [i / rate for i in range(50)], [latency] * 50, ["ok"] * 50)


def test_the_ladder_steps_by_the_rung_around_the_centre():
    rates = ladder(100.0, 0.04, 2, 3)
    assert len(rates) == 6 and rates[2] == pytest.approx(100.0)
    assert rates[0] == pytest.approx(100 / 1.04 ** 2) and rates[-1] == pytest.approx(100 * 1.04 ** 3)
    assert all(b / a == pytest.approx(1.04) for a, b in zip(rates, rates[1:]))


def test_the_first_turn_rotates_with_every_rung_and_round():
    firsts = [turns(["reamer", "peer"], r, i)[0] for r in range(2) for i in range(3)]
    assert firsts == ["reamer", "peer", "reamer", "peer", "reamer", "peer"]
    assert sorted(turns(["a", "b", "c"], 1, 1)) == ["a", "b", "c"]


def test_a_round_reads_the_highest_rung_passed_before_the_first_failure():
    rates = [10.0, 11.0, 12.0, 13.0]
    climb = Climb([_step(10, True), _step(11, True), _step(12, False)])
    assert climb.rate_rps(SLO_MS) == 11.0 and climb.done(SLO_MS) and not climb.topped(SLO_MS)
    assert Climb([_step(10, False)]).rate_rps(SLO_MS) == 0.0
    assert Climb([_step(r, True) for r in rates]).topped(SLO_MS)


def test_contenders_take_turns_and_each_stops_at_its_own_failure():
    capacity = {"reamer": 11.5, "peer": 12.5}  # a rung passes below the contender's capacity
    rates = ladder(12.0, 0.04, 2, 2)
    calls = []

    def drive(contender, rate, seed):
        calls.append((contender, round(rate, 3), seed))
        return _step(rate, rate <= capacity[contender])

    climbs = climb_ladder(drive, ["reamer", "peer"], rates, 3, SLO_MS, lambda _: None)
    for name in capacity:
        assert len(climbs[name]) == 3
        for climb in climbs[name]:  # passes up to its capacity, fails the next rung, then runs no more
            assert climb.rate_rps(SLO_MS) == max(r for r in rates if r <= capacity[name])
            assert climb.done(SLO_MS) and len(climb.steps) == sum(r <= capacity[name] for r in rates) + 1
    # the same rung of the same round: both contenders, with the round's seed, the order rotating
    assert calls[0][:2] == ("reamer", round(rates[0], 3)) and calls[1][0] == "peer"
    assert calls[2][0] == "peer" and calls[3][0] == "reamer"
    assert {seed for _, _, seed in calls} == {0, 1, 2}
    readings = {name: read_climbs(cl, SLO_MS) for name, cl in climbs.items()}
    ratio = paired_ratio(readings)
    assert ratio["best_peer"] == "peer" and ratio["bound"] == ""
    assert ratio["per_round"] == pytest.approx([readings["reamer"].median_rps / readings["peer"].median_rps] * 3)
    assert ratio["median_per_round"] == pytest.approx(ratio["ratio"])
    assert ratio["ratio"] == pytest.approx(readings["reamer"].median_rps / readings["peer"].median_rps)
    assert ratio["ratio"] < 1


def test_a_contender_still_passing_at_the_top_climbs_the_extra_rungs_alone():
    capacity = {"reamer": 14.0, "peer": 11.2}
    rates = ladder(11.0, 0.04, 1, 1)  # 10.58, 11.0, 11.44

    def drive(contender, rate, seed):
        return _step(rate, rate <= capacity[contender])

    climbs = climb_ladder(drive, ["reamer", "peer"], rates, 2, SLO_MS, lambda _: None, extra=3)
    reamer = read_climbs(climbs["reamer"], SLO_MS)
    assert reamer.median_rps == pytest.approx(11.0 * 1.04 ** 4) and reamer.lower_bound  # passed all 3 extra
    assert all(len(c.steps) == 6 for c in climbs["reamer"])
    assert all(len(c.steps) == 3 and c.done(SLO_MS) for c in climbs["peer"])
    assert paired_ratio({"reamer": reamer, "peer": read_climbs(climbs["peer"], SLO_MS)})["bound"] == "≥"


def test_a_contender_failing_the_first_rung_steps_down_until_it_passes():
    capacity = {"reamer": 9.5, "peer": 10.2}
    rates = ladder(11.0, 0.04, 1, 1)  # 10.58, 11.0, 11.44: both fail the first rung
    calls = []

    def drive(contender, rate, seed):
        calls.append((contender, rate))
        return _step(rate, rate <= capacity[contender])

    climbs = climb_ladder(drive, ["reamer", "peer"], rates, 1, SLO_MS, lambda _: None, extra=3)
    under = [10.58 / 1.04 ** k for k in (1, 2, 3)]  # 10.17, 9.78, 9.40
    assert climbs["peer"][0].rate_rps(SLO_MS) == pytest.approx(under[0], rel=1e-3)
    assert climbs["reamer"][0].rate_rps(SLO_MS) == pytest.approx(under[2], rel=1e-3)
    assert [round(r, 2) for c, r in calls if c == "peer"] == [10.58, 10.17]  # it stops at its first pass
    assert len([c for c, _ in calls if c == "reamer"]) == 4
    nothing = climb_ladder(lambda c, rate, seed: _step(rate, False), ["reamer"], rates, 1, SLO_MS,
                           lambda _: None, extra=2)
    assert nothing["reamer"][0].rate_rps(SLO_MS) == 0.0 and len(nothing["reamer"][0].below) == 2


def test_the_median_round_decides_and_one_disturbed_round_does_not():
    rates = [10.0, 11.0, 12.0]
    rounds = [Climb([_step(10, True), _step(11, True), _step(12, False)]),
              Climb([_step(10, False)]),  # disturbed
              Climb([_step(10, True), _step(11, True), _step(12, False)])]
    reading = read_climbs(rounds, SLO_MS)
    assert reading.rates_rps == (11.0, 0.0, 11.0) and reading.median_rps == 11.0 and not reading.lower_bound


def test_a_contender_topping_the_ladder_reads_as_a_lower_bound():
    rates = [10.0, 11.0]
    top = read_climbs([Climb([_step(10, True), _step(11, True)])] * 3, SLO_MS)
    short = read_climbs([Climb([_step(10, True), _step(11, False)])] * 3, SLO_MS)
    assert top.lower_bound and top.median_rps == 11.0
    assert paired_ratio({"reamer": top, "peer": short})["bound"] == "≥"
    assert paired_ratio({"reamer": short, "peer": top})["bound"] == "≤"
    assert paired_ratio({"reamer": top, "peer": top})["bound"] == "="
    assert paired_ratio({"reamer": top})["ratio"] is None


def test_the_section_renders_each_round_and_is_replaced_in_place(tmp_path):
    rates = [10.0, 11.0, 12.0]
    readings = {"reamer": read_climbs([Climb([_step(10, True), _step(11, True), _step(12, False)])] * 3, SLO_MS),
                "peer": read_climbs([Climb([_step(10, True), _step(11, False)])] * 3, SLO_MS)}
    from dataclasses import asdict

    data = {"machine": "m", "cpus": [0, 1], "started": "s", "ended": "e", "load_start": [0], "load_end": [0],
            "command": "c", "rung": 0.04, "below": 2, "above": 3, "rounds": 3,
            "rows": [{"model": "resnet50", "info": {"reamer 1000": {"layout": "2x1:b1@openvino"}},
                      "slos": {"1000": {"readings": {k: asdict(v) for k, v in readings.items()},
                                        "ratio": paired_ratio(readings)},
                               "200": {"skipped": "no peer sustains any rate under this SLO"}}},
                     {"model": "bert-base", "error": "boom"}]}
    text = render(data)
    assert "| resnet50 | 1000 ms | `2x1:b1@openvino` | 11.0 (11.0/11.0/11.0) | peer | 10.0 (10.0/10.0/10.0) | " \
           "1.10× | 1.10/1.10/1.10 (1.10×) |" in text
    assert "no peer sustains" in text and "error: boom" in text
    md = tmp_path / "RESULTS.md"
    md.write_text("# r\n\n## Against each runtime's own tuning (issue 14)\n\nintro\n")
    write_section(str(md), "placeholder")
    write_section(str(md), text)
    assert md.read_text().count(SECTION) == 1 and "placeholder" not in md.read_text()


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the bench gives every contender two cpus")
def test_quick_run_on_the_tiny_model(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.online_paired", "--quick", "--models", "tiny", "--slos", "1000",
         "--max-rate", "60", "--search-budget", "15", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = json.loads((tmp_path / "online_paired.json").read_text())["rows"][0]
    assert "error" not in row, row
    doc = row["slos"]["1000"]
    assert set(doc["climbs"]) == {"reamer", "OpenVINO THROUGHPUT f32 over HTTP"}
    for contender, rounds in doc["climbs"].items():
        assert len(rounds) == 2 and all(steps and steps[0]["ok"] > 0 for steps in rounds), contender
    assert doc["ratio"]["ratio"] is not None and doc["ratio"]["ratio"] > 0
    assert row["info"]["OpenVINO THROUGHPUT f32 over HTTP"]["check"]["max_rel_diff"] < 1e-4
