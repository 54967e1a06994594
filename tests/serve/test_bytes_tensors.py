"""String (BYTES) tensors end to end, custom-op libraries, and models no v2 client could use refused with the fix
(issue 24, item 3): real job processes queried with tritonclient over REST (JSON and binary) and gRPC by
concurrent clients, each checking its own answer; offline files; sample inputs; the deploy check."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import warnings

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from onnx import TensorProto, helper

from reamer.serve import backends, model_types
from reamer.serve.backends import BackendError, UnservableModel, open_backend
from reamer.serve.protocol.errors import BadRequest
from reamer.serve.protocol.grpc_codec import decode_infer_request
from reamer.serve.protocol.rest_codec import decode_request
from reamer.serve.doors.grpc_v2 import messages as pb
from reamer.serve.model_check import load_problem, open_problem
from reamer.serve.model_types import graph_problem
from reamer.serve.samples import SampleError, SampleSpec, plan_samples
from reamer.serve.spec import InstanceSpec, JobSpec, JobStatus
from reamer.serve.protocol.tensors import BadBytesTensor, TensorInfo, split_length_prefixed
from reamer.serve.protocol.v2wire import HEADER_LENGTH, le_bytes
from tests.conftest import wait_for
from tests.serve.jobs import CPUS, REPO, RunningJob

LABELS = {"cat": 1, "dog": 2, "bird": 3}


def _save(graph, path, domains=()) -> str:
    import onnx

    opsets = [helper.make_opsetid("", 17), *(helper.make_opsetid(d, v) for d, v in domains)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """labels: text [batch, 1] -> label (LabelEncoder, INT64) and echo (the text back, BYTES);
    unsqueeze: a string graph OpenVINO reads; upper: ai.onnx.contrib StringUpper; unknown_op: an op of a domain no library provides; zipmap/seq: outputs
    that are not tensors; bf16: an output with no v2 datatype."""
    d = tmp_path_factory.mktemp("bytes_models")
    text = helper.make_tensor_value_info("text", TensorProto.STRING, ["batch", 1])
    labels = helper.make_graph(
        [helper.make_node("LabelEncoder", ["text"], ["label"], domain="ai.onnx.ml", keys_strings=list(LABELS),
                          values_int64s=list(LABELS.values()), default_int64=-1),
         helper.make_node("Identity", ["text"], ["echo"])], "labels", [text],
        [helper.make_tensor_value_info("label", TensorProto.INT64, ["batch", 1]),
         helper.make_tensor_value_info("echo", TensorProto.STRING, ["batch", 1])])
    out = {"labels": _save(labels, d / "labels.onnx", [("ai.onnx.ml", 2)])}
    flat_in = helper.make_tensor_value_info("text", TensorProto.STRING, ["batch"])
    flat_out = helper.make_tensor_value_info("out", TensorProto.STRING, ["batch"])
    out["upper"] = _save(helper.make_graph([helper.make_node("StringUpper", ["text"], ["out"], domain="ai.onnx.contrib")],
                                           "upper", [flat_in], [flat_out]), d / "upper.onnx", [("ai.onnx.contrib", 1)])
    out["unknown_op"] = _save(helper.make_graph([helper.make_node("Frobnicate", ["text"], ["out"], domain="com.example.ops")],
                                                "unknown", [flat_in], [flat_out]), d / "unknown.onnx",
                              [("com.example.ops", 1)])
    axis = helper.make_tensor("axis", TensorProto.INT64, [1], [1])
    out["unsqueeze"] = _save(helper.make_graph([helper.make_node("Unsqueeze", ["text", "axis"], ["out"])], "unsqueeze",
                                               [flat_in], [text], initializer=[axis]), d / "unsqueeze.onnx")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])
    seq = helper.make_tensor_sequence_value_info("parts", TensorProto.FLOAT, None)
    out["seq"] = _save(helper.make_graph([helper.make_node("SequenceConstruct", ["x", "x"], ["parts"])], "seq", [x], [seq]),
                       d / "seq.onnx")
    bf16 = helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["batch", 2])
    out["bf16"] = _save(helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.BFLOAT16)], "bf16",
                                          [x], [bf16]), d / "bf16.onnx")
    return out


@pytest.fixture(scope="module")
def sklearn_models(tmp_path_factory):
    """A text classifier (TfidfVectorizer + LogisticRegression) without ZipMap, the fitted pipeline, and the
    same classifier kind with skl2onnx's default ZipMap output."""
    pytest.importorskip("skl2onnx", reason="skl2onnx is in the test extras")
    import onnx
    from skl2onnx import convert_sklearn, to_onnx
    from skl2onnx.common.data_types import StringTensorType
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    d = tmp_path_factory.mktemp("sklearn")
    texts = ["good movie", "bad film", "great film", "awful movie", "good good fun", "bad bad plot"]
    pipe = make_pipeline(TfidfVectorizer(), LogisticRegression()).fit(texts, [1, 0, 1, 0, 1, 0])
    vectorizer, classifier = pipe.steps[0][1], pipe.steps[1][1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # locale C.UTF-8: skl2onnx leaves StringNormalizer at ONNX Runtime's en_US.UTF-8, which a host may lack
        text_model = convert_sklearn(pipe, initial_types=[("text", StringTensorType([None, 1]))],
                                     options={id(classifier): {"zipmap": False}, id(vectorizer): {"locale": "C.UTF-8"}})
        X = np.random.default_rng(0).random((20, 3)).astype(np.float32)
        plain = LogisticRegression().fit(X, (X[:, 0] > 0.5).astype(int))
        zipmap = to_onnx(plain, X[:1])
    onnx.save(text_model, str(d / "text.onnx"))
    onnx.save(zipmap, str(d / "zipmap.onnx"))
    return {"text": str(d / "text.onnx"), "zipmap": str(d / "zipmap.onnx"), "pipeline": pipe}


def _texts(values) -> list[str]:
    """A client's BYTES answer as str (binary answers come as bytes, JSON ones as str)."""
    return [v.decode() if isinstance(v, bytes) else str(v) for v in np.asarray(values).reshape(-1).tolist()]


# ---------------------------------------------------------------- the wire codecs

def test_length_prefixed_layout_round_trips_and_refuses_what_does_not_add_up():
    values = np.array(["", "a", "ünïcødé", "x" * 300], dtype=object)
    raw = le_bytes(values)
    assert split_length_prefixed(raw, 4, "t") == [v.encode() for v in values]
    for broken, words in ((raw[:-1], "only"), (raw + b"\0", "follow"), (raw[:2], "cut off")):
        with pytest.raises(BadBytesTensor, match=words):
            split_length_prefixed(broken, 4 if words != "cut off" else 1, "input 't'")
    with pytest.raises(BadBytesTensor, match="holds 4 BYTES element"):
        split_length_prefixed(raw, 5, "input 't'")


def test_rest_decodes_bytes_from_json_and_binary_and_names_the_field_when_wrong():
    ins = [TensorInfo("text", "BYTES", [-1, 1])]
    outs = [TensorInfo("echo", "BYTES", [-1, 1])]
    body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": ["héllo", "b"]}]})
    got = decode_request(body.encode(), None, ins, outs).inputs["text"]
    assert got.dtype == object and got.shape == (2, 1) and got.ravel().tolist() == ["héllo", "b"]
    blob = le_bytes(np.array(["héllo", "b"], dtype=object))
    head = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1],
                                   "parameters": {"binary_data_size": len(blob)}}]}).encode()
    plans: dict = {}
    for _ in range(2):  # the second time a cached plan would be used if BYTES inputs were cached (they are not)
        got = decode_request(head + blob, len(head), ins, outs, plans).inputs["text"]
        assert got.ravel().tolist() == ["héllo", "b"]
    assert not plans
    for data, words in (([1, 2], "a number where a string belongs"), ("ab", "is a string, not a list"),
                        ([["a"], ["b", "c"]], "a list where a string belongs")):
        body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": data}]})
        with pytest.raises(BadRequest, match=words):
            decode_request(body.encode(), None, ins, outs)
    bad_utf8 = (3).to_bytes(4, "little") + b"\xff\xfe\xfd" + (1).to_bytes(4, "little") + b"b"
    head = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1],
                                   "parameters": {"binary_data_size": len(bad_utf8)}}]}).encode()
    with pytest.raises(BadRequest, match="element 0 is not UTF-8"):
        decode_request(head + bad_utf8, len(head), ins, outs)
    head = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1],
                                   "parameters": {"binary_data_size": 3}}]}).encode()
    with pytest.raises(BadRequest, match="need at least 8"):
        decode_request(head + b"abc", len(head), ins, outs)


