"""The `gpu:` section of the agent configuration (GpuConfig.from_dict)."""
from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from reamer.gpu.errors import GpuConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HealthThresholds(_Strict):
    """MuxFlow SysMonitor thresholds. Utilisation and memory: higher is worse (percent);
    SM clock: percent of the GPU's maximum SM clock, lower is worse (the clock drops under load)."""

    util_healthy_below: float = Field(80.0, ge=0, le=100)
    util_unhealthy_at: float = Field(90.0, ge=0, le=100)
    util_overlimit_at: float = Field(98.0, ge=0, le=100)
    mem_healthy_below: float = Field(80.0, ge=0, le=100)
    mem_unhealthy_at: float = Field(90.0, ge=0, le=100)
    mem_overlimit_at: float = Field(97.0, ge=0, le=100)
    sm_clock_healthy_above: float = Field(85.0, ge=0, le=100)
    sm_clock_unhealthy_at: float = Field(75.0, ge=0, le=100)
    sm_clock_overlimit_at: float = Field(60.0, ge=0, le=100)
    # Leaving Overlimit needs this long below the Overlimit thresholds, doubled for each
    # further entry into Overlimit within `overlimit_window_s` (MuxFlow: last two hours).
    overlimit_hold_s: float = Field(30.0, ge=0)
    overlimit_hold_max_s: float = Field(3600.0, ge=0)
    overlimit_window_s: float = Field(7200.0, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> "HealthThresholds":
        for name in ("util", "mem"):
            h, u, o = (getattr(self, f"{name}_{k}") for k in ("healthy_below", "unhealthy_at", "overlimit_at"))
            if not h <= u <= o:
                raise ValueError(f"{name} thresholds must satisfy healthy_below <= unhealthy_at <= overlimit_at "
                                 f"(got {h}, {u}, {o})")
        h, u, o = self.sm_clock_healthy_above, self.sm_clock_unhealthy_at, self.sm_clock_overlimit_at
        if not h >= u >= o:
            raise ValueError("sm_clock thresholds must satisfy healthy_above >= unhealthy_at >= overlimit_at "
                             f"(got {h}, {u}, {o})")
        return self


class PoliciesConfig(_Strict):
    """Sharing policies; each is off unless switched on."""

    # MuxFlow complement rule: offline (training) SM share = 100 - predicted online activity - headroom.
    complement: bool = False
    complement_headroom_pct: int = Field(10, ge=0, le=90)
    training_floor_pct: int = Field(10, ge=1, le=100)  # Mudi: training keeps at least 10 %
    inference_margin_pct: int = Field(10, ge=0, le=100)  # Mudi: +10 % GPU for prediction error
    # MuxFlow SysMonitor health state machine.
    health: bool = False
    health_thresholds: HealthThresholds = HealthThresholds()
    evict_on_overlimit: bool = True
    # Graceful eviction: SIGTERM, wait grace, terminate_client, wait, SIGKILL.
    eviction_grace_s: float = Field(10.0, ge=0)
    eviction_kill_after_s: float = Field(5.0, ge=0)
    # Fatal client fault: stop offline clients, report. MPS takes new clients again once every client of
    # the faulted server has exited; the daemon is restarted only if a server stays FAULT without clients.
    fault_handling: bool = True
    restart_daemon_on_fault: bool = True


class GpuConfig(_Strict):
    enabled: bool = True
    mps_control_path: str = "nvidia-cuda-mps-control"
    manage_mps: bool = True  # run one control daemon per GPU; False: telemetry and limits bookkeeping only
    gpus: list[str] | None = None  # UUIDs or indices to manage; None = every GPU
    allow_oversubscription: bool = False
    exclusive_process: bool = False  # set EXCLUSIVE_PROCESS compute mode while our daemon runs
    default_active_thread_percentage: int = Field(100, ge=1, le=100)
    command_timeout_s: float = Field(10.0, gt=0)
    sample_interval_s: float = Field(1.0, gt=0)
    history_len: int = Field(600, ge=1)
    stop_daemons_on_exit: bool = False
    policies: PoliciesConfig = PoliciesConfig()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "GpuConfig":
        try:
            return cls.model_validate(dict(data or {}))
        except ValidationError as exc:
            problems = "; ".join(
                f"gpu.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" if err["loc"] else err["msg"]
                for err in exc.errors()
            )
            raise GpuConfigError(f"invalid gpu configuration: {problems}",
                                 "correct these keys in the gpu: section of the config "
                                 "(see configs/reamer.yaml for every key)") from None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()
