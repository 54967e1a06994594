"""A BERT-shaped ONNX graph for serving tests, written with the onnx helper API: three INT64 inputs
`input_ids`, `attention_mask`, `token_type_ids` [batch, seq] and one FP32 output `last_hidden_state`
[batch, seq, hidden], with the index tables exporters produce (a token-type table of TWO rows, so any
token_type_ids value but 0 and 1 is out of range, as in every exported BERT)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def build_bertlike(path, hidden: int = 384, vocab: int = 100) -> str:
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((vocab, hidden)).astype(np.float32), "word_embeddings"),
               numpy_helper.from_array(rng.standard_normal((2, hidden)).astype(np.float32), "token_type_embeddings"),
               numpy_helper.from_array(np.array([2], np.int64), "last_axis")]
    nodes = [helper.make_node("Gather", ["word_embeddings", "input_ids"], ["words"], name="word_gather"),
             helper.make_node("Gather", ["token_type_embeddings", "token_type_ids"], ["types"], name="type_gather"),
             helper.make_node("Add", ["words", "types"], ["summed"], name="add"),
             helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Unsqueeze", ["mask_f", "last_axis"], ["mask_u"], name="unsqueeze"),
             helper.make_node("Mul", ["summed", "mask_u"], ["last_hidden_state"], name="mul")]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in INPUTS]
    output = helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "seq", hidden])
    model = helper.make_model(helper.make_graph(nodes, "bertlike", inputs, [output], weights),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))
    return str(path)


def bert_feeds(rows: int, seq: int, type_id: int = 0, word_id: int = 1) -> dict[str, np.ndarray]:
    ids = np.full((rows, seq), word_id, np.int64)
    return {"input_ids": ids, "attention_mask": np.ones((rows, seq), np.int64),
            "token_type_ids": np.full((rows, seq), type_id, np.int64)}


def export_bert(path, output: str = "last_hidden_state") -> str:
    """A small BertModel (transformers, random weights, type_vocab_size 2) exported by torch.onnx with the
    same inputs and output; the test skips where torch or transformers are not installed."""
    import pytest

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=384, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=256, max_position_embeddings=128, type_vocab_size=2)
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state

    ids = torch.ones(2, 16, dtype=torch.long)
    names = list(INPUTS)
    torch.onnx.export(Encoder(), (ids, ids, ids * 0), str(path), input_names=names, output_names=[output],
                      dynamic_axes={n: {0: "batch", 1: "seq"} for n in names + [output]}, opset_version=17,
                      dynamo=False)
    return str(path)
