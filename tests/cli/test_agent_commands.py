"""Commands that talk to the agent: request bodies, table and JSON output, and errors (agent
unreachable, 4xx answers) as "error: …" / "fix: …" with an exit code, never a traceback.

The agent side here is a small FastAPI app on a real Unix socket that answers with the API's own
response models (reamer.api.schemas) and records what it was sent; the demo test runs the real agent.
"""
from __future__ import annotations

import json
import threading
import time

import pytest
import uvicorn
from click.testing import CliRunner
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from reamer.api import schemas
from reamer.cli.main import cli
from tests.conftest import wait_for

NOW = time.time()

NODE = schemas.NodeInfo(
    hostname="node-a", version="0.1.0", agent_pid=4242, uptime_s=12.0, cpu_model="Test CPU", cpus=[0, 1, 2, 3],
    reserved_cpus=[0], training_cpus=[1], idle_cpus=[2, 3], free_cores=2, allocations={"train-a": [1]},
    cgroup_version=1, rt_throttling=schemas.RtThrottling(runtime_us=950000, period_us=1000000),
    training_jobs=1, inference_jobs=1)
TRAIN = schemas.TrainingJob(name="train-a", cpus=[1], pids=[111, 112], threads_rr=7, threads=7, priority=50,
                            source="pids", state="running", created_at=NOW)
ONLINE = schemas.InferenceJob(
    name="svc", model="/models/m.onnx", kind="online", backend="onnxruntime", slo_ms=50.0, rate_rps=20.0, port=8100,
    state="running", layout="2x1:b4", pid=333, url="http://node-a.example:8100", bind_address="0.0.0.0",
    instances=[schemas.InferenceInstance(cpus=[2], threads=1, max_batch=4),
               schemas.InferenceInstance(cpus=[3], threads=1, max_batch=4)],
    status=schemas.InferenceStatus(rate_rps=19.5, p50_ms=3.0, p99_ms=9.5, slo_attainment=0.998,
                                  frontdoor_busy=0.86, frontdoor_cpu_ms=4.4))
OFFLINE = schemas.InferenceJob(
    name="batch", model="/models/m.onnx", kind="offline", backend="openvino", input_dir="/in", output_dir="/out",
    precision="bf16", effective_precision="bf16", state="done", pid=None, status=schemas.InferenceStatus(done=40, total=40, throughput=12.5))


