"""The kernel OOM killer's preference per process (/proc/PID/oom_score_adj, -1000..1000)."""
from __future__ import annotations

from pathlib import Path

from reamer.host.errors import HostError, PermissionProblem
from reamer.host.sched import ThreadGone

OOM_SCORE_ADJ_MAX = 1000


def oom_score_adj(pid: int, proc_root: str | Path = "/proc") -> int:
    try:
        return int((Path(proc_root) / str(pid) / "oom_score_adj").read_text())
    except (FileNotFoundError, ProcessLookupError):
        raise ThreadGone(pid) from None


def set_oom_score_adj(pid: int, value: int, proc_root: str | Path = "/proc") -> None:
    """Make `pid` (and the children it forks from now on: they inherit it) a preferred OOM victim."""
    if not -OOM_SCORE_ADJ_MAX <= value <= OOM_SCORE_ADJ_MAX:
        raise HostError(f"oom_score_adj {value} is out of range", "use -1000..1000")
    try:
        (Path(proc_root) / str(pid) / "oom_score_adj").write_text(str(value))
    except (FileNotFoundError, ProcessLookupError):
        raise ThreadGone(pid) from None
    except PermissionError:
        raise PermissionProblem(f"not allowed to set oom_score_adj of {pid}", "run reamer as root") from None
