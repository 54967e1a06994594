"""The gRPC front door of a real online job (`python -m reamer.serve.runtime.job`): tritonclient.grpc and a plain
KServe-v2 gRPC client (typed contents) against it, next to REST on the same job."""
from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from reamer.serve.backends import open_backend
from reamer.serve.protocol.model_config import max_request_rows
from reamer.serve.doors.grpc_v2 import messages as pb
from reamer.serve.models import build_model
from reamer.serve.spec import InstanceSpec, JobSpec, JobStatus
from tests.conftest import wait_for
from tests.serve.jobs import CPUS, REPO, RunningJob

MAX_BATCH = 4


def grpc_job(model: str, tmp_path, name: str = "mio", **spec_fields) -> RunningJob:
    """A job serving REST and gRPC (loopback unless `host` says otherwise)."""
    spec_fields.setdefault("host", "127.0.0.1")
    return RunningJob(model, tmp_path, name, max_batch=MAX_BATCH, grpc_port=0, **spec_fields)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model("multi-io", tmp_path_factory.mktemp("m") / "mio.onnx").path


@pytest.fixture(scope="module")
def reference(model):
    ref = open_backend("onnxruntime", model, 1)
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def job(model, tmp_path_factory):
    j = grpc_job(model, tmp_path_factory.mktemp("job"), max_request_mb=1.0)
    yield j
    assert j.stop() == 0


def _inputs(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, 8)).astype(np.float32), "ids": rng.integers(0, 10, (batch, 4))}


def _triton_inputs(feeds: dict[str, np.ndarray]) -> list:
    ins = []
    for name, array in feeds.items():
        i = tgrpc.InferInput(name, list(array.shape), "FP32" if array.dtype == np.float32 else "INT64")
        i.set_data_from_numpy(array)  # tritonclient.grpc always sends raw_input_contents
        ins.append(i)
    return ins


def job_inputs() -> list:
    from reamer.serve.protocol.tensors import TensorInfo

    return [TensorInfo("x", "FP32", [-1, 8]), TensorInfo("ids", "INT64", [-1, 4])]


def _rpc(target: str, method: str):
    request, response = pb.METHODS[method]
    channel = grpc.insecure_channel(target)
    return channel, channel.unary_unary(f"/{pb.SERVICE}/{method}", request_serializer=request.SerializeToString,
                                        response_deserializer=response.FromString)


def test_health_metadata_and_config_over_tritonclient(job):
    c = tgrpc.InferenceServerClient(job.grpc)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("mio")
    meta = c.get_server_metadata(as_json=True)
    assert meta["name"] == "reamer"
    model = c.get_model_metadata("mio", as_json=True)
    assert model["name"] == "mio" and model["platform"] == "onnxruntime_onnx" and model["versions"] == ["1"]
    assert [(t["name"], t["datatype"], t["shape"]) for t in model["inputs"]] == [
        ("x", "FP32", ["-1", "8"]), ("ids", "INT64", ["-1", "4"])]  # int64 as JSON strings, as protobuf writes them
    assert [(t["name"], t["datatype"]) for t in model["outputs"]] == [("scores", "FP32"), ("id_sum", "INT64")]
    config = c.get_model_config("mio", as_json=True)["config"]
    # the model's batchability (the rows a request can carry within max_request_mb: 1 MiB / 64 bytes a row),
    # not the layout's max batch
    assert config["max_batch_size"] == 16384 == max_request_rows(job_inputs(), 2**20) != MAX_BATCH
    assert config["backend"] == "onnxruntime"
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("x", "TYPE_FP32", ["8"]), ("ids", "TYPE_INT64", ["4"])]
    with pytest.raises(InferenceServerException) as err:
        c.get_model_metadata("other")
    assert err.value.status() == "StatusCode.NOT_FOUND" and "'other'" in err.value.message()


