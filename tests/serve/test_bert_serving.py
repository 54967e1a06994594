"""A BERT-family encoder served by a real job process and queried with tritonclient (issue 12): warm-up on
zeros, JSON and binary outputs at one row and a full batch (one row with a JSON output answered
"503 instance 0 crashed"), model errors as 400s that leave the instance serving, warm-up on the traffic's
shapes and data, and a warm-up failure that names the input.

The model is our BERT-shaped graph (always) and, where torch and transformers are installed, a BertModel
exported by torch.onnx."""
import json

import numpy as np
import onnxruntime as ort
import psutil
import pytest

from reamer.serve.spec import read_events
from tests.serve.bertlike import bert_feeds, build_bertlike, export_bert
from tests.serve.jobs import RunningJob

httpclient = pytest.importorskip("tritonclient.http")

OUTPUT = "last_hidden_state"


@pytest.fixture(scope="module", params=["bertlike", "transformers"])
def bert(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("bert")
    if request.param == "bertlike":
        return build_bertlike(out / "bertlike.onnx")
    return export_bert(out / "bert.onnx")


def _start(model, tmp_path, **spec_fields) -> RunningJob:
    return RunningJob(model, tmp_path, "bert", settle=("ready", "failed"), **spec_fields)


@pytest.fixture(scope="module")
def served(bert, tmp_path_factory):
    job = _start(bert, tmp_path_factory.mktemp("job"))
    try:
        # warm-up on zeros: token_type_ids indexes a 2-row table
        assert job.status.state == "ready", job.status.message
        yield httpclient.InferenceServerClient(job.rest), bert, job.proc, job.run_dir
    finally:
        job.stop()


def _infer(client, feeds, binary_out, binary_in=True):
    inputs = []
    for name, arr in feeds.items():
        i = httpclient.InferInput(name, list(arr.shape), "INT64")
        i.set_data_from_numpy(arr, binary_data=binary_in)
        inputs.append(i)
    return client.infer("bert", inputs, outputs=[httpclient.InferRequestedOutput(OUTPUT, binary_data=binary_out)])


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("seq", [16, 40])  # outputs of 24 and 60 KB a row
@pytest.mark.parametrize("binary_out", [False, True])
def test_json_and_binary_outputs_match_onnxruntime(served, rows, seq, binary_out):
    client, model, job, _ = served
    feeds = bert_feeds(rows, seq, word_id=3)
    feeds["token_type_ids"][:, seq // 2:] = 1
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run([OUTPUT], feeds)[0]
    for binary_in in (True, False):
        got = _infer(client, feeds, binary_out, binary_in).as_numpy(OUTPUT)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_model_errors_leave_the_instance_serving_and_carry_the_runtime_message(served):
    client, _, job, run_dir = served
    workers = [p.pid for p in psutil.Process(job.pid).children()]
    out_of_range = bert_feeds(1, 8, type_id=5)
    mismatched = {**bert_feeds(1, 8), "attention_mask": np.ones((1, 9), np.int64)}
    for feeds in (out_of_range, mismatched):
        with pytest.raises(httpclient.InferenceServerException) as exc:
            _infer(client, feeds, binary_out=False)
        assert "503" not in exc.value.status() and "crashed" not in exc.value.message()
    assert "out of data bounds" in str(_error_of(client, out_of_range))
    try:  # a batch of 0 rows: an answer or a client error, never a crash
        _infer(client, bert_feeds(0, 8), binary_out=False)
    except httpclient.InferenceServerException as exc:
        assert "crashed" not in exc.message()
    assert _infer(client, bert_feeds(1, 8), binary_out=False).as_numpy(OUTPUT).shape == (1, 8, 384)
    assert [p.pid for p in psutil.Process(job.pid).children()] == workers
    events, _ = read_events(run_dir)
    assert not [e for e in events if e["kind"] in ("worker_crashed", "worker_restarted")]


def test_model_errors_are_400s(served):
    client = served[0]
    for feeds in (bert_feeds(1, 8, type_id=5), {**bert_feeds(1, 8), "attention_mask": np.ones((1, 9), np.int64)}):
        with pytest.raises(httpclient.InferenceServerException) as exc:
            _infer(client, feeds, binary_out=False)
        assert exc.value.status() == "400", exc.value.message()


def _error_of(client, feeds):
    try:
        _infer(client, feeds, binary_out=True)
    except httpclient.InferenceServerException as exc:
        return exc.message()
    return None


def test_warm_up_on_the_traffic_shapes_and_data(bert, tmp_path):
    data = tmp_path / "traffic.json"
    data.write_text(json.dumps({"data": [{"input_ids": [5] * 128, "attention_mask": [1] * 128,
                                          "token_type_ids": [1] * 128}]}))
    job = _start(bert, tmp_path, shapes={"input_ids": [1, 128]}, input_data=str(data))
    try:
        assert job.status.state == "ready", job.status.message
    finally:
        job.stop()


def test_warm_up_failure_names_the_input_and_the_reason(bert, tmp_path):
    data = tmp_path / "bad.npz"
    np.savez(data, **bert_feeds(1, 8, type_id=7))
    job = _start(bert, tmp_path, input_data=str(data))
    try:
        st = job.status
        assert st.state == "failed"
        assert "token_type_ids" in st.message and "out of data bounds" in st.message, st.message
    finally:
        job.stop()
