"""Demote every reamer training thread to SCHED_OTHER without a running agent (`reamer demote-all`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from reamer.agent.training import Placement, TrainingPinner
from reamer.host.cgroups import detect_driver


def demote_local(cgroup_root: str = "/sys/fs/cgroup", name: str = "reamer",
                 store_path: str | None = None) -> dict[str, Any]:
    """Demote every thread of every training job: the jobs in the agent's store (pinned in place, in a scope
    or in reamer's cgroups) and any of reamer's own cgroups `<name>/train-*` (the shape of the API's DemoteResult).

    Pinning (cpusets) is left as it is: the threads keep their cores but lose real-time priority.
    A running agent would make them RR again on its next pass; stop it first, or use the API."""
    pinner = TrainingPinner(detect_driver(cgroup_root), name, rt_runtime_us=0)
    if store_path and Path(store_path).exists():
        from reamer.agent.store import Store

        store = Store(store_path)
        try:
            for job, doc in store.jobs("training").items():
                if doc.get("placement"):
                    pinner.placements[job] = Placement.from_doc(doc["placement"])
        finally:
            store.close()
    jobs = pinner.job_cgroups()
    demoted = pinner.demote_all()
    return {"threads_demoted": demoted, "jobs": jobs,
            "message": "demoted without the agent; cpusets unchanged. If the agent runs again it re-promotes "
                       "attached jobs: use `reamer train detach NAME` to release them for good"}
