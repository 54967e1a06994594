"""`reamer profile` and `reamer search` on the exported models, run as a user runs them (the installed
command, in its own process), with short measurement settings and the traffic's shapes (`--shape`) for
the models with a sequence axis; and the deploy API's `shapes` and `input_data`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.acceptance.conftest import (BACKENDS, assert_outputs_match, job_name, model_path, needs_rt_host, reference,
                                       remove_all, wait_ready)
from tests.acceptance.exported_models import SPECS, MAX_POSITIONS

pytestmark = [pytest.mark.slow]

FAST = ["--warmup-s", "0.05", "--window-s", "0.05", "--max-windows", "3"]
CASES = [pytest.param(model, backend, id=f"{model}-{backend}")
         for model, spec in SPECS.items() for backend in BACKENDS if backend == "onnxruntime" or spec.openvino]


def reamer(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reamer.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=Path(__file__).resolve().parents[2])


def last_cpu() -> str:
    return str(max(os.sched_getaffinity(0)))


@pytest.mark.parametrize("model, backend", CASES)
def test_profile_runs_with_the_traffic_shapes(models_dir, model, backend):
    spec = SPECS[model]
    done = reamer("-o", "json", "profile", model_path(models_dir, model), "--backend", backend, "--cpus", last_cpu(),
                  "--batches", "1,2", *spec.shape_args(seq=24), *FAST)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(done.stdout)
    assert data["classification"] in ("scale-up", "scale-out")
    assert {p["batch"] for p in data["points"]} == {1, 2}
    assert all(p["throughput_rps"] > 0 for p in data["points"])


@pytest.mark.parametrize("model, backend", CASES)
def test_search_runs_with_the_traffic_shapes(models_dir, tmp_path, model, backend):
    spec = SPECS[model]
    done = reamer("-o", "json", "search", model_path(models_dir, model), "--backend", backend, "--cores", "1",
                  "--cpus", last_cpu(), "--max-batch", "1", "--slo-ms", "5000", "--cache-dir", str(tmp_path / "cache"),
                  *spec.shape_args(seq=24), *FAST, "--verify-windows", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(done.stdout)
    assert data["best"] is not None and data["best"]["layout"].startswith("1x1:b")
    assert data["best"]["throughput_rps"] > 0


@pytest.mark.parametrize("model", [m for m, s in SPECS.items() if s.sequence and s.name != "mixed-io"])
def test_profile_feeds_the_given_shapes(models_dir, model):
    """Proof that --shape reaches the model: a sequence longer than the model's position table fails in the
    runtime, with its reason, where the default length would have passed."""
    spec = SPECS[model]
    done = reamer("profile", model_path(models_dir, model), "--cpus", last_cpu(), "--batches", "1",
                  *spec.shape_args(seq=MAX_POSITIONS + 72), *FAST)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "error:" in output and "Traceback" not in output, output
    assert f"{MAX_POSITIONS + 72}]" in output, f"the error should show the shape that was fed: {output}"


def test_profile_takes_sample_data(models_dir, tmp_path):
    """--input-data: a .npz of named arrays, the traffic's own samples."""
    spec = SPECS["bert"]
    data = tmp_path / "samples.npz"
    np.savez(data, **spec.sample(4, seq=20, seed=5))
    done = reamer("-o", "json", "profile", model_path(models_dir, "bert"), "--cpus", last_cpu(), "--batches", "1,2",
                  "--input-data", str(data), *FAST)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["points"]


@needs_rt_host
@pytest.mark.root
def test_deploy_with_shapes_and_sample_data(agent, models_dir, tmp_path):
    """The deploy API takes the traffic's shapes and sample data (its warm-up runs on them), and serves."""
    spec = SPECS["bert"]
    remove_all(agent)
    samples = tmp_path / "samples.npz"
    np.savez(samples, **spec.sample(2, seq=32, seed=7))
    name = job_name("bert", "onnxruntime", "shaped")
    job = agent.client.deploy_inference({"name": name, "model": model_path(models_dir, "bert"), "kind": "online",
                                         "slo_ms": 5000, "layout": "1x1:b2", "shapes": spec.shapes(seq=32),
                                         "input_data": str(samples)})
    try:
        wait_ready(agent, name, job.port)
        from tests.acceptance.clients import CLIENT_VARIANTS, CLIENTS

        client, variant = CLIENT_VARIANTS[0]
        inputs = spec.sample(2, seq=32, seed=8)
        got = CLIENTS[client].infer(job, name, inputs, list(spec.outputs), variant)
        assert_outputs_match(spec, got, reference(model_path(models_dir, "bert"), inputs), "bert deployed with shapes")
    finally:
        remove_all(agent)
