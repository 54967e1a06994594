"""`reamer infer deploy` against a real agent: "running" means the front doors answer (REST and gRPC, asked
right after the command returns), `--wait` means ready, a deploy that cannot serve says why (as JSON on stdout
with -o json), and with no reserved cpu the front door takes the idle core, not the instance's."""
from __future__ import annotations

import json
import os

import grpc
import httpx
import psutil
import pytest
from click.testing import CliRunner

from reamer.cli.main import cli
from reamer.serve import models
from reamer.serve.doors.grpc_v2.messages import SERVICE, ServerReadyRequest, ServerReadyResponse
from tests.agent.conftest import needs_rt_host, started_daemon

pytestmark = [needs_rt_host, pytest.mark.root]


@pytest.fixture(scope="module")
def agent():
    with started_daemon() as daemon:  # reserved_cpus: [] (no cpu of its own for the front door)
        yield daemon


@pytest.fixture
def tiny_model(tmp_path) -> str:
    return models.build_model("tiny", tmp_path / "tiny.onnx").path


def reamer(agent, *args: str):
    return CliRunner().invoke(cli, ["--socket", agent.socket, *args])


def grpc_server_ready(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(f"/{SERVICE}/ServerReady", request_serializer=ServerReadyRequest.SerializeToString,
                                   response_deserializer=ServerReadyResponse.FromString)
        return call(ServerReadyRequest(), timeout=10).ready


@pytest.mark.parametrize("wait", [False, True])
def test_running_means_both_front_doors_answer_when_the_command_returns(agent, tiny_model, wait):
    name = f"web{int(wait)}"
    try:
        result = reamer(agent, "-o", "json", "infer", "deploy", name, "--model", tiny_model, "--online",
                        "--slo-ms", "500", "--layout", "1x1:b2", "--bind", "127.0.0.1", *(["--wait"] if wait else []))
        assert result.exit_code == 0, result.output
        job = json.loads(result.stdout)
        assert job["state"] == "running" and job["ready"] is True
        # asked at once, as a client that read "running" would
        assert httpx.get(f"http://127.0.0.1:{job['port']}/v2/health/ready", timeout=10).status_code == 200
        assert grpc_server_ready(job["grpc_port"])
        table = reamer(agent, "infer", "show", name)
        assert "state:" in table.output and "running" in table.output
    finally:
        reamer(agent, "infer", "remove", name)


def test_a_deploy_that_cannot_serve_says_why_as_json_on_stdout(agent, tmp_path):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"this is not an ONNX model")
    try:
        result = reamer(agent, "-o", "json", "infer", "deploy", "broken", "--model", str(broken), "--online",
                        "--slo-ms", "500", "--layout", "1x1:b1", "--timeout", "120")
        assert result.exit_code != 0
        error = json.loads(result.stdout)["error"]  # refused at deploy, or failed once started: either way, why
        assert error["message"] and error["fix"] and error["exit_code"] == result.exit_code
        assert "Traceback" not in result.output
    finally:
        reamer(agent, "infer", "remove", "broken")


def test_with_no_reserved_cpu_the_front_door_takes_the_idle_core(agent, tiny_model):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cpus: one for the instance, one for the front door")
    try:
        result = reamer(agent, "-o", "json", "infer", "deploy", "door", "--model", tiny_model, "--online",
                        "--slo-ms", "500", "--layout", "1x1:b2", "--bind", "127.0.0.1")
        assert result.exit_code == 0, result.output
        job = json.loads(result.stdout)
        instance_cpus = {c for i in job["instances"] for c in i["cpus"]}
        idle = set(agent.client.node().idle_cpus) - instance_cpus
        assert idle, "the node has no idle cpu beside the instance"
        door = set(psutil.Process(job["pid"]).cpu_affinity())  # the job's own process: its front doors
        assert door and door <= idle and door.isdisjoint(instance_cpus)
    finally:
        reamer(agent, "infer", "remove", "door")