def test_a_large_json_body_of_strings_takes_the_fast_reader_and_gives_the_same_strings():
    ins = [TensorInfo("text", "BYTES", [-1])]
    words = [f"wörd {i} " + "x" * (i % 40) for i in range(6000)]  # well over the simdjson threshold (64 KiB)
    body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [6000], "data": words}]}).encode()
    assert len(body) > 1 << 16
    assert decode_request(body, None, ins, ins).inputs["text"].tolist() == words


def test_binary_answers_of_equal_shape_carry_each_answers_own_byte_sizes():
    from reamer.serve.protocol.rest_codec import DecodedRequest, encode_response

    outs = [TensorInfo("echo", "BYTES", [-1])]
    heads: dict = {}  # the job's cache of binary answer headers, shared by requests of one shape
    for words in (["a", "b"], ["longer", "words here"]):
        decoded = DecodedRequest(id=None, inputs={}, outputs=None, binary_default=True)
        body, headers = encode_response("m", decoded, {"echo": np.array(words, dtype=object)}, outs, heads)
        n = int(headers[HEADER_LENGTH])
        head = json.loads(body[:n])
        assert head["outputs"][0]["parameters"]["binary_data_size"] == len(body) - n
        assert split_length_prefixed(body[n:], 2, "echo") == [w.encode() for w in words]


