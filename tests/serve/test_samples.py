"""One rule for sample inputs (warm-up, profile, search, admission): perf_analyzer's --shape and
--input-data, zeros for index inputs, errors that name the input and the fix."""
import json

import numpy as np
import pytest

from reamer.serve.measure.profile_cache import model_key
from reamer.serve.samples import (SampleError, SampleSpec, explain_failure, model_inputs, parse_shape_option,
                                  plan_samples, sample_batch, shapes_from_doc, shapes_from_options)
from reamer.serve.protocol.tensors import TensorInfo
from tests.serve.bertlike import bert_feeds, build_bertlike

BERT = [TensorInfo(n, "INT64", [-1, -1]) for n in ("input_ids", "attention_mask", "token_type_ids")]
IMAGE = [TensorInfo("image", "FP32", [-1, 3, 8, 8]), TensorInfo("flag", "BOOL", [1])]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return build_bertlike(tmp_path_factory.mktemp("bert") / "bertlike.onnx")


def test_shape_option_parses_like_perf_analyzer():
    assert parse_shape_option("input_ids:1,128") == ("input_ids", (1, 128))
    assert parse_shape_option("ns:name:3") == ("ns:name", (3,))  # the last colon splits
    assert shapes_from_options(["a:1,2", "b:4"]) == {"a": (1, 2), "b": (4,)}
    for bad in ("input_ids", ":1,2", "x:1,a", "x:0,4", "x:-1"):
        with pytest.raises(SampleError) as exc:
            parse_shape_option(bad)
        assert "--shape" in exc.value.fix


def test_api_shapes_are_checked():
    assert shapes_from_doc({"input_ids": [1, 128]}) == {"input_ids": (1, 128)}
    for bad in ([1], {"x": "1,2"}, {"x": []}, {"x": [1, 0]}, {"x": [1.5]}, {"x": [True]}):
        with pytest.raises(SampleError):
            shapes_from_doc(bad)


def test_defaults_are_zeros_for_integers_and_booleans():
    feeds = sample_batch(BERT + IMAGE, 3)
    assert feeds["input_ids"].shape == (3, 16) and not feeds["input_ids"].any()
    assert feeds["image"].shape == (3, 3, 8, 8) and feeds["image"].dtype == np.float32
    assert feeds["flag"].shape == (1,) and feeds["flag"].dtype == np.bool_ and not feeds["flag"].any()


def test_shapes_with_or_without_the_batch_dim():
    full = SampleSpec({"input_ids": (1, 128), "attention_mask": (1, 128), "token_type_ids": (128,)})
    feeds = sample_batch(BERT, 4, full)
    assert {k: v.shape for k, v in feeds.items()} == {k: (4, 128) for k in feeds}


@pytest.mark.parametrize("shapes, words", [
    ({"input_idz": (1, 128)}, ["input_idz", "input_ids"]),  # unknown name: lists the model's names
    ({"input_ids": (1, 2, 128)}, ["input_ids", "3 dims", "--shape input_ids:1,128"]),  # wrong rank
])
def test_shapes_that_do_not_fit_name_the_input_and_the_fix(shapes, words):
    with pytest.raises(SampleError) as exc:
        plan_samples(BERT, SampleSpec(shapes))
    text = str(exc.value)
    assert all(w in text for w in words), text


def test_fixed_dims_must_match():
    with pytest.raises(SampleError) as exc:
        plan_samples(IMAGE, SampleSpec({"image": (1, 3, 9, 8)}))
    assert "image" in exc.value.message and "fixed dims" in exc.value.message


def test_non_positive_dims_are_refused():
    with pytest.raises(SampleError) as exc:
        SampleSpec({"input_ids": (1, 0)})
    assert "input_ids" in exc.value.message


def test_npz_rows_are_samples_and_batches_cycle_through_them(tmp_path):
    path = tmp_path / "d.npz"
    feeds = bert_feeds(2, 5)
    feeds["input_ids"] = np.array([[1] * 5, [2] * 5])
    np.savez(path, **feeds)
    batch = sample_batch(BERT, 3, SampleSpec(input_data=str(path)))
    assert batch["input_ids"][:, 0].tolist() == [1, 2, 1] and batch["input_ids"].shape == (3, 5)


def test_perf_analyzer_json_input_data(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"data": [
        {"input_ids": [1, 2, 3, 4], "attention_mask": [1, 1, 1, 1], "token_type_ids": [0, 0, 1, 1]},
        {"input_ids": {"content": [5, 6, 7, 8], "shape": [4]}, "attention_mask": [1, 1, 1, 0],
         "token_type_ids": [0, 0, 0, 0]}]}))
    assert sample_batch(BERT, 2, SampleSpec(input_data=str(path)))["input_ids"].shape == (2, 4)
    spec = SampleSpec({"input_ids": (4,), "attention_mask": (1, 4), "token_type_ids": (4,)}, str(path))
    batch = sample_batch(BERT, 2, spec)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert batch["token_type_ids"].dtype == np.int64


