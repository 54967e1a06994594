"""Issue 14 on real runtimes: OpenVINO streams inside one instance, the layout search with --backend auto
(both backends measured, the best layout names its backend, each backend's points cached), and the agent
carrying the chosen backend from the cache and from a request's layout."""
from __future__ import annotations

import os

import numpy as np
import pytest

from reamer.agent.errors import InvalidRequest
from reamer.agent.inference import InferenceRecord, apply_choice, validate_request
from reamer.host.errors import ReamerError
from reamer.plan.layout import Layout, format_layout, parse_layout
from reamer.plan.partition import ProfilePoint
from reamer.serve.backends import open_backend, sample_inputs
from reamer.search.backends import installed_backends
from reamer.search.chooser import LayoutRequest, ProfileCacheChooser
from reamer.search.on_cores import MeasureSettings, cached_points, search_layout
from reamer.serve.models import build_model
from reamer.serve.measure.profile_cache import ProfileCache, model_key
from reamer.serve.measure.profiler import measure_layout_detail, measure_point
from reamer.serve.spec import InstanceSpec, SpecError

FAST = MeasureSettings(warmup_s=0.05, window_s=0.05, max_windows=4, verify_windows=2)
CPUS = sorted(os.sched_getaffinity(0))[-2:]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("auto-models")
    return {f: build_model(f, d / f"{f}.onnx").path for f in ("tiny", "multi-io")}


@pytest.mark.parametrize("family", ["tiny", "multi-io"])
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_streams_split_a_batch_and_answer_the_same(paths, family, batch):
    with open_backend("openvino", paths[family], 1) as one, open_backend("openvino", paths[family], 2, 2) as two:
        assert two.streams == 2 and int(two.property("NUM_STREAMS")) == 2
        feeds = sample_inputs(one, batch, np.random.default_rng(3))
        a, b = one.run(feeds), two.run(feeds)
        assert set(a) == set(b)
        for name in a:
            assert b[name].shape == a[name].shape and b[name].dtype == a[name].dtype
            np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6)


def test_streams_are_refused_where_they_cannot_run(paths):
    with pytest.raises(ReamerError, match="one stream"):
        open_backend("onnxruntime", paths["tiny"], 2, 2)
    with pytest.raises(ReamerError, match="streams must be"):
        open_backend("openvino", paths["tiny"], 1, 2)


def test_profiler_runs_a_streams_instance(paths):
    point = measure_point(paths["tiny"], "openvino", 1, 4, CPUS[-1:], warmup_s=0.05, window_s=0.05, max_windows=3,
                          threads=2, streams=2)
    assert point.throughput_rps > 0
    m = measure_layout_detail(paths["tiny"], "openvino", parse_layout("1x1t2s2:b4@openvino"), CPUS[-1:],
                              warmup_s=0.05, window_s=0.05, windows=2)
    assert m.throughput_rps > 0 and m.instances[0].threads == 2


def test_instance_spec_carries_streams():
    spec = InstanceSpec.from_dict({"cpus": [0, 1], "threads": 2, "max_batch": 4, "streams": 2})
    assert spec.streams == 2 and spec.key() != InstanceSpec([0, 1], 2, 4).key()
    assert InstanceSpec.from_dict({"cpus": [0], "threads": 1, "max_batch": 1}).streams == 1
    with pytest.raises(SpecError, match="streams"):
        InstanceSpec([0], 1, 1, streams=2)


@pytest.mark.skipif(len(installed_backends()) < 2, reason="needs onnxruntime and openvino installed")
def test_auto_search_measures_both_backends_and_names_the_winner(paths, tmp_path):
    cache = tmp_path / "profiles"
    outcome = search_layout(paths["tiny"], "auto", CPUS, None, cache_dir=cache, batches=[1, 2, 4], settings=FAST,
                            drop_margin=10.0)  # never drop: both backends are searched
    assert outcome.backends == ["onnxruntime", "openvino"]
    assert outcome.best is not None and outcome.best.layout.backend in ("onnxruntime", "openvino")
    assert outcome.backend == outcome.best.layout.backend
    labels = [r.layout for r in outcome.rows]
    assert all("@" in label for label in labels)
    assert {r.backend for r in outcome.rows} == {"onnxruntime", "openvino"}
    for backend in ("onnxruntime", "openvino"):
        assert cached_points(cache, paths["tiny"], backend)  # each backend's points in its own cache entry
    assert len(outcome.screens) == 2 and all(s.throughput for s in outcome.screens)
    if len(CPUS) == 2 and outcome.best.layout.backend == "openvino":  # streams were tried on the 2 cpus
        assert any("s2" in label for label in labels)
    again = search_layout(paths["tiny"], "auto", CPUS, None, cache_dir=cache, batches=[1, 2, 4], settings=FAST,
                          drop_margin=10.0)
    assert again.from_cache and again.best is not None


# --- the agent -----------------------------------------------------------------------------------------------


def _request(model, **extra):
    return {"name": "j", "model": model, "kind": "online", "slo_ms": 100.0, **extra}


def test_request_layout_names_the_backend(paths):
    rec = validate_request(_request(paths["tiny"], layout="2x1:b4@openvino"), "auto")
    assert rec.backend == "openvino" and rec.layout == "2x1:b4@openvino"
    rec = validate_request(_request(paths["tiny"], layout="2x1:b4@openvino", backend="auto"), "onnxruntime")
    assert rec.backend == "openvino"
    rec = validate_request(_request(paths["tiny"], layout="2x1:b4"), "auto")
    assert rec.backend == installed_backends()[0] and rec.layout == "2x1:b4"
    rec = validate_request(_request(paths["tiny"]), "auto")
    assert rec.backend == "auto"  # the chooser decides
    offline = validate_request({"name": "o", "model": paths["tiny"], "kind": "offline", "input_dir": str(CACHE_DIR),
                                "output_dir": str(CACHE_DIR / "out")}, "auto")
    assert offline.backend == installed_backends()[0]


