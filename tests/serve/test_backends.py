import numpy as np
import pytest

from reamer.host.errors import ReamerError
from reamer.serve.backends import BACKENDS, TensorInfo, open_backend, sample_inputs
from reamer.serve.models import build_model


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("backend-models")
    return {f: build_model(f, d / f"{f}.onnx").path for f in ("tiny", "multi-io")}


@pytest.fixture(scope="module")
def opened(model_paths):
    backends = {(k, f): open_backend(k, p, threads=1) for k in BACKENDS for f, p in model_paths.items()}
    yield backends
    for b in backends.values():
        b.close()


@pytest.mark.parametrize("family", ["tiny", "multi-io"])
@pytest.mark.parametrize("batch", [1, 5])
def test_backends_agree(opened, family, batch):
    ort_b, ov_b = opened[("onnxruntime", family)], opened[("openvino", family)]
    assert [t.to_dict() for t in ort_b.inputs] == [t.to_dict() for t in ov_b.inputs]
    assert [t.to_dict() for t in ort_b.outputs] == [t.to_dict() for t in ov_b.outputs]
    feeds = sample_inputs(ort_b, batch, np.random.default_rng(7))
    a, b = ort_b.run(feeds), ov_b.run(feeds)
    assert set(a) == set(b) == {t.name for t in ort_b.outputs}
    for name in a:
        assert a[name].shape[0] == batch
        assert a[name].dtype == b[name].dtype
        np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=1e-5)


def test_multi_io_metadata(opened):
    b = opened[("openvino", "multi-io")]
    assert b.inputs == [TensorInfo("x", "FP32", [-1, 8]), TensorInfo("ids", "INT64", [-1, 4])]
    assert b.outputs == [TensorInfo("scores", "FP32", [-1, 4]), TensorInfo("id_sum", "INT64", [-1, 1])]


def test_multi_io_integer_output_is_exact(opened):
    feeds = sample_inputs(opened[("onnxruntime", "multi-io")], 3, np.random.default_rng(0))
    for kind in BACKENDS:
        out = opened[(kind, "multi-io")].run(feeds)
        np.testing.assert_array_equal(out["id_sum"], feeds["ids"].sum(axis=1, keepdims=True))


def test_openvino_applies_thread_and_precision_settings(model_paths):
    b = open_backend("openvino", model_paths["tiny"], threads=2)
    try:
        assert int(b.property("INFERENCE_NUM_THREADS")) == 2
        assert b.property("ENABLE_CPU_PINNING") is False
        assert "32" in str(b.property("INFERENCE_PRECISION_HINT"))
        assert int(b.property("NUM_STREAMS")) == 1
    finally:
        b.close()


def test_sample_inputs_are_zeros_for_integers_and_normal_floats(opened):
    feeds = sample_inputs(opened[("onnxruntime", "multi-io")], 4, np.random.default_rng(0))
    assert feeds["x"].dtype == np.float32 and feeds["x"].shape == (4, 8) and feeds["x"].std() > 0.1
    assert feeds["ids"].dtype == np.int64 and feeds["ids"].shape == (4, 4)
    assert np.all(feeds["ids"] == 0)  # zero is a valid index into every table (issue 12)


def test_sample_inputs_dynamic_dims():
    class Fake:
        inputs = [TensorInfo("input_ids", "INT64", [-1, -1]), TensorInfo("attention_mask", "INT64", [-1, -1])]

    feeds = sample_inputs(Fake(), 2, np.random.default_rng(0), dims={"input_ids": 5, "attention_mask": 5})
    assert feeds["input_ids"].shape == feeds["attention_mask"].shape == (2, 5)
    assert np.all(feeds["attention_mask"] == 0)


def test_inputs_are_cast_to_the_model_dtype(opened):
    b = opened[("openvino", "multi-io")]
    out = b.run({"x": np.zeros((2, 8), dtype=np.float64), "ids": np.ones((2, 4), dtype=np.int32)})
    assert out["id_sum"].tolist() == [[4], [4]]


