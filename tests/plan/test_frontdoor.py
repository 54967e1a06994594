"""The front door's cpu as part of the layout: where the job's own process goes when no cpu is reserved, and
what the search charges a layout that leaves it no core."""
from __future__ import annotations

import shutil

import pytest

from reamer.agent.inference import InferenceRecord, InferenceSupervisor
from reamer.plan.frontdoor import charge_candidates, charged_rps, frontdoor_cpus, share_of_cores
from reamer.plan.layout import parse_layout
from reamer.plan.partition import Candidate

TRUE = shutil.which("true") or "/bin/true"  # the job "process": placement is what is tested here


def supervisor(tmp_path, reserved=()) -> InferenceSupervisor:
    return InferenceSupervisor(tmp_path / "run", reserved, python=TRUE)


def online(name: str, layout: str) -> InferenceRecord:
    return InferenceRecord(name=name, model="/m.onnx", kind="online", backend="onnxruntime", slo_ms=100.0,
                           layout=layout, port=0)


def test_no_reserved_cpu_two_cores_1x1_layout_puts_the_front_door_on_the_other_core(tmp_path):
    sup = supervisor(tmp_path)
    rec = sup.records["web"] = online("web", "1x1:b4")
    sup.replan([0, 1], [])
    spec = sup.build_spec(rec)
    (instance,) = spec.instances
    assert len(instance.cpus) == 1
    assert spec.frontdoor_cpus == sorted({0, 1} - set(instance.cpus))


def test_the_front_door_shares_the_jobs_cores_only_when_no_core_is_idle(tmp_path):
    sup = supervisor(tmp_path)
    web = sup.records["web"] = online("web", "1x1:b4")
    api = sup.records["api"] = online("api", "1x1:b4")
    api.created_at = web.created_at + 1
    sup.replan([0, 1], [])
    for rec in (web, api):  # every core holds an instance: each front door on its own job's core
        spec = sup.build_spec(rec)
        assert spec.frontdoor_cpus == spec.instances[0].cpus


def test_reserved_cpus_keep_the_front_door(tmp_path):
    sup = supervisor(tmp_path, reserved=[0])
    rec = sup.records["web"] = online("web", "1x1:b4")
    sup.replan([1, 2], [])
    assert sup.build_spec(rec).frontdoor_cpus == [0]


def test_the_rule_in_order():
    assert frontdoor_cpus([0], [3], [1], [1]) == [0]
    assert frontdoor_cpus([], [3, 2], [1], [1]) == [2, 3]
    assert frontdoor_cpus([], [], [1], [1, 5]) == [1]
    assert frontdoor_cpus([], [], [], [5]) == [5]  # offline on training cores only


def test_the_charge_is_rate_times_cpu_per_request():
    assert share_of_cores(100.0, 2.0, 2) == pytest.approx(0.1)  # 100 rps x 2 ms = 0.2 cpu of 2
    assert share_of_cores(10_000.0, 2.0, 2) == 1.0
    # a layout that carries 1000 rps alone on 2 cores, with a 1 ms front door beside it: X = 1000 / 1.5
    x = charged_rps(1000.0, 1.0, 2)
    assert x == pytest.approx(1000 / 1.5)
    assert x == pytest.approx(1000.0 * (1 - share_of_cores(x, 1.0, 2)))  # what is left carries X
    assert charged_rps(1000.0, 0.0, 2) == 1000.0


def test_a_layout_on_every_core_is_charged_one_that_leaves_a_core_is_not():
    full = Candidate(parse_layout("2x1:b4"), 1000.0, 5.0, 900.0, 6.0, sustained_rps=800.0)
    fewer = Candidate(parse_layout("1x1:b4"), 500.0, 5.0)
    charged_full, kept = charge_candidates([full, fewer], 2, 1.0)
    assert charged_full.measured_rps == pytest.approx(charged_rps(900.0, 1.0, 2))
    assert charged_full.predicted_rps == pytest.approx(charged_rps(1000.0, 1.0, 2))
    assert charged_full.sustained_rps is None  # simulated again from the charged figures
    assert kept == fewer
