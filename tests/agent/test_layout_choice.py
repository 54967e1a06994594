"""The built-in layout chooser: cached profile -> exact partition -> admission (no measuring)."""
from __future__ import annotations

import pytest

from reamer.agent.errors import AdmissionRefused
from reamer.agent.inference import InferenceRecord, apply_choice
from reamer.plan.partition import ProfilePoint
from reamer.host.errors import ReamerError
from reamer.search.chooser import LayoutChoice, LayoutChooser, LayoutRequest, ProfileCacheChooser, load_chooser
from reamer.serve.measure.profile_cache import ProfileCache, model_key

from reamer.serve import models


@pytest.fixture
def cached(tmp_path):
    model = models.build_model("tiny", tmp_path / "tiny.onnx").path
    # each p99 at or above the mean batch latency (batch / throughput), as measured figures are: admission
    # simulates the open-loop rate from them
    points = [ProfilePoint(1, 1, 200.0, 6.0), ProfilePoint(1, 4, 400.0, 12.0), ProfilePoint(2, 1, 300.0, 4.0),
              ProfilePoint(2, 4, 700.0, 9.0)]
    ProfileCache(tmp_path / "profiles").put(model_key(model, "onnxruntime"), points)
    return model, ProfileCacheChooser(tmp_path / "profiles")


def test_no_profile_means_no_opinion(tmp_path):
    model = models.build_model("tiny", tmp_path / "tiny.onnx").path
    assert ProfileCacheChooser(tmp_path / "none")(LayoutRequest(model, "onnxruntime", [0, 1], 10.0, 50.0)) is None


def test_profile_gives_a_layout_and_admits_a_rate_that_fits(cached):
    model, chooser = cached
    choice = chooser(LayoutRequest(model, "onnxruntime", [0, 1], 20.0, 100.0))
    assert choice.accepted and choice.layout and choice.achievable_rps >= 100.0
    rec = InferenceRecord(name="web", model=model, kind="online", backend="onnxruntime", slo_ms=20.0, rate_rps=100.0)
    apply_choice(rec, choice, [0, 1])
    assert rec.layout == choice.layout


def test_a_rate_beyond_the_cores_is_refused_with_the_achievable_rate(cached):
    model, chooser = cached
    choice = chooser(LayoutRequest(model, "onnxruntime", [0, 1], 20.0, 5000.0))
    assert not choice.accepted and 0 < choice.achievable_rps < 5000
    rec = InferenceRecord(name="web", model=model, kind="online", backend="onnxruntime", slo_ms=20.0,
                          rate_rps=5000.0)
    with pytest.raises(AdmissionRefused) as info:
        apply_choice(rec, choice, [0, 1])
    assert info.value.achievable_rps == choice.achievable_rps and "rps" in info.value.message
    assert info.value.fix


def test_an_slo_no_shape_meets_is_refused(cached):
    model, chooser = cached
    choice = chooser(LayoutRequest(model, "onnxruntime", [0, 1], 1.0, None))
    assert isinstance(choice, LayoutChoice) and not choice.accepted


def test_load_chooser_by_name_and_clear_error():
    chooser = load_chooser("tests.api.conftest:refuse_all", "/nonexistent")
    assert chooser(LayoutRequest("m", "b", [0], 1.0, 100.0)).accepted is False
    with pytest.raises(Exception, match="cannot be loaded"):
        load_chooser("no.such.module:fn", "/nonexistent")


# plug-ins as inference.layout_chooser names them ("tests.agent.test_layout_choice:NAME")
def five_argument_chooser(model, backend, cpus, slo_ms, rate_rps):
    return LayoutChoice("1x1:b1")


class FixedLayout:
    def __init__(self) -> None:
        self.asked: list[LayoutRequest] = []

    def __call__(self, request: LayoutRequest) -> LayoutChoice | None:
        self.asked.append(request)
        return LayoutChoice(f"{len(request.cpus)}x1:b1")


fixed_layout = FixedLayout()
not_a_chooser = 42


def test_a_chooser_object_takes_the_one_request_and_is_a_layout_chooser():
    chooser = load_chooser("tests.agent.test_layout_choice:fixed_layout", "/nonexistent")
    assert isinstance(chooser, LayoutChooser)
    request = LayoutRequest("m.onnx", "openvino", [2, 3], 50.0, 10.0, max_batch=8, precision="bf16")
    assert chooser(request).layout == "2x1:b1"
    assert fixed_layout.asked[-1] == request


@pytest.mark.parametrize("name, problem", [("five_argument_chooser", "cannot be called with one LayoutRequest"),
                                           ("not_a_chooser", "is not callable")])
def test_a_chooser_of_another_form_is_refused_at_load_with_the_fix(name, problem):
    with pytest.raises(ReamerError) as info:
        load_chooser(f"tests.agent.test_layout_choice:{name}", "/nonexistent")
    assert problem in info.value.message and "request: reamer.search.chooser.LayoutRequest" in info.value.fix


def test_a_planned_layout_keeps_its_batch_within_half_the_slo(cached):
    model, chooser = cached
    # at 30 ms every cached shape qualifies (15 ms for the batch): two 1-core instances at batch 4 (800/s); at 20 ms
    # (10 ms for the batch) 1x1:b4's 12 ms no longer does, though it is under the SLO itself
    assert chooser(LayoutRequest(model, "onnxruntime", [0, 1], 30.0, None)).layout == "2x1:b4"
    assert chooser(LayoutRequest(model, "onnxruntime", [0, 1], 20.0, None)).layout == "1x2:b4"
    refused = chooser(LayoutRequest(model, "onnxruntime", [0, 1], 7.0, None))
    assert not refused.accepted and "within 3.5 ms" in refused.reason