CACHE_DIR = __import__("pathlib").Path(__import__("tempfile").mkdtemp(prefix="reamer-auto-"))


@pytest.mark.parametrize("layout, backend, why", [
    ("2x1:b4@openvino", "onnxruntime", "runs on openvino"),
    ("1x2s2:b4", "onnxruntime", "only openvino"),
    ("1x2s2:b4@onnxruntime", None, "streams are OpenVINO's"),
    ("2x1:b4@cuda", None, "unknown"),
])
def test_request_layout_conflicts_are_refused(paths, layout, backend, why):
    req = _request(paths["tiny"], layout=layout)
    if backend:
        req["backend"] = backend
    with pytest.raises(InvalidRequest) as info:
        validate_request(req, "auto")
    assert why in info.value.message and info.value.fix


@pytest.mark.skipif(len(installed_backends()) < 2, reason="needs onnxruntime and openvino installed")
def test_chooser_plans_auto_from_both_cached_profiles(paths, tmp_path):
    cache = ProfileCache(tmp_path / "profiles")
    slow = [ProfilePoint(1, 1, 100.0, 5.0), ProfilePoint(2, 1, 150.0, 4.0)]
    fast = [ProfilePoint(1, 1, 140.0, 4.0), ProfilePoint(2, 1, 200.0, 3.0)]
    cache.put(model_key(paths["tiny"], "onnxruntime"), slow)
    cache.put(model_key(paths["tiny"], "openvino"), fast)
    chooser = ProfileCacheChooser(tmp_path / "profiles")
    choice = chooser(LayoutRequest(paths["tiny"], "auto", [0, 1], 20.0, 100.0))
    assert choice.accepted and parse_layout(choice.layout).backend == "openvino"
    assert chooser(LayoutRequest(paths["tiny"], "onnxruntime", [0, 1], 20.0, 100.0)).layout == "2x1:b1"  # no @
    rec = InferenceRecord(name="web", model=paths["tiny"], kind="online", backend="auto", slo_ms=20.0,
                          rate_rps=100.0)
    apply_choice(rec, choice, [0, 1])
    assert rec.backend == "openvino" and rec.layout == choice.layout
    unsure = InferenceRecord(name="x", model=paths["tiny"], kind="online", backend="auto")
    apply_choice(unsure, None, [0, 1])
    assert unsure.backend == installed_backends()[0]


def test_layout_on_keeps_the_instances():
    layout = Layout.uniform(2, 1, 4, backend="openvino")
    assert format_layout(layout) == "2x1:b4@openvino" and layout.on(None).instances == layout.instances


@pytest.mark.skipif(len(installed_backends()) < 2, reason="needs onnxruntime and openvino installed")
def test_cli_search_defaults_to_auto_and_says_what_screening_found(paths, tmp_path):
    import json

    from click.testing import CliRunner

    from reamer.cli.main import cli

    result = CliRunner().invoke(cli, ["-o", "json", "search", paths["tiny"], "--cores", "1", "--max-batch", "2",
                                      "--cpus", str(CPUS[-1]), "--cache-dir", str(tmp_path / "cache"),
                                      "--warmup-s", "0.05", "--window-s", "0.05", "--max-windows", "4",
                                      "--verify-windows", "2"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout[result.stdout.index("{"):])
    assert data["backends_searched"] == ["onnxruntime", "openvino"]
    assert parse_layout(data["best"]["layout"]).backend == data["backend"]
    assert {s["backend"] for s in data["screening"]} == {"onnxruntime", "openvino"}
    assert all(s["throughput_rps"] for s in data["screening"])


def test_job_serves_from_an_openvino_instance_with_streams(paths, tmp_path):
    import subprocess
    import sys

    import httpx

    from reamer.serve.spec import JobSpec
    from tests.conftest import wait_for
    from tests.serve.jobs import CPUS as JOB_CPUS, REPO, job_workers, read_status

    spec = JobSpec(name="tiny", kind="online", model=paths["tiny"], backend="openvino", port=0,
                   run_dir=str(tmp_path / "run"), instances=[InstanceSpec([JOB_CPUS[-1]], 2, 8, streams=2)],
                   frontdoor_cpus=[JOB_CPUS[0]])
    spec.save(tmp_path / "spec.json")
    proc = subprocess.Popen([sys.executable, "-m", "reamer.serve.runtime.job", "--spec", str(tmp_path / "spec.json")], cwd=REPO)
    try:
        status = wait_for(lambda: (s := read_status(tmp_path / "run")) and s.state == "ready" and s.port and s,
                          timeout=120, what="the job to be ready")
        assert any("2s2" in " ".join(w.cmdline()) for w in job_workers(proc))  # 2 threads in 2 streams
        x = np.random.default_rng(1).standard_normal((5, 16)).astype(np.float32)
        r = httpx.post(f"http://127.0.0.1:{status.port}/v2/models/tiny/infer", timeout=60,
                       json={"inputs": [{"name": "input", "shape": [5, 16], "datatype": "FP32",
                                         "data": x.ravel().tolist()}]})
        assert r.status_code == 200, r.text
        got = np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(5, -1)
        with open_backend("onnxruntime", paths["tiny"], 1) as ort_b:
            want = next(iter(ort_b.run({"input": x}).values()))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    finally:
        proc.terminate()
        proc.wait(60)
