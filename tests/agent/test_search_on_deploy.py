"""An online deploy without a layout runs the real layout search on the job's free cpus (issue 4
item 6): accepted with the chosen layout and the profile cached when the rate fits, refused with
409 admission_refused and the achievable rate when it does not."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import psutil
import pytest

from reamer.agent.inference import InferenceRecord, choose_for
from reamer.api.client import ApiError
from reamer.plan.layout import parse_layout
from reamer.search.chooser import LayoutRequest, ProfileCacheChooser, SearchOnDeploy
from reamer.serve.measure.profile_cache import ProfileCache, model_key
from tests.agent.conftest import needs_rt_host


from reamer.serve import models

# short measurements so the search takes seconds: one free cpu, batches 1 and 2
FAST_SEARCH = {"search_budget_s": 60, "search_max_batch": 2, "search_warmup_s": 0.05, "search_window_s": 0.05}


@pytest.fixture
def tiny_model(tmp_path) -> str:
    return models.build_model("tiny", tmp_path / "tiny.onnx").path


@pytest.fixture
def two_cpus() -> list[int]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs: one reserved for the agent, one free for the online job")
    return cpus


class WorkerWatch:
    """Samples the agent's profiler worker processes while a deploy runs: the cpus each was told to
    use and the affinity it actually had."""

    def __init__(self, agent_pid: int) -> None:
        self.agent_pid = agent_pid
        self.configured: dict[int, list[int]] = {}
        self.affinity: dict[int, set[tuple[int, ...]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                children = psutil.Process(self.agent_pid).children(recursive=True)
            except psutil.Error:
                children = []
            for proc in children:
                try:
                    cmd = proc.cmdline()
                    if "reamer.serve.measure.profile_worker" not in cmd:
                        continue
                    self.configured[proc.pid] = json.loads(cmd[-1])["cpus"]
                    self.affinity.setdefault(proc.pid, set()).add(tuple(sorted(proc.cpu_affinity())))
                except (psutil.Error, ValueError, KeyError, IndexError):
                    continue
            self._stop.wait(0.02)

    def __enter__(self) -> "WorkerWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@needs_rt_host
@pytest.mark.root
def test_deploy_searches_on_the_free_cpus_admits_caches_and_refuses_what_does_not_fit(
        daemon_factory, tiny_model, two_cpus):
    reserved, free = two_cpus[0], two_cpus[1:]
    daemon = daemon_factory(reserved_cpus=[reserved], inference=FAST_SEARCH)
    profile_dir = daemon.state_dir / "profiles"
    assert not list(profile_dir.glob("*.json"))

    with WorkerWatch(daemon.proc.pid) as watch:
        job = daemon.client.deploy_inference({"name": "web", "model": tiny_model, "kind": "online",
                                              "slo_ms": 1000, "rate_rps": 1})
    assert job.state == "running", job.message
    # the layout was chosen (not the default of one instance over all free cpus) and uses the free cpus
    deployed = next(e for e in daemon.events("inference_deployed") if e.job == "web")
    assert deployed.data["layout"] == job.layout
    assert parse_layout(job.layout).total_cores == len(free)
    assert {i.max_batch for i in job.instances} <= {1, 2}
    assert sorted(c for i in job.instances for c in i.cpus) == free
    # the search measured, and only on the free cpus
    assert watch.configured, "the deploy ran no profiler worker: no search happened"
    assert all(set(cpus) <= set(free) for cpus in watch.configured.values()), watch.configured
    assert any(set(a) <= set(free) for seen in watch.affinity.values() for a in seen), watch.affinity
    # the profile is cached under the model's key, for the cores that were free
    points = ProfileCache(profile_dir).get(model_key(tiny_model, "onnxruntime"))
    assert points and max(p.cores for p in points) == len(free)
    cache_file = next(profile_dir.glob("*.json"))
    stamp = cache_file.stat().st_mtime_ns
    daemon.client.remove_inference("web")

    # now a cache hit: planned from the profile without measuring, and the absurd rate is refused
    with WorkerWatch(daemon.proc.pid) as watch, pytest.raises(ApiError) as info:
        daemon.client.deploy_inference({"name": "flood", "model": tiny_model, "kind": "online",
                                        "slo_ms": 1000, "rate_rps": 1e7})
    assert info.value.status == 409 and info.value.code == "admission_refused"
    achievable = info.value.data["achievable_rps"]
    assert 0 < achievable < 1e7 and "rps" in info.value.message
    assert info.value.data["layout"]
    assert not watch.configured, "a cached profile must not be measured again"
    assert cache_file.stat().st_mtime_ns == stamp
    assert daemon.client.list_inference_jobs() == []


@needs_rt_host
@pytest.mark.root
def test_search_on_deploy_off_keeps_one_instance_over_the_free_cpus(daemon_factory, tiny_model, two_cpus):
    reserved, free = two_cpus[0], two_cpus[1:]
    daemon = daemon_factory(reserved_cpus=[reserved], inference={**FAST_SEARCH, "search_on_deploy": False})
    job = daemon.client.deploy_inference({"name": "wide", "model": tiny_model, "kind": "online", "slo_ms": 1000,
                                          "rate_rps": 1e7, "max_batch": 2})
    # no profile and no measuring: no admission check either
    assert len(job.instances) == 1 and job.instances[0].cpus == free and job.instances[0].threads == len(free)
    assert not list(Path(daemon.state_dir, "profiles").glob("*.json"))
    daemon.client.remove_inference("wide")


# --- the chooser itself (no daemon) ---------------------------------------------------------------

def chooser_for(tmp_path, **search) -> ProfileCacheChooser:
    settings = {"budget_s": 60, "max_batch": 2, "warmup_s": 0.05, "window_s": 0.05, **search}
    return ProfileCacheChooser(tmp_path / "profiles", search=SearchOnDeploy(**settings))


def test_the_search_keeps_to_the_jobs_max_batch_then_plans_from_the_cache(tmp_path, tiny_model):
    cpu = [max(os.sched_getaffinity(0))]
    chooser = chooser_for(tmp_path, max_batch=4)
    rec = InferenceRecord(name="web", model=tiny_model, kind="online", backend="onnxruntime", slo_ms=1000.0,
                          rate_rps=1.0, max_batch=1)
    choice = choose_for(chooser, rec, cpu)
    assert choice.accepted and choice.layout == "1x1:b1" and choice.achievable_rps >= 1.0
    assert "measured" in choice.reason
    points = ProfileCache(tmp_path / "profiles").get(model_key(tiny_model, "onnxruntime"))
    assert points and {p.batch for p in points} == {1}
    # the same deploy again: planned from the cache, refused for a rate beyond it
    rec.rate_rps = 1e7
    again = choose_for(chooser, rec, cpu)
    assert not again.accepted and 0 < again.achievable_rps < 1e7 and "cached profile" in again.reason


def test_a_budget_too_short_to_measure_refuses_a_rate_and_has_no_opinion_without_one(tmp_path, tiny_model):
    chooser = chooser_for(tmp_path, budget_s=1e-9)
    cpu = [max(os.sched_getaffinity(0))]
    refused = chooser(LayoutRequest(tiny_model, "onnxruntime", cpu, 1000.0, 5.0))
    assert not refused.accepted and refused.achievable_rps == 0.0 and "search_budget_s" in refused.reason
    assert chooser(LayoutRequest(tiny_model, "onnxruntime", cpu, 1000.0, None)) is None
    assert not list((tmp_path / "profiles").glob("*.json"))


def test_an_external_chooser_is_asked_the_whole_job_in_one_request(tiny_model):
    asked = []

    def external(request: LayoutRequest):
        asked.append(request)

    rec = InferenceRecord(name="web", model=tiny_model, kind="online", backend="openvino", slo_ms=10.0,
                          rate_rps=3.0, max_batch=4, precision="bf16")
    assert choose_for(external, rec, [1]) is None
    assert asked == [LayoutRequest(tiny_model, "openvino", [1], 10.0, 3.0, max_batch=4, samples=rec.samples(),
                                   precision="bf16")]
