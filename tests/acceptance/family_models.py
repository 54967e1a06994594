"""More model families for the acceptance suite (issue 24), built locally with random weights, cached.

Each recipe builds one model the way its users make it: scikit-learn through skl2onnx (with and without
ZipMap), LightGBM through onnxmltools, transformers' ViT, DistilBERT and Whisper (encoder only) from small
configs through torch.onnx.export, and graphs written with onnx.helper for the tensor kinds a v2 server
must carry (strings in and out; FP16, BOOL and rank-0 tensors; an output whose first dimension depends on
the data; a reduction over the whole request). As in `exported_models`, the heavy tools (torch,
transformers, scikit-learn, lightgbm) are imported only in the build process (`python -m
tests.acceptance.family_models --out DIR`); the pytest process reads the cache (built once per recipe and
tool versions, about a minute under load).

What a test needs to know about each model — how to make one client's request and which outputs to ask —
is in `FAMILIES`, next to the recipe that makes the model.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from tests.acceptance import exported_models as exported

TOOLS = exported.TOOLS + ("scikit-learn", "skl2onnx", "lightgbm", "onnxmltools")

FEATURES = 4  # tabular models' feature count (and the helper graphs' row width)
CLASSES = 3
IMAGE = 32  # ViT: [batch, 3, 32, 32] in patches of 8
MEL_BINS = 16  # Whisper: [batch, 16 mel bins, 2 * SOURCE_POSITIONS frames]
SOURCE_POSITIONS = 16
WORDS = ("Cat", "DOG", "bird", "Fish", "ünïcødé", "")  # the string model's vocabulary (and unknown words)


@dataclass(frozen=True)
class Family:
    """One model of a family: how one client makes its request, and what the tests expect of the deploy."""

    name: str
    # (client, request number, rows or None: 1 to 3 by the two numbers) -> that request's inputs
    request: Callable[[int, int, int | None], dict[str, np.ndarray]]
    outputs: tuple[str, ...]
    batchable: bool = True  # Triton's rule, confirmed on two rows: its requests may be merged into one run
    rtol: float = 1e-4  # against a direct ONNX Runtime run of the same file on the same request alone
    atol: float = 1e-4
    openvino: bool = False  # served with OpenVINO too (the transformers families; OpenVINO lacks ai.onnx.ml ops)
    strings: bool = False  # has BYTES tensors (the plain KServe gRPC client's typed contents carry none)
    files: tuple[str, ...] = ()  # besides NAME.onnx (external weights)
    refused: str = ""  # the deploy must be refused, with this in the fix; "" = the model is served
    note: str = ""


def _rng(client: int, request: int) -> np.random.Generator:
    return np.random.default_rng(10_000 + 100 * client + request)


def _rows(client: int, request: int) -> int:
    """1, 2 or 3 rows: requests of different sizes, so that merged batches have to be split by rows."""
    return 1 + (client + request) % 3


def tabular(client: int, request: int, rows: int | None = None) -> dict[str, np.ndarray]:
    shape = (rows or _rows(client, request), FEATURES)
    return {"features": _rng(client, request).standard_normal(shape).astype(np.float32)}


def images(client: int, request: int, rows: int | None = None) -> dict[str, np.ndarray]:
    shape = (rows or _rows(client, request), 3, IMAGE, IMAGE)
    return {"pixel_values": _rng(client, request).standard_normal(shape).astype(np.float32)}


def text(client: int, request: int, rows: int | None = None) -> dict[str, np.ndarray]:
    """Token ids and a ragged attention mask; each client has its own sequence length (5, 8, 11, ...), so
    requests of different lengths meet in the queue."""
    rng, rows, seq = _rng(client, request), rows or _rows(client, request), 5 + 3 * (client % 4)
    lengths = rng.integers(1, seq + 1, size=rows)
    return {"input_ids": rng.integers(0, exported.VOCAB, size=(rows, seq)).astype(np.int64),
            "attention_mask": (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)}


def audio(client: int, request: int, rows: int | None = None) -> dict[str, np.ndarray]:
    shape = (rows or _rows(client, request), MEL_BINS, 2 * SOURCE_POSITIONS)
    return {"input_features": _rng(client, request).standard_normal(shape).astype(np.float32)}


def words(client: int, request: int, rows: int | None = None) -> dict[str, np.ndarray]:
    rng = _rng(client, request)
    picked = [f"{WORDS[i]}" if i < len(WORDS) else f"Client{client}-Req{request}"
              for i in rng.integers(0, len(WORDS) + 1, size=rows or _rows(client, request))]
    return {"text": np.array(picked, dtype=object)}


def fp16_bool_scalar(client: int, request: int, rows: int | None = None) -> dict[str, np.ndarray]:
    rng, rows = _rng(client, request), rows or _rows(client, request)
    return {"x": rng.standard_normal((rows, FEATURES)).astype(np.float16),
            "keep": rng.random((rows, FEATURES)) < 0.6,
            "scale": np.array(0.5 + client + 0.25 * request, dtype=np.float16)}  # rank 0: each client its own


def rows_with_zeros(client: int, request: int, rows: int | None = None) -> dict[str, np.ndarray]:
    """Rows whose sums are positive or not, and zeros in other places, per client and request."""
    rng, rows = _rng(client, request), rows or _rows(client, request)
    x = rng.standard_normal((rows, FEATURES))
    return {"x": np.where(rng.random((rows, FEATURES)) < 0.4, 0.0, x).astype(np.float32)}


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("sklearn", tabular, ("label", "probabilities"),
           note="scikit-learn StandardScaler + LogisticRegression (3 classes) through skl2onnx.to_onnx with "
                "options {'zipmap': False}: label INT64 [N], probabilities FP32 [N, 3]"),
    Family("sklearn-zipmap", tabular, ("output_label", "output_probability"), batchable=False,
           refused="'zipmap': False",
           note="the same kind of classifier with skl2onnx's default ZipMap output (a sequence of maps): "
                "refused at deploy with the fix"),
    Family("lightgbm", tabular, ("label", "probabilities"), batchable=False, rtol=1e-5, atol=1e-5,
           note="LightGBM LGBMClassifier (8 trees of 4 leaves, 3 classes) through onnxmltools.convert_lightgbm "
                "with zipmap=False (TreeEnsembleClassifier, ai.onnx.ml); onnxmltools declares the label's shape "
                "as [1] (a fixed first dimension), so the model is not batchable by Triton's rule"),
    Family("vit", images, ("logits",), openvino=True, rtol=1e-3, atol=1e-3,
           note="transformers ViTForImageClassification from ViTConfig (1 layer, hidden 32, 3x32x32 images in "
                "8x8 patches, 10 labels); torch.onnx.export (dynamo), dynamic batch"),
    Family("distilbert", text, ("last_hidden_state",), openvino=True, rtol=1e-3, atol=1e-3,
           files=("distilbert.onnx.data",),
           note="transformers DistilBertModel from DistilBertConfig (1 layer, dim 32, vocab 1000); "
                "torch.onnx.export(dynamo=True, external_data=True) with two dynamic axes (batch, seq)"),
    Family("whisper-encoder", audio, ("last_hidden_state",), openvino=True, rtol=1e-3, atol=1e-3,
           note="the encoder of transformers WhisperModel from WhisperConfig (1 layer, d_model 32, 16 mel bins, "
                "32 frames); torch.onnx.export (dynamo), dynamic batch"),
    Family("strings", words, ("lower", "category"), strings=True,
           note="BYTES [N] in, BYTES [N] out twice: StringNormalizer (lower case) then a string-to-string "
                "LabelEncoder (ai.onnx.ml) with a default for unknown words; onnx.helper"),
    Family("fp16-bool-scalar", fp16_bool_scalar, ("y", "positive"), batchable=False, rtol=1e-3, atol=1e-3,
           note="FP16 [N, 4] and BOOL [N, 4] in with a rank-0 FP16 scale: y = where(keep, x * scale, 0) FP16, "
                "positive = x > 0 BOOL; onnx.helper (a rank-0 input: never batched)"),
    Family("data-dependent", rows_with_zeros, ("kept_rows", "nonzero"), batchable=False,
           note="Compress (the rows whose sum is positive: first dim by the data) and NonZero ([2, n]); "
                "onnx.helper"),
    Family("reduction", rows_with_zeros, ("y", "column_mean", "total"), batchable=False,
           note="y = 2x per row, beside the mean of every column over the request's rows ([4]: the same "
                "size as a full batch of 4) and the sum of the whole request (rank 0); onnx.helper"),
]}


# ---------------------------------------------------------------------------------------------- recipes
# Everything below runs only in the build process (python -m tests.acceptance.family_models).


def _tabular_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((120, FEATURES)).astype(np.float32)
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64) + (x[:, 2] > 0.8).astype(np.int64)


def build_sklearn(out: Path) -> None:
    import onnx
    from skl2onnx import to_onnx
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = _tabular_data()
    pipe = make_pipeline(StandardScaler(), LogisticRegression()).fit(x, y)
    classifier = pipe.steps[-1][1]
    model = to_onnx(pipe, x[:1], options={id(classifier): {"zipmap": False}}, target_opset=17,
                    initial_types=None)
    _rename_io(model, {"X": "features"})
    onnx.save(model, str(out / "sklearn.onnx"))
    zipmap = to_onnx(make_pipeline(StandardScaler(), LogisticRegression()).fit(x, y), x[:1], target_opset=17)
    _rename_io(zipmap, {"X": "features"})
    onnx.save(zipmap, str(out / "sklearn-zipmap.onnx"))


def build_lightgbm(out: Path) -> None:
    import onnx
    from lightgbm import LGBMClassifier
    from onnxmltools import convert_lightgbm
    from onnxmltools.convert.common.data_types import FloatTensorType

    x, y = _tabular_data()
    model = LGBMClassifier(n_estimators=8, num_leaves=4, min_child_samples=5, verbose=-1).fit(x, y)
    converted = convert_lightgbm(model, initial_types=[("features", FloatTensorType([None, FEATURES]))],
                                 zipmap=False, target_opset=15)
    onnx.save(converted, str(out / "lightgbm.onnx"))


def _rename_io(model, names: dict[str, str]) -> None:
    """Rename graph inputs (skl2onnx calls the input X) everywhere they are used."""
    graph = model.graph
    for vi in graph.input:
        if vi.name in names:
            vi.name = names[vi.name]
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in names:
                node.input[i] = names[name]


def build_vit(out: Path) -> None:
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=64, num_labels=10)
    torch.manual_seed(0)
    vit = ViTForImageClassification(config).eval()

    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vit = vit

        def forward(self, pixel_values):
            return self.vit(pixel_values=pixel_values).logits

    exported._export(Classifier(), (torch.randn(2, 3, IMAGE, IMAGE),), out / "vit.onnx", ["pixel_values"],
                     ["logits"], {"pixel_values": {0: "batch"}}, dynamo=True)


def build_distilbert(out: Path) -> None:
    import torch
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig(vocab_size=exported.VOCAB, dim=32, n_layers=1, n_heads=2, hidden_dim=64,
                              max_position_embeddings=exported.MAX_POSITIONS)
    torch.manual_seed(0)
    bert = DistilBertModel(config).eval()

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    sample = text(0, 1)  # 2 rows of 5 tokens, ragged: no dimension is specialised to a constant
    args = (torch.from_numpy(sample["input_ids"]), torch.from_numpy(sample["attention_mask"]))
    batch = torch.export.Dim("batch", min=1, max=exported.MAX_POSITIONS)
    seq = torch.export.Dim("seq", min=1, max=exported.MAX_POSITIONS)
    torch.onnx.export(Encoder().eval(), args, str(out / "distilbert.onnx"),
                      input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                      dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
                      dynamo=True, external_data=True, verbose=False)


def build_whisper_encoder(out: Path) -> None:
    import torch
    from transformers import WhisperConfig, WhisperModel

    config = WhisperConfig(vocab_size=100, num_mel_bins=MEL_BINS, d_model=32, encoder_layers=1,
                           encoder_attention_heads=2, encoder_ffn_dim=64, decoder_layers=1,
                           decoder_attention_heads=2, decoder_ffn_dim=64, max_source_positions=SOURCE_POSITIONS,
                           max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           decoder_start_token_id=1, suppress_tokens=[], begin_suppress_tokens=[])
    torch.manual_seed(0)
    encoder = WhisperModel(config).get_encoder().eval()

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_features):
            return self.encoder(input_features=input_features).last_hidden_state

    exported._export(Encoder(), (torch.randn(2, MEL_BINS, 2 * SOURCE_POSITIONS),), out / "whisper-encoder.onnx",
                     ["input_features"], ["last_hidden_state"], {"input_features": {0: "batch"}}, dynamo=True)


def _save_graph(graph, path: Path, ml: bool = False) -> None:
    import onnx
    from onnx import helper

    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("ai.onnx.ml", 2)] if ml else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def build_strings(out: Path) -> None:
    from onnx import TensorProto, helper

    known = [w.lower() for w in WORDS if w]
    kinds = ["animal", "animal", "animal", "animal", "accented"]
    nodes = [helper.make_node("StringNormalizer", ["text"], ["lower"], case_change_action="LOWER",
                              locale="C.UTF-8"),  # a locale every host has (ONNX Runtime's default is en_US)
             helper.make_node("LabelEncoder", ["lower"], ["category"], domain="ai.onnx.ml", keys_strings=known,
                              values_strings=kinds, default_string="unknown")]
    graph = helper.make_graph(nodes, "strings", [helper.make_tensor_value_info("text", TensorProto.STRING, ["N"])],
                              [helper.make_tensor_value_info("lower", TensorProto.STRING, ["N"]),
                               helper.make_tensor_value_info("category", TensorProto.STRING, ["N"])])
    _save_graph(graph, out / "strings.onnx", ml=True)


def build_fp16_bool_scalar(out: Path) -> None:
    from onnx import TensorProto, helper

    zero = helper.make_tensor("zero", TensorProto.FLOAT16, [], np.array([0], np.float16).view(np.uint16).tolist())
    nodes = [helper.make_node("Mul", ["x", "scale"], ["scaled"]),
             helper.make_node("Where", ["keep", "scaled", "zero"], ["y"]),
             helper.make_node("Greater", ["x", "zero"], ["positive"])]
    graph = helper.make_graph(
        nodes, "fp16_bool_scalar",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", FEATURES]),
         helper.make_tensor_value_info("keep", TensorProto.BOOL, ["N", FEATURES]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT16, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", FEATURES]),
         helper.make_tensor_value_info("positive", TensorProto.BOOL, ["N", FEATURES])], [zero])
    _save_graph(graph, out / "fp16-bool-scalar.onnx")


def build_data_dependent(out: Path) -> None:
    from onnx import TensorProto, helper

    axis1 = helper.make_tensor("axis1", TensorProto.INT64, [1], [1])
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
    nodes = [helper.make_node("ReduceSum", ["x", "axis1"], ["sums"], keepdims=0),
             helper.make_node("Greater", ["sums", "zero"], ["keep"]),
             helper.make_node("Compress", ["x", "keep"], ["kept_rows"], axis=0),
             helper.make_node("NonZero", ["x"], ["nonzero"])]
    graph = helper.make_graph(
        nodes, "data_dependent", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", FEATURES])],
        [helper.make_tensor_value_info("kept_rows", TensorProto.FLOAT, ["kept", FEATURES]),
         helper.make_tensor_value_info("nonzero", TensorProto.INT64, [2, "found"])], [axis1, zero])
    _save_graph(graph, out / "data-dependent.onnx")


def build_reduction(out: Path) -> None:
    from onnx import TensorProto, helper

    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    nodes = [helper.make_node("Mul", ["x", "two"], ["y"]),
             helper.make_node("ReduceMean", ["x"], ["column_mean"], axes=[0], keepdims=0),  # opset 17: attribute
             helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "reduction", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", FEATURES])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", FEATURES]),
         helper.make_tensor_value_info("column_mean", TensorProto.FLOAT, [FEATURES]),
         helper.make_tensor_value_info("total", TensorProto.FLOAT, [])], [two])
    _save_graph(graph, out / "reduction.onnx")


RECIPES: dict[str, Callable[[Path], None]] = {
    "sklearn": build_sklearn, "lightgbm": build_lightgbm, "vit": build_vit, "distilbert": build_distilbert,
    "whisper-encoder": build_whisper_encoder, "strings": build_strings, "fp16-bool-scalar": build_fp16_bool_scalar,
    "data-dependent": build_data_dependent, "reduction": build_reduction,
}  # sklearn also writes sklearn-zipmap


def cache_dir() -> Path:
    return exported.cache_dir(Path(__file__), TOOLS)


def ensure_models() -> Path:
    """The cache directory with every model in FAMILIES (built in a child process if any is missing)."""
    return exported.ensure_built(cache_dir(), __name__, list(FAMILIES), TOOLS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the acceptance suite's model families.")
    parser.add_argument("--out", default=None, help="directory (default: the test cache, see cache_dir())")
    args = parser.parse_args(argv)
    exported.build_recipes(Path(args.out) if args.out else cache_dir(), RECIPES, list(FAMILIES), TOOLS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
