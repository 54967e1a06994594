"""Exported models served online by a real agent, asked by the standard clients.

For every exported model and every backend that can load it: deploy through the agent's API (layout
1x1:b4), then for every client and encoding (tritonclient HTTP: binary and JSON inputs and outputs in
every combination; tritonclient.grpc, raw tensors; a plain KServe-v2 gRPC client, typed contents) send a batch of 1 and a full batch of 4, and compare every output with a direct ONNX
Runtime run of the same file (tight tolerance; looser where the model is INT8 or FP16).
"""
from __future__ import annotations

import pytest

from tests.acceptance.clients import CLIENT_VARIANTS, CLIENTS
from tests.acceptance.conftest import (BACKENDS, FULL_BATCH, assert_outputs_match, model_path, needs_rt_host,
                                       reference)
from tests.acceptance.exported_models import SPECS, TYPE_VOCAB

pytestmark = [needs_rt_host, pytest.mark.root, pytest.mark.slow]

# (model, backend) outermost, so the tests of one deployment run one after another and share it
CASES = [pytest.param(model, backend, client, variant, batch, id=f"{model}-{backend}-{client}-{variant}-b{batch}")
         for model, spec in SPECS.items()
         for backend in BACKENDS if backend == "onnxruntime" or spec.openvino
         for client, variant in CLIENT_VARIANTS
         for batch in (1, FULL_BATCH)]


@pytest.mark.parametrize("model, backend, client, variant, batch", CASES)
def test_online_answers_equal_a_direct_onnxruntime_run(online, models_dir, model, backend, client, variant, batch):
    spec = SPECS[model]
    job = online.get(model, backend)
    inputs = spec.sample(batch, seed=batch)
    want = reference(model_path(models_dir, model), inputs)
    got = CLIENTS[client].infer(job, job.name, inputs, list(spec.outputs), variant)
    assert_outputs_match(spec, got, want, f"{model} on {backend} via {client} {variant}, batch {batch}")


@pytest.mark.parametrize("model", [m for m, s in SPECS.items() if s.sequence])
def test_sequence_models_take_other_lengths(online, models_dir, model):
    """A dynamic sequence axis is dynamic: lengths other than the warm-up's answer as well."""
    spec = SPECS[model]
    job = online.get(model, "onnxruntime")
    client, variant = CLIENT_VARIANTS[0]
    for seq in (1, 7, 64):
        inputs = spec.sample(2, seq=seq, seed=seq)
        want = reference(model_path(models_dir, model), inputs)
        got = CLIENTS[client].infer(job, job.name, inputs, list(spec.outputs), variant)
        assert_outputs_match(spec, got, want, f"{model} at seq {seq}")


def broken_request(case: str) -> dict:
    spec = SPECS["bert"]
    inputs = spec.sample(2, seed=9)
    if case == "out-of-range-ids":  # token_type_ids index a table of TYPE_VOCAB rows
        inputs["token_type_ids"][:] = TYPE_VOCAB + 3
    elif case == "mismatched-seq":  # dynamic dims that the model ties together, sent apart
        inputs["attention_mask"] = inputs["attention_mask"][:, :-3].copy()
    elif case == "batch-0":
        inputs = {k: v[:0].copy() for k, v in inputs.items()}
    return inputs


@pytest.mark.parametrize("variant", [CLIENTS["http"].variants[0], CLIENTS["http"].variants[-1]])
@pytest.mark.parametrize("case", ["out-of-range-ids", "mismatched-seq", "batch-0"])
def test_what_the_model_raises_is_a_400_and_the_instance_keeps_serving(online, models_dir, case, variant):
    from tritonclient.utils import InferenceServerException

    spec = SPECS["bert"]
    job = online.get("bert", "onnxruntime")
    client = CLIENTS["http"]
    inputs = broken_request(case)
    try:
        got = client.infer(job, job.name, inputs, list(spec.outputs), variant)
    except InferenceServerException as error:
        assert str(error.status()) == "400", f"{case}: {error}"
        assert error.message(), f"{case}: a 400 must carry the runtime's message"
        if case == "out-of-range-ids":
            assert "out of" in error.message() or "indices" in error.message(), error.message()
        if case == "batch-0":  # JSON "data": [] carries no type of its own: never blamed on the client's dtype
            assert "dtype" not in error.message(), error.message()
    else:  # a batch of 0 may also be answered, with empty outputs equal to the runtime's own
        assert case == "batch-0", f"{case} was answered: {got}"
        assert_outputs_match(spec, got, reference(model_path(models_dir, "bert"), inputs), case)
    # the same instance answers the next request, without a restart in between
    pid = online.daemon.client.get_inference_job(job.name).pid
    good = spec.sample(2, seed=10)
    assert_outputs_match(spec, client.infer(job, job.name, good, list(spec.outputs), variant),
                         reference(model_path(models_dir, "bert"), good), f"after {case}")
    assert online.daemon.client.get_inference_job(job.name).pid == pid


@pytest.mark.parametrize("case", ["out-of-range-ids", "mismatched-seq"])
def test_what_the_model_raises_over_grpc_is_invalid_argument_and_the_instance_keeps_serving(online, models_dir, case):
    from tritonclient.utils import InferenceServerException

    spec = SPECS["bert"]
    job = online.get("bert", "onnxruntime")
    client = CLIENTS["grpc"]
    pid = online.daemon.client.get_inference_job(job.name).pid
    with pytest.raises(InferenceServerException) as error:
        client.infer(job, job.name, broken_request(case), list(spec.outputs), "raw")
    assert error.value.status() == "StatusCode.INVALID_ARGUMENT", f"{case}: {error.value}"
    assert error.value.message(), f"{case}: INVALID_ARGUMENT must carry the runtime's message"
    good = spec.sample(2, seed=11)
    assert_outputs_match(spec, client.infer(job, job.name, good, list(spec.outputs), "raw"),
                         reference(model_path(models_dir, "bert"), good), f"after {case} over gRPC")
    assert online.daemon.client.get_inference_job(job.name).pid == pid
