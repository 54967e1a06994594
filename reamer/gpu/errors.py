"""Errors of the GPU layer a user can cause or fix; each names the problem and the fix."""
from __future__ import annotations

from reamer.errors import ErrorKind, ReamerError


class GpuError(ReamerError):
    """Base of the GPU layer's user-facing errors."""

    kind = ErrorKind.GPU_REFUSED


class NoGpuDriver(GpuError):
    """No NVIDIA driver / NVML, or no `nvidia-cuda-mps-control`: GPU requests cannot be served."""

    kind = ErrorKind.GPU_UNAVAILABLE


class MpsError(GpuError):
    """The MPS control daemon refused a command, did not answer, or is not running."""

    kind = ErrorKind.MPS_UNAVAILABLE


class LimitError(GpuError):
    """A requested SM share or memory limit is invalid or would oversubscribe a GPU."""

    kind = ErrorKind.GPU_LIMITS


class UnknownGpu(GpuError):
    """A GPU named by index or UUID that this node does not have."""

    kind = ErrorKind.UNKNOWN_GPU


class UnknownJob(GpuError):
    """A GPU job name that is not registered."""

    kind = ErrorKind.NOT_FOUND


class GpuConfigError(GpuError):
    """The `gpu` section of the configuration is invalid."""

    kind = ErrorKind.GPU_BAD_CONFIG


class LatencyModelError(GpuError):
    """Latency samples that cannot be fitted, or an SLO no GPU share can meet."""
