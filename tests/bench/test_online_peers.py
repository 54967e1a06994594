"""The online peers bench: its pass rule and rate search against a simulated server (no timing), and a smoke run
of the whole bench (real reamer job, real OpenVINO and ONNX Runtime) on the tiny model."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import pytest

import numpy as np

from bench.online_peers import (HTTP_PEERS, INPROCESS_PEERS, SECTION, Step, answer_check, binary_request,
                                bracket, parse_binary_request, parse_binary_response, ratios, render, search_rate,
                                select_contenders, step_from, step_seconds, write_section)

ROOT = Path(__file__).resolve().parents[2]


class SimulatedServer:
    """A server with a fixed capacity: latency = base / (1 - load), past capacity it falls behind (and sheds when
    told to). Counts the probes it answered."""

    def __init__(self, capacity: float, base_ms: float, shed_above: float | None = None) -> None:
        self.capacity, self.base_ms, self.shed_above = capacity, base_ms, shed_above
        self.rates: list[float] = []

    def __call__(self, rate: float) -> Step:
        self.rates.append(rate)
        n = max(int(rate * 5), 1)
        load = rate / self.capacity
        if load >= 1:  # the queue grows all through the step
            lat = [self.base_ms + 1e3 * i / rate * (load - 1) for i in range(n)]
        else:
            lat = [self.base_ms / (1 - load)] * n  # one value: p99 is the same whatever the step's size
        shed = self.shed_above is not None and rate > self.shed_above
        status = ["shed" if shed and i % 7 == 0 else "ok" for i in range(n)]
        return step_from(rate, 5.0, [i / rate for i in range(n)], lat, status)

    def threshold(self, slo_ms: float) -> float:
        """The true highest rate meeting the SLO: p99 = base / (1 - load) <= slo, below any shedding."""
        rate = self.capacity * (1 - self.base_ms / slo_ms)
        return min(rate, self.shed_above) if self.shed_above is not None else rate


@pytest.mark.parametrize("capacity,base_ms,slo_ms,start", [
    (20.0, 50.0, 1000.0, 14.0),  # start below the answer: grow, then bisect
    (20.0, 50.0, 200.0, 14.0),  # start above it: shrink, then bisect
    (300.0, 2.0, 200.0, 60.0),  # far below: several growth steps
    (5.0, 150.0, 200.0, 3.5),  # tight SLO: the answer is a small fraction of capacity
])
def test_the_search_brackets_the_true_rate_within_its_precision(capacity, base_ms, slo_ms, start):
    server = SimulatedServer(capacity, base_ms)
    found = search_rate(server, slo_ms, start, max_steps=12, precision=0.05)
    truth = server.threshold(slo_ms)
    assert found.best is not None and found.best.meets(slo_ms)
    assert found.rate_rps <= truth * 1.001  # never reports a rate that fails
    assert found.rate_rps >= truth / 1.05 / 1.001  # and is within the precision of the true rate
    assert found.below_rps is not None and found.below_rps <= found.rate_rps * 1.05 + 1e-9
    assert len(server.rates) == len(found.steps) <= 12 + 1  # one failed step is re-run


def test_a_second_slo_starts_from_the_first_searchs_steps():
    server = SimulatedServer(20.0, 50.0)
    first = search_rate(server, 1000.0, 14.0, max_steps=8, precision=0.05)
    probes_before = len(server.rates)
    second = search_rate(server, 200.0, 14.0, known=first.steps, max_steps=8, precision=0.05)
    alone = search_rate(SimulatedServer(20.0, 50.0), 200.0, 14.0, max_steps=8, precision=0.05)
    assert len(server.rates) - probes_before == len(second.steps) < len(alone.steps)
    assert second.rate_rps == pytest.approx(alone.rate_rps, rel=0.06)


def test_shedding_or_falling_behind_fails_a_step_whatever_its_p99():
    shedding = SimulatedServer(100.0, 1.0, shed_above=40.0)
    found = search_rate(shedding, 1000.0, 70.0, max_steps=12, precision=0.03)
    assert 40.0 / 1.03 <= found.rate_rps <= 40.0
    # a queue that grows by 600 ms over the step: p99 under a 1 s SLO, yet not a rate the server sustains
    behind = step_from(10.0, 5.0, [i / 10 for i in range(50)], [20.0 + 12.0 * i for i in range(50)], ["ok"] * 50)
    assert behind.p99_ms < 1000 and not behind.kept_up(1000.0) and not behind.meets(1000.0)
    steady = step_from(10.0, 5.0, [i / 10 for i in range(50)], [20.0 + (i % 5) for i in range(50)], ["ok"] * 50)
    assert steady.meets(1000.0) and steady.meets(30.0) and not steady.meets(20.0)


@pytest.mark.parametrize("slo_ms,precision", [(1000.0, 0.08), (200.0, 0.08), (1000.0, 0.03)])
def test_a_step_lasts_long_enough_for_a_queue_growing_at_half_the_precision_to_fail_it(slo_ms, precision):
    rate = 12.0
    duration = step_seconds(rate, slo_ms, step_s=4.0, min_requests=30, precision=precision, max_step_s=60.0)

    def step(seconds: float, overload: float) -> Step:  # each arrival waits for the backlog built up before it
        times = [i / rate for i in range(int(rate * seconds))]
        return step_from(rate, seconds, times, [100.0 + 1e3 * overload * t for t in times], ["ok"] * len(times))

    assert not step(duration, 0.6 * precision).meets(slo_ms)
    if duration > 4.0:  # the queue's growth sets the length, not the 4 s floor
        assert step(duration, 0.3 * precision).meets(slo_ms)  # well inside the precision: still a pass
        assert step(4.0, 0.6 * precision).meets(slo_ms)  # what a 4 s step let pass
    assert step_seconds(rate, slo_ms, step_s=4.0, min_requests=30, precision=precision, max_step_s=3.0) == 3.0
    assert step_seconds(1.0, 200.0, step_s=4.0, min_requests=30, precision=0.08, max_step_s=60.0) == 30.0


def test_a_refused_request_counts_as_a_late_one_and_a_failed_one_fails_the_step():
    def step(statuses: list[str]) -> Step:
        return step_from(20.0, 10.0, [i / 20 for i in range(len(statuses))], [50.0] * len(statuses), statuses)

    one_shed = step(["shed"] + ["ok"] * 199)  # 0.5 %: like a peer answering 0.5 % of its requests late
    assert one_shed.p99_ms == 50.0 and one_shed.meets(200.0)
    three_shed = step(["ok", "shed"] * 3 + ["ok"] * 194)  # 1.5 %: the p99 request was refused
    assert not three_shed.meets(200.0) and "3 shed of 200" in three_shed.why_not(200.0)
    late = step_from(20.0, 10.0, [i / 20 for i in range(200)], [201.0] * 3 + [50.0] * 197, ["ok"] * 200)
    assert not late.meets(200.0)  # the same 1.5 % answered late fails alike, however little late
    two_late = step_from(20.0, 10.0, [i / 20 for i in range(200)], [9e3] * 2 + [50.0] * 198, ["ok"] * 200)
    assert two_late.meets(200.0) and step(["shed"] * 2 + ["ok"] * 198).meets(200.0)  # 1 %: however late
    one_error = step(["error"] + ["ok"] * 199)
    assert not one_error.meets(200.0) and "1 failed" in one_error.why_not(200.0)
    from_before = Step(**{**asdict(one_shed), "p99_with_shed_ms": math.nan})  # a run's JSON from before the field
    assert not from_before.meets(200.0)


def test_the_ceiling_ends_the_search_and_nothing_passing_reads_zero():
    fast = search_rate(SimulatedServer(1e6, 0.1), 200.0, 50.0, max_steps=10, max_rps=300.0)
    assert fast.rate_rps == 300.0 and fast.at_ceiling and len(fast.steps) < 10
    never = search_rate(SimulatedServer(5.0, 500.0), 200.0, 3.5, max_steps=4)
    assert never.best is None and never.rate_rps == 0.0 and never.below_rps is not None


def test_a_disturbed_step_is_run_again_before_it_bounds_the_search():
    server = SimulatedServer(20.0, 50.0)
    truth = server.threshold(1000.0)

    def disturbed_once() -> tuple[Callable[[float], Step], list[float]]:
        hit: list[float] = []

        def probe(rate: float) -> Step:
            if not hit and rate < truth:  # the first step under the true rate meets a burst of other work
                hit.append(rate)
                return SimulatedServer(1.0, 50.0)(rate)
            return server(rate)
        return probe, hit

    probe, hit = disturbed_once()
    found = search_rate(probe, 1000.0, 8.0, max_steps=8, precision=0.05)
    assert hit and [s.rate_rps for s in found.steps].count(hit[0]) == 2  # run again at the same rate
    assert found.rate_rps >= truth / 1.05 / 1.001
    probe, hit = disturbed_once()
    assert search_rate(probe, 1000.0, 8.0, max_steps=8, precision=0.05, retries=0).rate_rps < hit[0]


def test_bracket_ignores_a_noisy_failure_below_a_pass():
    ok = step_from(10.0, 1.0, [0.0], [10.0], ["ok"])
    noisy = step_from(8.0, 1.0, [0.0], [900.0], ["ok"])
    fail = step_from(14.0, 1.0, [0.0], [900.0], ["ok"])
    lo, hi = bracket([noisy, ok, fail], 200.0)
    assert lo is ok and hi is fail


def test_the_section_lands_right_after_the_offline_table_and_is_replaced_in_place(tmp_path):
    md = tmp_path / "RESULTS.md"
    md.write_text("# r\n\n## Against each runtime's own tuning (issue 14)\n\nintro\n\n"
                  "### Offline: reamer's pick against OpenVINO THROUGHPUT, ONNX Runtime's default session, one "
                  "backend alone\n\noffline table\n\n### A serving peer: MLServer (issue 14)\n\nmlserver\n")
    write_section(str(md), "first")
    write_section(str(md), "second")
    text = md.read_text()
    assert text.count(SECTION) == 1 and "first" not in text
    assert text.index("offline table") < text.index(SECTION) < text.index("second") < text.index("MLServer")


def test_the_http_peers_parse_the_request_reamers_client_sends():
    inputs = {"x": np.arange(12, dtype=np.float32).reshape(1, 3, 4), "ids": np.array([[7, -1]], dtype=np.int64)}
    body, headers = binary_request(inputs, ["y"])
    got, wanted = parse_binary_request(body, int(headers["Inference-Header-Content-Length"]))
    assert wanted == ["y"] and list(got) == ["x", "ids"]
    for name, array in inputs.items():
        assert got[name].dtype == array.dtype and np.array_equal(got[name], array)
    with pytest.raises(ValueError, match="binary part"):  # a truncated body is refused, not read short
        parse_binary_request(body[:-4], int(headers["Inference-Header-Content-Length"]))


def test_a_binary_response_reads_back_and_the_check_catches_a_wrong_answer():
    from reamer.serve.protocol.v2wire import binary_body

    ref = {"y": np.array([[1.0, -2.0, 4.0]], dtype=np.float32), "z": np.array([3], dtype=np.int64)}
    head, blobs = binary_body("m", None, [("y", "FP32", ref["y"]), ("z", "INT64", ref["z"])])
    got = parse_binary_response(head + b"".join(blobs), len(head))
    assert answer_check(got, ref)["max_abs_diff"] == 0 and not answer_check(got, ref)["missing"]
    off = {"y": ref["y"] + np.float32(0.5), "z": ref["z"]}
    assert answer_check(off, ref)["max_abs_diff"] == pytest.approx(0.5)
    assert answer_check(off, ref)["max_rel_diff"] == pytest.approx(0.5 / 4.0)
    assert answer_check({"y": ref["y"]}, ref)["missing"] == ["z"]
    assert answer_check({"y": ref["y"][0], "z": ref["z"]}, ref)["max_abs_diff"] == math.inf  # wrong shape


def test_peers_select_the_contenders_and_a_wrong_group_is_named():
    assert select_contenders("inprocess,http") == ["reamer", *INPROCESS_PEERS, *HTTP_PEERS]
    assert select_contenders("http") == ["reamer", *HTTP_PEERS]
    assert select_contenders("http", reamer=False) == list(HTTP_PEERS)
    with pytest.raises(SystemExit, match="unknown group grpc"):
        select_contenders("http,grpc")


def _result(rate):
    return {"rate_rps": rate, "p99_ms": 50.0, "steps": []}


def test_two_ratios_one_against_each_kind_of_peer():
    results = {"reamer": {"1000": _result(30.0), "200": _result(10.0)},
               "OpenVINO THROUGHPUT f32": {"1000": _result(60.0), "200": _result(40.0)},
               "ORT default": {"1000": _result(50.0), "200": _result(50.0)},
               "OpenVINO THROUGHPUT f32 over HTTP": {"1000": _result(20.0), "200": _result(0.0)},
               "ORT default over HTTP": {"1000": _result(25.0), "200": _result(8.0)}}
    got = ratios(results)
    assert got["1000"] == {"best_peer": "OpenVINO THROUGHPUT f32", "ratio": 0.5,
                           "best_http_peer": "ORT default over HTTP", "ratio_http": 1.2}
    assert got["200"]["best_peer"] == "ORT default" and got["200"]["ratio"] == pytest.approx(0.2)
    assert got["200"]["best_http_peer"] == "ORT default over HTTP" and got["200"]["ratio_http"] == 1.25
    only_http = ratios({k: v for k, v in results.items() if k not in INPROCESS_PEERS})
    assert only_http["1000"]["ratio"] is None and only_http["1000"]["ratio_http"] == 1.2


def _run(contenders, results, info=None):
    row = {"model": "m", "load_before": [1.0], "load_after": [1.5], "results": results, "info": info or {},
           "ratio": ratios(results)}
    return {"command": "c", "machine": {"cpu_model": "cpu", "cpus": 2}, "cpus": [0, 1], "load_start": [1.0],
            "load_end": [1.5], "started": "s", "ended": "e", "step_s": 4.0, "min_requests": 30, "max_step_s": 20.0,
            "seed": 0, "precision": 0.08, "client": "lean", "contenders": contenders, "rows": [row]}


def test_the_table_shows_the_http_peers_and_both_ratios():
    contenders = select_contenders("inprocess,http")
    results = {"reamer": {"1000": _result(30.0), "200": _result(10.0)},
               **{c: {"1000": _result(60.0), "200": _result(40.0)} for c in INPROCESS_PEERS},
               **{c: {"1000": _result(20.0), "200": _result(8.0)} for c in HTTP_PEERS}}
    check = {"max_abs_diff": 2e-6, "max_rel_diff": 1e-7, "missing": []}
    text = render(_run(contenders, results, {c: {"check": check} for c in HTTP_PEERS}))
    header = next(line for line in text.splitlines() if line.startswith("| model"))
    for title in [*HTTP_PEERS, *INPROCESS_PEERS, "reamer / best in-process peer", "reamer / best peer over HTTP"]:
        assert title in header
    row = next(line for line in text.splitlines() if line.startswith("| m | 1000"))
    assert "0.50× (OpenVINO THROUGHPUT f32)" in row and "1.50× (OpenVINO THROUGHPUT f32 over HTTP)" in row
    assert len(row.split("|")) == len(header.split("|"))
    assert "reamer / best peer over HTTP ≥ 1.0: met in 2 of 2" in text
    assert "reamer / best in-process peer ≥ 1.0: met in 0 of 2" in text
    assert "2 checked, largest difference 2e-06" in text
    http_only = render(_run(select_contenders("http"), {c: results[c] for c in ["reamer", *HTTP_PEERS]}))
    assert "best in-process" not in http_only and "OpenVINO THROUGHPUT f32 /s" not in http_only


def test_a_run_from_before_the_http_peers_renders_as_it_did():
    data = _run(None, {c: {"1000": _result(30.0), "200": _result(10.0)} for c in ["reamer", *INPROCESS_PEERS]})
    del data["contenders"]
    header = next(line for line in render(data).splitlines() if line.startswith("| model"))
    assert "over HTTP" not in header and "reamer / best in-process peer" in header


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the bench gives every contender two cpus")
def test_quick_run_on_the_tiny_model(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.online_peers", "--quick", "--models", "tiny", "--max-rate", "60", "--step", "1",
         "--max-step", "2", "--search-budget", "15", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = json.loads((tmp_path / "online_peers.json").read_text())["rows"][0]
    assert "error" not in row, row
    for contender, results in row["results"].items():
        assert set(results) == {"1000", "200"}, contender
        steps = [s for r in results.values() for s in r["steps"]]
        assert steps and all(s["sent"] > 0 for s in steps)
        for slo, result in results.items():
            if result["rate_rps"] > 0:  # the reported rate is one of the contender's passing steps
                assert any(s["rate_rps"] == result["rate_rps"] and Step(**s).meets(float(slo))
                           for s in steps), (contender, slo)
    # reamer's requests went through its front door and came back answered (binary tensors accepted)
    reamer_steps = [s for r in row["results"]["reamer"].values() for s in r["steps"]]
    assert any(s["ok"] > 0 for s in reamer_steps)
    assert math.isfinite(row["ratio"]["1000"]["ratio"]) and math.isfinite(row["ratio"]["1000"]["ratio_http"])
    # the peers over HTTP answered the sample request with the in-process output's numbers, and then the load
    assert set(row["results"]) == {"reamer", *INPROCESS_PEERS, *HTTP_PEERS}
    for peer in HTTP_PEERS:
        check = row["info"][peer]["check"]
        assert not check["missing"] and check["max_rel_diff"] < 1e-4, (peer, check)
        assert any(s["ok"] > 0 for r in row["results"][peer].values() for s in r["steps"]), peer
