"""Batching only where it is safe, faults that never wedge a job, and Triton's config and statistics surface.

Models (tests/serve/batch_models.py) whose outputs are per row and others whose outputs are not (a
reduction over the request, a data-dependent first dimension, an operation across rows, a rank-0 input);
real instance workers and real online jobs; eight concurrent tritonclient clients over REST and gRPC that
each check they get the answer of their own input computed alone.
"""
from __future__ import annotations

import asyncio
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from reamer.serve.runtime import batcher as batcher_module
from reamer.serve.backends import open_backend
from reamer.serve.runtime.batchability import declared_batchability, onnx_batch_dim_names
from reamer.serve.runtime.batcher import DynamicBatcher, ModelFault, RequestRefused
from reamer.serve.protocol.model_config import max_request_rows
from reamer.serve.spec import InstanceSpec
from reamer.serve.runtime.instances import InstanceWorker
from tests.serve import batch_models
from tests.serve.batch_models import MODELS, client_inputs
from tests.serve.jobs import RunningJob

CPU = sorted(os.sched_getaffinity(0))[-1]
MAX_BATCH = 4
CLIENTS = 8
REQUESTS_PER_CLIENT = 5
BATCHABLE = {"rowwise": True, "reduction": False, "nonzero": False, "compress": False, "crossrow": False,
             "scalar_in": False}
TRITON_TYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch-models")
    return {kind: batch_models.build(kind, d) for kind in MODELS}


@pytest.fixture(scope="module")
def references(models):
    refs = {kind: open_backend("onnxruntime", path, 1) for kind, path in models.items()}
    yield refs
    for ref in refs.values():
        ref.close()


# ---------------------------------------------------------------- the rule and the probe

@pytest.mark.parametrize("kind", MODELS)
def test_the_declared_rule_is_tritons_and_the_probe_catches_what_it_cannot_see(kind, models, make_worker):
    ref = open_backend("onnxruntime", models[kind], 1)
    declared = declared_batchability(ref.inputs, ref.outputs, onnx_batch_dim_names(models[kind]))
    # crossrow declares a batch dimension everywhere: only running two rows together shows it is not one
    assert declared.batchable == (kind in ("rowwise", "crossrow")), declared
    w = make_worker(models[kind])  # the worker runs the probe on the job's sample inputs when it starts
    assert w.batchability.batchable == BATCHABLE[kind] and w.batchability.reason
    if kind == "crossrow":
        assert "depends on the other rows" in w.batchability.reason


# ---------------------------------------------------------------- the batcher over real workers

@pytest.fixture
def make_worker(tmp_path):
    made = []

    def make(model, max_batch=MAX_BATCH):
        w = InstanceWorker(len(made), InstanceSpec([CPU], 1, max_batch), model, run_dir=str(tmp_path))
        made.append(w)
        w.start()
        return w

    yield make
    for w in made:
        if w.alive:
            os.kill(w.pid, signal.SIGCONT)
        w.stop(grace_s=5)


async def _until(pred, timeout=30.0, what="condition"):
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _queued_behind_a_stopped_batch(b: DynamicBatcher, w: InstanceWorker, feeds: list[dict]) -> list:
    """Run feeds[0], hold the instance (SIGSTOP) so the others queue behind it, release; every answer or error."""
    os.kill(w.pid, signal.SIGSTOP)
    first = asyncio.ensure_future(b.infer(feeds[0]))
    await _until(lambda: w.busy, what="the first batch in flight")
    rest = [asyncio.ensure_future(b.infer(f)) for f in feeds[1:]]
    await _until(lambda: len(b._queue) == len(feeds) - 1, what="the other requests queued")
    os.kill(w.pid, signal.SIGCONT)
    return await asyncio.gather(first, *rest, return_exceptions=True)