def test_grpc_decodes_bytes_contents_and_raw_bytes():
    ins = [TensorInfo("text", "BYTES", [-1])]
    outs = [TensorInfo("echo", "BYTES", [-1])]
    typed = pb.ModelInferRequest(model_name="m")
    typed.inputs.add(name="text", datatype="BYTES", shape=[2]).contents.bytes_contents.extend([b"a", "ß".encode()])
    assert decode_infer_request(typed, ins, outs).inputs["text"].tolist() == ["a", "ß"]
    raw = pb.ModelInferRequest(model_name="m")
    raw.inputs.add(name="text", datatype="BYTES", shape=[2])
    raw.raw_input_contents.append(le_bytes(np.array(["a", "ß"], dtype=object)))
    assert decode_infer_request(raw, ins, outs).inputs["text"].tolist() == ["a", "ß"]
    short = pb.ModelInferRequest(model_name="m")
    short.inputs.add(name="text", datatype="BYTES", shape=[3]).contents.bytes_contents.extend([b"a"])
    with pytest.raises(BadRequest, match="bytes_contents has 1 values but shape"):
        decode_infer_request(short, ins, outs)


# ---------------------------------------------------------------- models refused with the fix

def test_zipmap_sequence_and_bf16_outputs_are_refused_at_deploy_with_the_fix(models, sklearn_models):
    zipmap = load_problem("onnxruntime", sklearn_models["zipmap"])  # the deploy's own check, in a child process
    assert zipmap is not None and "output_probability" in zipmap.message and "sequence of maps" in zipmap.message
    assert "'zipmap': False" in zipmap.fix and "--backend openvino" not in zipmap.fix
    for backend in ("onnxruntime", "openvino", None):  # None: a deploy with backend "auto"
        assert "'zipmap': False" in graph_problem(sklearn_models["zipmap"], backend).fix
    from reamer.serve.deploy_check import DeployCheck, DeployRequest

    auto = DeployCheck().run(DeployRequest(sklearn_models["zipmap"], None))  # the agent's check for "auto"
    assert auto.problem is not None and "'zipmap': False" in auto.problem.fix
    assert DeployCheck().run(DeployRequest(models["labels"], None)).problem is None
    seq = open_problem("onnxruntime", models["seq"])
    assert "'parts' is a sequence" in seq.message and "SequenceAt" in seq.fix
    bf16 = open_problem("onnxruntime", models["bf16"])
    assert "'y' is tensor(bfloat16)" in bf16.message and "Cast" in bf16.fix
    # the runtime's own view, for a model file the graph check did not read: the same problem and fix
    with pytest.raises(UnservableModel, match="sequence of maps") as err:
        open_backend("onnxruntime", sklearn_models["zipmap"], 1)
    assert "'zipmap': False" in err.value.fix


