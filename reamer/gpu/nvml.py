"""GPU telemetry through NVML (nvidia-ml-py, imported as `pynvml`) into a bounded in-memory history.

The NVML module is a parameter (default: `import pynvml`), so tests inject a fake at the import
boundary. Every metric NVML cannot give on a device (NOT_SUPPORTED, no permission, old driver) is
None rather than an error. Utilisation is NVML's "percent of time a kernel ran", not SM occupancy.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any, Callable

from reamer.gpu.errors import NoGpuDriver, UnknownGpu

MB = 1024 * 1024
NO_DRIVER_FIX = ("install the NVIDIA driver (nvidia-smi must work), or set gpu.enabled: false in the "
                 "config to run without GPU management")


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_total_mb: float
    max_sm_clock_mhz: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ProcessSample:
    pid: int
    used_memory_mb: float | None
    sm_util_pct: float | None = None


@dataclass(frozen=True)
class GpuSample:
    ts: float
    uuid: str
    index: int
    util_pct: float | None
    mem_util_pct: float | None
    memory_used_mb: float | None
    memory_total_mb: float | None
    sm_clock_mhz: float | None
    max_sm_clock_mhz: float | None
    power_w: float | None
    temperature_c: float | None
    processes: tuple[ProcessSample, ...] = ()
    xids: tuple[int, ...] = ()

    @property
    def memory_pct(self) -> float | None:
        if self.memory_used_mb is None or not self.memory_total_mb:
            return None
        return 100.0 * self.memory_used_mb / self.memory_total_mb

    @property
    def sm_clock_pct(self) -> float | None:
        if self.sm_clock_mhz is None or not self.max_sm_clock_mhz:
            return None
        return 100.0 * self.sm_clock_mhz / self.max_sm_clock_mhz

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["processes"] = [asdict(p) for p in self.processes]
        d["xids"] = list(self.xids)
        d["memory_pct"] = self.memory_pct
        d["sm_clock_pct"] = self.sm_clock_pct
        return d


class Nvml:
    """An open NVML session: GPU inventory, sampling into per-GPU bounded histories, XID events."""

    def __init__(self, module: ModuleType | Any | None = None, history_len: int = 600,
                 clock: Callable[[], float] = time.time) -> None:
        self._module = module
        self.history_len = history_len
        self._clock = clock
        self.nv: Any = None
        self.available = False
        self.reason = "NVML not opened"
        self._handles: dict[str, Any] = {}
        self._gpus: list[GpuInfo] = []
        self._history: dict[str, deque[GpuSample]] = {}
        self._last_proc_ts: dict[str, int] = {}
        self._event_set: Any = None
        self.xid_supported: dict[str, bool] = {}
        self.xid_counts: dict[str, int] = {}

    # ------------------------------------------------------------------ open / close

    def open(self) -> None:
        """Initialise NVML and read the GPU inventory; raises NoGpuDriver with the reason."""
        nv = self._module
        if nv is None:
            try:
                import pynvml as nv  # type: ignore[no-redef]
            except ImportError as exc:
                self.reason = f"nvidia-ml-py is not installed ({exc})"
                raise NoGpuDriver(self.reason, "pip install nvidia-ml-py") from None
        self.nv = nv
        try:
            nv.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded / ...
            self.reason = f"no NVIDIA driver (NVML: {exc})"
            raise NoGpuDriver(self.reason, NO_DRIVER_FIX) from None
        self.available = True
        self.reason = ""
        self._gpus, self._handles = [], {}
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(nv.nvmlDeviceGetUUID(h))
            mem = self._call(nv.nvmlDeviceGetMemoryInfo, h)
            max_clock = self._call(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM)
            info = GpuInfo(i, uuid, _text(self._call(nv.nvmlDeviceGetName, h) or "unknown"),
                           mem.total / MB if mem is not None else 0.0, max_clock)
            self._gpus.append(info)
            self._handles[uuid] = h
            self._history.setdefault(uuid, deque(maxlen=self.history_len))
            self.xid_counts.setdefault(uuid, 0)
        self._register_xid_events()

    def _register_xid_events(self) -> None:
        nv = self.nv
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except Exception:
            self._event_set = None
        for uuid, h in self._handles.items():
            ok = False
            if self._event_set is not None:
                try:
                    nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._event_set)
                    ok = True
                except Exception:  # NOT_SUPPORTED on some boards / in containers
                    ok = False
            self.xid_supported[uuid] = ok

    def close(self) -> None:
        if not self.available:
            return
        try:
            if self._event_set is not None:
                self.nv.nvmlEventSetFree(self._event_set)
        except Exception:
            pass
        try:
            self.nv.nvmlShutdown()
        finally:
            self.available = False
            self.reason = "NVML closed"
            self._event_set = None

    # ------------------------------------------------------------------ inventory

    def gpus(self) -> list[GpuInfo]:
        return list(self._gpus)

    def resolve(self, gpu: str | int) -> GpuInfo:
        """A GPU by index ("0"), full UUID, or unique UUID prefix ("GPU-8932f937")."""
        text = str(gpu).strip()
        if text.isdigit():
            for g in self._gpus:
                if g.index == int(text):
                    return g
        else:
            matches = [g for g in self._gpus if g.uuid == text] or \
                      [g for g in self._gpus if g.uuid.lower().startswith(text.lower())]
            if len(matches) == 1:
                return matches[0]
        have = ", ".join(f"{g.index}={g.uuid}" for g in self._gpus) or "none"
        raise UnknownGpu(f"no GPU {text!r} on this node (GPUs: {have})",
                         "name the GPU by its index or UUID as `reamer gpu status` lists them")

    # ------------------------------------------------------------------ sampling

    def sample(self) -> list[GpuSample]:
        """One sample per GPU (appended to its history), with XID events since the last sample."""
        if not self.available:
            return []
        xids = self._drain_xids()
        now = self._clock()
        out = []
        nv = self.nv
        for g in self._gpus:
            h = self._handles[g.uuid]
            util = self._call(nv.nvmlDeviceGetUtilizationRates, h)
            mem = self._call(nv.nvmlDeviceGetMemoryInfo, h)
            clock = self._call(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
            power = self._call(nv.nvmlDeviceGetPowerUsage, h)
            temp = self._call(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
            s = GpuSample(
                ts=now, uuid=g.uuid, index=g.index,
                util_pct=_f(getattr(util, "gpu", None)), mem_util_pct=_f(getattr(util, "memory", None)),
                memory_used_mb=mem.used / MB if mem is not None else None,
                memory_total_mb=mem.total / MB if mem is not None else g.memory_total_mb,
                sm_clock_mhz=_f(clock), max_sm_clock_mhz=_f(g.max_sm_clock_mhz),
                power_w=power / 1000.0 if power is not None else None, temperature_c=_f(temp),
                processes=self._processes(g.uuid, h), xids=tuple(xids.get(g.uuid, ())))
            self._history[g.uuid].append(s)
            out.append(s)
        return out

    def _processes(self, uuid: str, h: Any) -> tuple[ProcessSample, ...]:
        nv = self.nv
        mem_by_pid: dict[int, float | None] = {}
        for fn_name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"):
            fn = getattr(nv, fn_name, None)
            for p in (self._call(fn, h) or []) if fn else []:
                used = getattr(p, "usedGpuMemory", None)
                mem_by_pid[int(p.pid)] = used / MB if isinstance(used, (int, float)) else mem_by_pid.get(int(p.pid))
        sm_by_pid: dict[int, float] = {}
        fn = getattr(nv, "nvmlDeviceGetProcessUtilization", None)
        if fn is not None:
            samples = self._call(fn, h, self._last_proc_ts.get(uuid, 0)) or []
            for s in samples:
                sm_by_pid[int(s.pid)] = float(s.smUtil)
                self._last_proc_ts[uuid] = max(self._last_proc_ts.get(uuid, 0), int(s.timeStamp))
        pids = sorted(set(mem_by_pid) | set(sm_by_pid))
        return tuple(ProcessSample(p, mem_by_pid.get(p), sm_by_pid.get(p)) for p in pids)

    def _drain_xids(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        if self._event_set is None:
            return out
        nv = self.nv
        for _ in range(1000):  # bounded: never spin on a broken event set
            try:
                data = nv.nvmlEventSetWait(self._event_set, 0)
            except Exception:  # NVML_ERROR_TIMEOUT: nothing pending
                break
            try:
                uuid = _text(nv.nvmlDeviceGetUUID(data.device))
            except Exception:
                continue
            out.setdefault(uuid, []).append(int(data.eventData))
            self.xid_counts[uuid] = self.xid_counts.get(uuid, 0) + 1
        return out

    def _call(self, fn: Callable[..., Any] | None, *args: Any) -> Any:
        if fn is None:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            if self.nv is not None and isinstance(exc, getattr(self.nv, "NVMLError", ())):
                return None  # NOT_SUPPORTED, NO_PERMISSION, NOT_FOUND (no process samples yet), ...
            raise

    # ------------------------------------------------------------------ history

    def history(self, uuid: str) -> list[GpuSample]:
        return list(self._history.get(uuid, ()))

    def latest(self, uuid: str) -> GpuSample | None:
        h = self._history.get(uuid)
        return h[-1] if h else None

    # ------------------------------------------------------------------ compute mode

    def compute_mode(self, uuid: str) -> int | None:
        return self._call(self.nv.nvmlDeviceGetComputeMode, self._handles[uuid])

    def set_compute_mode(self, uuid: str, mode: int) -> None:
        """Needs root; raises the NVML error (the caller reports it)."""
        self.nv.nvmlDeviceSetComputeMode(self._handles[uuid], mode)

    @property
    def exclusive_process_mode(self) -> int:
        return int(getattr(self.nv, "NVML_COMPUTEMODE_EXCLUSIVE_PROCESS", 3))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _f(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) else None
