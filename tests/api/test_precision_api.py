"""A job's precision through a real agent: a bad value is a 400 with the fix; an OpenVINO job deployed at bf16
answers in bf16 (close to, and different from, the f32 job's exact answers); `reamer infer show` and the API
report the precision the instances actually run."""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from click.testing import CliRunner

from reamer.api.client import ApiError
from reamer.cli.main import cli
from tests.acceptance.exported_models import SPECS
from tests.agent.conftest import needs_rt_host
from tests.conftest import wait_for
from tests.serve.test_precision import HAS_BF16, models_dir, reference, resnet  # noqa: F401 (fixtures)

pytestmark = [needs_rt_host, pytest.mark.root]
pytest.importorskip("openvino")


def test_bad_precision_is_a_400_naming_the_fix(daemon, resnet):
    with pytest.raises(ApiError) as info:
        daemon.client.deploy_inference({"name": "p", "model": resnet, "kind": "online", "slo_ms": 500,
                                        "backend": "openvino", "layout": "1x1:b1", "precision": "fp8"})
    assert info.value.status == 400 and "fp8" in info.value.message
    assert "bf16" in info.value.fix and "f32" in info.value.fix
    assert "p" not in {j.name for j in daemon.client.list_inference_jobs()}


def _answer(port: int, name: str, image: np.ndarray) -> np.ndarray:
    body = {"inputs": [{"name": "pixel_values", "shape": list(image.shape), "datatype": "FP32",
                        "data": image.ravel().tolist()}]}
    reply = httpx.post(f"http://127.0.0.1:{port}/v2/models/{name}/infer", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    out = reply.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def test_bf16_job_computes_in_bf16_and_show_says_so(daemon, resnet):
    expected = "bf16" if HAS_BF16 else "f32"  # OpenVINO keeps f32 where the CPU has no bf16: report that
    for name, precision in (("exact", None), ("fast", "BF16")):
        request = {"name": name, "model": resnet, "kind": "online", "slo_ms": 500, "backend": "openvino",
                   "layout": "1x1:b1"}
        if precision:
            request["precision"] = precision
        daemon.client.deploy_inference(request)
    jobs = {name: wait_for(lambda n=name: (j := daemon.client.get_inference_job(n)).effective_precision and j,
                           timeout=120, what=f"job {name} to report its precision")
            for name in ("exact", "fast")}
    assert (jobs["exact"].precision, jobs["exact"].effective_precision) == ("f32", "f32")
    assert (jobs["fast"].precision, jobs["fast"].effective_precision) == ("bf16", expected)

    image = SPECS["resnet"].sample(1)["pixel_values"]
    want = reference(resnet, {"pixel_values": image})["logits"]
    exact, fast = _answer(jobs["exact"].port, "exact", image), _answer(jobs["fast"].port, "fast", image)
    np.testing.assert_allclose(exact, want, rtol=SPECS["resnet"].rtol, atol=SPECS["resnet"].atol)
    err = float(np.abs(fast - want).max())
    assert err <= 0.05 * float(np.abs(want).max())
    if HAS_BF16:
        assert err > 1e-6, "the bf16 job's answers equal f32's: bf16 did not run"

    runner = CliRunner()
    shown = runner.invoke(cli, ["--socket", daemon.socket, "infer", "show", "fast"])
    assert shown.exit_code == 0, shown.output
    line = next(row for row in shown.stdout.splitlines() if row.startswith("precision"))
    assert line.split()[1] == expected and ("asked bf16" in line) == (expected != "bf16")
    doc = json.loads(runner.invoke(cli, ["--socket", daemon.socket, "-o", "json", "infer", "show", "exact"]).stdout)
    assert (doc["precision"], doc["effective_precision"]) == ("f32", "f32")