@pytest.mark.parametrize("kind", ["reduction", "nonzero", "compress", "crossrow", "scalar_in"])
def test_requests_of_a_model_that_is_not_batchable_are_never_merged(kind, models, references, make_worker):
    w = make_worker(models[kind])
    feeds = [client_inputs(kind, c, 0, rows=1 + c % 2) for c in range(4)]

    async def main():
        b = DynamicBatcher(slo_ms=None)
        b.add_instance(w)
        outs = await _queued_behind_a_stopped_batch(b, w, feeds)
        await b.close()
        return outs

    outs = asyncio.run(main())
    for f, out in zip(feeds, outs):
        want = references[kind].run(f)
        assert set(out) == set(want)
        for name in want:
            np.testing.assert_allclose(out[name], want[name], rtol=1e-5)
    assert w.batches_run == len(feeds)  # one run per request, although three of them queued together


def test_requests_of_a_batchable_model_are_merged_and_split_by_rows(models, references, make_worker):
    w = make_worker(models["rowwise"])
    feeds = [client_inputs("rowwise", c, 0, rows=n) for c, n in enumerate((1, 1, 2, 1))]  # 1, then 1 + 2 + 1

    async def main():
        b = DynamicBatcher(slo_ms=None)
        b.add_instance(w)
        outs = await _queued_behind_a_stopped_batch(b, w, feeds)
        await b.close()
        return outs, b.model_stats.to_doc("m")

    outs, stats = asyncio.run(main())
    for f, out in zip(feeds, outs):
        for name, want in references["rowwise"].run(f).items():
            np.testing.assert_allclose(out[name], want, rtol=1e-5)
    assert w.batches_run == 2
    assert [(s["batch_size"], s["compute_infer"]["count"]) for s in stats["batch_stats"]] == [(1, 1), (4, 1)]
    assert (stats["inference_count"], stats["execution_count"]) == (5, 2)
    assert stats["inference_stats"]["success"]["count"] == 4


def test_a_rank_0_input_to_a_batchable_model_is_refused_and_the_lane_keeps_serving(models, references, make_worker):
    w = make_worker(models["rowwise"])
    good = client_inputs("rowwise", 1, 0)

    async def main():
        b = DynamicBatcher(slo_ms=None)
        b.add_instance(w)
        with pytest.raises(RequestRefused) as refused:
            await b.infer({"x": np.ones((), np.float32)})
        out = await b.infer(good)
        ready = b.all_ready()
        await b.close()
        return refused.value, out, ready

    refused, out, ready = asyncio.run(main())
    assert "scalar (rank 0)" in refused.message and "leading batch dimension" in refused.fix
    np.testing.assert_allclose(out["y"], references["rowwise"].run(good)["y"], rtol=1e-5)
    assert ready


def test_a_batch_that_cannot_be_joined_runs_request_by_request(models, references, make_worker, monkeypatch):
    w = make_worker(models["rowwise"])
    feeds = [client_inputs("rowwise", c, 0) for c in range(4)]
    real = np.concatenate

    class _NumpyWithBrokenConcatenate:  # the batcher's np, whose concatenate raises (numpy itself untouched)
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def concatenate(arrays, *args, **kwargs):
            if len(arrays) > 1:
                raise ValueError("zero-dimensional arrays cannot be concatenated")
            return real(arrays, *args, **kwargs)

    monkeypatch.setattr(batcher_module, "np", _NumpyWithBrokenConcatenate())

    async def main():
        b = DynamicBatcher(slo_ms=None)
        b.add_instance(w)
        outs = await _queued_behind_a_stopped_batch(b, w, feeds)
        await b.close()
        return outs

    outs = asyncio.run(main())
    for f, out in zip(feeds, outs):
        np.testing.assert_allclose(out["y"], references["rowwise"].run(f)["y"], rtol=1e-5)
    assert w.batches_run == 4