@pytest.mark.parametrize("batch", [1, MAX_BATCH])
def test_tritonclient_infer_equals_onnxruntime(job, reference, batch):
    c = tgrpc.InferenceServerClient(job.grpc)
    feeds = _inputs(batch, seed=batch)
    res = c.infer("mio", _triton_inputs(feeds), request_id="r7")
    want = reference.run(feeds)
    assert res.get_response().id == "r7" and res.get_response().model_name == "mio"
    np.testing.assert_array_equal(res.as_numpy("scores"), want["scores"])
    np.testing.assert_array_equal(res.as_numpy("id_sum"), want["id_sum"])
    # one output asked for: only it comes back
    res = c.infer("mio", _triton_inputs(feeds), outputs=[tgrpc.InferRequestedOutput("id_sum")])
    assert res.as_numpy("scores") is None
    np.testing.assert_array_equal(res.as_numpy("id_sum"), want["id_sum"])


@pytest.mark.parametrize("compression", ["gzip", "deflate"])
def test_compressed_requests_and_answers(job, reference, compression):
    feeds = _inputs(MAX_BATCH, seed=5)
    res = tgrpc.InferenceServerClient(job.grpc).infer("mio", _triton_inputs(feeds), compression_algorithm=compression)
    np.testing.assert_array_equal(res.as_numpy("scores"), reference.run(feeds)["scores"])


def test_typed_contents_from_a_plain_kserve_v2_client_come_back_typed(job, reference):
    feeds = _inputs(3, seed=9)
    req = pb.ModelInferRequest(model_name="mio", id="k1")
    req.inputs.add(name="x", datatype="FP32", shape=[3, 8]).contents.fp32_contents.extend(feeds["x"].ravel().tolist())
    req.inputs.add(name="ids", datatype="INT64", shape=[3, 4]).contents.int64_contents.extend(feeds["ids"].ravel().tolist())
    channel, infer = _rpc(job.grpc, "ModelInfer")
    with channel:
        resp, call = infer.with_call(req, timeout=60)
    want = reference.run(feeds)
    assert resp.id == "k1" and not resp.raw_output_contents
    scores, id_sum = resp.outputs
    assert (scores.name, scores.datatype, list(scores.shape)) == ("scores", "FP32", [3, 4])
    np.testing.assert_array_equal(np.array(scores.contents.fp32_contents, np.float32).reshape(3, 4), want["scores"])
    assert list(id_sum.contents.int64_contents) == want["id_sum"].ravel().tolist()
    timing = dict(call.trailing_metadata())["server-timing"]
    assert "queue;dur=" in timing and "compute;dur=" in timing and "total;dur=" in timing


def _bad(job, mutate) -> grpc.RpcError:
    feeds = _inputs(2)
    req = pb.ModelInferRequest(model_name="mio")
    for name, array in feeds.items():
        req.inputs.add(name=name, datatype="FP32" if name == "x" else "INT64", shape=list(array.shape))
        req.raw_input_contents.append(array.tobytes())
    mutate(req)
    channel, infer = _rpc(job.grpc, "ModelInfer")
    with channel, pytest.raises(grpc.RpcError) as err:
        infer(req, timeout=60)
    return err.value


@pytest.mark.parametrize("mutate, words", [
    (lambda r: setattr(r.inputs[0], "name", "nope"), "unknown input 'nope'"),
    (lambda r: r.inputs[0].shape.__setitem__(1, 7), "input 'x' has shape [2, 7]"),
    (lambda r: setattr(r.inputs[1], "datatype", "FP32"), "input 'ids' has datatype 'FP32' but the model expects INT64"),
    (lambda r: (r.inputs.pop(), r.raw_input_contents.pop()), "missing input(s) ['ids']"),
    (lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 12), "raw_input_contents[0] ('x') has 12 bytes"),
    (lambda r: r.raw_input_contents.pop(), "raw_input_contents has 1 entries for 2 inputs"),
    (lambda r: r.inputs[0].contents.fp32_contents.append(1.0), "inputs[0] ('x').contents is set beside"),
    (lambda r: r.outputs.add(name="nah"), "unknown output 'nah' in outputs[0].name"),
    (lambda r: r.ClearField("raw_input_contents"), "inputs[0] ('x').contents.fp32_contents has 0 values"),
])
def test_bad_requests_are_invalid_argument_naming_the_field_and_the_job_keeps_serving(job, reference, mutate, words):
    err = _bad(job, mutate)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert words in err.details() and "fix:" in err.details()
    feeds = _inputs(1)
    res = tgrpc.InferenceServerClient(job.grpc).infer("mio", _triton_inputs(feeds))
    np.testing.assert_array_equal(res.as_numpy("id_sum"), reference.run(feeds)["id_sum"])


