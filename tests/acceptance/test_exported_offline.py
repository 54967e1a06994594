"""Exported models run offline by a real agent: a directory of .npz inputs (arrays named after the model's
inputs, several batch sizes and sequence lengths) in, one .npz of every output per input out, each equal to
a direct ONNX Runtime run of the same file."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.acceptance.conftest import BACKENDS, assert_outputs_match, job_name, model_path, needs_rt_host, reference, \
    remove_all
from tests.acceptance.exported_models import SEQ, SPECS
from tests.conftest import wait_for

pytestmark = [needs_rt_host, pytest.mark.root, pytest.mark.slow]

CASES = [pytest.param(model, backend, id=f"{model}-{backend}")
         for model, spec in SPECS.items() for backend in BACKENDS if backend == "onnxruntime" or spec.openvino]


def write_inputs(spec, directory: Path) -> dict[str, dict[str, np.ndarray]]:
    """Three inputs: one sample, a batch of 3, and (sequence models) a batch of 2 at another length."""
    directory.mkdir()
    shapes = {"a-one": (1, SEQ), "b-three": (3, SEQ), "c-two": (2, 9 if spec.sequence else SEQ)}
    made = {}
    for i, (stem, (batch, seq)) in enumerate(shapes.items()):
        made[stem] = spec.sample(batch, seq=seq, seed=100 + i)
        np.savez(directory / f"{stem}.npz", **made[stem])
    return made


@pytest.mark.parametrize("model, backend", CASES)
def test_offline_outputs_equal_a_direct_onnxruntime_run(agent, models_dir, tmp_path, model, backend):
    spec = SPECS[model]
    remove_all(agent)
    inputs = write_inputs(spec, tmp_path / "in")
    out = tmp_path / "out"
    name = job_name(model, backend, "offline")
    agent.client.deploy_inference({"name": name, "model": model_path(models_dir, model), "kind": "offline",
                                   "backend": backend, "input_dir": str(tmp_path / "in"), "output_dir": str(out),
                                   "max_batch": 4})
    try:
        job = wait_for(lambda: (j := agent.client.get_inference_job(name)).state in ("done", "failed") and j,
                       timeout=180, interval=0.2, what=f"offline job {name} to finish")
        assert job.state == "done", f"offline {model} on {backend}: {job.message}"
        assert sorted(p.name for p in out.iterdir()) == [f"{stem}.npz" for stem in sorted(inputs)]
        for stem, given in inputs.items():
            with np.load(out / f"{stem}.npz") as result:
                got = {k: result[k] for k in result.files}
            want = reference(model_path(models_dir, model), given)
            assert_outputs_match(spec, got, want, f"offline {model} on {backend}, {stem}")
    finally:
        remove_all(agent)
