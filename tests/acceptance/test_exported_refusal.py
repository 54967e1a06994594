"""A backend that cannot load a model is refused at deploy, with the runtime's own reason: no job is made
that could only fail later. The model is `ort-only` (an ONNX Runtime contrib op OpenVINO cannot convert;
every exported model here loads in both runtimes); ONNX Runtime serves it (test_exported_online)."""
from __future__ import annotations

import pytest

from reamer.api.client import ApiError
from tests.acceptance.conftest import job_name, model_path, needs_rt_host, remove_all
from tests.acceptance.exported_models import SPECS

pytestmark = [needs_rt_host, pytest.mark.root, pytest.mark.slow]

REFUSED = [m for m, s in SPECS.items() if not s.openvino]


@pytest.mark.parametrize("model", REFUSED)
@pytest.mark.parametrize("kind", ["online", "online-searched", "offline"])
def test_openvino_is_refused_at_deploy_with_its_reason(agent, models_dir, tmp_path, model, kind):
    remove_all(agent)
    name = job_name(model, "openvino", kind)
    request = {"name": name, "model": model_path(models_dir, model), "backend": "openvino"}
    if kind == "offline":
        (tmp_path / "in").mkdir()
        request |= {"kind": "offline", "input_dir": str(tmp_path / "in"), "output_dir": str(tmp_path / "out")}
    else:
        request |= {"kind": "online", "slo_ms": 5000}
        if kind == "online":  # a fixed layout: nothing else would open the model before the job starts
            request["layout"] = "1x1:b2"
    try:
        with pytest.raises(ApiError) as refused:
            agent.client.deploy_inference(request)
        assert refused.value.status == 400, refused.value.message
        message = refused.value.message
        assert "openvino" in message.lower() and "com.microsoft.Inverse" in message, message
        assert refused.value.fix, "the refusal must say what to do (e.g. use onnxruntime)"
        assert name not in {j.name for j in agent.client.list_inference_jobs()}, "a refused deploy leaves no job"
        assert not (tmp_path / "out").exists(), "a refused deploy makes no output directory"
    finally:
        remove_all(agent)
