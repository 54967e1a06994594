"""Models made by the real exporters, for the acceptance suite: built locally with random weights, cached.

Each recipe below builds one model the way a user would: transformers' own model classes and
`torch.onnx.export`, ONNX Runtime's quantiser, onnxconverter-common's float16 conversion, onnx's
external-data writer. torch and transformers are test-only dependencies: they are imported only here,
only in the process that builds (`python -m tests.acceptance.exported_models --out DIR`), never by
reamer itself and never by the pytest process, which reads the cache.

The cache is `$REAMER_TEST_MODELS`, else `~/.cache/reamer/test-models/<key>/`, where the key hashes
this file's text and the versions of the tools that built the models: a change of recipe or of a
tool builds anew. A build of all models takes about 15 s on a quiet two-core machine and about a minute
under load (torch's import and the dynamo exporter dominate); later runs only read the files (3.6 MB).

What the tests need to know about each model (its inputs, valid values for them, tolerances) is in
`SPECS`, written here next to the recipe that makes the model, so the two cannot drift apart.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("torch", "transformers", "onnx", "onnxruntime", "onnxscript", "onnxconverter-common", "numpy")

VOCAB = 1000  # token vocabulary of the text models (small: the embedding table is most of their weights)
TYPE_VOCAB = 2  # token_type_ids index a table of 2 rows, as in BERT: the warm-up crash
HIDDEN = 64
MAX_POSITIONS = 128
SEQ = 16  # the sequence length the tests send (the models accept any up to MAX_POSITIONS)
IMAGE = 32  # the CNN's input is [batch, 3, IMAGE, IMAGE]
CLASSES = 10


# ---------------------------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class InputSpec:
    """One model input: its dtype and how to make valid values for it at (batch, seq)."""

    name: str
    dtype: str  # numpy dtype name
    dims: tuple[str | int, ...]  # "batch", "seq" or a fixed size
    high: int | None = None  # integer inputs: values in [0, high) (token ids, token types)
    kind: str = "normal"  # "normal" | "ints" | "mask" (1s with a ragged tail of 0s) | "invertible"

    def shape(self, batch: int, seq: int) -> list[int]:
        return [batch if d == "batch" else seq if d == "seq" else int(d) for d in self.dims]

    def make(self, batch: int, seq: int, rng: np.random.Generator) -> np.ndarray:
        shape = self.shape(batch, seq)
        if self.kind == "ints":
            return rng.integers(0, self.high, size=shape).astype(self.dtype)
        if self.kind == "invertible":  # well-conditioned square matrices
            return (4 * np.eye(shape[-1]) + 0.5 * rng.standard_normal(shape)).astype(self.dtype)
        if self.kind == "mask":
            lengths = rng.integers(1, shape[1] + 1, size=shape[0])
            mask = np.arange(shape[1])[None, :] < lengths[:, None]
            return mask.astype(self.dtype)
        return rng.standard_normal(shape).astype(self.dtype)


@dataclass(frozen=True)
class ModelSpec:
    """What the tests know about one exported model."""

    name: str
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    rtol: float = 1e-4  # against a direct ONNX Runtime run of the same file
    atol: float = 1e-4
    sequence: bool = False  # has a dynamic sequence axis: profile/search get --shape
    files: tuple[str, ...] = ()  # files besides NAME.onnx that belong to the model (external data)
    openvino: bool = True  # OpenVINO can load it (False: the deploy must be refused with OpenVINO's reason)
    note: str = ""

    def sample(self, batch: int, seq: int = SEQ, seed: int = 0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {i.name: i.make(batch, seq, rng) for i in self.inputs}

    def shape_args(self, batch: int = 1, seq: int = SEQ) -> list[str]:
        """perf_analyzer-style `--shape NAME:DIMS` for every input with a sequence axis."""
        out: list[str] = []
        for i in self.inputs:
            if "seq" in i.dims:
                out += ["--shape", f"{i.name}:{','.join(map(str, i.shape(batch, seq)))}"]
        return out

    def shapes(self, batch: int = 1, seq: int = SEQ) -> dict[str, list[int]]:
        """The API's `shapes` field: {name: dims} for every input with a sequence axis."""
        return {i.name: i.shape(batch, seq) for i in self.inputs if "seq" in i.dims}


def _text_inputs(token_types: bool) -> tuple[InputSpec, ...]:
    ids = InputSpec("input_ids", "int64", ("batch", "seq"), high=VOCAB, kind="ints")
    mask = InputSpec("attention_mask", "int64", ("batch", "seq"), kind="mask")
    if not token_types:
        return ids, mask
    return ids, mask, InputSpec("token_type_ids", "int64", ("batch", "seq"), high=TYPE_VOCAB, kind="ints")


