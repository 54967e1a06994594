"""Whether a model may be batched: requests merged into one run and its outputs split back by rows.

Decided as Triton decides it (a model supports batching when every input and every output has a leading
dimension that is the batch: dynamic, rank >= 1, and — where the ONNX file names its dims — the same
symbolic name everywhere), then confirmed on representative inputs (the job's sample inputs): two
different rows run in one batch must give, row by row, what each row gives alone. A model that fails
either test is served one request per run: a per-request reduction (a rank-0 output), a data-dependent
first dimension (NonZero, Compress) or an operation across rows (a mean over the batch) would otherwise
hand one client's rows to another client's answer.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import numpy as np

    from reamer.serve.protocol.tensors import TensorInfo

PROBE_TIMEOUT_S = 300.0
# Rows computed in one batch may differ from rows computed alone by the kernels' summation order: these
# bound that for float outputs (relative to the output's magnitude); integer, bool and string outputs must
# be equal.
RTOL = {"FP16": 1e-2, "BF16": 2e-2}
DEFAULT_RTOL = 1e-3


@dataclass(frozen=True)
class Batchability:
    batchable: bool
    reason: str  # why (not): shown in `infer show` and the job's events

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> "Batchability":
        return cls(bool(doc["batchable"]), str(doc.get("reason", "")))


def onnx_batch_dim_names(model_path: str | os.PathLike) -> dict[str, str | None]:
    """The symbolic name (dim_param) of the first dim of every input and output of an ONNX file; {} for
    other files or a file that cannot be read (the names are then unknown, not different)."""
    if not str(model_path).endswith(".onnx"):
        return {}
    try:
        import onnx

        graph = onnx.load(os.fspath(model_path), load_external_data=False).graph
    except Exception:  # noqa: BLE001 - names are a refinement; the runtime's shapes still decide
        return {}
    names: dict[str, str | None] = {}
    for vi in (*graph.input, *graph.output):
        dims = vi.type.tensor_type.shape.dim
        names[vi.name] = (dims[0].dim_param or None) if len(dims) else None
    return names


def declared_batchability(inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo],
                          dim_names: dict[str, str | None] | None = None) -> Batchability:
    """Triton's rule on the model's declared shapes (-1: dynamic) and first-dim names."""
    dim_names = dim_names or {}
    seen: dict[str, str] = {}  # symbolic first-dim name -> the tensor that has it
    for kind, tensors in (("input", inputs), ("output", outputs)):
        for t in tensors:
            if not t.shape:
                return Batchability(False, f"{kind} {t.name!r} is a scalar (rank 0): it has no batch dimension")
            if t.shape[0] != -1:
                return Batchability(False, f"{kind} {t.name!r} has a fixed first dimension ({t.shape[0]}), "
                                           "not a batch dimension")
            name = dim_names.get(t.name)
            if name:
                seen.setdefault(name, f"{kind} {t.name!r}")
    if len(seen) > 1:
        (a, where_a), (b, where_b) = list(seen.items())[:2]
        return Batchability(False, f"the first dimensions differ: {where_a} has {a!r}, {where_b} has {b!r} "
                                   "(an output sized by the data, not by the batch)")
    return Batchability(True, "every input and output has a leading batch dimension")


def _close(batched: np.ndarray, alone: np.ndarray, datatype: str) -> bool:
    import numpy as np

    if batched.shape != alone.shape:
        return False
    if batched.dtype.kind == "f":
        scale = float(np.max(np.abs(alone))) if alone.size else 0.0
        rtol = RTOL.get(datatype, DEFAULT_RTOL)
        return bool(np.allclose(batched, alone, rtol=rtol, atol=rtol * max(scale, 1e-6), equal_nan=True))
    return bool(np.array_equal(batched, alone))


def _distinct_rows(feeds: dict[str, np.ndarray], from_data: set[str]) -> dict[str, np.ndarray]:
    """`feeds` (2 rows) with the second row of generated integer and bool inputs set to ones: the sample
    plan fills those with zeros, and two equal rows would prove nothing."""
    out = dict(feeds)
    for name, arr in feeds.items():
        if name not in from_data and arr.dtype.kind in "iub" and arr.ndim and arr.shape[0] == 2:
            arr = arr.copy()
            arr[1] = 1
            out[name] = arr
    return out


def probe_batchability(run: Any, outputs: Sequence[TensorInfo], feeds: dict[str, np.ndarray]) -> Batchability:
    """Run `feeds` (two rows) as one batch and row by row through `run` (inputs -> outputs); batchable when
    every output has the batch's rows and each row equals the row computed alone."""
    import numpy as np

    try:
        together = run(feeds)
    except Exception as exc:  # noqa: BLE001 - runtimes raise their own types
        return Batchability(False, f"the model refused two rows in one run ({str(exc)[:300]})")
    alone = [run({k: np.ascontiguousarray(v[i:i + 1]) for k, v in feeds.items()}) for i in range(2)]
    types = {t.name: t.datatype for t in outputs}
    for name, arr in together.items():
        arr = np.asarray(arr)
        if arr.ndim == 0 or arr.shape[0] != 2 or any(np.asarray(a[name]).shape[:1] != (1,) for a in alone):
            one = list(np.asarray(alone[0][name]).shape)
            return Batchability(False, f"output {name!r} does not have one row per input row (two rows gave "
                                       f"shape {list(arr.shape)}, one row gave {one})")
        for i in range(2):
            if not _close(arr[i:i + 1], np.asarray(alone[i][name]), types.get(name, "")):
                return Batchability(False, f"output {name!r} of a row depends on the other rows of its batch "
                                           "(two rows in one run differ from each row run alone)")
    return Batchability(True, "every input and output has a leading batch dimension, and two rows in one run "
                              "equal each row run alone")


