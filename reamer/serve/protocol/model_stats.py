"""A job's model statistics in Triton's shape (statistics extension: GET /v2/models/NAME/stats, gRPC
ModelStatistics), which tritonclient's get_inference_statistics, dashboards and perf_analyzer read.

As Triton counts them: `success`, `queue`, `compute_input`, `compute_infer` and `compute_output` count
successful requests and add up their time (queue: waiting for an instance; compute_input: assembling the
batch and handing it to the instance's process; compute_infer: the model's run; compute_output: the way
back and splitting the outputs); `fail` counts failed requests (refused, shed or failed in the model)
and their time; `inference_count` adds the rows of successful requests (1 per request for a model that is
not batchable), `execution_count` the model runs; `batch_stats` the runs per batch size. Durations in ns.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

NS = 1_000_000_000


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += max(int(seconds * NS), 0)

    def to_doc(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class _BatchRuns:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


STAGES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")


class ModelStatistics:
    """Counters of one model; safe to update from the event loop and read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self.stages = {name: Duration() for name in STAGES}
        self.batches: dict[int, _BatchRuns] = {}

    def record_success(self, rows: int, total_s: float, queue_s: float, input_s: float, infer_s: float,
                       output_s: float) -> None:
        with self._lock:
            self.inference_count += rows
            self.last_inference_ms = int(time.time() * 1000)
            for name, seconds in (("success", total_s), ("queue", queue_s), ("compute_input", input_s),
                                  ("compute_infer", infer_s), ("compute_output", output_s)):
                self.stages[name].add(seconds)

    def record_failure(self, total_s: float) -> None:
        with self._lock:
            self.last_inference_ms = int(time.time() * 1000)
            self.stages["fail"].add(total_s)

    def record_execution(self, batch_size: int, input_s: float, infer_s: float, output_s: float) -> None:
        with self._lock:
            self.execution_count += 1
            runs = self.batches.setdefault(batch_size, _BatchRuns())
            runs.compute_input.add(input_s)
            runs.compute_infer.add(infer_s)
            runs.compute_output.add(output_s)

    def to_doc(self, name: str, version: str = "1") -> dict[str, Any]:
        """One entry of Triton's `model_stats` list (REST JSON; uint64 as numbers, as Triton writes them)."""
        with self._lock:
            return {
                "name": name, "version": version, "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count, "execution_count": self.execution_count,
                "inference_stats": {stage: d.to_doc() for stage, d in self.stages.items()},
                "batch_stats": [{"batch_size": size, "compute_input": runs.compute_input.to_doc(),
                                 "compute_infer": runs.compute_infer.to_doc(),
                                 "compute_output": runs.compute_output.to_doc()}
                                for size, runs in sorted(self.batches.items())],
                "memory_usage": [],
            }

    def fill(self, message: Any, name: str, version: str = "1") -> None:
        """Fill a gRPC `inference.ModelStatistics` message."""
        doc = self.to_doc(name, version)
        message.name, message.version = name, version
        message.last_inference = doc["last_inference"]
        message.inference_count, message.execution_count = doc["inference_count"], doc["execution_count"]
        for stage, d in doc["inference_stats"].items():
            target = getattr(message.inference_stats, stage)
            target.count, target.ns = d["count"], d["ns"]
        for entry in doc["batch_stats"]:
            batch = message.batch_stats.add(batch_size=entry["batch_size"])
            for stage in ("compute_input", "compute_infer", "compute_output"):
                target = getattr(batch, stage)
                target.count, target.ns = entry[stage]["count"], entry[stage]["ns"]
