"""Open-loop load generator for a KServe v2 (Open Inference Protocol) REST endpoint.

Arrivals follow a Poisson process at a fixed rate and are drawn up front, so when a request is sent
never depends on how fast earlier ones were answered (no coordinated omission). Latency runs from a
request's scheduled arrival to its response, so client-side lag counts against the server too.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import httpx
import numpy as np

from reamer.host.errors import ReamerError
from reamer.plan.statistics import percentile, slo_attainment
from reamer.serve.protocol.tensors import numpy_to_v2

RequestStatus = Literal["ok", "shed", "error"]


class LoadError(ReamerError):
    """The load generator was asked for something it cannot do."""


@dataclass
class RequestRecord:
    scheduled_s: float  # arrival time, seconds after the run started
    latency_ms: float  # scheduled arrival -> response (or failure)
    status: RequestStatus  # ok = 200, shed = 503 (server over capacity), error = anything else
    http_status: int | None = None
    detail: str = ""


@dataclass
class LoadResult:
    url: str
    rate_rps: float
    duration_s: float
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def latencies(self) -> list[float]:
        """Latencies (ms) of the successful requests, in arrival order."""
        return [r.latency_ms for r in self.records if r.status == "ok"]

    @property
    def ok(self) -> int:
        return sum(r.status == "ok" for r in self.records)

    @property
    def shed(self) -> int:
        return sum(r.status == "shed" for r in self.records)

    @property
    def errors(self) -> int:
        return sum(r.status == "error" for r in self.records)

    def percentile(self, p: float) -> float:
        """The p-th percentile (0..100) of successful-request latency in ms; NaN when none succeeded."""
        return percentile(self.latencies, p)

    @property
    def p50_ms(self) -> float:
        return self.percentile(50)

    @property
    def p99_ms(self) -> float:
        return self.percentile(99)

    @property
    def achieved_rps(self) -> float:
        """Successful requests per second of offered-load duration."""
        return self.ok / self.duration_s if self.duration_s > 0 else 0.0

    def slo_attainment(self, slo_ms: float) -> float:
        """Fraction of all sent requests answered successfully within `slo_ms`."""
        return slo_attainment(self.latencies, slo_ms, len(self.records))

    def summary(self) -> dict:
        return {"url": self.url, "rate_rps": self.rate_rps, "duration_s": self.duration_s, "sent": len(self.records),
                "ok": self.ok, "shed": self.shed, "errors": self.errors, "achieved_rps": self.achieved_rps,
                "p50_ms": self.p50_ms, "p99_ms": self.p99_ms, "wall_s": self.wall_s}

    def to_dict(self) -> dict:
        return {**self.summary(), "records": [asdict(r) for r in self.records]}


def infer_url(host: str, port: int, model: str) -> str:
    return f"http://{host}:{port}/v2/models/{model}/infer"


def v2_request_body(inputs: dict[str, np.ndarray]) -> dict:
    """A v2 JSON inference request carrying `inputs` (row-major flattened data)."""
    tensors = []
    for name, value in inputs.items():
        arr = np.asarray(value)
        tensors.append({"name": name, "shape": list(arr.shape), "datatype": numpy_to_v2(arr.dtype),
                        "data": arr.reshape(-1).tolist()})
    return {"inputs": tensors}


def poisson_schedule(rate_rps: float, duration_s: float, rng: np.random.Generator) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson process with rate `rate_rps`."""
    if rate_rps <= 0 or duration_s <= 0:
        raise LoadError(f"rate ({rate_rps}) and duration ({duration_s}) must be positive",
                        "pass a request rate in requests/s and a duration in seconds, both > 0")
    times: list[float] = []
    t = 0.0
    while True:
        # draw in chunks; exponential gaps with mean 1/rate
        gaps = rng.exponential(1.0 / rate_rps, size=max(16, int(rate_rps * duration_s * 0.25) + 1))
        for g in gaps:
            t += float(g)
            if t >= duration_s:
                return times
            times.append(t)


async def run_load_async(url: str, body: dict | bytes, rate_rps: float, duration_s: float, *, seed: int = 0,
                         timeout_s: float = 30.0, max_connections: int = 1000,
                         headers: dict[str, str] | None = None) -> LoadResult:
    """Send `body` to `url` at Poisson arrivals for `duration_s`; wait for every answer (or timeout).

    `headers`: the request's headers (default JSON; binary tensors need their own, see reamer.serve.protocol.v2wire)."""
    schedule = poisson_schedule(rate_rps, duration_s, np.random.default_rng(seed))
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = headers or {"content-type": "application/json"}
    result = LoadResult(url=url, rate_rps=rate_rps, duration_s=duration_s)
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as client:
        start = time.perf_counter()

        async def send(offset: float) -> RequestRecord:
            due = start + offset
            try:
                resp = await client.post(url, content=payload, headers=headers)
            except httpx.HTTPError as exc:
                return RequestRecord(offset, (time.perf_counter() - due) * 1e3, "error", None,
                                     f"{type(exc).__name__}: {exc}")
            latency = (time.perf_counter() - due) * 1e3
            if resp.status_code == 200:
                return RequestRecord(offset, latency, "ok", 200)
            status: RequestStatus = "shed" if resp.status_code == 503 else "error"
            return RequestRecord(offset, latency, status, resp.status_code, resp.text[:200])

        tasks: list[asyncio.Task[RequestRecord]] = []
        for offset in schedule:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(offset)))
        result.records = list(await asyncio.gather(*tasks))
        result.wall_s = time.perf_counter() - start
    return result


def run_load(url: str, body: dict | bytes, rate_rps: float, duration_s: float, *, seed: int = 0,
             timeout_s: float = 30.0, max_connections: int = 1000,
             headers: dict[str, str] | None = None) -> LoadResult:
    """Blocking wrapper of `run_load_async` (do not call from inside a running event loop)."""
    return asyncio.run(run_load_async(url, body, rate_rps, duration_s, seed=seed, timeout_s=timeout_s,
                                      max_connections=max_connections, headers=headers))