def test_other_model_name_is_not_found(job):
    err = _bad(job, lambda r: setattr(r, "model_name", "other"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "'other'" in err.details() and "'mio'" in err.details()


def test_a_message_over_max_request_mb_is_resource_exhausted_and_the_job_keeps_serving(job, reference):
    big = _inputs(40000)  # 40000 x (8 x 4 + 4 x 8) bytes: 2.5 MB, over the job's 1 MiB
    with pytest.raises(InferenceServerException) as err:
        tgrpc.InferenceServerClient(job.grpc).infer("mio", _triton_inputs(big))
    assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED", err.value
    feeds = _inputs(2)
    res = tgrpc.InferenceServerClient(job.grpc).infer("mio", _triton_inputs(feeds))
    np.testing.assert_array_equal(res.as_numpy("scores"), reference.run(feeds)["scores"])


def test_rest_and_grpc_clients_at_once_on_the_same_job(job, reference):
    before = job.read_status().requests
    rounds = 15

    def grpc_client(seed: int) -> int:
        c = tgrpc.InferenceServerClient(job.grpc)
        for k in range(rounds):
            feeds = _inputs(1 + (seed + k) % MAX_BATCH, seed=1000 * seed + k)
            res = c.infer("mio", _triton_inputs(feeds))
            want = reference.run(feeds)
            np.testing.assert_allclose(res.as_numpy("scores"), want["scores"], rtol=1e-5)
            np.testing.assert_array_equal(res.as_numpy("id_sum"), want["id_sum"])
        return rounds

    def rest_client(seed: int) -> int:
        c = thttp.InferenceServerClient(job.rest)
        for k in range(rounds):
            feeds = _inputs(1 + (seed + k) % MAX_BATCH, seed=1000 * seed + k)
            ins = []
            for name, array in feeds.items():
                i = thttp.InferInput(name, list(array.shape), "FP32" if name == "x" else "INT64")
                i.set_data_from_numpy(array)
                ins.append(i)
            res = c.infer("mio", ins)
            want = reference.run(feeds)
            np.testing.assert_allclose(res.as_numpy("scores"), want["scores"], rtol=1e-5)
            np.testing.assert_array_equal(res.as_numpy("id_sum"), want["id_sum"])
        return rounds

    with ThreadPoolExecutor(4) as pool:
        done = [pool.submit(f, s) for s, f in enumerate([grpc_client, rest_client, grpc_client, rest_client])]
        assert sum(f.result() for f in done) == 4 * rounds
    # both doors count in the job's one set of request stats
    wait_for(lambda: job.read_status().requests >= before + 4 * rounds, timeout=30,
             what="status.json to count the REST and gRPC requests")


def test_an_instance_killed_mid_request_is_unavailable_then_grpc_serves_from_its_restart(job, reference):
    """The job restarts the instance (a new process, while the gRPC server runs) and answers again."""
    (worker,) = job.workers
    feeds = _inputs(1)
    worker.suspend()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(lambda: tgrpc.InferenceServerClient(job.grpc).infer("mio", _triton_inputs(feeds)))
        time.sleep(1.0)  # the request reaches the stopped instance (the job hands it over within ms)
        assert not held.done()
        worker.kill()
        with pytest.raises(InferenceServerException) as err:
            held.result(60)
    assert err.value.status() == "StatusCode.UNAVAILABLE" and "crashed" in err.value.message(), err.value
    c = tgrpc.InferenceServerClient(job.grpc)
    wait_for(lambda: c.is_model_ready("mio"), timeout=90, what="the instance's restart")
    job.workers = job.live_workers()
    res = c.infer("mio", _triton_inputs(feeds))
    np.testing.assert_array_equal(res.as_numpy("id_sum"), reference.run(feeds)["id_sum"])


def test_grpc_and_rest_ports_are_in_the_status_and_differ(job):
    st = job.read_status()
    assert st.grpc_port and st.port and st.grpc_port != st.port
    assert httpx.get(f"http://{job.rest}/v2/health/ready", timeout=10).status_code == 200


def _two_calls_on_a_stopped_instance(j: RunningJob, feeds: dict[str, np.ndarray], what: str) -> tuple:
    """Two calls sent while the job's one instance is stopped: the one answered while it still is (`what`
    it is waited for as), then the results of both once the instance runs again."""
    (worker,) = j.workers
    worker.suspend()

    def call():
        try:
            return tgrpc.InferenceServerClient(j.grpc).infer("mio", _triton_inputs(feeds))
        except InferenceServerException as exc:
            return exc

    with ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(call) for _ in range(2)]
        first = wait_for(lambda: next((f.result() for f in calls if f.done()), None), timeout=60, what=what)
        worker.resume()
        return first, [f.result() for f in calls]


def test_over_capacity_is_unavailable_with_the_reason_and_serving_goes_on(model, reference, tmp_path):
    """A job whose SLO no request can meet while its one instance is busy: of two requests sent while the
    instance is stopped, one runs on it (and waits) and the other is shed at once."""
    j = grpc_job(model, tmp_path, slo_ms=0.001)
    try:
        c = tgrpc.InferenceServerClient(j.grpc)
        feeds = _inputs(1)
        for _ in range(3):  # the batcher measures the instance (nothing is shed before a measurement)
            c.infer("mio", _triton_inputs(feeds))
        shed, results = _two_calls_on_a_stopped_instance(j, feeds, "one of the two requests to be shed")
        assert isinstance(shed, InferenceServerException)
        assert shed.status() == "StatusCode.UNAVAILABLE", shed
        assert "over capacity" in shed.message() and "SLO" in shed.message()
        (served,) = [r for r in results if not isinstance(r, InferenceServerException)]
        np.testing.assert_array_equal(served.as_numpy("id_sum"), reference.run(feeds)["id_sum"])
        res = c.infer("mio", _triton_inputs(feeds))  # the instance is free again: served
        np.testing.assert_array_equal(res.as_numpy("id_sum"), reference.run(feeds)["id_sum"])
        wait_for(lambda: j.read_status().shed >= 1, timeout=30, what="status.json to count the shed request")
    finally:
        assert j.stop() == 0


# -- every datatype the front door carries, raw and typed

RAW_ONLY = ("FP16",)
DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
          "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
          "FP32": np.float32, "FP64": np.float64}


