"""Issue 12 through a real agent: the traffic's shapes and sample data on POST /v1/inference-jobs (400s that
name the input), the client URL in the job record, and a job reached from another network namespace at
exactly that URL."""
from __future__ import annotations

import json
import os

import httpx
import numpy as np
import pytest

from reamer.api.client import ApiError
from tests.agent.conftest import needs_rt_host, wait_for
from tests.serve.bertlike import bert_feeds, build_bertlike
from tests.serve.netns import TRITON_CLIENT, netns  # noqa: F401 - the fixture

pytestmark = [needs_rt_host, pytest.mark.root]

from reamer.serve import models


@pytest.fixture
def tiny_model(tmp_path) -> str:
    return models.build_model("tiny", tmp_path / "tiny.onnx").path


@pytest.fixture
def bert_model(tmp_path) -> str:
    return build_bertlike(tmp_path / "bertlike.onnx")


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("shapes, words", [
    ({"input_idz": [1, 128]}, ["input_idz", "input_ids"]),
    ({"input_ids": [1, 2, 128]}, ["input_ids", "3 dims"]),
    ({"input_ids": [1, 0]}, ["input_ids", "positive"]),
])
def test_shapes_that_do_not_fit_are_400s_naming_the_input(daemon, bert_model, shapes, words):
    with pytest.raises(ApiError) as exc:
        daemon.client.deploy_inference({"name": "b", "model": bert_model, "kind": "online", "slo_ms": 500,
                                        "layout": "1x1:b4", "shapes": shapes})
    assert exc.value.status == 400
    assert all(w in f"{exc.value.message} {exc.value.fix}" for w in words), exc.value
    assert daemon.client.list_inference_jobs() == []  # all-or-nothing


def test_missing_or_foreign_sample_data_is_a_400(daemon, bert_model, tmp_path):
    data = tmp_path / "d.npz"
    np.savez(data, other=np.zeros((1, 4), np.int64))
    for input_data, word in ((str(tmp_path / "nope.npz"), "does not exist"), (str(data), "other")):
        with pytest.raises(ApiError) as exc:
            daemon.client.deploy_inference({"name": "b", "model": bert_model, "kind": "online", "slo_ms": 500,
                                            "layout": "1x1:b4", "input_data": input_data})
        assert exc.value.status == 400 and word in exc.value.message


def test_job_with_traffic_shapes_and_data_serves_and_reports_them(daemon, bert_model, tmp_path):
    data = tmp_path / "traffic.json"
    data.write_text(json.dumps({"data": [{"input_ids": [3] * 64, "attention_mask": [1] * 64,
                                          "token_type_ids": [1] * 64}]}))
    job = daemon.client.deploy_inference({"name": "b", "model": bert_model, "kind": "online", "slo_ms": 500,
                                          "layout": "1x1:b4", "shapes": {"input_ids": [1, 64]},
                                          "input_data": str(data), "bind_address": "127.0.0.1"})
    assert job.shapes == {"input_ids": [1, 64]} and job.input_data == str(data)
    assert job.bind_address == "127.0.0.1" and job.url == f"http://127.0.0.1:{job.port}"
    wait_for(lambda: _ready(job.url), timeout=90, what="the job to be ready")
    feeds = bert_feeds(1, 64)
    body = {"inputs": [{"name": k, "shape": list(v.shape), "datatype": "INT64", "data": v.ravel().tolist()}
                       for k, v in feeds.items()]}
    answer = httpx.post(f"{job.url}/v2/models/b/infer", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    # the front door's own cpu for that request reaches the job's status and the agent's metrics
    status = wait_for(lambda: (s := daemon.client.get_inference_job("b").status).frontdoor_cpu_ms and s,
                      timeout=30, what="the front door's cpu in the job's status")
    assert status.frontdoor_cpu_ms > 0 and status.frontdoor_busy > 0
    assert 'reamer_inference_frontdoor_busy{job="b"}' in daemon.client.metrics()


def test_default_job_listens_everywhere_and_its_url_works_from_another_namespace(daemon, tiny_model, netns):  # noqa: F811
    job = daemon.client.deploy_inference({"name": "web", "model": tiny_model, "kind": "online", "slo_ms": 500,
                                          "layout": "1x1:b4"})
    assert job.bind_address == "0.0.0.0"
    assert job.url and job.url.endswith(f":{job.port}") and "127.0.0.1" not in job.url
    wait_for(lambda: _ready(f"http://127.0.0.1:{job.port}"), timeout=90, what="the job to be ready")
    done = netns.python(TRITON_CLIENT, job.url, "web")
    assert done.returncode == 0 and done.stdout.strip() == "(2, 4)", done.stderr


def test_search_on_deploy_measures_the_traffic_and_caches_it_under_its_shapes(daemon_factory, tmp_path):
    from reamer.serve.measure.profile_cache import ProfileCache, model_key
    from reamer.serve.samples import SampleSpec

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs: one reserved for the agent, one free for the online job")
    bert = build_bertlike(tmp_path / "bertlike.onnx", hidden=32)
    daemon = daemon_factory(reserved_cpus=[cpus[0]], inference={
        "search_budget_s": 60, "search_max_batch": 2, "search_warmup_s": 0.05, "search_window_s": 0.05})
    job = daemon.client.deploy_inference({"name": "seq96", "model": bert, "kind": "online", "slo_ms": 1000,
                                          "rate_rps": 1, "backend": "onnxruntime",
                                          "shapes": {"input_ids": [1, 96]}})
    assert job.state == "running", job.message
    cache = ProfileCache(daemon.state_dir / "profiles")
    assert cache.get(model_key(bert, "onnxruntime", samples=SampleSpec({"input_ids": (1, 96)})))
    assert cache.get(model_key(bert, "onnxruntime")) is None  # not filed as the default (seq 16) traffic
    daemon.client.remove_inference("seq96")
