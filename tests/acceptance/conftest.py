"""Fixtures of the acceptance suite: the exported models (built once, cached), direct ONNX Runtime
runs of them as the reference, one real agent per test module, and deployed jobs shared by the
tests of one (model, backend) pair."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

from tests.acceptance.exported_models import SPECS, BuildUnavailable, ModelSpec, ensure_models
from tests.agent.conftest import Daemon, needs_rt_host, started_daemon  # noqa: F401 (re-exported for the modules)
from tests.conftest import wait_for

BACKENDS = ("onnxruntime", "openvino")
FULL_BATCH = 4  # the layout every online test deploys is 1x1:b4: a batch of 4 is a full batch


@pytest.fixture(scope="session")
def models_dir() -> Path:
    """The directory of built models; builds them on first use (about a minute), skips without the exporters."""
    try:
        return ensure_models()
    except BuildUnavailable as why:
        pytest.skip(str(why))


def model_path(models_dir: Path, name: str) -> str:
    return str(models_dir / f"{name}.onnx")


@functools.lru_cache(maxsize=None)
def _session(path: str):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: onnxmltools' LightGBM declares label [1], which ORT warns of per run
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def reference(path: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A direct ONNX Runtime run of the model file: what every served answer must equal."""
    session = _session(path)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs)))


def assert_outputs_match(spec: ModelSpec, got: dict[str, np.ndarray], want: dict[str, np.ndarray],
                         where: str) -> None:
    assert sorted(got) == sorted(want), f"{where}: outputs {sorted(got)}, expected {sorted(want)}"
    for name, expected in want.items():
        actual = np.asarray(got[name])
        assert actual.shape == expected.shape, f"{where}: {name} has shape {actual.shape}, expected {expected.shape}"
        assert actual.dtype == expected.dtype, f"{where}: {name} has dtype {actual.dtype}, expected {expected.dtype}"
        if expected.dtype == object:  # BYTES: binary answers come as bytes, JSON ones as str
            as_text = [v.decode() if isinstance(v, bytes) else str(v) for v in actual.ravel().tolist()]
            assert as_text == [str(v) for v in expected.ravel().tolist()], f"{where}: {name} is {as_text}"
        elif expected.dtype.kind in "iub":
            np.testing.assert_array_equal(actual, expected, err_msg=f"{where}: {name}")
        else:
            np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64), rtol=spec.rtol,
                                       atol=spec.atol, err_msg=f"{where}: {name}")


@pytest.fixture(scope="module")
def agent() -> Iterator[Daemon]:
    """One real agent for the whole module (starting one costs seconds on a loaded machine)."""
    with started_daemon() as daemon:
        yield daemon


def remove_all(daemon: Daemon) -> None:
    for job in daemon.client.list_inference_jobs():
        daemon.client.remove_inference(job.name)


def job_name(model: str, backend: str, kind: str) -> str:
    return f"{model}-{'ov' if backend == 'openvino' else 'ort'}-{kind}".replace("_", "-")


def wait_ready(daemon: Daemon, name: str, port: int, timeout: float = 180) -> None:
    """Until the job answers ready; fails at once with the job's message if the job failed."""
    def ready() -> bool:
        job = daemon.client.get_inference_job(name)
        if job.state == "failed":
            pytest.fail(f"job {name} failed: {job.message}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ready, timeout=timeout, interval=0.2, what=f"online job {name} to be ready")


class OnlineDeployments:
    """At most one online job at a time (two cpus here): the one the current test's (model, backend) needs.

    A deploy that failed is remembered, so the other tests of that pair fail at once with the same reason."""

    def __init__(self, daemon: Daemon, models_dir: Path, specs: dict | None = None) -> None:
        self.daemon = daemon
        self.models_dir = models_dir
        self.specs = SPECS if specs is None else specs  # name -> ModelSpec (or family_models.Family)
        self.current: tuple[str, str] | None = None
        self.job = None
        self.failures: dict[tuple[str, str], str] = {}

    def get(self, model: str, backend: str):
        key = (model, backend)
        if key in self.failures:
            pytest.fail(self.failures[key])
        if self.current == key:
            job = self.daemon.client.get_inference_job(self.job.name)
            if job.state == "running":  # an instance an earlier test crashed must not fail this one too
                wait_ready(self.daemon, self.job.name, self.job.port, timeout=60)
                return self.job
        remove_all(self.daemon)
        self.current, self.job = None, None
        name = job_name(model, backend, "online")
        spec = self.specs[model]
        request = {"name": name, "model": model_path(self.models_dir, model), "kind": "online", "slo_ms": 5000,
                   "backend": backend, "layout": f"1x1:b{FULL_BATCH}"}
        try:
            job = self.daemon.client.deploy_inference(request)
            wait_ready(self.daemon, name, job.port)
        except BaseException as exc:  # noqa: BLE001 - pytest.fail included: remember and re-raise
            message = getattr(exc, "msg", None) or str(exc)
            self.failures[key] = f"deploying {model} on {backend} failed: {message}"
            if getattr(spec, "sequence", False):
                self.failures[key] += f" (inputs {', '.join(i.name for i in spec.inputs)})"
            raise
        self.current, self.job = key, job
        return job


@pytest.fixture(scope="module")
def online(agent: Daemon, models_dir: Path) -> Iterator[OnlineDeployments]:
    deployments = OnlineDeployments(agent, models_dir)
    yield deployments
    if agent.proc is not None and agent.proc.poll() is None:
        remove_all(agent)
