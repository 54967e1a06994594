"""Small ONNX models whose outputs are, or are not, per row of the batch (onnx.helper, as models.py builds).

- "rowwise": y = x * 2 + 1 and a per-row sum, every first dim "batch": batchable.
- "reduction": the sum over the whole request (ReduceSum over all axes: a rank-0 output) beside the rows.
- "nonzero": NonZero(x): [2, n] indices, n depends on the data.
- "compress": the rows whose sum is positive (Compress along the batch axis), first dim "kept" (by the data).
- "crossrow": y = x - mean of x over the batch axis, declared [batch, 4] (claims a batch dim, but a row's
  answer depends on the other rows: only the startup probe can tell).
- "scalar_in": y = x * s, with s a rank-0 input.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from reamer.serve.models import IR_VERSION

FEATURES = 4
MODELS = ("rowwise", "reduction", "nonzero", "compress", "crossrow", "scalar_in")


def _x() -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", FEATURES])


def _graph(kind: str) -> onnx.GraphProto:
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    if kind == "rowwise":
        nodes = [helper.make_node("Mul", ["x", "two"], ["x2"]), helper.make_node("Add", ["x2", "one"], ["y"]),
                 helper.make_node("ReduceSum", ["x", "axis1"], ["row_sum"], keepdims=0)]
        axis1 = helper.make_tensor("axis1", TensorProto.INT64, [1], [1])
        return helper.make_graph(nodes, kind, [_x()],
                                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", FEATURES]),
                                  helper.make_tensor_value_info("row_sum", TensorProto.FLOAT, ["batch"])],
                                 [two, one, axis1])
    if kind == "reduction":
        nodes = [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
                 helper.make_node("Mul", ["x", "two"], ["y"])]
        return helper.make_graph(nodes, kind, [_x()],
                                 [helper.make_tensor_value_info("total", TensorProto.FLOAT, []),
                                  helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", FEATURES])], [two])
    if kind == "nonzero":
        nodes = [helper.make_node("NonZero", ["x"], ["idx"])]
        return helper.make_graph(nodes, kind, [_x()],
                                 [helper.make_tensor_value_info("idx", TensorProto.INT64, [2, "n"])])
    if kind == "compress":
        axis1 = helper.make_tensor("axis1", TensorProto.INT64, [1], [1])
        zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
        nodes = [helper.make_node("ReduceSum", ["x", "axis1"], ["sums"], keepdims=0),
                 helper.make_node("Greater", ["sums", "zero"], ["keep"]),
                 helper.make_node("Compress", ["x", "keep"], ["kept_rows"], axis=0)]
        return helper.make_graph(nodes, kind, [_x()],
                                 [helper.make_tensor_value_info("kept_rows", TensorProto.FLOAT, ["kept", FEATURES])],
                                 [axis1, zero])
    if kind == "crossrow":
        nodes = [helper.make_node("ReduceMean", ["x"], ["mean"], axes=[0], keepdims=1),
                 helper.make_node("Sub", ["x", "mean"], ["y"])]
        return helper.make_graph(nodes, kind, [_x()],
                                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", FEATURES])])
    if kind == "scalar_in":
        nodes = [helper.make_node("Mul", ["x", "s"], ["y"])]
        return helper.make_graph(nodes, kind, [_x(), helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
                                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", FEATURES])])
    raise ValueError(kind)


def build(kind: str, directory: Path) -> str:
    model = helper.make_model(_graph(kind), opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    path = Path(directory) / f"{kind}.onnx"
    onnx.save(model, path)
    return str(path)


def client_inputs(kind: str, client: int, request: int, rows: int = 1) -> dict[str, np.ndarray]:
    """Distinct inputs for one client's request (NonZero sees a different zero pattern per client)."""
    rng = np.random.default_rng(1000 * client + request)
    x = rng.standard_normal((rows, FEATURES)).astype(np.float32)
    if kind == "nonzero":
        x = np.where(rng.random((rows, FEATURES)) < 0.5, 0.0, x).astype(np.float32)
    feeds = {"x": x}
    if kind == "scalar_in":
        feeds["s"] = np.array(client + 0.5 * request, dtype=np.float32)
    return feeds
