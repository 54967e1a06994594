"""Offline runner: in-process with real workers, and the whole job process killed and resumed."""
import json
import os
import signal
import subprocess
import sys
import zipfile

import numpy as np
import psutil
import pytest

from reamer.serve.backends import open_backend
from reamer.serve.models import build_model
from reamer.serve.runtime.offline import OfflineInputError, OfflineRunner, list_inputs, load_inputs, read_npz
from reamer.serve.spec import InstanceSpec, JobSpec, JobStatus, is_temp_file, read_events
from reamer.serve.protocol.tensors import TensorInfo
from reamer.serve.runtime.instances import InstanceWorker
from tests.conftest import wait_for

CPUS = sorted(os.sched_getaffinity(0))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {f: build_model(f, d / f"{f}.onnx").path for f in ("tiny", "multi-io")}


def _tiny_inputs(d, n, seed=0):
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        # alternate: one sample (16,), a batch (3, 16), a batch bigger than max_batch (7, 16)
        shape = [(16,), (3, 16), (7, 16)][i % 3]
        np.save(d / f"s{i:03d}.npy", rng.standard_normal(shape).astype(np.float32))


def _check_results(in_dir, out_dir, model):
    ref = open_backend("onnxruntime", model, 1)
    inputs = list_inputs(in_dir)
    assert sorted(os.listdir(out_dir)) == sorted(f"{p.stem}.npz" for p in inputs)  # exactly one each, no temp
    for p in inputs:
        x = np.load(p)
        with np.load(out_dir / f"{p.stem}.npz") as res:
            want = ref.run({"input": x[np.newaxis] if x.ndim == 1 else x})["output"]
            np.testing.assert_allclose(res["output"], want[0] if x.ndim == 1 else want, rtol=1e-5)
    ref.close()


def test_runner_processes_all_inputs_with_two_instances(models, tmp_path):
    _tiny_inputs(tmp_path / "in", 9)
    runner = OfflineRunner(tmp_path / "in", tmp_path / "out", run_dir=tmp_path)
    assert runner.progress().total == 9 and runner.progress().done == 0
    workers = [InstanceWorker(i, InstanceSpec([c], 1, 4), models["tiny"]) for i, c in enumerate(CPUS[:2])]
    try:
        for w in workers:
            w.start()
            runner.add_instance(w)
        assert runner.all_done.wait(60)
    finally:
        runner.stop()
    p = runner.progress()
    assert (p.done, p.total, p.failed, p.finished) == (9, 9, 0, True) and p.throughput > 0 and p.eta_s == 0
    _check_results(tmp_path / "in", tmp_path / "out", models["tiny"])
    assert all(not w.alive for w in workers)
    # max_batch 4 is respected: a (7, 16) file is two batches.
    assert sum(w.batches_run for w in workers) == 3 * (1 + 1 + 2)


def test_resume_skips_finished_results_and_removes_temp_files(models, tmp_path):
    _tiny_inputs(tmp_path / "in", 4)
    out = tmp_path / "out"
    out.mkdir()
    np.savez(out / "s000.npz", output=np.zeros(4))  # finished earlier: must not be redone
    (out / ".s001.npz.tmp-123-abcd").write_bytes(b"half")  # left by a crash
    before = os.stat(out / "s000.npz").st_mtime_ns
    runner = OfflineRunner(tmp_path / "in", out)
    assert runner.progress().done == 1 and runner.total == 4
    assert not [n for n in os.listdir(out) if is_temp_file(n)]
    w = InstanceWorker(0, InstanceSpec([CPUS[-1]], 1, 8), models["tiny"])
    try:
        w.start()
        runner.add_instance(w)
        assert runner.all_done.wait(60)
    finally:
        runner.stop()
    assert os.stat(out / "s000.npz").st_mtime_ns == before
    assert sorted(os.listdir(out)) == ["s000.npz", "s001.npz", "s002.npz", "s003.npz"]
    assert w.samples_run == 3 + 7 + 1  # s001, s002, s003 only