IMAGE_INPUT = (InputSpec("pixel_values", "float32", ("batch", 3, IMAGE, IMAGE)),)

SPECS: dict[str, ModelSpec] = {s.name: s for s in [
    ModelSpec("bert", _text_inputs(True), ("last_hidden_state",), sequence=True,
              note="transformers BertModel, 2 layers, hidden 64, vocab 1000, type_vocab 2; torch.onnx.export "
                   "(dynamo, torch's default), dynamic batch and seq"),
    ModelSpec("gpt2", _text_inputs(False), ("logits",), sequence=True, rtol=1e-3, atol=1e-3,
              note="transformers GPT2LMHeadModel, 2 layers, no KV cache (use_cache=False); torch.onnx.export "
                   "(TorchScript exporter, dynamo=False, as optimum-era exports), dynamic batch and seq"),
    ModelSpec("resnet", IMAGE_INPUT, ("logits",), rtol=1e-3, atol=1e-3,
              note="a small ResNet (basic blocks, batch norm) written with torch alone; torch.onnx.export "
                   "(dynamo), dynamic batch, 3x32x32 images"),
    ModelSpec("int8", _text_inputs(True), ("last_hidden_state",), sequence=True, rtol=0.0, atol=0.05,
              note="the bert model quantised with onnxruntime.quantization.quantize_dynamic (INT8 weights, "
                   "MatMulInteger/DynamicQuantizeLinear)"),
    ModelSpec("int8-static", IMAGE_INPUT, ("logits",), rtol=0.0, atol=0.05,
              note="the resnet quantised with onnxruntime.quantization.quantize_static (QDQ, calibrated on "
                   "random images)"),
    ModelSpec("fp16", (InputSpec("pixel_values", "float16", ("batch", 3, IMAGE, IMAGE)),), ("logits",),
              rtol=0.0, atol=0.02,
              note="the resnet converted with onnxconverter_common.float16.convert_float_to_float16 "
                   "(keep_io_types=False: FP16 inputs and outputs)"),
    ModelSpec("external-data", _text_inputs(True), ("last_hidden_state",), sequence=True,
              files=("external-data.onnx.data",),
              note="the bert model saved by onnx.save_model(save_as_external_data=True): weights in "
                   "external-data.onnx.data beside the .onnx"),
    ModelSpec("mixed-io", (InputSpec("features", "float32", ("batch", "seq", 8)),
                           InputSpec("token_ids", "int64", ("batch", "seq"), high=50, kind="ints"),
                           InputSpec("valid", "bool", ("batch", "seq"), kind="mask")),
              ("scores", "best", "count"), sequence=True,
              note="FP32 + INT64 + BOOL in, FP32 + INT64 out (scores [batch, seq, 4], argmax [batch, seq], "
                   "count of valid positions [batch]); torch.onnx.export (dynamo), dynamic batch and seq"),
    ModelSpec("ort-only", (InputSpec("matrix", "float32", ("batch", 4, 4), kind="invertible"),), ("inverse",),
              openvino=False,
              note="one ONNX Runtime contrib op (com.microsoft Inverse) that OpenVINO has no conversion for, "
                   "written with onnx.helper (no exporter emits one for torch.linalg.inv): OpenVINO must be "
                   "refused at deploy with its own reason"),
]}


# ---------------------------------------------------------------------------------------------- cache


def tool_versions(tools: tuple[str, ...] = TOOLS) -> dict[str, str]:
    out = {}
    for tool in tools:
        try:
            out[tool] = metadata.version(tool)
        except metadata.PackageNotFoundError:
            out[tool] = "missing"
    return out