def make_app(received: list) -> FastAPI:
    app = FastAPI()

    def error(status: int, code: str, message: str, fix: str) -> JSONResponse:
        return JSONResponse({"error": {"code": code, "message": message, "fix": fix}}, status_code=status)

    @app.get("/healthz")
    def healthz():
        return {"status": "ok"}

    @app.get("/v1/node")
    def node():
        return NODE.model_dump(mode="json")

    @app.get("/v1/training-jobs")
    def training():
        return {"jobs": [TRAIN.model_dump(mode="json")]}

    @app.post("/v1/training-jobs")
    async def attach(request: Request):
        body = await request.json()
        received.append(("POST /v1/training-jobs", body))
        if body["name"] == "busy":
            return error(409, "conflict", "only 0 free cores left, 2 asked", "detach a job or ask for fewer cores")
        return TRAIN.model_copy(update={"name": body["name"]}).model_dump(mode="json")

    @app.delete("/v1/training-jobs/{name}")
    def detach(name: str):
        if name != "train-a":
            return error(404, "not_found", f"no training job named {name}", "see `reamer train list`")
        return TRAIN.model_copy(update={"state": "ended"}).model_dump(mode="json")

    @app.get("/v1/inference-jobs")
    def inference():
        return {"jobs": [ONLINE.model_dump(mode="json"), OFFLINE.model_dump(mode="json")]}

    deployed: dict = {}  # what POST /v1/inference-jobs made, by name (a deploy polls it)

    @app.get("/v1/inference-jobs/{name}")
    def show(name: str):
        if name in deployed:
            return deployed[name].model_dump(mode="json")
        for job in (ONLINE, OFFLINE):
            if job.name == name:
                return job.model_dump(mode="json")
        return error(404, "not_found", f"no inference job named {name}", "see `reamer infer list`")

    @app.post("/v1/inference-jobs")
    async def deploy(request: Request):
        body = await request.json()
        received.append(("POST /v1/inference-jobs", body))
        job = (ONLINE if body["kind"] == "online" else OFFLINE).model_copy(update={"name": body["name"]})
        if body["name"] == "broken":  # the agent took it; its process failed at once
            deployed["broken"] = job.model_copy(update={
                "state": "failed", "pid": None,
                "message": "crashed 6 times within 60s (exit code 1); last log lines: no model - fix the cause"})
            job = job.model_copy(update={"state": "pending", "pid": None})
        if body["name"] == "waiting":  # no free cores: the agent keeps it pending
            job = deployed["waiting"] = job.model_copy(update={"state": "pending", "pid": None, "instances": [],
                                                               "message": "waiting for free cores"})
        deployed.setdefault(job.name, job)
        return job.model_dump(mode="json")

    @app.get("/v1/events")
    def events(since: int = 0, wait: float = 0.0):
        all_events = [schemas.Event(id=i, ts=NOW + i, kind=k, job=j, message=m) for i, k, j, m in (
            (1, "training_attached", "train-a", "train-a pinned to cpus 1"),
            (2, "inference_deployed", "svc", "svc on cpus 2-3"),
            (3, "overload", "svc", "svc gets 31 rps, admitted 20"))]
        chosen = [e.model_dump(mode="json") for e in all_events if e.id > since]
        return {"events": chosen, "last_id": 3}

    @app.get("/v1/gpus")
    def gpus():
        return {"enabled": True, "message": "no NVIDIA driver (nvidia-smi / libnvidia-ml not found)", "gpus": []}

    @app.post("/v1/demote-all")
    def demote():
        return {"threads_demoted": 7, "jobs": ["train-a"], "message": ""}

    return app


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """(socket path, list of received request bodies) for a stub agent on a real Unix socket."""
    socket_path = str(tmp_path_factory.mktemp("agent") / "reamer.sock")
    received: list = []
    server = uvicorn.Server(uvicorn.Config(make_app(received), uds=socket_path, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=60, what="stub agent to listen")
    yield socket_path, received
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def run(agent):
    socket_path, _ = agent
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(cli, ["--socket", socket_path, *args])

    return invoke


def stdout_json(result):
    return json.loads(result.stdout)


def test_status_table_shows_cores_and_jobs(run):
    result = run("status")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "node-a (Test CPU)" in out
    assert "reserved:" in out and "idle:" in out and "2-3" in out
    assert "train-a" in out and "7/7" in out
    assert "svc" in out and "2x1:b4" in out and "p99 9.5 ms" in out and "99.8% in SLO" in out
    assert "front door 86% of a cpu" in out
    assert "batch" in out and "40/40" in out


def test_status_json_is_the_api_objects(run):
    result = run("-o", "json", "status")
    assert result.exit_code == 0, result.output
    data = stdout_json(result)
    assert data["node"]["idle_cpus"] == [2, 3]
    assert [j["name"] for j in data["training_jobs"]] == ["train-a"]
    assert [j["name"] for j in data["inference_jobs"]] == ["svc", "batch"]
    assert data["inference_jobs"][0]["status"]["p99_ms"] == 9.5


def test_socket_from_environment(agent):
    socket_path, _ = agent
    result = CliRunner().invoke(cli, ["-o", "json", "train", "list"], env={"REAMER_SOCKET": socket_path})
    assert result.exit_code == 0, result.output
    assert stdout_json(result)[0]["threads_rr"] == 7


def test_train_attach_sends_the_request(run, agent):
    _, received = agent
    result = run("train", "attach", "job-x", "--pid", "10", "--pid", "11", "--cores", "2", "--priority", "60")
    assert result.exit_code == 0, result.output
    assert "attached job-x" in result.output and "SCHED_RR at priority 50" in result.output
    path, body = received[-1]
    assert path == "POST /v1/training-jobs"
    assert body == {"name": "job-x", "pids": [10, 11], "cores": 2, "priority": 60}


def test_train_attach_needs_exactly_one_source(run):
    result = run("train", "attach", "job-x", "--pid", "10", "--container", "abc")
    assert result.exit_code == 2
    assert "error: give exactly one of --pid, --cgroup, --container" in result.output
    assert "fix: " in result.output and "Traceback" not in result.output


def test_agent_conflict_is_exit_1_with_the_agents_fix(run):
    result = run("train", "attach", "busy", "--cgroup", "some/cgroup")
    assert result.exit_code == 1
    assert "error: only 0 free cores left, 2 asked" in result.output
    assert "fix: detach a job or ask for fewer cores" in result.output


def test_unknown_job_is_exit_2(run):
    result = run("infer", "show", "nope")
    assert result.exit_code == 2
    assert "error: no inference job named nope" in result.output
    assert "fix: see `reamer infer list`" in result.output
    assert "Traceback" not in result.output


def test_infer_deploy_online_sends_absolute_paths(run, agent, tmp_path):
    _, received = agent
    model = tmp_path / "m.onnx"
    model.write_bytes(b"onnx")
    result = run("-o", "json", "infer", "deploy", "svc2", "--model", str(model), "--online", "--slo-ms", "25",
                 "--rate", "40", "--layout", "2x1:b4", "--backend", "openvino", "--no-wait")
    assert result.exit_code == 0, result.output
    assert stdout_json(result)["name"] == "svc2"
    _, body = received[-1]
    assert body == {"name": "svc2", "model": str(model), "kind": "online", "slo_ms": 25.0, "rate_rps": 40.0,
                    "backend": "openvino", "layout": "2x1:b4"}


@pytest.mark.parametrize("extra, message", [
    (["--online"], "an online job needs a latency target"),
    (["--offline", "--input", "in"], "an offline job needs --input DIR and --output DIR"),
    ([], "say whether the job is --online or --offline"),
    (["--online", "--slo-ms", "10", "--layout", "2by1"], "layout"),
    (["--online", "--slo-ms", "10", "--shape", "input_ids"], "--shape 'input_ids' has no input name"),
    (["--online", "--slo-ms", "10", "--shape", "input_ids:1,x"], "not comma-separated integers"),
    (["--online", "--slo-ms", "10", "--shape", "input_ids:1,0"], "positive"),
    (["--online", "--slo-ms", "10", "--input-data", "/nonexistent.npz"], "--input-data /nonexistent.npz does not exist"),
    (["--offline", "--input", "/", "--output", "/tmp", "--bind", "127.0.0.1"], "--bind is for online jobs"),
])
def test_infer_deploy_bad_input(run, tmp_path, extra, message):
    model = tmp_path / "m.onnx"
    model.write_bytes(b"onnx")
    result = run("infer", "deploy", "x", "--model", str(model), *extra)
    assert result.exit_code == 2, result.output
    assert message in result.output and "fix: " in result.output


def test_infer_deploy_offline_waits_with_progress(run, agent, tmp_path):
    _, received = agent
    model = tmp_path / "m.onnx"
    model.write_bytes(b"onnx")
    (tmp_path / "in").mkdir()
    result = run("infer", "deploy", "batch", "--model", str(model), "--offline", "--input", str(tmp_path / "in"),
                 "--output", str(tmp_path / "out"), "--wait")
    assert result.exit_code == 0, result.output
    assert "deployed batch (offline): done" in result.output
    assert result.output.count("40/40") == 1  # the tqdm bar reached the total, drawn once
    assert received[-1][1]["input_dir"] == str(tmp_path / "in")


def test_infer_list_and_show(run):
    listing = run("infer", "list")
    assert listing.exit_code == 0
    assert "svc" in listing.output and "batch" in listing.output and "12.5/s" in listing.output
    assert "PRECISION" in listing.output and "bf16" in listing.output  # batch's; svc runs the default, f32
    show = run("infer", "show", "svc")
    assert show.exit_code == 0
    assert "layout:" in show.output and "2x1:b4" in show.output
    assert show.output.count("\n2 ") + show.output.count("\n3 ") == 2  # one row per instance
    # the front door's cpu (86 %, 4.4 ms per request) and the rate one process could carry at that cost
    assert "86% of a cpu, 4.4 ms of cpu per request: about 227 requests/s at most" in show.output


def test_events_list_and_since(run):
    result = run("events")
    assert result.exit_code == 0
    assert "training_attached" in result.output and "overload" in result.output
    newer = run("-o", "json", "events", "--since", "2")
    assert [e["id"] for e in stdout_json(newer)["events"]] == [3]


def test_gpu_status_without_driver(run):
    result = run("gpu", "status")
    assert result.exit_code == 0
    assert "no NVIDIA driver" in result.output


def test_demote_all_through_the_agent(run):
    result = run("-o", "json", "demote-all")
    assert result.exit_code == 0
    assert stdout_json(result) == {"via": "agent", "threads_demoted": 7, "jobs": ["train-a"], "message": ""}


@pytest.mark.parametrize("args", [["status"], ["train", "list"], ["infer", "list"], ["events"], ["gpu", "status"],
                                  ["train", "detach", "x"], ["infer", "remove", "x"]])
def test_agent_unreachable_is_message_fix_exit_1(tmp_path, args):
    result = CliRunner().invoke(cli, ["--socket", str(tmp_path / "none.sock"), *args])
    assert result.exit_code == 1
    assert f"error: the reamer agent is not reachable on {tmp_path / 'none.sock'}" in result.output
    assert "fix: start it" in result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)