def test_npz_inputs_for_a_multi_input_model(models, tmp_path):
    rng = np.random.default_rng(3)
    (tmp_path / "in").mkdir()
    x, ids = rng.standard_normal((2, 8)).astype(np.float32), rng.integers(0, 10, (2, 4))
    np.savez(tmp_path / "in" / "a.npz", x=x, ids=ids)
    runner = OfflineRunner(tmp_path / "in", tmp_path / "out")
    w = InstanceWorker(0, InstanceSpec([CPUS[-1]], 1, 8), models["multi-io"])
    try:
        w.start()
        runner.add_instance(w)
        assert runner.all_done.wait(60)
    finally:
        runner.stop()
    ref = open_backend("onnxruntime", models["multi-io"], 1).run({"x": x, "ids": ids})
    with np.load(tmp_path / "out" / "a.npz") as res:
        assert set(res.files) == {"scores", "id_sum"}
        np.testing.assert_allclose(res["scores"], ref["scores"], rtol=1e-5)


MIO = [TensorInfo("x", "FP32", [-1, 8]), TensorInfo("ids", "INT64", [-1, 4])]


@pytest.mark.parametrize("make, words", [
    (lambda p: np.save(p / "f.npy", np.zeros((1, 8), np.float32)), "several inputs"),
    (lambda p: np.savez(p / "f.npz", x=np.zeros((1, 8), np.float32)), "holds arrays ['x']"),
    (lambda p: np.savez(p / "f.npz", x=np.zeros((1, 9), np.float32), ids=np.zeros((1, 4), np.int64)), "shape [1, 9]"),
    (lambda p: np.savez(p / "f.npz", x=np.zeros((2, 8), np.float32), ids=np.zeros((1, 4), np.int64)), "batch size"),
    (lambda p: np.savez(p / "f.npz", x=np.zeros((1, 8), np.float32), ids=np.zeros((1, 4), np.float32)), "float32"),
    (lambda p: (p / "f.npz").write_bytes(b"garbage"), "cannot be read"),
])
def test_bad_input_files_name_the_file_and_expected_inputs(tmp_path, make, words):
    make(tmp_path)
    path = next(tmp_path.iterdir())
    with pytest.raises(OfflineInputError) as err:
        load_inputs(path, MIO)
    assert words in err.value.message and path.name in err.value.message
    assert "x (FP32 [-1, 8]), ids (INT64 [-1, 4])" in err.value.message


def test_inputs_that_would_collide_are_refused(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros(3))
    np.savez(tmp_path / "a.npz", x=np.zeros(3))
    with pytest.raises(OfflineInputError, match="both write a.npz"):
        list_inputs(tmp_path)
    with pytest.raises(OfflineInputError, match="does not exist"):
        list_inputs(tmp_path / "nope")


def _job_spec(tmp_path, model, **kw):
    spec = JobSpec(name="off", kind="offline", model=model, run_dir=str(tmp_path / "run"),
                   input_dir=str(tmp_path / "in"), output_dir=str(tmp_path / "out"),
                   instances=[InstanceSpec([CPUS[-1]], 1, 4)], frontdoor_cpus=[CPUS[0]], **kw)
    spec.save(tmp_path / "spec.json")
    return tmp_path / "spec.json"


def _start_job(spec_path):
    return subprocess.Popen([sys.executable, "-m", "reamer.serve.runtime.job", "--spec", str(spec_path)], cwd=REPO)


def _status(tmp_path):
    try:
        return JobStatus.load(tmp_path / "run" / "status.json")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def test_job_killed_midway_resumes_with_every_output_exactly_once(models, tmp_path):
    _tiny_inputs(tmp_path / "in", 400)  # many: the job must not finish them all before it is killed
    spec_path = _job_spec(tmp_path, models["tiny"])
    out = tmp_path / "out"
    job = _start_job(spec_path)
    workers = []
    try:
        wait_for(lambda: out.exists() and len([n for n in os.listdir(out) if not is_temp_file(n)]) >= 3,
                 timeout=60, what="a few results")
        workers = psutil.Process(job.pid).children()
        for w in workers:
            w.send_signal(signal.SIGSTOP)  # freeze progress so the kill lands mid-way
        job.send_signal(signal.SIGKILL)
        job.wait(30)
    finally:
        for w in workers:
            try:
                w.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        if job.poll() is None:
            job.kill()
            job.wait(30)
    psutil.wait_procs(workers, timeout=30)  # orphaned workers see EOF and leave
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    first = {n: os.stat(out / n).st_mtime_ns for n in os.listdir(out) if not is_temp_file(n)}
    assert 3 <= len(first) < 400

    job = _start_job(spec_path)
    try:
        assert job.wait(120) == 0
    finally:
        if job.poll() is None:
            job.kill()
    _check_results(tmp_path / "in", out, models["tiny"])
    assert all(os.stat(out / n).st_mtime_ns == t for n, t in first.items())  # nothing redone
    st = _status(tmp_path)
    assert st.state == "done" and st.done == st.total == 400 and st.eta_s == 0
    events = read_events(tmp_path / "run")[0]
    assert events[-1]["kind"] == "done"


