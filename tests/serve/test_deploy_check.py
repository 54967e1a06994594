"""The deploy check in its child process (as this test's own user): answers, memory and time limits.
The same check as another user, through a real agent, is tests/security/test_untrusted_input.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from reamer.serve.deploy_check import DeployCheck, DeployRequest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from reamer.serve import models

    return str(models.build_model("tiny", tmp_path_factory.mktemp("m") / "tiny.onnx").path)  # "input" [-1, 16]


def test_a_model_and_traffic_that_fit_pass_and_report_the_inputs(tiny, tmp_path):
    data = tmp_path / "rows.npz"
    np.savez(data, input=np.ones((3, 16), np.float32))
    answer = DeployCheck().run(DeployRequest(tiny, "onnxruntime", {"input": [1, 16]}, str(data)))
    assert answer.problem is None and not answer.exceeded
    assert answer.inputs == [{"name": "input", "datatype": "FP32", "shape": [-1, 16]}]


def test_sample_data_that_does_not_fit_gets_the_samples_modules_words(tiny, tmp_path):
    data = tmp_path / "wrong.npz"
    np.savez(data, other=np.ones((3, 16), np.float32))
    answer = DeployCheck().run(DeployRequest(tiny, None, {}, str(data)))
    assert answer.problem is not None and "which the model does not have" in answer.problem.message
    assert "name its arrays after the model's inputs" in answer.problem.fix


def test_a_compressed_bomb_is_refused_from_its_headers(tiny, tmp_path):
    bomb = tmp_path / "bomb.npz"
    np.savez_compressed(bomb, input=np.zeros((2**22, 16), np.float32))  # 256 MiB of zeros in a few hundred KiB
    assert bomb.stat().st_size < 2 << 20
    answer = DeployCheck(memory_mb=128, memory_source="the job's memory_limit_mb").run(
        DeployRequest(tiny, "onnxruntime", {}, str(bomb)))
    assert answer.exceeded == "memory" and answer.problem is not None
    assert answer.problem.message.startswith(f"input_data {bomb} needs more than 128 MiB to check (its arrays take "
                                             "256 MiB decompressed)"), answer.problem.message
    assert "raise the job's memory_limit_mb (now 128 MiB)" in answer.problem.fix


def test_data_that_grows_past_the_limit_is_stopped_by_the_limit(tiny, tmp_path):
    data = tmp_path / "huge.json"
    with open(data, "w") as fh:
        fh.write('{"data": [{"input": [' + "0," * 30_000_000 + "0]}]}")
    answer = DeployCheck(memory_mb=128).run(DeployRequest(tiny, "onnxruntime", {}, str(data)))
    assert answer.exceeded == "memory", answer
    assert f"input_data {data} needs more than 128 MiB to check" in answer.problem.message
    assert "inference.check_memory_mb (now 128 MiB)" in answer.problem.fix


def test_deeply_nested_sample_data_is_a_problem_not_a_crash(tiny, tmp_path):
    data = tmp_path / "deep.json"
    data.write_text('{"data": [{"input": ' + "[" * 200_000 + "]" * 200_000 + "}]}")
    answer = DeployCheck().run(DeployRequest(tiny, None, {}, str(data)))
    assert answer.problem is not None and str(data) in answer.problem.message, answer
    assert answer.problem.fix


@pytest.mark.parametrize("content", [b"not a model", b"\x08\x07\x12\x04"])
def test_a_file_that_is_not_onnx_gets_the_runtimes_reason(tmp_path, content):
    model = tmp_path / "bad.onnx"
    model.write_bytes(content)
    opened = DeployCheck().run(DeployRequest(str(model), "onnxruntime"))
    assert opened.problem is not None and "cannot load" in opened.problem.message and "backend" in opened.problem.fix
    read = DeployCheck().run(DeployRequest(str(model), None, {"input": [1, 16]}))
    assert read.problem is not None and read.problem.fix == "check that it is an ONNX file", read


def test_a_check_past_its_time_is_stopped(tiny):
    answer = DeployCheck(timeout_s=0.05).run(DeployRequest(tiny, "onnxruntime"))
    assert answer.exceeded == "time" and "took longer than 0.05 s" in answer.problem.message
    assert "inference.check_timeout_s" in answer.problem.fix


def test_a_missing_file_is_the_childs_answer_too(tmp_path):
    answer = DeployCheck().run(DeployRequest(str(tmp_path / "none.onnx"), "onnxruntime"))
    assert answer.problem is not None and str(Path(tmp_path / "none.onnx")) in answer.problem.message
