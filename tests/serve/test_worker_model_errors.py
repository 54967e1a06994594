"""Instance workers on a BERT-shaped model: warm-up on zeros, sample data, named warm-up failures, runtime
errors that leave the instance serving, and the JSON-output crash of issue 12 (uvloop left the pipe
non-blocking, so a reply that came as two writes read as a dead instance)."""
import asyncio
import fcntl
import json
import os

import numpy as np
import pytest
import uvloop

from reamer.serve.spec import InstanceSpec
from reamer.serve.runtime.instances import InferenceFailed, InstanceWorker, WorkerStartError
from tests.serve.bertlike import bert_feeds, build_bertlike, export_bert

CPU = sorted(os.sched_getaffinity(0))[-1]


@pytest.fixture(scope="module", params=["bertlike", "transformers"])
def bert(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("bert")
    if request.param == "bertlike":
        return build_bertlike(out / "bertlike.onnx")
    return export_bert(out / "bert.onnx")  # exported by torch.onnx, where torch and transformers are here


@pytest.fixture
def started(bert, tmp_path):
    made = []

    def start(samples=None):
        w = InstanceWorker(0, InstanceSpec([CPU], 1, 4), bert, run_dir=str(tmp_path), samples=samples)
        made.append(w)
        w.start()
        return w

    yield start
    for w in made:
        w.stop(grace_s=5)


def test_warm_up_feeds_zeros_to_index_inputs(started):
    w = started()  # random ids in [0, 10) used to fail here: token_type_ids indexes a table of 2 rows
    assert w.ready and w.alive


def test_warm_up_with_shapes_and_sample_data(started, tmp_path):
    data = tmp_path / "samples.npz"
    np.savez(data, **bert_feeds(3, 20, type_id=1, word_id=7))
    w = started({"shapes": {"input_ids": [1, 20]}, "input_data": str(data)})
    assert w.ready


def test_warm_up_failure_names_the_input_and_the_runtime_reason(bert, tmp_path):
    data = tmp_path / "bad.json"
    data.write_text(json.dumps({"data": [{"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1],
                                          "token_type_ids": [0, 5, 0]}]}))
    w = InstanceWorker(0, InstanceSpec([CPU], 1, 4), bert, samples={"input_data": str(data)})
    with pytest.raises(WorkerStartError) as exc:
        w.start()
    w.stop(grace_s=5)
    assert "refused input token_type_ids" in exc.value.message
    assert "out of data bounds" in exc.value.message  # the runtime's own words
    assert "--input-data" in exc.value.message


def test_runtime_errors_fail_the_request_and_the_instance_keeps_serving(started):
    w = started()
    pid = w.pid
    bad = [bert_feeds(1, 8, type_id=5),  # out-of-range token type
           {**bert_feeds(1, 8), "attention_mask": np.ones((1, 9), np.int64)},  # mismatched dynamic dims
           bert_feeds(0, 8)]  # a batch of 0 rows
    for feeds in bad[:2]:
        with pytest.raises(InferenceFailed) as exc:
            w.run(feeds)
        assert "ONNXRuntimeError" in exc.value.message
    try:
        w.run(bad[2])
    except InferenceFailed:
        pass  # a runtime may refuse an empty batch; it must not take the instance down
    out = w.run(bert_feeds(2, 8))["last_hidden_state"]
    assert out.shape == (2, 8, 384) and w.pid == pid and w.alive and w.restarts == 0


@pytest.mark.parametrize("seq", [16, 40])  # outputs of 24 and 60 KB: inline replies sent as two writes
def test_replies_between_16_and_64_kb_from_an_event_loop_do_not_look_like_a_crash(started, seq):
    w = started()
    fd = w._conn.fileno()

    async def many():
        for _ in range(30):
            out = await w.run_async(bert_feeds(1, seq))
            assert out["last_hidden_state"].shape == (1, seq, 384)
            # libuv made the fd non-blocking while the loop watched it; the pipe's reads need it blocking
            assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK

    uvloop.run(many())
    assert w.restarts == 0 and w.alive
    w.run(bert_feeds(1, seq))  # a thread's blocking run() after the loop's (the offline path) works too