def test_strings_are_refused_for_openvino_with_the_fix(models):
    problem = open_problem("openvino", models["labels"])
    assert "string (BYTES)" in problem.message and "--backend onnxruntime" in problem.fix
    with pytest.raises(UnservableModel, match="ONNX Runtime only"):  # a string graph OpenVINO reads: refused all the same
        open_backend("openvino", models["unsqueeze"], 1)
    assert open_problem("onnxruntime", models["labels"]) is None


def test_a_custom_op_no_library_provides_is_refused_with_the_exact_fix(models, monkeypatch):
    problem = open_problem("onnxruntime", models["unknown_op"])
    assert "com.example.ops: Frobnicate" in problem.message
    assert "inference.custom_op_libraries" in problem.fix and "--backend openvino" not in problem.fix
    openvino = open_problem("openvino", models["upper"])
    assert "OpenVINO cannot run" in openvino.message and "onnxruntime-extensions" in openvino.fix
    monkeypatch.setattr(model_types, "extensions_library", lambda: None)  # as on a host without the package
    monkeypatch.delenv(backends.CUSTOM_OP_LIBRARIES_ENV, raising=False)
    missing = open_problem("onnxruntime", models["upper"])
    assert "ai.onnx.contrib: StringUpper" in missing.message and "loaded: none" in missing.message
    assert "pip install onnxruntime-extensions" in missing.fix and "inference.custom_op_libraries" in missing.fix
    assert graph_problem(models["upper"], None).fix == missing.fix  # a deploy with backend "auto" as well
    # the runtime's refusal, where the graph was not read first, gives the same fix
    with pytest.raises(UnservableModel, match="no loaded custom-op library provides") as err:
        open_backend("onnxruntime", models["upper"], 1)
    assert err.value.fix == missing.fix


def test_custom_op_libraries_from_the_environment_are_registered(models, monkeypatch, tmp_path):
    library = backends.extensions_library()
    if library is None:
        pytest.skip("onnxruntime-extensions is not installed (pip install onnxruntime-extensions)")
    monkeypatch.setattr(model_types, "extensions_library", lambda: None)
    monkeypatch.setenv(backends.CUSTOM_OP_LIBRARIES_ENV, library)  # what inference.custom_op_libraries sets
    with open_backend("onnxruntime", models["upper"], 1) as backend:
        assert backend.run({"text": np.array(["abc", b"x"], dtype=object)})["out"].tolist() == ["ABC", "X"]
    monkeypatch.setenv(backends.CUSTOM_OP_LIBRARIES_ENV, str(tmp_path / "missing.so"))
    with pytest.raises(BackendError, match="missing.so") as err:
        open_backend("onnxruntime", models["labels"], 1)
    assert "inference.custom_op_libraries" in err.value.fix