def test_gpu_status_renders_the_managers_shape():
    from reamer.cli.gpu_cmd import render_gpu_status

    status = {
        "enabled": True, "available": True, "mps_available": True, "reason": "",
        "gpus": [{"index": 0, "uuid": "GPU-1", "name": "H100", "health": {"state": "healthy"},
                  "daemon": {"running": True, "pid": 77, "error": None}, "sm_percent_desired_total": 70,
                  "jobs": ["svc"], "latest": {"util_pct": 41.0, "memory_pct": 12.5}}],
        "jobs": [{"name": "svc", "gpu_index": 0, "kind": "inference", "state": "running",
                  "desired": {"sm_percent": 70, "mem_limit_mb": None}, "applied": {"sm_percent": 50},
                  "limits_state": "pending_restart"}],
    }
    text = render_gpu_status(status)
    assert "H100" in text and "healthy" in text and "running (pid 77)" in text and "41%" in text
    assert "pending_restart" in text and "70" in text and "50" in text
    assert render_gpu_status({"enabled": False, "message": "gpu.enabled is false"}).endswith("gpu.enabled is false")


def test_infer_deploy_sends_traffic_shapes_sample_data_and_bind(run, agent, tmp_path):
    _, received = agent
    model = tmp_path / "m.onnx"
    model.write_bytes(b"onnx")
    data = tmp_path / "samples.npz"
    data.write_bytes(b"npz")
    result = run("infer", "deploy", "bert", "--model", str(model), "--online", "--slo-ms", "50", "--layout", "1x1:b4",
                 "--shape", "input_ids:1,128", "--shape", "attention_mask:128", "--input-data", str(data),
                 "--bind", "127.0.0.1", "-o", "json", "--no-wait")
    assert result.exit_code == 0, result.output
    assert stdout_json(result)["name"] == "bert"  # -o json after the subcommand
    body = received[-1][1]
    assert body["shapes"] == {"input_ids": [1, 128], "attention_mask": [128]}
    assert body["input_data"] == str(data) and body["bind_address"] == "127.0.0.1"