def test_a_fault_in_the_batch_path_fails_its_requests_clearly_and_the_lane_goes_on(models, references, make_worker,
                                                                                   monkeypatch, capfd):
    w = make_worker(models["rowwise"])
    feeds = [client_inputs("rowwise", c, 0) for c in range(3)]
    faults = []

    def broken_split(self, outputs, live):
        raise RuntimeError("split exploded")

    async def main():
        b = DynamicBatcher(slo_ms=None, name="safety", on_fault=lambda kind, msg: faults.append((kind, msg)))
        b.add_instance(w)
        with monkeypatch.context() as m:
            m.setattr(DynamicBatcher, "_split", broken_split)
            outs = await _queued_behind_a_stopped_batch(b, w, feeds)
        later = await asyncio.gather(*(b.infer(f) for f in feeds))  # the same lane answers afterwards
        ready = b.all_ready()
        await b.close()
        return outs, later, ready

    outs, later, ready = asyncio.run(main())
    # the first ran alone (never split); the two merged behind it failed with the reason, as a model fault
    assert not isinstance(outs[0], BaseException)
    for failed in outs[1:]:
        assert isinstance(failed, ModelFault) and "split exploded" in failed.message
    for f, out in zip(feeds, later):
        np.testing.assert_allclose(out["y"], references["rowwise"].run(f)["y"], rtol=1e-5)
    assert ready
    assert faults and faults[0][0] == "batch_failed" and "split exploded" in faults[0][1]
    assert "split exploded" in capfd.readouterr().err  # logged (the job's log)


def test_a_serving_loop_that_ends_makes_the_job_not_ready(models, make_worker, monkeypatch):
    w = make_worker(models["rowwise"])

    async def dies(self, lane):
        raise RuntimeError("loop died")

    monkeypatch.setattr(DynamicBatcher, "_serve", dies)

    async def main():
        b = DynamicBatcher(slo_ms=None)
        b.add_instance(w)
        await _until(lambda: not b.all_ready(), what="the job to say it is not ready")
        reason = b.not_ready_reason()
        with pytest.raises(batcher_module.NotReady):
            await b.infer(client_inputs("rowwise", 0, 0))
        b._closed = True
        return reason

    reason = asyncio.run(main())
    assert "0 of 1 instances are ready" in reason and "serving loop stopped" in reason and "loop died" in reason


# ---------------------------------------------------------------- real jobs, eight clients, REST and gRPC

def _http_inputs(feeds: dict) -> list:
    ins = []
    for name, arr in feeds.items():
        i = thttp.InferInput(name, list(arr.shape), TRITON_TYPES[arr.dtype])
        i.set_data_from_numpy(arr, binary_data=True)
        ins.append(i)
    return ins


def _grpc_inputs(feeds: dict) -> list:
    ins = []
    for name, arr in feeds.items():
        i = tgrpc.InferInput(name, list(arr.shape), TRITON_TYPES[arr.dtype])
        i.set_data_from_numpy(arr)
        ins.append(i)
    return ins


def _ask(job: RunningJob, protocol: str, feeds: dict, outputs: list[str], client=None) -> dict:
    if protocol == "http":
        c = client or thttp.InferenceServerClient(job.rest)
        result = c.infer(job.name, _http_inputs(feeds))
    else:
        c = client or tgrpc.InferenceServerClient(job.grpc)
        result = c.infer(job.name, _grpc_inputs(feeds))
    return {name: result.as_numpy(name) for name in outputs}


def _rows(kind: str, client: int, request: int) -> int:
    return 1 + (client + request) % 3


def _eight_clients(job: RunningJob, kind: str, protocol: str, reference) -> list[str]:
    """Eight threads, each sending its own inputs; the mismatches (empty: every client got its own answer)."""
    outputs = [t.name for t in reference.outputs]

    def client(c: int) -> list[str]:
        conn = thttp.InferenceServerClient(job.rest) if protocol == "http" else tgrpc.InferenceServerClient(job.grpc)
        wrong = []
        for r in range(REQUESTS_PER_CLIENT):
            feeds = client_inputs(kind, c, r, rows=_rows(kind, c, r))
            got = _ask(job, protocol, feeds, outputs, conn)
            want = reference.run(feeds)
            for name in outputs:
                if got[name].shape != want[name].shape or not np.allclose(got[name], want[name], rtol=1e-5, atol=1e-6):
                    wrong.append(f"client {c} request {r} output {name}: got {got[name]!r}, alone {want[name]!r}")
        return wrong

    with ThreadPoolExecutor(CLIENTS) as pool:
        return [w for ws in pool.map(client, range(CLIENTS)) for w in ws]