def test_the_config_key_takes_only_root_owned_files(tmp_path):
    from reamer.agent.config import ConfigError, config_from_dict

    library = backends.extensions_library() or sys.executable
    assert config_from_dict({"inference": {"custom_op_libraries": [library]}}).inference.custom_op_libraries == [library]
    writable = tmp_path / "lib.so"
    writable.write_bytes(b"\x7fELF")
    writable.chmod(0o666)
    for paths, words in (([str(writable)], "writable by root alone"), (["lib.so"], "not an absolute path"),
                         ([str(tmp_path / "none.so")], "cannot be read")):
        with pytest.raises(ConfigError, match=words):
            config_from_dict({"inference": {"custom_op_libraries": paths}})


# ---------------------------------------------------------------- sample inputs

def test_samples_for_bytes_inputs_are_words_or_the_given_strings(models, tmp_path):
    info = [TensorInfo("text", "BYTES", [-1, 1])]
    feeds = plan_samples(info).batch(8, np.random.default_rng(1))["text"]
    assert feeds.dtype == object and feeds.shape == (8, 1)
    assert all(isinstance(v, str) and v and v.replace(" ", "").isalpha() for v in feeds.ravel().tolist())
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"data": [{"text": ["good movie"]}, {"text": ["bad film"]}]}))
    assert plan_samples(info, SampleSpec(input_data=str(data))).batch(3)["text"].ravel().tolist() == [
        "good movie", "bad film", "good movie"]
    npz = tmp_path / "data.npz"
    np.savez(npz, text=np.array([["ünï"], ["two"]]))  # a numpy unicode array: no pickle
    assert plan_samples(info, SampleSpec(input_data=str(npz))).batch(2)["text"].ravel().tolist() == ["ünï", "two"]
    data.write_text(json.dumps({"data": [{"text": [7]}]}))
    with pytest.raises(SampleError, match="not strings"):
        plan_samples(info, SampleSpec(input_data=str(data)))
    with open_backend("onnxruntime", models["labels"], 1) as backend:  # words the model takes: unknown -> -1
        assert backend.run({"text": feeds})["echo"].tolist() == feeds.tolist()


def test_profile_measures_a_string_model_on_sample_words(models):
    from reamer.serve.measure.profiler import measure_point

    point = measure_point(models["labels"], "onnxruntime", cores=1, batch=4, cpus=CPUS[-1:], max_windows=4,
                          warmup_s=0.1, window_s=0.15)
    assert point.throughput_rps > 0


def test_an_auto_search_of_a_string_model_drops_openvino_and_picks_onnxruntime(models):
    from reamer.search.on_cores import MeasureSettings, installed_backends, search_layout

    if "openvino" not in installed_backends():
        pytest.skip("OpenVINO is not installed: there is nothing to drop")
    outcome = search_layout(models["labels"], "auto", CPUS[-1:], None, cache_dir=None, batches=(1, 2),
                            settings=MeasureSettings(warmup_s=0.1, window_s=0.1), budget_s=120, finals=None)
    assert outcome.best is not None and outcome.best.layout.backend == "onnxruntime"


# ---------------------------------------------------------------- served by real jobs

def _expected(words: list[str]) -> list[int]:
    return [LABELS.get(w, -1) for w in words]


def _rest_call(client: thttp.InferenceServerClient, words: list[str], binary: bool):
    arr = np.array(words, dtype=object).reshape(-1, 1)
    item = thttp.InferInput("text", list(arr.shape), "BYTES")
    item.set_data_from_numpy(arr, binary_data=binary)
    outs = [thttp.InferRequestedOutput(n, binary_data=binary) for n in ("label", "echo")]
    result = client.infer("strings", [item], outputs=outs)
    return result.as_numpy("label").ravel().tolist(), _texts(result.as_numpy("echo"))