def cache_dir(recipe_file: Path = Path(__file__), tools: tuple[str, ...] = TOOLS) -> Path:
    """The cache of the models of `recipe_file` (this module's by default; family_models' has its own, whose
    key also covers this file, whose helpers it uses)."""
    own = recipe_file == Path(__file__)
    env = os.environ.get("REAMER_TEST_MODELS")
    if env:
        return Path(env) if own else Path(env) / recipe_file.stem
    files = [Path(__file__)] + ([] if own else [recipe_file])
    recipe = b"".join(f.read_text().split('"""', 2)[2].encode() for f in files)  # the code, not the docstrings
    key = hashlib.sha256(recipe + json.dumps(tool_versions(tools), sort_keys=True).encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "reamer" / "test-models" / (key if own else f"{recipe_file.stem}-{key}")


class BuildUnavailable(Exception):
    """The exporters are not installed (torch, transformers: the `test` extra)."""


def missing_tools(tools: tuple[str, ...] = TOOLS) -> list[str]:
    return [t for t, v in tool_versions(tools).items() if v == "missing"]


def ensure_models(timeout_s: float = 1800) -> Path:
    """The cache directory with every model in SPECS, built in a child process if any is missing."""
    return ensure_built(cache_dir(), "tests.acceptance.exported_models", list(SPECS), TOOLS, timeout_s)


def ensure_built(directory: Path, module: str, names: list[str], tools: tuple[str, ...],
                 timeout_s: float = 1800) -> Path:
    """`directory` with a NAME.onnx for every name, built by `python -m module --out directory` if any is missing.

    A lock file keeps two test runs from building at once; the second waits and then reads."""
    if all((directory / f"{name}.onnx").exists() for name in names) and (directory / "built.json").exists():
        return directory
    missing = missing_tools(tools)
    if missing:
        raise BuildUnavailable(f"cannot build the exported models: {', '.join(missing)} not installed "
                               "(pip install -e '.[test]')")
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (directory / "built.json").exists():
            log = directory / "build.log"
            with open(log, "wb") as handle:
                done = subprocess.run([sys.executable, "-m", module, "--out",
                                       str(directory)], cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                      timeout=timeout_s)
            if done.returncode != 0:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"building the exported models failed (exit {done.returncode}); {log}:\n{tail}")
    return directory


# ---------------------------------------------------------------------------------------------- recipes
# Everything below runs only in the build process (python -m tests.acceptance.exported_models).


def _export(module, args: tuple, path: Path, input_names: list[str], output_names: list[str],
            dynamic: dict[str, dict[int, str]], dynamo: bool) -> None:
    import torch

    module.eval()
    if dynamo:
        dims = {name: torch.export.Dim(name, min=1, max=MAX_POSITIONS) for name in {n for d in dynamic.values()
                                                                                    for n in d.values()}}
        shapes = {name: {axis: dims[label] for axis, label in dynamic[name].items()} for name in input_names}
        torch.onnx.export(module, args, str(path), input_names=input_names, output_names=output_names,
                          dynamic_shapes=shapes, dynamo=True, external_data=False, verbose=False)
    else:
        torch.onnx.export(module, args, str(path), input_names=input_names, output_names=output_names,
                          dynamic_axes=dynamic, opset_version=17, dynamo=False)


def _text_args(batch: int, seq: int, token_types: bool) -> tuple:
    import torch

    spec = SPECS["bert" if token_types else "gpt2"]
    # two rows of different lengths with seq > 1, so no dimension is specialised to a constant
    return tuple(torch.from_numpy(a) for a in spec.sample(batch, seq, seed=1).values())


def build_bert(out: Path) -> None:
    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=2 * HIDDEN, max_position_embeddings=MAX_POSITIONS,
                        type_vocab_size=TYPE_VOCAB)
    torch.manual_seed(0)
    bert = BertModel(config).eval()

    class Encoder(torch.nn.Module):  # the last hidden state alone, as sentence-transformers' exports do
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state

    names = ["input_ids", "attention_mask", "token_type_ids"]
    _export(Encoder(), _text_args(2, 8, True), out / "bert.onnx", names, ["last_hidden_state"],
            {n: {0: "batch", 1: "seq"} for n in names}, dynamo=True)


def build_gpt2(out: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=MAX_POSITIONS, n_embd=HIDDEN, n_layer=2, n_head=2,
                        use_cache=False)
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(config).eval()

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt2 = gpt2

        def forward(self, input_ids, attention_mask):
            return self.gpt2(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    names = ["input_ids", "attention_mask"]
    dynamic = {n: {0: "batch", 1: "seq"} for n in names} | {"logits": {0: "batch", 1: "seq"}}
    _export(Decoder(), _text_args(2, 8, False), out / "gpt2.onnx", names, ["logits"], dynamic, dynamo=False)


def _resnet():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, inp: int, outp: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(inp, outp, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(outp)
            self.conv2 = nn.Conv2d(outp, outp, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(outp)
            self.short = (nn.Sequential(nn.Conv2d(inp, outp, 1, stride, bias=False), nn.BatchNorm2d(outp))
                          if stride != 1 or inp != outp else nn.Identity())

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + self.short(x))

    class ResNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
            self.layers = nn.Sequential(Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2))
            self.head = nn.Linear(64, CLASSES)

        def forward(self, pixel_values):
            x = self.layers(self.stem(pixel_values))
            return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    torch.manual_seed(0)
    model = ResNet()
    # batch-norm statistics that are not the identity: a few training-mode passes over random images
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, IMAGE, IMAGE))
    return model.eval()