def test_infer_deploy_sends_the_memory_limit(run, agent, tmp_path):
    _, received = agent
    model = tmp_path / "m.onnx"
    model.write_bytes(b"onnx")
    result = run("infer", "deploy", "capped", "--model", str(model), "--online", "--slo-ms", "50",
                 "--memory-limit-mb", "512", "--no-wait")
    assert result.exit_code == 0, result.output
    assert received[-1][1]["memory_limit_mb"] == 512
    assert run("infer", "deploy", "capped", "--model", str(model), "--online", "--slo-ms", "50",
               "--memory-limit-mb", "0").exit_code == 2


@pytest.mark.parametrize("args", [("infer", "list", "-o", "json"), ("infer", "show", "svc", "--output", "json"),
                                  ("-o", "json", "infer", "list"), ("status", "-o", "json")])
def test_json_output_before_or_after_the_subcommand(run, args):
    result = run(*args)
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)


def test_infer_list_gives_the_url(run):
    listing = run("infer", "list")
    assert listing.exit_code == 0 and "URL" in listing.output and "http://node-a.example:8100" in listing.output


def test_infer_show_gives_the_url(agent, tmp_path):
    socket_path, _ = agent
    result = CliRunner().invoke(cli, ["--socket", socket_path, "infer", "show", "svc"])
    assert result.exit_code == 0
    assert "url:" in result.output and "http://node-a.example:8100" in result.output