def test_flat_json_values_on_several_dynamic_dims_need_a_shape(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"data": [{"frames": [0.5] * 6}]}))
    frames = [TensorInfo("frames", "FP32", [-1, -1, -1])]
    with pytest.raises(SampleError) as exc:
        plan_samples(frames, SampleSpec(input_data=str(path)))
    assert "frames" in exc.value.message and "shape" in exc.value.fix
    batch = sample_batch(frames, 2, SampleSpec({"frames": (2, 3)}, str(path)))
    assert batch["frames"].shape == (2, 2, 3)


def test_sample_data_must_cover_the_model(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, input_ids=np.zeros((1, 4), np.int64), extra=np.zeros(3))
    with pytest.raises(SampleError) as exc:
        plan_samples(BERT, SampleSpec(input_data=str(path)))
    assert "extra" in exc.value.message
    np.savez(path, input_ids=np.zeros((1, 4), np.int64))
    with pytest.raises(SampleError) as exc:
        plan_samples(BERT, SampleSpec(input_data=str(path)))
    assert "attention_mask" in exc.value.message
    with pytest.raises(SampleError):
        plan_samples(BERT, SampleSpec(input_data=str(tmp_path / "missing.npz")))


def test_model_inputs_read_without_a_runtime(bert):
    assert [(t.name, t.datatype, t.shape) for t in model_inputs(bert)] == [
        (n, "INT64", [-1, -1]) for n in ("input_ids", "attention_mask", "token_type_ids")]


def test_profile_cache_key_includes_the_shapes(bert, tmp_path):
    plain = model_key(bert, "onnxruntime", "cpu")
    assert model_key(bert, "onnxruntime", "cpu", SampleSpec()) == plain  # old caches stay valid
    k128 = model_key(bert, "onnxruntime", "cpu", SampleSpec({"input_ids": (1, 128)}))
    k64 = model_key(bert, "onnxruntime", "cpu", SampleSpec({"input_ids": (1, 64)}))
    assert len({plain, k128, k64}) == 3
    data = tmp_path / "d.npz"
    np.savez(data, **bert_feeds(1, 4))
    assert model_key(bert, "onnxruntime", "cpu", SampleSpec(input_data=str(data))) != plain


def test_a_runtime_refusal_is_explained_with_the_input_behind_it(bert):
    import onnxruntime as ort

    plan = plan_samples(model_inputs(bert))
    feeds = bert_feeds(1, 4, type_id=3)
    with pytest.raises(Exception) as raised:
        ort.InferenceSession(bert, providers=["CPUExecutionProvider"]).run(None, feeds)
    text = explain_failure(bert, plan, feeds, raised.value)
    assert text.startswith("the model refused input token_type_ids")
    assert "out of data bounds" in text and "input_ids INT64 [1, 4] (zeros)" in text


def test_one_shape_sizes_the_inputs_that_share_its_named_dims(bert):
    inputs = model_inputs(bert)  # all three are [batch, seq]
    feeds = plan_samples(inputs, SampleSpec({"input_ids": (1, 128)}), bert).batch(2)
    assert {k: v.shape for k, v in feeds.items()} == {k: (2, 128) for k in feeds}
    feeds = plan_samples(inputs, SampleSpec({"token_type_ids": (64,)}), bert).batch(1)
    assert feeds["attention_mask"].shape == (1, 64)
    assert plan_samples(inputs, SampleSpec({"input_ids": (1, 128)})).batch(1)["attention_mask"].shape == (1, 16)


def test_deploy_chooser_plans_from_the_profile_of_the_deployed_traffic(bert, tmp_path):
    from reamer.search.chooser import LayoutRequest, ProfileCacheChooser
    from reamer.plan.partition import ProfilePoint
    from reamer.serve.measure.profile_cache import ProfileCache

    seq128 = SampleSpec({"input_ids": (1, 128)})
    ProfileCache(tmp_path).put(model_key(bert, "onnxruntime", samples=seq128), [ProfilePoint(1, 1, 100.0, 5.0)])
    chooser = ProfileCacheChooser(tmp_path)  # cached profiles only, no search
    assert chooser(LayoutRequest(bert, "onnxruntime", [1], 50.0, None, samples=seq128)).layout == "1x1:b1"
    assert chooser(LayoutRequest(bert, "onnxruntime", [1], 50.0, None)) is None  # seq 16 was never profiled
    seq64 = SampleSpec({"input_ids": (1, 64)})
    assert chooser(LayoutRequest(bert, "onnxruntime", [1], 50.0, None, samples=seq64)) is None