@pytest.mark.parametrize("kind", BACKENDS)
def test_bad_input_names_name_the_expected_inputs(opened, kind):
    b = opened[(kind, "multi-io")]
    with pytest.raises(ReamerError) as exc:
        b.run({"x": np.zeros((1, 8), np.float32), "wrong": np.zeros((1, 4), np.int64)})
    assert "ids" in exc.value.message and "wrong" in exc.value.message
    assert "x: FP32 [-1, 8]" in exc.value.fix and "ids: INT64 [-1, 4]" in exc.value.fix


@pytest.mark.parametrize("kind", BACKENDS)
def test_bad_input_shape_names_the_expected_shape(opened, kind):
    b = opened[(kind, "tiny")]
    with pytest.raises(ReamerError) as exc:
        b.run({"input": np.zeros((1, 15), np.float32)})
    assert "[1, 15]" in exc.value.message and "[-1, 16]" in exc.value.message


def test_batch_sizes_must_agree(opened):
    with pytest.raises(ReamerError, match="batch"):
        opened[("onnxruntime", "multi-io")].run({"x": np.zeros((2, 8), np.float32), "ids": np.zeros((3, 4), np.int64)})


def test_float_into_integer_input_is_refused(opened):
    with pytest.raises(ReamerError, match="INT64"):
        opened[("onnxruntime", "multi-io")].run({"x": np.zeros((1, 8), np.float32), "ids": np.zeros((1, 4), np.float32)})


def test_unknown_backend_and_bad_arguments(model_paths, tmp_path):
    with pytest.raises(ReamerError) as exc:
        open_backend("tensorrt", model_paths["tiny"], 1)
    assert "onnxruntime" in exc.value.fix and "openvino" in exc.value.fix
    with pytest.raises(ReamerError, match="threads"):
        open_backend("onnxruntime", model_paths["tiny"], 0)
    with pytest.raises(ReamerError, match="does not exist"):
        open_backend("onnxruntime", tmp_path / "missing.onnx", 1)
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    for kind in BACKENDS:
        with pytest.raises(ReamerError):
            open_backend(kind, garbage, 1)


@pytest.mark.parametrize("family", ["tiny", "multi-io"])
def test_openvino_static_batch_runs_that_shape_and_others_through_a_dynamic_form(model_paths, opened, family):
    """A max-batch-1 instance's OpenVINO compiles a static batch-1 shape (faster), still describes its inputs with a
    dynamic batch axis, and answers a batch of another size (a client's multi-row request) from a dynamic form
    compiled when one first comes."""
    ref = opened[("onnxruntime", family)]
    with open_backend("openvino", model_paths[family], 1, static_batch=1) as b:
        assert b.static_batch == 1
        assert b.inputs == ref.inputs and b.outputs == ref.outputs
        assert [list(p.get_partial_shape().to_shape()) for p in b._main.compiled.inputs] == \
               [[1, *t.shape[1:]] for t in b.inputs]
        assert b._dynamic is None
        for batch in (1, 3, 1):
            feeds = sample_inputs(ref, batch, np.random.default_rng(batch))
            got, want = b.run(feeds), ref.run(feeds)
            for name in want:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)
        assert b._dynamic is not None and b._dynamic is not b._main


def test_openvino_reads_inputs_where_they_are_each_run(opened):
    """OpenVINO reads the caller's arrays in place (as the worker's shared memory is reused for the next batch):
    each run answers for what the buffer holds then, and an earlier answer is not overwritten."""
    ort_b, ov_b = opened[("onnxruntime", "tiny")], opened[("openvino", "tiny")]
    buffer = np.empty((2, 16), np.float32)
    answers = []
    for seed in (1, 2):
        buffer[:] = np.random.default_rng(seed).standard_normal((2, 16))
        answers.append((ov_b.run({"input": buffer})["output"], ort_b.run({"input": buffer.copy()})["output"]))
    for got, want in answers:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(answers[0][0], answers[1][0])


@pytest.mark.parametrize("family", ["tiny", "multi-io"])
def test_openvino_takes_read_only_inputs(opened, family):
    """Arrays read from a request body or unpickled from the worker's pipe are read-only: OpenVINO cannot read
    them in place, so it copies them (it refused them with 'array is not writeable' at first)."""
    ref = opened[("onnxruntime", family)]
    feeds = sample_inputs(ref, 2, np.random.default_rng(3))
    for arr in feeds.values():
        arr.flags.writeable = False
    got, want = opened[("openvino", family)].run(feeds), ref.run(feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)