@pytest.fixture(scope="module")
def jobs(models, tmp_path_factory):
    started = {}
    yield lambda kind: started.get(kind) or started.setdefault(kind, RunningJob(
        models[kind], tmp_path_factory.mktemp(kind), kind, max_batch=MAX_BATCH, grpc_port=0, host="127.0.0.1"))
    for job in started.values():
        job.stop()


def _stat(doc: dict, *path: str) -> int:
    for key in path:
        doc = doc[key]
    return int(doc)  # gRPC's JSON writes uint64 as strings


@pytest.mark.parametrize("kind", MODELS)
def test_every_client_gets_the_answer_of_its_own_input_and_the_surface_tells_the_truth(kind, jobs, references):
    job = jobs(kind)
    batchable = BATCHABLE[kind]
    status = job.read_status()
    assert status.batchable is batchable and status.batchable_reason

    # the model configuration: REST (tritonclient.http's get_model_config) and gRPC carry the same facts
    config = thttp.InferenceServerClient(job.rest).get_model_config(kind)
    gconfig = tgrpc.InferenceServerClient(job.grpc).get_model_config(kind, as_json=True)["config"]
    ref = references[kind]
    # batchable: the rows a request can carry within the job's max_request_mb (64 MiB: 4 float32 a row)
    most_rows = max_request_rows(ref.inputs, 64 * 2**20)
    assert most_rows == 4 * 2**20 or not batchable
    assert config["max_batch_size"] == (most_rows if batchable else 0) == gconfig.get("max_batch_size", 0)
    assert config["platform"] == "onnxruntime_onnx" and config["backend"] == "onnxruntime"
    dims = {t.name: (t.shape[1:] if batchable else t.shape) for t in (*ref.inputs, *ref.outputs)}
    assert {t["name"]: t["dims"] for t in config["input"] + config["output"]} == dims
    assert {t["name"]: [int(d) for d in t.get("dims", [])] for t in gconfig["input"] + gconfig["output"]} == dims
    assert config["input"][0]["data_type"] == gconfig["input"][0]["data_type"] == "TYPE_FP32"
    assert ("dynamic_batching" in config) == ("dynamic_batching" in gconfig) == batchable
    assert config["instance_group"][0]["kind"] == gconfig["instance_group"][0]["kind"] == "KIND_CPU"
    assert config["instance_group"][0]["count"] == gconfig["instance_group"][0]["count"] == 1

    wrong = _eight_clients(job, kind, "http", ref) + _eight_clients(job, kind, "grpc", ref)
    assert not wrong, f"{len(wrong)} wrong answers, e.g. {wrong[:2]}"

    # the statistics: every request counted once, as Triton counts them, over both protocols alike
    requests = 2 * CLIENTS * REQUESTS_PER_CLIENT
    rows = 2 * sum(_rows(kind, c, r) for c in range(CLIENTS) for r in range(REQUESTS_PER_CLIENT))
    stats = thttp.InferenceServerClient(job.rest).get_inference_statistics(kind)["model_stats"][0]
    gstats = tgrpc.InferenceServerClient(job.grpc).get_inference_statistics(kind, as_json=True)["model_stats"][0]
    for doc in (stats, gstats):
        assert _stat(doc, "inference_stats", "success", "count") == requests
        assert _stat(doc, "inference_count") == (rows if batchable else requests)
        assert _stat(doc, "inference_stats", "compute_infer", "ns") > 0
        assert _stat(doc, "inference_stats", "queue", "ns") > 0
        if batchable:
            assert _stat(doc, "execution_count") <= requests
        else:
            assert _stat(doc, "execution_count") == requests  # never merged
    assert all_stats_models(job) == [kind]
    extensions = httpx.get(f"http://{job.rest}/v2").json()["extensions"]
    assert {"model_configuration", "statistics"} <= set(extensions)
    assert {"model_configuration", "statistics"} <= set(
        tgrpc.InferenceServerClient(job.grpc).get_server_metadata(as_json=True)["extensions"])
    assert httpx.get(f"http://{job.rest}/v2/health/ready").status_code == 200


