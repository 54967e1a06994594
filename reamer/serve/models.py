"""Built-in model families, written as ONNX graphs with random weights (no PyTorch needed).

Every model has a dynamic batch axis named "batch". Parameter counts follow the usual definition
(trainable weights: conv/linear weights and biases, norm scale and shift; BatchNorm running
statistics are buffers, not parameters), so resnet50 and mobilenetv2 match torchvision exactly.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from reamer.errors import ErrorKind
from reamer.host.errors import ReamerError
from reamer.serve.protocol.tensors import TensorInfo, onnx_to_v2

# torchvision's names where torchvision has the model (what users type), Hugging Face's stem for BERT
MODEL_FAMILIES: tuple[str, ...] = ("resnet50", "mobilenet_v2", "bert-base", "deepspeech2", "tiny", "multi-io")
# other spellings users type, matched after lower-casing and dropping "-" and "_" (mobilenetv2, MobileNet-V2, ...)
FAMILY_ALIASES: dict[str, str] = {"bert": "bert-base", "bertbaseuncased": "bert-base", "bertbasecased": "bert-base",
                                  "resnet": "resnet50", "mobilenet": "mobilenet_v2", "multiinputoutput": "multi-io"}

OPSET = 17
IR_VERSION = 8  # the lowest IR that carries opset 17; older runtimes read it too


class UnknownModelFamily(ReamerError):
    """A model family name that reamer cannot build."""

    kind = ErrorKind.BAD_INPUT


@dataclass
class ModelInfo:
    family: str
    path: str
    params: int
    inputs: list[TensorInfo] = field(default_factory=list)
    outputs: list[TensorInfo] = field(default_factory=list)


class _GraphBuilder:
    """Collects nodes and initializers; counts trainable parameters."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.params = 0
        self._counter = 0

    def fresh(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}_{self._counter}"

    def tensor(self, prefix: str, array: np.ndarray, trainable: bool = True) -> str:
        name = self.fresh(prefix)
        self.initializers.append(numpy_helper.from_array(np.asarray(array, order="C"), name))
        if trainable:
            self.params += int(array.size)
        return name

    def const(self, prefix: str, array: np.ndarray) -> str:
        return self.tensor(prefix, array, trainable=False)

    def normal(self, prefix: str, shape: tuple[int, ...], std: float) -> str:
        return self.tensor(prefix, self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    def filled(self, prefix: str, shape: tuple[int, ...], value: float, trainable: bool = True) -> str:
        return self.tensor(prefix, np.full(shape, value, dtype=np.float32), trainable)

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs) -> str | list[str]:
        outputs = [self.fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=self.fresh(op_type), **attrs))
        return outputs[0] if n_out == 1 else outputs

    def rename_output(self, produced: str, final: str) -> None:
        """Give the value `produced` (output of the last node that made it) a public name."""
        for node in reversed(self.nodes):
            if produced in node.output:
                node.output[list(node.output).index(produced)] = final
                return
        raise AssertionError(produced)

    # layers ---------------------------------------------------------------------------------
    def conv(self, x: str, cin: int, cout: int, k: int | tuple[int, int], stride: int | tuple[int, int] = 1,
             pad: int | tuple[int, int] = 0, group: int = 1, bias: bool = False) -> str:
        kh, kw = (k, k) if isinstance(k, int) else k
        sh, sw = (stride, stride) if isinstance(stride, int) else stride
        ph, pw = (pad, pad) if isinstance(pad, int) else pad
        fan_in = (cin // group) * kh * kw
        w = self.normal("conv_w", (cout, cin // group, kh, kw), math.sqrt(2.0 / fan_in))
        ins = [x, w] + ([self.filled("conv_b", (cout,), 0.0)] if bias else [])
        return self.op("Conv", ins, kernel_shape=[kh, kw], strides=[sh, sw], pads=[ph, pw, ph, pw], group=group)

    def batchnorm(self, x: str, c: int, gamma: float = 1.0) -> str:
        scale = self.filled("bn_scale", (c,), gamma)
        shift = self.filled("bn_shift", (c,), 0.0)
        mean = self.filled("bn_mean", (c,), 0.0, trainable=False)
        var = self.filled("bn_var", (c,), 1.0, trainable=False)
        return self.op("BatchNormalization", [x, scale, shift, mean, var], epsilon=1e-5)

    def clip(self, x: str, lo: float, hi: float) -> str:
        return self.op("Clip", [x, self.const("clip_lo", np.array(lo, np.float32)),
                                self.const("clip_hi", np.array(hi, np.float32))])

    def linear(self, x: str, fin: int, fout: int, std: float | None = None) -> str:
        """x @ W + b on the last axis (MatMul keeps any leading axes dynamic)."""
        w = self.normal("fc_w", (fin, fout), std if std is not None else 1.0 / math.sqrt(fin))
        b = self.filled("fc_b", (fout,), 0.0)
        return self.op("Add", [self.op("MatMul", [x, w]), b])

    def layernorm(self, x: str, c: int) -> str:
        return self.op("LayerNormalization", [x, self.filled("ln_scale", (c,), 1.0), self.filled("ln_shift", (c,), 0.0)],
                       axis=-1, epsilon=1e-12)

    def ints(self, prefix: str, values: list[int]) -> str:
        return self.const(prefix, np.array(values, dtype=np.int64))

    def scalar(self, prefix: str, value: float) -> str:
        return self.const(prefix, np.array(value, dtype=np.float32))


def _value_info(name: str, elem_type: int, shape: list[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def _tensor_info(vi: onnx.ValueInfoProto) -> TensorInfo:
    t = vi.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
    return TensorInfo(vi.name, onnx_to_v2(t.elem_type), dims)


# --- families ------------------------------------------------------------------------------------

def _resnet50(b: _GraphBuilder, image_size: int = 224, num_classes: int = 1000) -> tuple[list, list]:
    """ResNet-50 v1.5 (stride on the 3x3 conv of each bottleneck), as torchvision.models.resnet50."""
    x = "input"
    y = b.op("Relu", [b.batchnorm(b.conv(x, 3, 64, 7, 2, 3), 64)])
    y = b.op("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            s = stride if i == 0 else 1
            out = planes * 4
            h = b.op("Relu", [b.batchnorm(b.conv(y, cin, planes, 1), planes)])
            h = b.op("Relu", [b.batchnorm(b.conv(h, planes, planes, 3, s, 1), planes)])
            # a small last-BN scale keeps random-weight activations in range through 16 residual adds
            h = b.batchnorm(b.conv(h, planes, out, 1), out, gamma=0.2)
            shortcut = b.batchnorm(b.conv(y, cin, out, 1, s), out) if (s != 1 or cin != out) else y
            y = b.op("Relu", [b.op("Add", [h, shortcut])])
            cin = out
    y = b.op("Flatten", [b.op("GlobalAveragePool", [y])], axis=1)
    logits = b.linear(y, 2048, num_classes)
    b.rename_output(logits, "logits")
    inputs = [_value_info("input", TensorProto.FLOAT, ["batch", 3, image_size, image_size])]
    outputs = [_value_info("logits", TensorProto.FLOAT, ["batch", num_classes])]
    return inputs, outputs


def _make_divisible(v: float, divisor: int = 8) -> int:
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def _mobilenetv2(b: _GraphBuilder, image_size: int = 224, num_classes: int = 1000) -> tuple[list, list]:
    """MobileNetV2 (width 1.0), as torchvision.models.mobilenet_v2."""
    def conv_bn_relu6(x: str, cin: int, cout: int, k: int, stride: int, group: int = 1) -> str:
        return b.clip(b.batchnorm(b.conv(x, cin, cout, k, stride, (k - 1) // 2, group), cout), 0.0, 6.0)

    y = conv_bn_relu6("input", 3, 32, 3, 2)
    cin = 32
    for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)):
        cout = _make_divisible(c)
        for i in range(n):
            stride = s if i == 0 else 1
            hidden = int(round(cin * t))
            h = conv_bn_relu6(y, cin, hidden, 1, 1) if t != 1 else y
            h = conv_bn_relu6(h, hidden, hidden, 3, stride, group=hidden)
            h = b.batchnorm(b.conv(h, hidden, cout, 1), cout, gamma=0.5)
            y = b.op("Add", [y, h]) if (stride == 1 and cin == cout) else h
            cin = cout
    y = conv_bn_relu6(y, cin, 1280, 1, 1)
    y = b.op("Flatten", [b.op("GlobalAveragePool", [y])], axis=1)
    logits = b.linear(y, 1280, num_classes)
    b.rename_output(logits, "logits")
    inputs = [_value_info("input", TensorProto.FLOAT, ["batch", 3, image_size, image_size])]
    outputs = [_value_info("logits", TensorProto.FLOAT, ["batch", num_classes])]
    return inputs, outputs


def _bert(b: _GraphBuilder, layers: int = 12, hidden: int = 768, heads: int = 12, intermediate: int = 3072,
          seq_len: int = 128, vocab_size: int = 30522, max_positions: int = 512) -> tuple[list, list]:
    """BERT encoder (bert-base-uncased shape by default) with pooler; token type ids are all 0."""
    if hidden % heads:
        raise ReamerError(f"bert-base: hidden size {hidden} is not divisible by {heads} heads",
                          "choose hidden and heads so that hidden % heads == 0")
    if seq_len > max_positions:
        raise ReamerError(f"bert-base: seq_len {seq_len} exceeds {max_positions} positions",
                          f"use seq_len <= {max_positions}")
    head_dim = hidden // heads
    std = 0.02
    words = b.op("Gather", [b.normal("word_emb", (vocab_size, hidden), std), "input_ids"], axis=0)
    positions = b.op("Gather", [b.normal("pos_emb", (max_positions, hidden), std), b.ints("positions", list(range(seq_len)))], axis=0)
    types = b.op("Gather", [b.normal("type_emb", (2, hidden), std), b.ints("token_types", [0] * seq_len)], axis=0)
    x = b.layernorm(b.op("Add", [b.op("Add", [words, positions]), types]), hidden)

    mask = b.op("Cast", ["attention_mask"], to=TensorProto.FLOAT)
    mask = b.op("Mul", [b.op("Sub", [b.scalar("one", 1.0), mask]), b.scalar("neg", -10000.0)])
    mask = b.op("Unsqueeze", [mask, b.ints("axes", [1, 2])])  # [batch, 1, 1, seq]
    split_heads = b.ints("split_shape", [0, 0, heads, head_dim])
    merge_heads = b.ints("merge_shape", [0, 0, hidden])
    inv_sqrt_d = b.scalar("inv_sqrt_d", 1.0 / math.sqrt(head_dim))
    for _ in range(layers):
        q = b.op("Transpose", [b.op("Reshape", [b.linear(x, hidden, hidden, std), split_heads])], perm=[0, 2, 1, 3])
        k = b.op("Transpose", [b.op("Reshape", [b.linear(x, hidden, hidden, std), split_heads])], perm=[0, 2, 3, 1])
        v = b.op("Transpose", [b.op("Reshape", [b.linear(x, hidden, hidden, std), split_heads])], perm=[0, 2, 1, 3])
        scores = b.op("Add", [b.op("Mul", [b.op("MatMul", [q, k]), inv_sqrt_d]), mask])
        ctx = b.op("MatMul", [b.op("Softmax", [scores], axis=-1), v])
        ctx = b.op("Reshape", [b.op("Transpose", [ctx], perm=[0, 2, 1, 3]), merge_heads])
        x = b.layernorm(b.op("Add", [x, b.linear(ctx, hidden, hidden, std)]), hidden)
        h = b.linear(x, hidden, intermediate, std)
        # exact GELU: 0.5 * h * (1 + erf(h / sqrt(2)))
        erf = b.op("Erf", [b.op("Mul", [h, b.scalar("inv_sqrt2", 1.0 / math.sqrt(2.0))])])
        h = b.op("Mul", [b.op("Mul", [h, b.scalar("half", 0.5)]), b.op("Add", [erf, b.scalar("one", 1.0)])])
        x = b.layernorm(b.op("Add", [x, b.linear(h, intermediate, hidden, std)]), hidden)
    b.nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"], name=b.fresh("Identity")))
    first = b.op("Gather", [x, b.const("cls_index", np.array(0, dtype=np.int64))], axis=1)
    pooled = b.op("Tanh", [b.linear(first, hidden, hidden, std)])
    b.rename_output(pooled, "pooler_output")
    inputs = [_value_info("input_ids", TensorProto.INT64, ["batch", seq_len]),
              _value_info("attention_mask", TensorProto.INT64, ["batch", seq_len])]
    outputs = [_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", seq_len, hidden]),
               _value_info("pooler_output", TensorProto.FLOAT, ["batch", hidden])]
    return inputs, outputs


def _deepspeech2(b: _GraphBuilder, frames: int = 200, features: int = 161, rnn_layers: int = 3, hidden: int = 800,
                 num_classes: int = 29) -> tuple[list, list]:
    """DeepSpeech2: two 2-D convs (BN, clipped ReLU 0..20), bidirectional GRUs (directions summed), FC, log-softmax."""
    x = b.op("Unsqueeze", ["spectrogram", b.ints("axes", [1])])  # [batch, 1, time, freq]
    x = b.clip(b.batchnorm(b.conv(x, 1, 32, (11, 41), (2, 2), (5, 20)), 32), 0.0, 20.0)
    x = b.clip(b.batchnorm(b.conv(x, 32, 32, (11, 21), (1, 2), (5, 10)), 32), 0.0, 20.0)
    freq = (features + 2 * 20 - 41) // 2 + 1
    freq = (freq + 2 * 10 - 21) // 2 + 1
    steps = (frames + 2 * 5 - 11) // 2 + 1
    x = b.op("Transpose", [x], perm=[2, 0, 1, 3])  # [time', batch, 32, freq']
    x = b.op("Reshape", [x, b.ints("seq_shape", [0, 0, 32 * freq])])
    fin = 32 * freq
    for _ in range(rnn_layers):
        std = 1.0 / math.sqrt(hidden)
        w = b.normal("gru_w", (2, 3 * hidden, fin), std)
        r = b.normal("gru_r", (2, 3 * hidden, hidden), std)
        bias = b.filled("gru_b", (2, 6 * hidden), 0.0)
        y, _ = b.op("GRU", [x, w, r, bias], n_out=2, hidden_size=hidden, direction="bidirectional", linear_before_reset=1)
        x = b.op("ReduceSum", [y, b.ints("dir_axis", [1])], keepdims=0)  # [time', batch, hidden]
        fin = hidden
    x = b.op("Transpose", [x], perm=[1, 0, 2])  # [batch, time', hidden]
    out = b.op("LogSoftmax", [b.linear(x, hidden, num_classes)], axis=-1)
    b.rename_output(out, "log_probs")
    inputs = [_value_info("spectrogram", TensorProto.FLOAT, ["batch", frames, features])]
    outputs = [_value_info("log_probs", TensorProto.FLOAT, ["batch", steps, num_classes])]
    return inputs, outputs


def _tiny(b: _GraphBuilder, features: int = 16, hidden: int = 32, classes: int = 4) -> tuple[list, list]:
    """A two-layer MLP: fast enough for tests."""
    h = b.op("Relu", [b.linear("input", features, hidden)])
    out = b.linear(h, hidden, classes)
    b.rename_output(out, "output")
    return ([_value_info("input", TensorProto.FLOAT, ["batch", features])],
            [_value_info("output", TensorProto.FLOAT, ["batch", classes])])


def _multi_io(b: _GraphBuilder, features: int = 8, tokens: int = 4, vocab: int = 10, classes: int = 4) -> tuple[list, list]:
    """Two inputs (FP32 features, INT64 token ids) and two outputs (FP32 scores, INT64 id sums)."""
    emb = b.op("ReduceMean", [b.op("Gather", [b.normal("emb", (vocab, features), 0.5), "ids"], axis=0)],
               axes=[1], keepdims=0)  # ReduceMean takes axes as attribute until opset 18
    scores = b.linear(b.op("Add", ["x", emb]), features, classes)
    b.rename_output(scores, "scores")
    b.nodes.append(helper.make_node("ReduceSum", ["ids", b.ints("sum_axis", [1])], ["id_sum"], keepdims=1,
                                    name=b.fresh("ReduceSum")))
    inputs = [_value_info("x", TensorProto.FLOAT, ["batch", features]),
              _value_info("ids", TensorProto.INT64, ["batch", tokens])]
    outputs = [_value_info("scores", TensorProto.FLOAT, ["batch", classes]),
               _value_info("id_sum", TensorProto.INT64, ["batch", 1])]
    return inputs, outputs


_BUILDERS: dict[str, Callable[..., tuple[list, list]]] = {
    "resnet50": _resnet50,
    "mobilenet_v2": _mobilenetv2,
    "bert-base": _bert,
    "deepspeech2": _deepspeech2,
    "tiny": _tiny,
    "multi-io": _multi_io,
}


def _squash(name: str) -> str:
    return name.strip().lower().replace("-", "").replace("_", "")


def canonical_family(name: str) -> str | None:
    """The family `name` means (torchvision's `mobilenet_v2`, `mobilenetv2`, `MobileNet-V2`, `bert-base-uncased`,
    ...), or None."""
    key = _squash(name)
    for family in MODEL_FAMILIES:
        if _squash(family) == key:
            return family
    return FAMILY_ALIASES.get(key)


# Hugging Face's config names for the BERT options (what users copy from a config.json) -> ours
OPTION_ALIASES: dict[str, dict[str, str]] = {
    "bert-base": {"num_hidden_layers": "layers", "hidden_size": "hidden", "num_attention_heads": "heads",
                  "intermediate_size": "intermediate", "max_position_embeddings": "max_positions",
                  "sequence_length": "seq_len", "seq_length": "seq_len"},
    "resnet50": {"num_labels": "num_classes", "input_size": "image_size"},
    "mobilenet_v2": {"num_labels": "num_classes", "input_size": "image_size"},
}


def canonical_options(family: str, options: dict) -> dict:
    """`options` with the aliases of OPTION_ALIASES replaced by our names (`-` and `_` alike)."""
    aliases = OPTION_ALIASES.get(canonical_family(family) or family, {})
    out = {}
    for key, value in options.items():
        key = key.replace("-", "_")
        out[aliases.get(key, key)] = value
    return out


def build_model(family: str, out_path: str | os.PathLike, seed: int = 0, **options) -> ModelInfo:
    """Write `family` as an ONNX file at `out_path` (random weights from `seed`) and describe it.

    `family` may be any spelling canonical_family() knows. Options per family: resnet50/mobilenet_v2: image_size, num_classes; bert-base: layers, hidden, heads,
    intermediate, seq_len, vocab_size; deepspeech2: frames, features, rnn_layers, hidden, num_classes;
    tiny: features, hidden, classes; multi-io: features, tokens, vocab, classes.
    """
    family = canonical_family(family) or family
    options = canonical_options(family, options)
    builder_fn = _BUILDERS.get(family)
    if builder_fn is None:
        raise UnknownModelFamily(f"unknown model family {family!r}",
                                 f"choose one of: {', '.join(MODEL_FAMILIES)}")
    b = _GraphBuilder(seed)
    try:
        inputs, outputs = builder_fn(b, **options)
    except TypeError as exc:
        raise ReamerError(f"bad option for model family {family!r}: {exc}",
                          f"see reamer.serve.models.build_model for the options of {family}") from None
    graph = helper.make_graph(b.nodes, family.replace("-", "_"), inputs, outputs, initializer=b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="reamer", ir_version=IR_VERSION)
    model.doc_string = f"reamer built-in {family}, random weights (seed {seed})"
    onnx.checker.check_model(model)
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        onnx.save_model(model, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return ModelInfo(family=family, path=str(path), params=b.params,
                     inputs=[_tensor_info(v) for v in inputs], outputs=[_tensor_info(v) for v in outputs])
