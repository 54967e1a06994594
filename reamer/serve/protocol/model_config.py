"""A served model's configuration in Triton's shape: REST `GET /v2/models/NAME/config` (JSON, as Triton writes
its model_config.proto) and gRPC `ModelConfig` carry the same facts.

`max_batch_size` is the model's batchability, not a layout's tuning figure: 0 when the model is not
batchable (each request runs alone, with whatever first dimension the client sends; dims then include
it), else the most rows one request can carry — as many as fit the job's max_request_mb in binary form
(max_request_rows); requests larger than an instance's max batch are split into parts and answered whole,
so a client never needs to know the layout.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import math

from reamer.plan.online_sim import MAX_WAIT_SHARE_OF_SLO

if TYPE_CHECKING:
    from reamer.serve.runtime.batcher import DynamicBatcher
    from reamer.serve.protocol.tensors import TensorInfo


def triton_data_type(datatype: str) -> str:
    """The model_config.proto DataType name of a v2 datatype ("FP32" -> "TYPE_FP32", BYTES -> TYPE_STRING)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def backend_of(platform: str) -> str:
    return "onnxruntime" if platform == "onnxruntime_onnx" else "openvino"


INT32_MAX = 2**31 - 1  # max_batch_size is an int32


def max_request_rows(inputs: list[TensorInfo], max_request_bytes: int) -> int:
    """The most rows a request can carry within `max_request_bytes`: one row's inputs at their smallest (dynamic
    dims of 1, binary tensors, a BYTES element of one byte)."""
    row_bytes = sum(math.prod(max(d, 1) for d in t.shape[1:]) * (1 if t.datatype == "BYTES" else t.numpy_dtype.itemsize)
                    for t in inputs)
    return max(1, min(INT32_MAX, max_request_bytes // max(row_bytes, 1)))


def _dims(t: TensorInfo, batchable: bool) -> list[int]:
    return list(t.shape[1:] if batchable else t.shape)


def model_config(name: str, platform: str, batcher: DynamicBatcher, max_request_bytes: int) -> dict[str, Any] | None:
    """The configuration as Triton's JSON (None while no instance has loaded the model)."""
    sig = batcher.signature()
    verdict = batcher.batchability()
    if sig is None or verdict is None:
        return None
    ins, outs = sig
    batchable = verdict.batchable
    doc: dict[str, Any] = {
        "name": name, "platform": platform, "backend": backend_of(platform),
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": max_request_rows(ins, max_request_bytes) if batchable else 0,
        "input": [{"name": t.name, "data_type": triton_data_type(t.datatype), "format": "FORMAT_NONE",
                   "dims": _dims(t, batchable), "is_shape_tensor": False, "allow_ragged_batch": False,
                   "optional": False} for t in ins],
        "output": [{"name": t.name, "data_type": triton_data_type(t.datatype), "dims": _dims(t, batchable),
                    "label_filename": "", "is_shape_tensor": False} for t in outs],
        "batch_input": [], "batch_output": [],
        "instance_group": [{"name": name, "kind": "KIND_CPU", "count": len(batcher.workers), "gpus": [],
                            "secondary_devices": [], "profile": [], "passive": False, "host_policy": ""}],
        "default_model_filename": "model.onnx" if platform == "onnxruntime_onnx" else "model.xml",
        "cc_model_filenames": {}, "metric_tags": {}, "parameters": {
            # reamer's own facts, as Triton carries backend settings: why (not) batched, and the layout's batch
            "batchable": {"string_value": str(batchable).lower()},
            "batchable_reason": {"string_value": verdict.reason},
            "instance_max_batch": {"string_value": str(batcher.max_batch())},
        },
        "model_warmup": [],
    }
    if batchable:
        if batcher.slo_ms is not None:
            wait_us = int(batcher.slo_ms * MAX_WAIT_SHARE_OF_SLO * 1000)
        else:
            wait_us = int(batcher.default_max_wait_ms * 1000)
        doc["dynamic_batching"] = {"preferred_batch_size": [batcher.max_batch()],
                                   "max_queue_delay_microseconds": wait_us, "preserve_ordering": False,
                                   "priority_levels": 0, "default_priority_level": 0}
    return doc


_KIND = {"KIND_AUTO": 0, "KIND_GPU": 1, "KIND_CPU": 2, "KIND_MODEL": 3}


def fill_grpc_config(config: Any, doc: dict[str, Any], data_types: dict[str, int]) -> None:
    """Fill a gRPC `inference.ModelConfig` from model_config()'s document."""
    config.name, config.platform, config.backend = doc["name"], doc["platform"], doc["backend"]
    config.max_batch_size = doc["max_batch_size"]
    for key, target in (("input", config.input), ("output", config.output)):
        for t in doc[key]:
            target.add(name=t["name"], data_type=data_types.get(t["data_type"], 0), dims=t["dims"])
    for group in doc["instance_group"]:
        config.instance_group.add(name=group["name"], kind=_KIND[group["kind"]], count=group["count"])
    batching = doc.get("dynamic_batching")
    if batching is not None:
        config.dynamic_batching.preferred_batch_size.extend(batching["preferred_batch_size"])
        config.dynamic_batching.max_queue_delay_microseconds = batching["max_queue_delay_microseconds"]
    for key, value in doc["parameters"].items():
        config.parameters[key].string_value = value["string_value"]
