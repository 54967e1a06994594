import numpy as np
import onnx
import onnxruntime as ort
import pytest

from reamer.host.errors import ReamerError
from reamer.serve.models import MODEL_FAMILIES, ModelInfo, build_model

# small options keep the heavy families fast; resnet50/mobilenetv2 are built full size once per module
SMALL_OPTIONS = {
    "bert-base": {"layers": 2, "seq_len": 32, "vocab_size": 1000},
    "deepspeech2": {"frames": 40, "hidden": 64, "rnn_layers": 2},
}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def built(models_dir):
    cache: dict[str, ModelInfo] = {}

    def get(family: str) -> ModelInfo:
        if family not in cache:
            cache[family] = build_model(family, models_dir / f"{family}.onnx", **SMALL_OPTIONS.get(family, {}))
        return cache[family]

    return get


def _feeds(info: ModelInfo, batch: int) -> dict:
    rng = np.random.default_rng(0)
    feeds = {}
    for t in info.inputs:
        shape = [batch if d == -1 else d for d in t.shape]
        feeds[t.name] = rng.integers(0, 10, shape).astype(np.int64) if t.datatype == "INT64" else rng.standard_normal(shape).astype(np.float32)
    return feeds


def test_resnet50_has_torchvision_parameter_count(built):
    assert built("resnet50").params == 25_557_032


def test_mobilenet_v2_has_torchvision_parameter_count(built):
    assert built("mobilenet_v2").params == 3_504_872


@pytest.mark.parametrize("typed, family", [("mobilenet_v2", "mobilenet_v2"), ("mobilenetv2", "mobilenet_v2"),
                                           ("MobileNet-V2", "mobilenet_v2"), ("resnet50", "resnet50"),
                                           ("ResNet-50", "resnet50"), ("bert-base", "bert-base"),
                                           ("bert_base_uncased", "bert-base"), ("multi_io", "multi-io")])
def test_family_names_users_type(typed, family):
    from reamer.serve.models import canonical_family

    assert canonical_family(typed) == family


def test_unknown_family_is_refused_with_the_names():
    from reamer.serve.models import UnknownModelFamily

    with pytest.raises(UnknownModelFamily) as exc:
        build_model("vgg99", "/nonexistent/x.onnx")
    assert "mobilenet_v2" in exc.value.fix


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_family_runs_at_batch_1_and_2(built, family):
    info = built(family)
    model = onnx.load(info.path, load_external_data=False)
    onnx.checker.check_model(model)
    # the batch axis is named "batch" on every input and output
    for vi in list(model.graph.input) + list(model.graph.output):
        assert vi.type.tensor_type.shape.dim[0].dim_param == "batch"
    assert [t.name for t in info.outputs] == [o.name for o in model.graph.output]
    session = ort.InferenceSession(info.path, providers=["CPUExecutionProvider"])
    for batch in (1, 2):
        outs = session.run(None, _feeds(info, batch))
        assert len(outs) == len(info.outputs)
        for out, meta in zip(outs, info.outputs):
            assert list(out.shape) == [batch] + meta.shape[1:]
            assert np.all(np.isfinite(out))


def test_bert_shapes_and_dtypes(built):
    info = built("bert-base")
    assert [(t.name, t.datatype, t.shape) for t in info.inputs] == [
        ("input_ids", "INT64", [-1, 32]), ("attention_mask", "INT64", [-1, 32])]
    assert [(t.name, t.shape) for t in info.outputs] == [("last_hidden_state", [-1, 32, 768]), ("pooler_output", [-1, 768])]


def test_bert_layers_change_parameter_count(models_dir):
    one = build_model("bert-base", models_dir / "bert1.onnx", layers=1, seq_len=8, vocab_size=100)
    two = build_model("bert-base", models_dir / "bert2.onnx", layers=2, seq_len=8, vocab_size=100)
    # one BERT-base encoder layer: 4 attention projections + FFN + 2 LayerNorms
    per_layer = 4 * (768 * 768 + 768) + (768 * 3072 + 3072) + (3072 * 768 + 768) + 4 * 768
    assert two.params - one.params == per_layer


def test_deepspeech2_input_and_output(built):
    info = built("deepspeech2")
    assert info.inputs[0].name == "spectrogram" and info.inputs[0].shape == [-1, 40, 161]
    assert info.outputs[0].shape == [-1, 20, 29]
    model = onnx.load(info.path)
    assert sum(n.op_type == "GRU" for n in model.graph.node) == 2


def test_multi_io_has_two_dtypes_each_way(built):
    info = built("multi-io")
    assert {t.datatype for t in info.inputs} == {"FP32", "INT64"}
    assert {t.datatype for t in info.outputs} == {"FP32", "INT64"}


def test_seed_determines_weights(models_dir):
    a = build_model("tiny", models_dir / "a.onnx", seed=1)
    b = build_model("tiny", models_dir / "b.onnx", seed=1)
    c = build_model("tiny", models_dir / "c.onnx", seed=2)
    read = lambda p: open(p, "rb").read()
    assert read(a.path) == read(b.path)
    assert read(a.path) != read(c.path)


def test_unknown_family_lists_families(tmp_path):
    with pytest.raises(ReamerError) as exc:
        build_model("vgg16", tmp_path / "x.onnx")
    assert "vgg16" in exc.value.message
    for family in MODEL_FAMILIES:
        assert family in exc.value.fix
    assert not (tmp_path / "x.onnx").exists()


def test_bad_option_is_a_reamer_error(tmp_path):
    with pytest.raises(ReamerError, match="option"):
        build_model("tiny", tmp_path / "x.onnx", depth=3)


def test_bert_takes_hugging_face_option_names(tmp_path):
    info = build_model("bert-base-uncased", tmp_path / "b.onnx", num_hidden_layers=1, hidden_size=64,
                       num_attention_heads=2, intermediate_size=128, vocab_size=50, seq_length=8)
    assert info.family == "bert-base" and info.inputs[0].shape == [-1, 8]
    small = build_model("bert-base", tmp_path / "s.onnx", layers=1, hidden=64, heads=2, intermediate=128,
                        vocab_size=50, seq_len=8)
    assert info.params == small.params


def test_backend_names_users_type():
    from reamer.serve.spec import canonical_backend

    assert [canonical_backend(n) for n in ("ORT", "onnx-runtime", "OnnxRuntime", "OpenVINO", "ov", "tensorrt")] == \
        ["onnxruntime", "onnxruntime", "onnxruntime", "openvino", "openvino", None]
