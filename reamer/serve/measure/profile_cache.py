"""Profile points cached on disk per (model bytes, backend, CPU model), so re-plans need no new measurement."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from reamer.plan.partition import ProfilePoint
from reamer.serve.backends import DEFAULT_PRECISION, compute_precision
from reamer.serve.samples import SampleSpec
from reamer.serve.spec import write_atomic

CACHE_FORMAT = 1


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """sha256 of a regular file. A user's path may have become a FIFO or a device since it was checked: such a
    file is never read (OSError), so it cannot stall whoever hashes it (the agent, for a cache key)."""
    import stat

    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def model_key(model_path: str | os.PathLike, backend: str, cpu_model: str | None = None,
              samples: SampleSpec | None = None, precision: str = "f32") -> str:
    """Cache key: sha256 over the model file's sha256, the backend, the CPU model name, when the
    traffic was described, its shapes and the sample data's sha256 (a BERT profiled at sequence 128 is
    another profile than at 16) and, where the backend computes in a precision other than f32 (OpenVINO
    at bf16), that precision. f32 keys are the ones reamer always used, so existing caches stay valid.

    `cpu_model` defaults to this host's (from reamer.host.topology).
    """
    if cpu_model is None:
        from reamer.host.topology import read_topology

        cpu_model = read_topology().model_name
    parts: list = [file_sha256(model_path), backend, cpu_model]
    traffic = samples.cache_material() if samples is not None else None
    if traffic is not None:  # the default inputs keep the key they always had
        parts.append(traffic)
    computes = compute_precision(backend, precision)
    if computes != DEFAULT_PRECISION:  # a bf16 point is another measurement than an f32 one
        parts.append({"precision": computes})
    material = json.dumps(parts)
    return hashlib.sha256(material.encode()).hexdigest()


class ProfileCache:
    """A directory of `<key>.json` files, each holding the profile points measured for one key."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)

    def path_for(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"profile cache key must be a lowercase hex digest, got {key!r}")
        return self.directory / f"{key}.json"

    def get(self, key: str) -> list[ProfilePoint] | None:
        """The cached points, or None when absent or unreadable (an unreadable entry is a cache miss)."""
        try:
            data = json.loads(self.path_for(key).read_text())
            if data.get("format") != CACHE_FORMAT:
                return None
            return [ProfilePoint(int(p["cores"]), int(p["batch"]), float(p["throughput_rps"]), float(p["p99_ms"]))
                    for p in data["points"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, points: list[ProfilePoint], meta: dict | None = None) -> Path:
        """Store `points` under `key` atomically (readers see the old or the new entry, never a part)."""
        path = self.path_for(key)
        self.directory.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": CACHE_FORMAT,
            "key": key,
            "created_at": time.time(),
            "meta": meta or {},
            "points": [{"cores": p.cores, "batch": p.batch, "throughput_rps": p.throughput_rps, "p99_ms": p.p99_ms}
                       for p in points],
        }
        write_atomic(path, json.dumps(payload, indent=1))
        return path

    def delete(self, key: str) -> bool:
        try:
            self.path_for(key).unlink()
            return True
        except FileNotFoundError:
            return False
