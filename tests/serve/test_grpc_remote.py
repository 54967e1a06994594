"""gRPC clients "on another host": tritonclient.grpc in a network namespace of its own (tests/serve/netns.py)
reaches a job's gRPC front door over a veth pair, as a client elsewhere in the cluster does."""
from __future__ import annotations

import json

import numpy as np
import pytest

from reamer.serve.backends import open_backend
from reamer.serve.models import build_model
from tests.serve.netns import netns  # noqa: F401 - the fixture
from tests.serve.test_grpc_frontdoor import grpc_job

GRPC_CLIENT = """
import json, sys, numpy as np, tritonclient.grpc as grpcclient
target, name = sys.argv[1:3]
x = np.arange(2 * 16, dtype=np.float32).reshape(2, 16) / 32
c = grpcclient.InferenceServerClient(target)
i = grpcclient.InferInput("input", [2, 16], "FP32")
i.set_data_from_numpy(x)
print(json.dumps(c.infer(name, [i], client_timeout=10).as_numpy("output").tolist()))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model("tiny", tmp_path_factory.mktemp("m") / "tiny.onnx").path


def _want(model: str) -> np.ndarray:
    ref = open_backend("onnxruntime", model, 1)
    try:
        return ref.run({"input": np.arange(2 * 16, dtype=np.float32).reshape(2, 16) / 32})["output"]
    finally:
        ref.close()


def test_a_job_on_all_interfaces_answers_grpc_from_another_network_namespace(tiny, tmp_path, netns):  # noqa: F811
    job = grpc_job(tiny, tmp_path, name="tiny", host="0.0.0.0")
    try:
        done = netns.python(GRPC_CLIENT, f"{netns.host_address}:{job.status.grpc_port}", "tiny")
        assert done.returncode == 0, done.stderr[-2000:]
        np.testing.assert_array_equal(np.array(json.loads(done.stdout), np.float32), _want(tiny))
    finally:
        assert job.stop() == 0


def test_a_loopback_job_is_not_reachable_over_grpc_from_elsewhere(tiny, tmp_path, netns):  # noqa: F811
    job = grpc_job(tiny, tmp_path, name="tiny", host="127.0.0.1")
    try:
        done = netns.python(GRPC_CLIENT, f"{netns.host_address}:{job.status.grpc_port}", "tiny", timeout=60)
        assert done.returncode != 0 and "UNAVAILABLE" in done.stderr, done.stderr[-2000:]
    finally:
        assert job.stop() == 0
