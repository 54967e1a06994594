"""Model families a new user brings (issue 24), served online by a real agent to concurrent clients.

The models (tests/acceptance/family_models.py, built locally with random weights): scikit-learn through
skl2onnx with zipmap=False, LightGBM through onnxmltools, ViT, DistilBERT (dynamo export, dynamic batch and
sequence, external weights), a Whisper encoder, strings in and out, FP16 + BOOL + a rank-0 input, outputs
whose first dimension depends on the data, and a reduction over the whole request. Each is deployed
through the agent's API (ONNX Runtime; OpenVINO too for ViT, DistilBERT and Whisper; layout 1x1:b4: one
instance that batches up to 4 rows where that is safe), then six client threads at once (tritonclient HTTP
with binary and JSON tensors, tritonclient gRPC, a plain KServe-v2 gRPC client) each send their own
requests of 1 to 3 rows, and each checks that its answer is what a direct ONNX Runtime run of the same file
gives for its own request alone: a batcher that merged requests it must not merge, or split an answer by
guess, hands one client another's data and fails here. Then a request larger than the max batch is
answered whole; Triton's model configuration (REST and gRPC) says whether the model batches; its
statistics count every request, with one run per request where the model must not batch.
The ZipMap classifier (a sequence-of-maps output no v2 client can receive) must be refused at deploy with
the fix (zipmap=False).
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

import pytest

from reamer.api.client import ApiError
from tests.acceptance.clients import CLIENTS
from tests.acceptance.conftest import (FULL_BATCH, OnlineDeployments, assert_outputs_match, job_name, model_path,
                                       needs_rt_host, reference, remove_all)
from tests.acceptance.exported_models import BuildUnavailable
from tests.acceptance.family_models import FAMILIES, ensure_models

pytestmark = [needs_rt_host, pytest.mark.root, pytest.mark.slow]

SERVED = [pytest.param(name, backend, id=f"{name}-{backend}") for name, family in FAMILIES.items() if not family.refused
          for backend in ("onnxruntime", "openvino") if backend == "onnxruntime" or family.openvino]
REFUSED = [name for name, family in FAMILIES.items() if family.refused]
REQUESTS_PER_CLIENT = 4
# six clients at once, over every transport; a second tritonclient gRPC client where the plain KServe client
# cannot carry the model's tensors (BYTES has no typed contents field)
TRANSPORTS = [("http", "binary-in/binary-out"), ("http", "json-in/json-out"), ("grpc", "raw"),
              ("http", "binary-in/json-out"), ("kserve-grpc", "typed"), ("http", "json-in/binary-out")]


@pytest.fixture(scope="session")
def families_dir() -> Path:
    try:
        return ensure_models()
    except BuildUnavailable as why:
        pytest.skip(str(why))


@pytest.fixture(scope="module")
def deployments(agent, families_dir) -> Iterator[OnlineDeployments]:
    deployed = OnlineDeployments(agent, families_dir, specs=FAMILIES)
    yield deployed
    if agent.proc is not None and agent.proc.poll() is None:
        remove_all(agent)


def transports(family: str) -> list[tuple[str, str]]:
    if FAMILIES[family].strings:
        return [("grpc", "raw") if client == "kserve-grpc" else (client, variant) for client, variant in TRANSPORTS]
    return TRANSPORTS


@pytest.mark.parametrize("family, backend", SERVED)
def test_concurrent_clients_each_get_the_answer_to_their_own_request(deployments, families_dir, family, backend):
    spec = FAMILIES[family]
    job = deployments.get(family, backend)
    path = model_path(families_dir, family)
    ways = transports(family)
    requests = {(c, r): spec.request(c, r) for c in range(len(ways)) for r in range(REQUESTS_PER_CLIENT)}
    expected = {key: reference(path, inputs) for key, inputs in requests.items()}  # each request alone
    failures: list[str] = []
    start = threading.Barrier(len(ways))

    def client(c: int) -> None:
        name, variant = ways[c]
        try:
            start.wait(timeout=120)
        except threading.BrokenBarrierError:
            failures.append(f"{family}: client {c} never saw the other clients start")
            return
        for r in range(REQUESTS_PER_CLIENT):
            where = f"{family} on {backend}: client {c} ({name} {variant}) request {r}"
            try:
                got = CLIENTS[name].infer(job, job.name, requests[c, r], list(spec.outputs), variant)
                assert_outputs_match(spec, got, expected[c, r], where)
            except Exception as exc:  # noqa: BLE001 - every client's failure is reported, with its request
                failures.append(f"{where}: {exc!r}"[:1500])

    threads = [threading.Thread(target=client, args=(c,), name=f"client-{c}") for c in range(len(ways))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not any(thread.is_alive() for thread in threads), f"{family}: a client never got its answers"
    assert not failures, f"{len(failures)} of {len(requests)} answers wrong:\n" + "\n".join(failures[:6])
    # the job is still whole after the crowd; a request of more rows than the instance's max batch (4) is
    # answered whole: split and joined where the model batches, run as it is where it does not
    for rows in (1, 2 * FULL_BATCH - 1):
        alone = spec.request(0, 99, rows)
        assert_outputs_match(spec, CLIENTS["grpc"].infer(job, job.name, alone, list(spec.outputs), "raw"),
                             reference(path, alone), f"{family} on {backend}: {rows} rows after the crowd")
    assert_config_and_statistics_tell_the_truth(job, family, answered=len(requests) + 2)


def assert_config_and_statistics_tell_the_truth(job, family: str, answered: int) -> None:
    """Triton's model configuration says whether the model batches (max_batch_size 0: never merged), the same over
    REST and gRPC; its statistics count every answered request, and one run per request where it must not batch."""
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp

    spec = FAMILIES[family]
    rest = thttp.InferenceServerClient(f"127.0.0.1:{job.port}", network_timeout=60)
    grpc = tgrpc.InferenceServerClient(f"127.0.0.1:{job.grpc_port}")
    try:
        config = rest.get_model_config(job.name)
        over_grpc = grpc.get_model_config(job.name, as_json=True)["config"]
        stats = rest.get_inference_statistics(job.name)["model_stats"][0]
    finally:
        rest.close()
        grpc.close()
    assert (config["max_batch_size"] > 0) == spec.batchable, f"{family}: max_batch_size {config['max_batch_size']}"
    assert int(over_grpc.get("max_batch_size", 0)) == config["max_batch_size"], (over_grpc, config)  # JSON drops 0
    runs, succeeded = int(stats["execution_count"]), int(stats["inference_stats"]["success"]["count"])
    assert succeeded == answered, f"{family}: statistics count {succeeded} answered requests, {answered} were sent"
    if spec.batchable:  # merged requests save runs; the request larger than the max batch took two
        assert 1 <= runs <= succeeded + 1, stats
    else:
        assert runs == succeeded, f"{family} is not batchable, yet {succeeded} requests took {runs} runs"
    print(f"{family}: {succeeded} requests in {runs} runs")  # how many the batcher merged (shown with -s)


@pytest.mark.parametrize("family", REFUSED)
@pytest.mark.parametrize("backend", ["onnxruntime", "auto"])
def test_a_zipmap_classifier_is_refused_at_deploy_with_the_fix(agent, families_dir, family, backend):
    remove_all(agent)
    name = job_name(family, backend, "online")
    request = {"name": name, "model": model_path(families_dir, family), "kind": "online", "slo_ms": 5000,
               "backend": backend, "layout": "1x1:b4"}
    try:
        with pytest.raises(ApiError) as refused:
            agent.client.deploy_inference(request)
        assert refused.value.status == 400, refused.value.message
        assert "sequence of maps" in refused.value.message, refused.value.message
        assert FAMILIES[family].refused in (refused.value.fix or ""), refused.value.fix
        assert name not in {j.name for j in agent.client.list_inference_jobs()}, "a refused deploy leaves no job"
    finally:
        remove_all(agent)
