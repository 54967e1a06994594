"""gRPC through a real agent: an online job deployed by the API (and `reamer infer deploy --grpc-port`) gets a
gRPC port beside its REST one, shown by the API and `reamer infer show`, and answers tritonclient.grpc."""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from click.testing import CliRunner

from reamer.api.client import ApiError
from reamer.cli.main import cli
from reamer.serve import models
from reamer.serve.backends import open_backend
from tests.agent.conftest import daemon, needs_rt_host, shared_daemon, wait_for  # noqa: F401 - fixtures
from tests.conftest import unique_name

pytestmark = [needs_rt_host, pytest.mark.root]


@pytest.fixture
def tiny_model(tmp_path) -> str:
    return models.build_model("tiny", tmp_path / "tiny.onnx").path


def _ready(target: str, name: str) -> bool:
    try:
        return tgrpc.InferenceServerClient(target).is_model_ready(name)
    except Exception:  # noqa: BLE001 - not listening yet
        return False


def _infer(target: str, name: str, x: np.ndarray) -> np.ndarray:
    i = tgrpc.InferInput("input", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return tgrpc.InferenceServerClient(target).infer(name, [i]).as_numpy("output")


def test_an_online_job_gets_a_grpc_port_and_answers_tritonclient_grpc(daemon, tiny_model):  # noqa: F811
    job = daemon.client.deploy_inference({"name": "rpc", "model": tiny_model, "kind": "online", "slo_ms": 500,
                                          "layout": "1x1:b4"})
    assert job.grpc_port and job.port and job.grpc_port != job.port
    target = f"127.0.0.1:{job.grpc_port}"
    wait_for(lambda: _ready(target, "rpc"), timeout=90, what="the job's gRPC front door to be ready")
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    ref = open_backend("onnxruntime", tiny_model, 1)
    try:
        want = ref.run({"input": x})["output"]
    finally:
        ref.close()
    np.testing.assert_array_equal(_infer(target, "rpc", x), want)
    again = daemon.client.get_inference_job("rpc")
    assert again.grpc_port == job.grpc_port
    # the address to dial: the REST url's host with the gRPC port (what tritonclient.grpc takes as its url)
    assert again.url and again.grpc_target == f"{again.url.split('://', 1)[1].rsplit(':', 1)[0]}:{job.grpc_port}"
    np.testing.assert_array_equal(_infer(again.grpc_target, "rpc", x), want)  # and it answers there
    shown = CliRunner().invoke(cli, ["infer", "show", "rpc"], env={"REAMER_SOCKET": daemon.socket})
    assert shown.exit_code == 0, shown.output
    assert "grpc port" in shown.output and "grpc target" in shown.output and again.grpc_target in shown.output


def test_deploy_takes_the_grpc_port_asked_for_and_refuses_the_rest_port(daemon, tiny_model):  # noqa: F811
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free now; the job binds it in a moment
    deployed = CliRunner().invoke(cli, ["-o", "json", "infer", "deploy", "asked", "--model", tiny_model, "--online",
                                        "--slo-ms", "500", "--layout", "1x1:b1", "--grpc-port", str(port)],
                                  env={"REAMER_SOCKET": daemon.socket})
    assert deployed.exit_code == 0, deployed.output
    assert daemon.client.get_inference_job("asked").grpc_port == port
    wait_for(lambda: _ready(f"127.0.0.1:{port}", "asked"), timeout=90, what="the job on the gRPC port asked for")
    with pytest.raises(ApiError) as info:
        daemon.client.deploy_inference({"name": unique_name("same"), "model": tiny_model, "kind": "online",
                                        "slo_ms": 500, "layout": "1x1:b1", "port": 18123, "grpc_port": 18123})
    assert info.value.status == 400 and "grpc_port 18123 is also the REST port" in info.value.message
    refused = CliRunner().invoke(cli, ["infer", "deploy", "off", "--model", tiny_model, "--offline", "--input", "/tmp",
                                       "--output", "/tmp/x", "--grpc-port", "18124"], env={"REAMER_SOCKET": daemon.socket})
    assert refused.exit_code != 0 and "--grpc-port are for online jobs" in refused.output