def _grpc_call(client: tgrpc.InferenceServerClient, words: list[str], binary: bool):
    arr = np.array(words, dtype=object).reshape(-1, 1)
    item = tgrpc.InferInput("text", list(arr.shape), "BYTES")
    item.set_data_from_numpy(arr)
    result = client.infer("strings", [item])
    return result.as_numpy("label").ravel().tolist(), _texts(result.as_numpy("echo"))


def test_concurrent_clients_over_rest_json_binary_and_grpc_each_get_their_own_strings(models, tmp_path):
    job = RunningJob(models["labels"], tmp_path, name="strings", max_batch=8, log_path=tmp_path / "job.log")
    failures: list[str] = []
    try:
        meta = thttp.InferenceServerClient(job.rest).get_model_metadata("strings")
        assert meta["inputs"][0]["datatype"] == "BYTES" and meta["outputs"][1]["datatype"] == "BYTES"

        def client(k: int, kind: str) -> None:
            rest = thttp.InferenceServerClient(job.rest)
            grpc = tgrpc.InferenceServerClient(job.grpc)
            try:
                for i in range(12):
                    words = [f"{kind}-client{k}-req{i}-ünï", list(LABELS)[(k + i) % 3]][: 1 + (i % 2)]
                    call = _grpc_call if kind == "grpc" else _rest_call
                    labels, echo = call(grpc if kind == "grpc" else rest, words, kind != "json")
                    if echo != words or labels != _expected(words):
                        failures.append(f"{kind} client {k} request {i}: sent {words}, got {echo} {labels}")
            except Exception as exc:  # noqa: BLE001 - reported below, with the client that hit it
                failures.append(f"{kind} client {k}: {exc!r}")
            finally:
                grpc.close()

        threads = [threading.Thread(target=client, args=(k, kind)) for k in range(3)
                   for kind in ("json", "binary", "grpc")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not failures, failures[:5]
        # a BYTES request the model cannot take is a clear 400, and the job goes on serving
        r = httpx.post(f"http://{job.rest}/v2/models/strings/infer", timeout=30, json={
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": [5]}]})
        assert r.status_code == 400 and "a number where a string belongs" in r.json()["error"]
        assert _rest_call(thttp.InferenceServerClient(job.rest), ["dog"], False) == ([2], ["dog"])
    finally:
        assert job.stop() == 0


def test_a_skl2onnx_text_pipeline_answers_as_scikit_learn_does(sklearn_models, tmp_path):
    job = RunningJob(sklearn_models["text"], tmp_path, name="strings", max_batch=4, log_path=tmp_path / "job.log")
    try:
        texts = ["good movie", "bad plot", "great fun film", "awful"]
        arr = np.array(texts, dtype=object).reshape(-1, 1)
        item = thttp.InferInput("text", [4, 1], "BYTES")
        item.set_data_from_numpy(arr)
        got = thttp.InferenceServerClient(job.rest).infer("strings", [item]).as_numpy("probabilities")
        np.testing.assert_allclose(got, sklearn_models["pipeline"].predict_proba(texts), atol=1e-5)
    finally:
        assert job.stop() == 0


def test_an_onnxruntime_extensions_op_is_served_when_the_package_is_installed(models, tmp_path):
    if backends.extensions_library() is None:
        pytest.skip("onnxruntime-extensions is not installed (pip install onnxruntime-extensions)")
    job = RunningJob(models["upper"], tmp_path, name="strings", max_batch=4, log_path=tmp_path / "job.log")
    try:
        arr = np.array(["abc", "Mixed Case"], dtype=object)
        for binary in (False, True):
            item = thttp.InferInput("text", [2], "BYTES")
            item.set_data_from_numpy(arr, binary_data=binary)
            out = thttp.InferenceServerClient(job.rest).infer(
                "strings", [item], outputs=[thttp.InferRequestedOutput("out", binary_data=binary)])
            assert _texts(out.as_numpy("out")) == ["ABC", "MIXED CASE"]
    finally:
        assert job.stop() == 0


def test_an_offline_job_reads_and_writes_strings_without_pickles(models, tmp_path):
    (tmp_path / "in").mkdir()
    words = {"a": np.array([["cat"], ["ünknown"], ["bird"]]), "b": np.array(["dog"])}  # a batch, and one sample
    for stem, arr in words.items():
        np.save(tmp_path / "in" / f"{stem}.npy", arr)
    spec = JobSpec(name="off", kind="offline", model=models["labels"], run_dir=str(tmp_path / "run"),
                   input_dir=str(tmp_path / "in"), output_dir=str(tmp_path / "out"),
                   instances=[InstanceSpec([CPUS[-1]], 1, 4)], frontdoor_cpus=[CPUS[0]])
    spec.save(tmp_path / "spec.json")
    job = subprocess.run([sys.executable, "-m", "reamer.serve.runtime.job", "--spec", str(tmp_path / "spec.json")],
                         cwd=REPO, timeout=300, capture_output=True, text=True)
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-2000:]
    for stem, arr in words.items():
        with np.load(tmp_path / "out" / f"{stem}.npz", allow_pickle=False) as result:
            assert result["echo"].dtype.kind == "U" and result["echo"].tolist() == arr.tolist()
            assert result["label"].ravel().tolist() == _expected(arr.ravel().tolist())
    status = wait_for(lambda: JobStatus.load(tmp_path / "run" / "status.json"), timeout=10, what="status")
    assert status.state == "done"


# ---------------------------------------------------------------- deployed through a real agent

@pytest.fixture(scope="module")
def agent():
    from tests.agent.conftest import needs_rt_host, started_daemon

    if needs_rt_host.args[0]:
        pytest.skip(needs_rt_host.kwargs["reason"])
    with started_daemon() as daemon:
        yield daemon


def _reamer(agent, *args: str):
    from click.testing import CliRunner

    from reamer.cli.main import cli

    return CliRunner().invoke(cli, ["--socket", agent.socket, *args])


@pytest.mark.root
@pytest.mark.parametrize("backend", ["auto", "onnxruntime"])
def test_the_agent_refuses_a_zipmap_classifier_at_deploy_with_the_fix(agent, sklearn_models, backend):
    name = f"zipmap-{backend}"
    try:
        result = _reamer(agent, "-o", "json", "infer", "deploy", name, "--model", sklearn_models["zipmap"],
                         "--online", "--slo-ms", "500", "--layout", "1x1:b1", "--backend", backend)
        assert result.exit_code != 0, result.output
        error = json.loads(result.stdout)["error"]
        assert "sequence of maps" in error["message"] and "'zipmap': False" in error["fix"]
        listed = json.loads(_reamer(agent, "-o", "json", "infer", "list").stdout)
        assert name not in json.dumps(listed)  # refused: no job was made
    finally:
        _reamer(agent, "infer", "remove", name)


@pytest.mark.root
def test_the_agent_serves_a_string_model_with_the_default_backend(agent, models):
    try:
        result = _reamer(agent, "-o", "json", "infer", "deploy", "strings", "--model", models["labels"], "--online",
                         "--slo-ms", "500", "--layout", "1x1:b4", "--bind", "127.0.0.1", "--wait")
        assert result.exit_code == 0, result.output
        job = json.loads(result.stdout)
        client = thttp.InferenceServerClient(f"127.0.0.1:{job['port']}")
        for binary in (False, True):
            assert _rest_call(client, ["bird", "unknown ünï"], binary) == ([3, -1], ["bird", "unknown ünï"])
        grpc = tgrpc.InferenceServerClient(f"127.0.0.1:{job['grpc_port']}")
        try:
            assert _grpc_call(grpc, ["cat"], True) == ([1], ["cat"])
        finally:
            grpc.close()
    finally:
        _reamer(agent, "infer", "remove", "strings")