def decide(backend: Any, samples_doc: dict | None) -> Batchability:
    """Declared rule, then the probe on the job's sample inputs (samples.py), for an open backend."""
    declared = declared_batchability(backend.inputs, backend.outputs, onnx_batch_dim_names(backend.model_path))
    if not declared.batchable:
        return declared
    from reamer.serve.samples import SampleSpec, plan_samples

    plan = plan_samples(backend.inputs, SampleSpec.from_doc(samples_doc), backend.model_path)
    from_data = {p.info.name for p in plan.inputs if p.samples is not None}
    feeds = plan.batch(2)
    distinct = _distinct_rows(feeds, from_data)
    verdict = probe_batchability(backend.run, backend.outputs, distinct)
    if not verdict.batchable and distinct is not feeds and verdict.reason.startswith("the model refused"):
        verdict = probe_batchability(backend.run, backend.outputs, feeds)  # ones may be out of range: as sampled
    return verdict


def check_batchability(backend: str, model_path: str, samples_doc: dict | None = None,
                       timeout_s: float = PROBE_TIMEOUT_S) -> Batchability | None:
    """decide() in a child process (`python -m reamer.serve.runtime.batchability`: the caller never loads a runtime
    itself); None when the check could not finish (no evidence either way)."""
    from reamer.serve.measure.profiler import child_start

    argv, how = child_start("reamer.serve.runtime.batchability", [backend, model_path, json.dumps(samples_doc or {})])
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **how)
    except subprocess.TimeoutExpired:
        return None
    lines = done.stdout.strip().splitlines()
    try:
        return Batchability.from_doc(json.loads(lines[-1])) if lines else None
    except (ValueError, KeyError, TypeError):
        return None


def main(argv: list[str]) -> int:
    backend_kind, model_path, samples = argv
    from reamer.serve.backends import open_backend

    try:
        with open_backend(backend_kind, model_path, 1) as backend:
            verdict = decide(backend, json.loads(samples) or None)
    except Exception:  # noqa: BLE001 - the caller treats no answer as unknown
        return 1
    print(json.dumps(verdict.to_doc()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