def all_stats_models(job: RunningJob) -> list[str]:
    doc = httpx.get(f"http://{job.rest}/v2/models/stats").json()
    return [m["name"] for m in doc["model_stats"]]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_request_of_three_max_batches_is_split_and_answered_whole(protocol, jobs, references):
    job = jobs("rowwise")
    feeds = client_inputs("rowwise", 99, 0, rows=3 * MAX_BATCH)
    got = _ask(job, protocol, feeds, ["y", "row_sum"])
    want = references["rowwise"].run(feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5)
    stats = thttp.InferenceServerClient(job.rest).get_inference_statistics("rowwise")["model_stats"][0]
    assert any(s["batch_size"] == MAX_BATCH for s in stats["batch_stats"])


def test_a_rank_0_input_is_refused_with_400_and_the_job_keeps_answering(jobs, references):
    job = jobs("rowwise")
    body = {"inputs": [{"name": "x", "shape": [], "datatype": "FP32", "data": [1.0]}]}
    reply = httpx.post(f"http://{job.rest}/v2/models/rowwise/infer", json=body)
    assert reply.status_code == 400 and "shape" in reply.json()["error"]
    with pytest.raises(InferenceServerException) as err:
        _ask(job, "grpc", {"x": np.ones((), np.float32)}, ["y"])
    assert "INVALID_ARGUMENT" in err.value.status()
    feeds = client_inputs("rowwise", 7, 7)
    np.testing.assert_allclose(_ask(job, "http", feeds, ["y"])["y"], references["rowwise"].run(feeds)["y"], rtol=1e-5)
    assert httpx.get(f"http://{job.rest}/v2/health/ready").status_code == 200
    assert httpx.get(f"http://{job.rest}/v2/models/rowwise/ready").status_code == 200


def test_rank_0_inputs_of_a_model_that_takes_them_are_served_one_per_run(jobs, references):
    job = jobs("scalar_in")
    feeds = [client_inputs("scalar_in", c, 3) for c in range(CLIENTS)]
    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = list(pool.map(lambda f: _ask(job, "http", f, ["y"]), feeds))
    for f, got in zip(feeds, answers):
        np.testing.assert_allclose(got["y"], references["scalar_in"].run(f)["y"], rtol=1e-5)
    assert httpx.get(f"http://{job.rest}/v2/health/ready").status_code == 200


# ---------------------------------------------------------------- the search

@pytest.mark.parametrize("kind", ["reduction", "rowwise"])
def test_the_search_measures_only_batch_1_for_a_model_that_is_not_batchable(kind, models, tmp_path):
    from reamer.search.on_cores import MeasureSettings, search_layout

    fast = MeasureSettings(warmup_s=0.05, window_s=0.05, max_windows=4, verify_windows=2)
    outcome = search_layout(models[kind], "onnxruntime", [CPU], None, cache_dir=tmp_path / "profiles",
                            batches=[1, 2, 4], settings=fast)
    assert outcome.batchable is BATCHABLE[kind] and outcome.batchable_reason
    measured = {p.batch for p in outcome.new_points}
    assert measured == ({1, 2, 4} if BATCHABLE[kind] else {1})
    assert outcome.best is not None
    if not BATCHABLE[kind]:
        assert all(shape.batch == 1 for shape in outcome.best.layout.instances)


def test_infer_show_says_whether_requests_are_merged_and_why():
    from reamer.cli.infer_cmd import render_job

    job = {"name": "r", "kind": "online", "state": "running", "instances": [],
           "status": {"batchable": False, "batchable_reason": "output 'total' is a scalar (rank 0)"}}
    assert "one request per run (max_batch_size 0): output 'total' is a scalar (rank 0)" in render_job(job)
    job["status"] = {"batchable": True, "batchable_reason": "every input and output has a leading batch dimension"}
    assert "requests merged into batches: every input" in render_job(job)
