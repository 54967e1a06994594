"""A fake `pynvml` (nvidia-ml-py) for tests: the calls reamer makes, with settable per-GPU values.

Use `FakeNvml([FakeGpu(...), ...])` where the real module would go (GpuManager(..., nvml=fake)).
Errors are NVMLError instances carrying `.value` like the real module's; `FakeNvml(init_error=
NVML_ERROR_LIBRARY_NOT_FOUND)` behaves like a machine without the driver.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
_NAMES = {3: "Not Supported", 4: "Insufficient Permissions", 6: "Not Found", 9: "Driver Not Loaded",
          10: "Timeout", 12: "NVML Shared Library Not Found"}

NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_COMPUTEMODE_DEFAULT = 0
NVML_COMPUTEMODE_PROHIBITED = 2
NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 3
nvmlEventTypeXidCriticalError = 0x8
MB = 1024 * 1024


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _NAMES.get(self.value, f"NVML Error with code {self.value}")


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    memory_total_mb: int = 81559
    memory_used_mb: int = 0
    util: int = 0
    mem_util: int = 0
    sm_clock: int = 1980
    max_sm_clock: int = 1980
    power_mw: int = 70_000
    temperature: int = 35
    compute_mode: int = NVML_COMPUTEMODE_DEFAULT
    processes: dict[int, int] = field(default_factory=dict)  # pid -> used MiB
    process_sm: dict[int, int] = field(default_factory=dict)  # pid -> SM util %
    xid_supported: bool = True
    power_supported: bool = True


class FakeNvml:
    """Module-like object: attribute names match pynvml's."""

    NVMLError = NVMLError

    def __init__(self, gpus: list[FakeGpu] | None = None, init_error: int | None = None) -> None:
        self.gpus = list(gpus or [])
        self.init_error = init_error
        self.initialised = False
        self.calls: list[str] = []
        self._events: deque[tuple[FakeGpu, int]] = deque()
        self._registered: set[str] = set()
        self._ts = 0
        for name, value in globals().items():
            if name.startswith(("NVML_", "nvmlEventType")):
                setattr(self, name, value)

    # -- test controls
    def gpu(self, uuid: str) -> FakeGpu:
        return next(g for g in self.gpus if g.uuid == uuid)

    def inject_xid(self, uuid: str, xid: int) -> None:
        g = self.gpu(uuid)
        if g.uuid in self._registered:
            self._events.append((g, xid))

    # -- pynvml API
    def _check(self) -> None:
        if not self.initialised:
            raise NVMLError(1)

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
        self._check()
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h: FakeGpu) -> str:
        return h.uuid

    def nvmlDeviceGetName(self, h: FakeGpu) -> str:
        return h.name

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu) -> Any:
        return SimpleNamespace(total=h.memory_total_mb * MB, used=h.memory_used_mb * MB,
                               free=(h.memory_total_mb - h.memory_used_mb) * MB)

    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> Any:
        return SimpleNamespace(gpu=h.util, memory=h.mem_util)

    def nvmlDeviceGetClockInfo(self, h: FakeGpu, kind: int) -> int:
        return h.sm_clock

    def nvmlDeviceGetMaxClockInfo(self, h: FakeGpu, kind: int) -> int:
        return h.max_sm_clock

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:
        if not h.power_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return h.power_mw

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:
        return h.temperature

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeGpu) -> list[Any]:
        return [SimpleNamespace(pid=p, usedGpuMemory=mb * MB) for p, mb in sorted(h.processes.items())]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, h: FakeGpu) -> list[Any]:
        return []

    def nvmlDeviceGetProcessUtilization(self, h: FakeGpu, last_ts: int) -> list[Any]:
        if not h.process_sm:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        self._ts += 1
        return [SimpleNamespace(pid=p, timeStamp=self._ts, smUtil=v, memUtil=0, encUtil=0, decUtil=0)
                for p, v in sorted(h.process_sm.items())]

    def nvmlDeviceGetComputeMode(self, h: FakeGpu) -> int:
        return h.compute_mode

    def nvmlDeviceSetComputeMode(self, h: FakeGpu, mode: int) -> None:
        self.calls.append(f"nvmlDeviceSetComputeMode {h.uuid} {mode}")
        h.compute_mode = mode

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, h: FakeGpu, types: int, event_set: object) -> None:
        if not h.xid_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        self._registered.add(h.uuid)

    def nvmlEventSetWait(self, event_set: object, timeout_ms: int) -> Any:
        if not self._events:
            raise NVMLError(NVML_ERROR_TIMEOUT)
        g, xid = self._events.popleft()
        return SimpleNamespace(device=g, eventType=nvmlEventTypeXidCriticalError, eventData=xid)

    def nvmlEventSetFree(self, event_set: object) -> None:
        pass
