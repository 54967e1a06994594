"""The deploy's layout choice keeps to the job's precision: OpenVINO points cached at one precision never plan
a job at the other (ONNX Runtime's serve both: it computes f32 at either), and the record carries the
precision into the job spec the agent writes."""
from __future__ import annotations

from reamer.agent.inference import InferenceRecord, InferenceSupervisor, choose_for
from reamer.plan.partition import ProfilePoint
from reamer.search.chooser import ProfileCacheChooser
from reamer.serve import models
from reamer.serve.measure.profile_cache import ProfileCache, model_key

POINTS = [ProfilePoint(1, 1, 100.0, 5.0), ProfilePoint(1, 4, 180.0, 12.0), ProfilePoint(2, 1, 150.0, 4.0),
          ProfilePoint(2, 4, 260.0, 9.0)]


def test_cached_openvino_points_plan_only_their_own_precision(tmp_path):
    model = models.build_model("tiny", tmp_path / "tiny.onnx").path
    ProfileCache(tmp_path / "profiles").put(model_key(model, "openvino", precision="bf16"), POINTS)
    chooser = ProfileCacheChooser(tmp_path / "profiles")  # no search: a miss is "no opinion" (None)
    at = {p: InferenceRecord(name=p, model=model, kind="online", backend="openvino", slo_ms=20.0, precision=p)
          for p in ("f32", "bf16")}
    assert choose_for(chooser, at["f32"], [0, 1]) is None, "an f32 job was planned from bf16 points"
    assert choose_for(chooser, at["bf16"], [0, 1]).layout


def test_onnxruntime_points_serve_either_precision(tmp_path):
    model = models.build_model("tiny", tmp_path / "tiny.onnx").path
    ProfileCache(tmp_path / "profiles").put(model_key(model, "onnxruntime"), POINTS)
    chooser = ProfileCacheChooser(tmp_path / "profiles")
    rec = InferenceRecord(name="j", model=model, kind="online", backend="onnxruntime", slo_ms=20.0, precision="bf16")
    assert choose_for(chooser, rec, [0, 1]).layout


def test_the_job_spec_carries_the_precision(tmp_path):
    supervisor = InferenceSupervisor(tmp_path / "run", reserved_cpus=[0])
    old = InferenceRecord.from_doc({"name": "old", "model": "/m.onnx", "kind": "online", "backend": "openvino",
                                    "port": 1, "instances": [{"cpus": [1], "threads": 1, "max_batch": 1,
                                                              "on_training": False}]})
    assert old.precision == "f32"  # a record stored before precision existed
    assert supervisor.build_spec(old).precision == "f32"
    new = InferenceRecord.from_doc({**old.to_doc(), "name": "new", "precision": "bf16"})
    assert supervisor.build_spec(new).precision == "bf16"
