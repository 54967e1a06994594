"""A running online job against the Open Inference Protocol's REST spec (JSON): schemathesis finds no 5xx
and no answer that contradicts the spec, for valid and invalid requests alike."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agent.conftest import daemon_factory  # noqa: F401
from tests.conftest import IS_ROOT, wait_for

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extra: pip install -e '.[test]'")
import yaml  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,  # noqa: E402
                                               status_code_conformance)

pytestmark = [pytest.mark.root, pytest.mark.skipif(not IS_ROOT, reason="needs root: a real agent runs the job")]

SPEC = Path(__file__).parent / "specs" / "oip_rest_v2.yaml"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES_PER_OPERATION = 20


def test_a_running_job_answers_as_the_open_inference_protocol_says(daemon_factory, tmp_path):
    from reamer.serve import models

    model = models.build_model("tiny", tmp_path / "tiny.onnx").path
    daemon = daemon_factory()
    job = daemon.client.deploy_inference({"name": "oip", "model": str(model), "kind": "online", "slo_ms": 500,
                                          "layout": "1x1:b1"})
    base = f"http://127.0.0.1:{job.port}"
    wait_for(lambda: _ready(base), timeout=120, what="the job to be ready")
    schema = schemathesis.openapi.from_dict(yaml.safe_load(SPEC.read_text()))
    failures: list[str] = []
    with httpx.Client(base_url=base, timeout=60) as http:
        for operation in [result.ok() for result in schema.get_all_operations()]:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                @given(case=operation.as_strategy(generation_mode=mode))
                @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                          suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
                def run(case: Any) -> None:
                    if "model_name" in (case.path_parameters or {}) and mode == GenerationMode.POSITIVE:
                        case.path_parameters["model_name"] = "oip"  # the served model, so inference runs
                    kwargs = case.as_transport_kwargs(base_url=base)
                    content = kwargs.get("data")
                    response = http.request(kwargs["method"], kwargs["url"], params=kwargs.get("params"),
                                            headers=kwargs.get("headers"), json=kwargs.get("json"),
                                            content=content.encode() if isinstance(content, str) else content)
                    case.validate_response(response, checks=CHECKS)

                try:
                    run()
                except Unsatisfiable:
                    continue
                except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - collect them all
                    failures.append(f"{operation.label} ({mode.value}): {str(exc)[:1500]}")
    daemon.client.remove_inference("oip")
    assert not failures, "\n\n".join(failures)


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/v2/health/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