def _identity_model(path, datatypes: list[str]) -> str:
    """One Identity per datatype: input `in_<dt>` [batch, 3] -> output `out_<dt>`."""
    import onnx
    from onnx import helper

    from reamer.serve.protocol.tensors import v2_to_onnx

    nodes = [helper.make_node("Identity", [f"in_{d}"], [f"out_{d}"]) for d in datatypes]
    graph = helper.make_graph(nodes, "dtypes",
                              [helper.make_tensor_value_info(f"in_{d}", v2_to_onnx(d), ["batch", 3]) for d in datatypes],
                              [helper.make_tensor_value_info(f"out_{d}", v2_to_onnx(d), ["batch", 3]) for d in datatypes])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def _values(datatype: str, batch: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dtype = np.dtype(DTYPES[datatype])
    if dtype.kind == "b":
        return rng.integers(0, 2, (batch, 3)).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)  # the extremes too: they must survive int32/uint32 typed fields and raw bytes
        return np.array([[info.min, info.max, 0]] * batch, dtype=dtype) if seed == 0 else \
            rng.integers(info.min, info.max, (batch, 3), dtype=dtype, endpoint=True)
    return rng.standard_normal((batch, 3)).astype(dtype)


def test_every_datatype_raw_from_tritonclient(tmp_path):
    names = list(DTYPES)
    j = grpc_job(_identity_model(tmp_path / "dtypes.onnx", names), tmp_path, name="dtypes")
    try:
        c = tgrpc.InferenceServerClient(j.grpc)
        meta = c.get_model_metadata("dtypes", as_json=True)
        assert [t["datatype"] for t in meta["inputs"]] == names
        for seed, batch in ((0, 1), (1, MAX_BATCH)):
            feeds = {d: _values(d, batch, seed) for d in names}
            ins = []
            for d, array in feeds.items():
                i = tgrpc.InferInput(f"in_{d}", list(array.shape), d)
                i.set_data_from_numpy(array)
                ins.append(i)
            res = c.infer("dtypes", ins)
            for d, array in feeds.items():
                got = res.as_numpy(f"out_{d}")
                assert got.dtype == array.dtype, d
                np.testing.assert_array_equal(got, array, err_msg=d)
    finally:
        assert j.stop() == 0


