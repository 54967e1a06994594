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