def test_job_with_a_bad_file_finishes_the_rest_then_fails_naming_it(models, tmp_path):
    _tiny_inputs(tmp_path / "in", 3)
    np.savez(tmp_path / "in" / "zz_bad.npz", wrong=np.zeros((1, 16), np.float32))
    job = _start_job(_job_spec(tmp_path, models["tiny"]))
    try:
        assert job.wait(120) == 1
    finally:
        if job.poll() is None:
            job.kill()
    assert sorted(os.listdir(tmp_path / "out")) == ["s000.npz", "s001.npz", "s002.npz"]
    st = _status(tmp_path)
    assert st.state == "failed" and "zz_bad.npz" in st.message and "input (FP32 [-1, 16])" in st.message
    kinds = [e["kind"] for e in read_events(tmp_path / "run")[0]]
    assert kinds == ["input_failed", "failed"]


def test_sighup_adds_an_instance_to_a_running_offline_job(models, tmp_path):
    _tiny_inputs(tmp_path / "in", 400)  # many: the first instance must not finish them before it is stopped
    spec_path = _job_spec(tmp_path, models["tiny"])
    out = tmp_path / "out"
    job = _start_job(spec_path)
    first = []
    try:
        wait_for(lambda: out.exists() and len(os.listdir(out)) >= 1, timeout=60, what="a first result")
        first = psutil.Process(job.pid).children()
        for w in first:
            w.send_signal(signal.SIGSTOP)  # only a new instance can make progress now
        done_before = len(os.listdir(out))
        spec = JobSpec.load(spec_path)
        spec.instances = spec.instances + [InstanceSpec([CPUS[0]], 1, 2)]
        spec.save(spec_path)
        job.send_signal(signal.SIGHUP)
        wait_for(lambda: len(os.listdir(out)) > done_before + 2, timeout=60, what="progress by the new instance")
        for w in first:
            w.send_signal(signal.SIGCONT)
        assert job.wait(120) == 0
    finally:
        for w in first:
            try:
                w.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        if job.poll() is None:
            job.kill()
            job.wait(30)
    _check_results(tmp_path / "in", out, models["tiny"])
    events = read_events(tmp_path / "run")[0]
    (reconf,) = [e for e in events if e["kind"] == "reconfigured"]
    assert (reconf["kept"], reconf["started"], reconf["stopped"]) == (1, 1, 0)
    assert _status(tmp_path).instances_total == 2


def test_read_npz_matches_numpy_for_stored_compressed_and_fortran_arrays(tmp_path):
    rng = np.random.default_rng(3)
    arrays = {"a": rng.standard_normal((2, 3, 5)).astype(np.float32), "b": np.asfortranarray(rng.integers(0, 9, (4, 6))),
              "c": np.array(7.5), "d": np.zeros((0, 3), np.float16)}
    np.savez(tmp_path / "s.npz", **arrays)
    np.savez_compressed(tmp_path / "c.npz", **arrays)
    for name in ("s.npz", "c.npz"):
        got = read_npz(tmp_path / name)
        assert sorted(got) == sorted(arrays)
        for k, v in arrays.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape
            np.testing.assert_array_equal(got[k], v)


def test_read_npz_refuses_object_arrays_and_corrupt_data(tmp_path):
    np.savez(tmp_path / "o.npz", x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="objects"):
        read_npz(tmp_path / "o.npz")
    np.savez(tmp_path / "bad.npz", x=np.arange(1000, dtype=np.int64))
    raw = bytearray((tmp_path / "bad.npz").read_bytes())
    raw[400] ^= 0xFF  # inside the array data: the zip CRC no longer matches
    (tmp_path / "bad.npz").write_bytes(bytes(raw))
    with pytest.raises(zipfile.BadZipFile):
        read_npz(tmp_path / "bad.npz")
    with pytest.raises(OfflineInputError, match="cannot be read"):
        load_inputs(tmp_path / "bad.npz", [TensorInfo("x", "INT64", [-1])])
