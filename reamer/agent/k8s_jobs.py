"""Training containers that reamer's NRI plugin hands to the agent before they run (Kubernetes pods).

At the runtime's CreateContainer the plugin posts `{"name", "k8s_container": ID, "cores": N}`: the agent takes N
whole cores from its core table at once (the plugin returns them to the runtime as the container's cpuset, so
the container's first process starts on them) and keeps the record "pending", durable in its store, keyed by
the container id. As soon as the container has processes (the plugin posts again at StartContainer, between
the runtime creating the task and starting it; the reconcile pass looks too) the job is pinned in place by the
agent's usual pinning: its threads SCHED_RR, the RT budget its cgroup needs on cgroup v1, nothing moved out of
the runtime's cgroups, no memory or pids limit touched. From then on it is an ordinary in-place container job:
it ends (cores back) when its processes are gone, or when the plugin deletes it at RemoveContainer.

Posting the same container again returns the record it has (a restarted plugin re-posts at Synchronize).
"""
from __future__ import annotations

import time
from typing import Any

from reamer.host.container import ContainerInfo, ContainerNotFound, resolve_container
from reamer.host.errors import HostError

SOURCE = "k8s"


class K8sTraining:
    """The agent's pending Kubernetes containers (running ones are ordinary in-place container jobs)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def pending(self) -> dict[str, dict[str, Any]]:
        return {n: d for n, d in self.agent.training.items()
                if d.get("source") == SOURCE and d.get("state") == "pending"}

    def is_pending(self, name: str) -> bool:
        return self.pending_doc(self.agent.training.get(name, {}))

    @staticmethod
    def pending_doc(doc: dict[str, Any]) -> bool:
        return doc.get("source") == SOURCE and doc.get("state") == "pending"

    # --- API ---

    def attach(self, req: dict[str, Any], caller: Any) -> dict[str, Any]:
        from reamer.agent.errors import Conflict
        from reamer.agent.policy import Forbidden

        agent = self.agent
        if not caller.is_admin:
            raise Forbidden("k8s_container", "only root and the admin group hand Kubernetes containers to reamer "
                                             "(the NRI plugin runs as root)",
                            "run `reamer nri` as root beside the container runtime, or give your own processes "
                            "with pids/cgroup")
        name, container_id = req["name"], req["k8s_container"]
        priority = agent.training_priority(req, caller)
        with agent._lock:
            doc = agent.training.get(name)
            if doc is not None:
                if doc.get("source") != SOURCE or doc.get("source_ref") != container_id:
                    raise Conflict(f"training job {name!r} is already attached (to something else)",
                                   "detach it first, or use another name")
                existing = True
            else:
                existing = False
                agent.check_new_training(name)
                doc = {"name": name, "pids": [], "priority": priority, "source": SOURCE,
                       "source_ref": container_id, "k8s_pod": req.get("k8s_pod") or "", "state": "pending",
                       "created_at": time.time(), "changes": [], "demoted": False, "owner_uid": caller.uid,
                       "owner_admin": caller.is_admin, "message": "waiting for the container's processes"}
                cpus = agent.record_new_training(name, req.get("cores") or 1, doc)
                agent.events.emit("training_pending", f"{name}: Kubernetes container {container_id[:12]} of pod "
                                  f"{doc['k8s_pod'] or '?'} holds cpus {cpus} until it runs", job=name,
                                  data={"cpus": cpus, "k8s_container": container_id})
                agent._replan()  # inference leaves the cores while the runtime still creates the container
        if doc.get("state") == "pending":
            self.activate(name, self.observe(container_id))
        if not existing:
            agent.wake()
        with agent._lock:
            return agent._training_view(name)

    # --- the pass ---

    def observe(self, container_id: str) -> ContainerInfo | None:
        """The container's processes, if it has any (outside the agent's lock: a /proc scan)."""
        try:
            return resolve_container(container_id, proc_root=self.agent.proc_root,
                                     cgroup_root=self.agent.config.cgroup_root, driver=self.agent.driver)
        except ContainerNotFound:
            return None

    def observe_all(self) -> dict[str, ContainerInfo | None]:
        with self.agent._lock:
            wanted = {n: d["source_ref"] for n, d in self.pending().items()}
        return {n: self.observe(cid) for n, cid in wanted.items()}

    def apply(self, observed: dict[str, ContainerInfo | None]) -> None:
        for name, info in observed.items():
            self.activate(name, info)

    def activate(self, name: str, info: ContainerInfo | None) -> None:
        """A pending container that has processes: pin it in place (takes the agent's lock)."""
        agent = self.agent
        if info is None or not info.pids:
            return
        with agent._lock:
            if not self.is_pending(name):
                return  # pinned meanwhile, or removed
            doc = agent.training[name]
            try:
                agent.pinner.check_rt_possible()
                placement = agent.pinner.place(name, "container", info.pids, info.id)
                placement.owner_uid, placement.privileged = 0, True  # handed over by root (the plugin)
                state = agent.pinner.attach(name, placement, info.pids, doc["cpus"], doc["priority"],
                                            agent.pinner.new_log(name, agent._save_changes(doc)))
            except HostError as error:
                self._say(doc, f"{error.message}; fix: {error.fix}")
                return
            if doc.get("demoted") or agent.rt_disabled:  # demote-all (or RT throttling off) came first
                agent.pinner.demote(name)
            doc.update(state="running", pids=info.pids, placement=placement.to_doc(), message="")
            agent.store.put_job("training", name, doc)
            agent._pin_state[name] = state
            agent._note_refused(name, state)
            agent.events.emit("training_attached", f"{name}: Kubernetes container {info.id[:12]} on cpus "
                              f"{doc['cpus']}, {state.threads_rr} thread(s) SCHED_RR at priority {doc['priority']}",
                              job=name, data={"cpus": doc["cpus"], "pids": state.pids, "k8s_container": info.id})

    def view(self, doc: dict[str, Any]) -> dict[str, Any]:
        """The Kubernetes-specific part of a training job's view."""
        view = {"scheduler": {"kind": "kubernetes", "container_id": doc["source_ref"], "pod": doc.get("k8s_pod", "")}}
        if doc.get("state") == "pending":
            view.update(state="pending", message=doc.get("message", ""))
        return view

    def _say(self, doc: dict[str, Any], message: str) -> None:
        if message != doc.get("message", ""):
            doc["message"] = message
            self.agent.store.put_job("training", doc["name"], doc)
            self.agent.events.emit("training_k8s_problem", f"{doc['name']}: {message}", job=doc["name"])