# --- an online deploy tells the truth -----------------------------------------------------------------------


def test_infer_deploy_online_waits_for_the_front_doors_and_says_why_they_never_answered(run, tmp_path):
    """The stub's job runs but its front doors (port 8100) never answer: no "running", the reason instead."""
    model = tmp_path / "m.onnx"
    model.write_bytes(b"onnx")
    result = run("infer", "deploy", "mute", "--model", str(model), "--online", "--slo-ms", "50", "--timeout", "1")
    assert result.exit_code == 1, result.output
    assert "running" not in result.stdout
    assert "error: inference job mute is not ready after 1 s" in result.output
    assert "the job has not reported ready" in result.output and "fix: see `reamer infer show mute`" in result.output


def test_infer_deploy_of_a_job_that_fails_gives_the_agents_reason_as_json_on_stdout(run, tmp_path):
    model = tmp_path / "m.onnx"
    model.write_bytes(b"onnx")
    result = run("-o", "json", "infer", "deploy", "broken", "--model", str(model), "--online", "--slo-ms", "50")
    assert result.exit_code == 1
    error = json.loads(result.stdout)["error"]
    assert error["message"].startswith("inference job broken failed: crashed 6 times")
    assert "reamer infer show broken" in error["fix"] and error["exit_code"] == 1
    assert "error: inference job broken failed" in result.stderr  # people still read it on stderr


def test_infer_deploy_pending_says_pending_and_why(run, tmp_path):
    model = tmp_path / "m.onnx"
    model.write_bytes(b"onnx")
    result = run("infer", "deploy", "waiting", "--model", str(model), "--online", "--slo-ms", "50")
    assert result.exit_code == 0, result.output
    assert "deployed waiting (online): pending" in result.output and "waiting for free cores" in result.output


@pytest.mark.parametrize("args, status, code", [
    (("infer", "show", "nope"), 404, 2),  # the agent's 4xx
    (("train", "attach", "busy", "--cgroup", "some/cgroup"), 409, 1),
    (("infer", "deploy", "x", "--model", "/nonexistent.onnx", "--online", "--slo-ms", "5"), None, 2),  # the CLI's
])
def test_json_output_of_a_failure_is_a_json_error_on_stdout(run, args, status, code):
    result = run("-o", "json", *args)
    assert result.exit_code == code
    error = json.loads(result.stdout)["error"]
    assert error["message"] and error["fix"] and error["exit_code"] == code
    assert error.get("status") == status


def test_json_output_of_an_unreachable_agent_and_a_bad_flag(tmp_path):
    result = CliRunner().invoke(cli, ["--socket", str(tmp_path / "none.sock"), "-o", "json", "infer", "list"])
    assert result.exit_code == 1
    assert "is not reachable" in json.loads(result.stdout)["error"]["message"]
    bad = CliRunner().invoke(cli, ["--socket", str(tmp_path / "none.sock"), "-o", "json", "infer", "deploy", "x",
                                   "--model", "m", "--rate", "-1"])
    assert bad.exit_code == 2
    assert "--rate" in json.loads(bad.stdout)["error"]["message"]


def test_the_offline_progress_bar_draws_each_line_once(monkeypatch, capsys):
    from reamer.cli import infer_cmd

    monkeypatch.setattr(infer_cmd, "POLL_S", 0.15)  # above tqdm's 0.1 s between draws: every change is drawn
    polls = iter([("running", 0), ("running", 10), ("running", 10), ("running", 25), ("running", 40), ("done", 40)])

    class Agent:
        def get_inference_job(self, name):
            state, done = next(polls)
            return {"state": state, "status": {"total": 40, "done": done}}

    assert infer_cmd.wait_until_done(Agent(), "batch")["state"] == "done"
    drawn = [line.split("|")[-1].split("[")[0].strip() for line in capsys.readouterr().err.split("\r") if line.strip()]
    assert drawn == ["10/40", "25/40", "40/40"]  # no line twice, none at 0 before anything happened