def build_resnet(out: Path) -> None:
    import torch

    _export(_resnet(), (torch.randn(2, 3, IMAGE, IMAGE),), out / "resnet.onnx", ["pixel_values"], ["logits"],
            {"pixel_values": {0: "batch"}}, dynamo=True)


def build_int8(out: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(out / "bert.onnx"), str(out / "int8.onnx"), weight_type=QuantType.QInt8)


def build_int8_static(out: Path) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Images(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(3)
            self.batches = iter([{"pixel_values": rng.standard_normal((1, 3, IMAGE, IMAGE)).astype(np.float32)}
                                 for _ in range(8)])

        def get_next(self):
            return next(self.batches, None)

    prepared = out / "resnet-prepared.tmp.onnx"
    quant_pre_process(str(out / "resnet.onnx"), str(prepared))
    quantize_static(str(prepared), str(out / "int8-static.onnx"), Images(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    prepared.unlink()


def build_fp16(out: Path) -> None:
    import onnx
    from onnxconverter_common import float16

    model = onnx.load(str(out / "resnet.onnx"))
    onnx.save(float16.convert_float_to_float16(model, keep_io_types=False), str(out / "fp16.onnx"))


def build_external_data(out: Path) -> None:
    import onnx

    model = onnx.load(str(out / "bert.onnx"))
    onnx.save_model(model, str(out / "external-data.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="external-data.onnx.data", size_threshold=1024)


def build_mixed_io(out: Path) -> None:
    import torch
    from torch import nn

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 8)
            self.proj = nn.Linear(8, 4)

        def forward(self, features, token_ids, valid):
            scores = self.proj(features + self.embed(token_ids))
            scores = torch.where(valid.unsqueeze(-1), scores, torch.zeros_like(scores))
            return scores, scores.argmax(dim=-1), valid.to(torch.int64).sum(dim=-1)

    torch.manual_seed(0)
    args = tuple(torch.from_numpy(a) for a in SPECS["mixed-io"].sample(2, 8, seed=1).values())
    names = ["features", "token_ids", "valid"]
    _export(Tagger(), args, out / "mixed-io.onnx", names, ["scores", "best", "count"],
            {n: {0: "batch", 1: "seq"} for n in names}, dynamo=True)


def build_ort_only(out: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    matrix = helper.make_tensor_value_info("matrix", TensorProto.FLOAT, ["batch", 4, 4])
    inverse = helper.make_tensor_value_info("inverse", TensorProto.FLOAT, ["batch", 4, 4])
    graph = helper.make_graph([helper.make_node("Inverse", ["matrix"], ["inverse"], domain="com.microsoft")],
                              "ort_only", [matrix], [inverse])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(out / "ort-only.onnx"))


RECIPES: dict[str, Callable[[Path], None]] = {  # in build order: derived models after their source
    "bert": build_bert, "gpt2": build_gpt2, "resnet": build_resnet, "int8": build_int8,
    "int8-static": build_int8_static, "fp16": build_fp16, "external-data": build_external_data,
    "mixed-io": build_mixed_io, "ort-only": build_ort_only,
}


def build_all(out: Path) -> dict:
    """Build every model into `out`; built.json, written last, marks the set as whole."""
    return build_recipes(out, RECIPES, list(SPECS), TOOLS)


def build_recipes(out: Path, recipes: dict[str, Callable[[Path], None]], names: list[str],
                  tools: tuple[str, ...]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    took = {}
    for name, recipe in recipes.items():
        started = time.monotonic()
        recipe(out)
        took[name] = round(time.monotonic() - started, 2)
        print(f"built {name} in {took[name]:.1f} s", flush=True)
    for name in names:
        if not (out / f"{name}.onnx").exists():
            raise RuntimeError(f"recipe for {name} made no {name}.onnx")
    record = {"tools": tool_versions(tools), "seconds": took, "models": sorted(names)}
    (out / "built.json").write_text(json.dumps(record, indent=2))
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the acceptance suite's exported models.")
    parser.add_argument("--out", default=None, help="directory (default: the test cache, see cache_dir())")
    args = parser.parse_args(argv)
    build_all(Path(args.out) if args.out else cache_dir())
    return 0


if __name__ == "__main__":
    sys.exit(main())