def test_every_typed_datatype_from_a_plain_kserve_v2_client(tmp_path):
    names = [d for d in DTYPES if d not in RAW_ONLY]
    j = grpc_job(_identity_model(tmp_path / "typed.onnx", names), tmp_path, name="typed")
    try:
        from reamer.serve.protocol.grpc_codec import CONTENTS_FIELD

        channel, infer = _rpc(j.grpc, "ModelInfer")
        with channel:
            for seed, batch in ((0, 1), (1, MAX_BATCH)):
                feeds = {d: _values(d, batch, seed) for d in names}
                req = pb.ModelInferRequest(model_name="typed")
                for d, array in feeds.items():
                    item = req.inputs.add(name=f"in_{d}", datatype=d, shape=list(array.shape))
                    getattr(item.contents, CONTENTS_FIELD[d]).extend(array.ravel().tolist())
                resp = infer(req, timeout=60)
                assert not resp.raw_output_contents
                for out in resp.outputs:
                    d = out.datatype
                    got = np.array(getattr(out.contents, CONTENTS_FIELD[d]), dtype=DTYPES[d]).reshape(list(out.shape))
                    np.testing.assert_array_equal(got, feeds[d], err_msg=d)
            # a value that does not fit the declared type is the client's mistake, named
            req = pb.ModelInferRequest(model_name="typed")
            for d, array in {d: _values(d, 1, 0) for d in names}.items():
                item = req.inputs.add(name=f"in_{d}", datatype=d, shape=list(array.shape))
                values = array.ravel().tolist()
                if d == "INT8":
                    values[0] = 300
                getattr(item.contents, CONTENTS_FIELD[d]).extend(values)
            with pytest.raises(grpc.RpcError) as err:
                infer(req, timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "('in_INT8').contents.int_contents does not fit INT8" in err.value.details()
    finally:
        assert j.stop() == 0


def test_calls_over_the_jobs_connection_limit_are_resource_exhausted(model, reference, tmp_path):
    """The REST door's max_connections also bounds gRPC calls in flight: with 1, of two calls sent while the
    instance is stopped one waits on it and the other is refused at once; the waiting one is answered."""
    j = grpc_job(model, tmp_path, frontdoor={"max_connections": 1})
    try:
        feeds = _inputs(1)
        tgrpc.InferenceServerClient(j.grpc).infer("mio", _triton_inputs(feeds))
        refused, results = _two_calls_on_a_stopped_instance(j, feeds, "one of the two calls to be refused")
        assert isinstance(refused, InferenceServerException) and refused.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "limit" in refused.message().lower()
        (answered,) = [r for r in results if not isinstance(r, InferenceServerException)]
        np.testing.assert_array_equal(answered.as_numpy("id_sum"), reference.run(feeds)["id_sum"])
    finally:
        assert j.stop() == 0


def test_a_grpc_port_in_use_fails_the_start_with_the_fix():
    import asyncio
    import socket

    from reamer.host.errors import ReamerError
    from reamer.serve.runtime.batcher import DynamicBatcher
    from reamer.serve.doors.grpc import GrpcFrontDoor, GrpcV2Service

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        door = GrpcFrontDoor(GrpcV2Service("m", DynamicBatcher(None)), "127.0.0.1", port, 1 << 20)
        with pytest.raises(ReamerError) as err:
            asyncio.run(door.start())
    assert f"127.0.0.1:{port}" in str(err.value) and "grpc_port" in str(err.value)


def test_string_outputs_come_back_as_bytes_raw_and_typed(tmp_path):
    """A model with a BYTES (string) output: Triton's length-prefixed raw layout for tritonclient.grpc,
    bytes_contents for a typed request."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Cast", ["x"], ["label"], to=TensorProto.STRING)], "strings",
                              [helper.make_tensor_value_info("x", TensorProto.INT32, ["batch", 2])],
                              [helper.make_tensor_value_info("label", TensorProto.STRING, ["batch", 2])])
    path = tmp_path / "strings.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    j = grpc_job(str(path), tmp_path, name="strings")
    try:
        x = np.array([[7, -12], [0, 123456]], dtype=np.int32)
        want = np.array([[b"7", b"-12"], [b"0", b"123456"]], dtype=object)
        i = tgrpc.InferInput("x", [2, 2], "INT32")
        i.set_data_from_numpy(x)
        got = tgrpc.InferenceServerClient(j.grpc).infer("strings", [i]).as_numpy("label")
        assert got.shape == (2, 2) and got.tolist() == want.tolist()
        req = pb.ModelInferRequest(model_name="strings")
        req.inputs.add(name="x", datatype="INT32", shape=[2, 2]).contents.int_contents.extend(x.ravel().tolist())
        channel, infer = _rpc(j.grpc, "ModelInfer")
        with channel:
            resp = infer(req, timeout=60)
        (out,) = resp.outputs
        assert out.datatype == "BYTES" and list(out.contents.bytes_contents) == want.ravel().tolist()
        rest = thttp.InferenceServerClient(j.rest)  # REST: binary (length-prefixed) and JSON string outputs
        h = thttp.InferInput("x", [2, 2], "INT32")
        h.set_data_from_numpy(x)
        for binary in (True, False):
            out = rest.infer("strings", [h], outputs=[thttp.InferRequestedOutput("label", binary_data=binary)])
            got = out.as_numpy("label")
            assert [v if isinstance(v, bytes) else v.encode() for v in got.ravel().tolist()] == want.ravel().tolist()
    finally:
        assert j.stop() == 0


def test_a_job_whose_grpc_port_is_taken_fails_saying_so(model, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        spec = JobSpec(name="mio", kind="online", model=model, port=0, grpc_port=port, host="127.0.0.1",
                       run_dir=str(tmp_path / "run"), instances=[InstanceSpec([CPUS[-1]], 1, 1)])
        spec.save(tmp_path / "spec.json")
        job = subprocess.run([sys.executable, "-m", "reamer.serve.runtime.job", "--spec", str(tmp_path / "spec.json")],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert job.returncode == 1, job.stderr[-2000:]
    status = JobStatus.load(tmp_path / "run" / "status.json")
    assert status.state == "failed"
    assert f"cannot listen for gRPC on 127.0.0.1:{port}: Address already in use" in status.message
    assert "grpc_port" in status.message and "Traceback" not in job.stderr
