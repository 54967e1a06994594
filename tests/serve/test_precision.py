"""The job's precision (f32 | bf16) with the real runtimes on real exported models: bf16 OpenVINO answers are
close to f32's and differ from them (bf16 really ran), f32 stays exact against ONNX Runtime, ONNX Runtime
stays f32 whatever is asked, the effective precision is read back from OpenVINO, and bf16 profile points
never serve an f32 search."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from reamer.serve.backends import BackendError, effective_precision, open_backend
from reamer.serve.measure.profile_cache import file_sha256, model_key
from reamer.serve.spec import InstanceSpec, JobSpec, SpecError, canonical_precision
from tests.acceptance.exported_models import SPECS, BuildUnavailable, ensure_models

pytest.importorskip("openvino")


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def openvino_computes_bf16() -> bool:
    """Whether OpenVINO, asked for bf16, really computes in it here: its answers on a small model differ from
    f32's. Native bf16 (avx512_bf16, amx_bf16) does; newer OpenVINO also runs bf16 on plain AVX-512 CPUs,
    which /proc/cpuinfo alone cannot tell."""
    if cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        return True
    import tempfile

    import openvino as ov

    from reamer.serve import models

    with tempfile.TemporaryDirectory() as tmp:
        path = str(models.build_model("tiny", Path(tmp) / "tiny.onnx").path)
        core = ov.Core()
        exact, fast = (core.compile_model(path, "CPU", {"INFERENCE_PRECISION_HINT": hint}) for hint in ("f32", "bf16"))
        shape = [d.get_length() if d.is_static else 4 for d in exact.inputs[0].get_partial_shape()]
        sample = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        return not np.array_equal(exact(sample)[0], fast(sample)[0])


HAS_BF16 = openvino_computes_bf16()
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="OpenVINO computes f32 here even when asked for bf16 (no "
                                                     "avx512_bf16 or amx_bf16, and its answers equal f32's)")


@pytest.fixture(scope="module")
def resnet(models_dir: Path) -> str:
    """The exported ResNet (tests/acceptance/exported_models.py); also used by the API and CLI precision tests."""
    return str(models_dir / "resnet.onnx")


@pytest.fixture(scope="module")
def models_dir() -> Path:
    try:
        return ensure_models()
    except BuildUnavailable as why:
        pytest.skip(str(why))


def reference(path: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def run(kind: str, path: str, feeds: dict[str, np.ndarray], precision: str) -> tuple[dict[str, np.ndarray], str]:
    with open_backend(kind, path, 1, precision=precision) as backend:
        return backend.run(feeds), backend.precision


@needs_bf16
@pytest.mark.parametrize("name", ["resnet", "bert"])
def test_bf16_answers_are_close_to_f32_and_differ_from_them(models_dir, name):
    spec = SPECS[name]
    path = str(models_dir / f"{name}.onnx")
    feeds = spec.sample(4)
    want = reference(path, feeds)
    f32, f32_runs = run("openvino", path, feeds, "f32")
    bf16, bf16_runs = run("openvino", path, feeds, "bf16")
    assert (f32_runs, bf16_runs) == ("f32", "bf16")
    for out in spec.outputs:
        # f32 is what it always was: ONNX Runtime's answers within the model's own tolerance
        np.testing.assert_allclose(f32[out], want[out], rtol=spec.rtol, atol=spec.atol, err_msg=out)
        # bf16 keeps 8 bits of mantissa (about 3 significant digits): close to f32, scaled to the output
        scale = float(np.abs(want[out]).max())
        err = float(np.abs(bf16[out].astype(np.float64) - want[out]).max())
        assert err <= 0.05 * scale, f"{name}/{out}: bf16 is {err:.3g} from f32 (outputs up to {scale:.3g})"
        # and not f32 in disguise: the answers differ by far more than f32's own rounding
        assert err > 50 * float(np.abs(f32[out].astype(np.float64) - want[out]).max()) and err > 1e-6, \
            f"{name}/{out}: bf16 answers equal f32's ({err:.3g}): bf16 did not run"
        assert bf16[out].dtype == want[out].dtype and bf16[out].shape == want[out].shape


def test_f32_is_the_default_and_exact_against_onnxruntime(models_dir):
    spec = SPECS["resnet"]
    path = str(models_dir / "resnet.onnx")
    feeds = spec.sample(2)
    want = reference(path, feeds)
    with open_backend("openvino", path, 1) as backend:
        assert backend.precision == "f32"
        got = backend.run(feeds)
        assert backend.property("INFERENCE_PRECISION_HINT").to_string() == "f32"
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=spec.rtol, atol=spec.atol)


def test_onnxruntime_stays_f32_whatever_is_asked(models_dir):
    spec = SPECS["bert"]
    path = str(models_dir / "bert.onnx")
    feeds = spec.sample(2)
    got, runs = run("onnxruntime", path, feeds, "bf16")
    assert runs == "f32"
    np.testing.assert_array_equal(got["last_hidden_state"], reference(path, feeds)["last_hidden_state"])
    assert effective_precision("onnxruntime", "bf16") == "f32"


def test_effective_precision_is_what_openvino_compiles(models_dir):
    """The host-level answer (no model loaded) agrees with the compiled model's read-back, on any CPU:
    bf16 where the CPU has it, f32 where OpenVINO falls back."""
    with open_backend("openvino", str(models_dir / "resnet.onnx"), 1, precision="bf16") as backend:
        compiled = backend.precision
    assert effective_precision("openvino", "bf16") == compiled == ("bf16" if HAS_BF16 else "f32")
    assert effective_precision("openvino", "f32") == "f32"


def test_bad_precision_is_refused_with_the_fix(models_dir, tmp_path):
    with pytest.raises(BackendError) as info:
        open_backend("openvino", str(models_dir / "resnet.onnx"), 1, precision="fp8")
    assert "fp8" in info.value.message and "bf16" in info.value.fix and "f32" in info.value.fix
    with pytest.raises(SpecError) as spec_info:
        JobSpec(name="j", kind="online", model="m.onnx", port=0, run_dir=str(tmp_path),
                instances=[InstanceSpec([0], 1, 1)], precision="int4")
    assert "int4" in spec_info.value.message and "bf16" in spec_info.value.fix
    assert [canonical_precision(v) for v in ("FP32", "float32", "BF16", "bfloat16", "f16", 3)] == \
        ["f32", "f32", "bf16", "bf16", None, None]


def test_cache_key_keeps_f32_keys_and_separates_bf16_openvino(models_dir):
    import hashlib
    import json

    path = str(models_dir / "resnet.onnx")
    cpu = "Test CPU"
    # the key reamer always computed, so caches written before precision existed stay valid
    legacy = hashlib.sha256(json.dumps([file_sha256(path), "openvino", cpu]).encode()).hexdigest()
    assert model_key(path, "openvino", cpu) == model_key(path, "openvino", cpu, precision="f32") == legacy
    assert model_key(path, "openvino", cpu, precision="bf16") != legacy
    # ONNX Runtime computes the same at either: its points are shared
    assert model_key(path, "onnxruntime", cpu, precision="bf16") == model_key(path, "onnxruntime", cpu)


def test_a_bf16_point_is_never_served_to_an_f32_search(models_dir, tmp_path):
    from reamer.search.on_cores import MeasureSettings, cached_points, search_layout

    path = str(models_dir / "resnet.onnx")
    cpus = sorted(os.sched_getaffinity(0))[-1:]
    quick = MeasureSettings(warmup_s=0.05, window_s=0.05, max_windows=3, verify_windows=1)
    cache = tmp_path / "profiles"
    bf16 = search_layout(path, "openvino", cpus, None, cache_dir=cache, batches=(1,), settings=quick,
                         precision="bf16")
    assert not bf16.from_cache and bf16.new_points
    assert cached_points(cache, path, "openvino", precision="bf16")
    assert cached_points(cache, path, "openvino") == []  # f32 has none: the bf16 points are not its
    f32 = search_layout(path, "openvino", cpus, None, cache_dir=cache, batches=(1,), settings=quick)
    assert not f32.from_cache and f32.new_points, "an f32 search measured nothing: it took bf16 points"
    again = search_layout(path, "openvino", cpus, None, cache_dir=cache, batches=(1,), settings=quick,
                          precision="bf16")
    assert again.from_cache
    assert {(p.cores, p.batch, p.throughput_rps) for p in again.points} == \
        {(p.cores, p.batch, p.throughput_rps) for p in bf16.points}


def test_job_reports_what_runs_and_keeps_its_precision_on_reload(models_dir, tmp_path):
    import signal
    from dataclasses import replace

    from reamer.serve.spec import read_events
    from tests.conftest import wait_for
    from tests.serve.jobs import RunningJob

    job = RunningJob(str(models_dir / "resnet.onnx"), tmp_path, "rn", backend="openvino", precision="bf16")
    try:
        assert job.status.precision == ("bf16" if HAS_BF16 else "f32")
        replace(job.spec, precision="f32").save(tmp_path / "spec.json")
        job.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: any(e["kind"] == "reload_failed" and "precision" in e["message"]
                             for e in read_events(job.run_dir)[0]), what="the reload to be refused")
        assert job.read_status().precision == job.status.precision
    finally:
        job.stop()
