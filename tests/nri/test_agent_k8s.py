"""The agent's side of the NRI plugin, through its HTTP API with no runtime: a Kubernetes container's cores
are reserved before it has processes, durably and idempotently, and only root or the admin group may hand
one over."""
from __future__ import annotations

import pytest

from tests.agent.conftest import daemon_factory, needs_rt_host  # noqa: F401 - fixture
from tests.security.conftest import as_user, secure_daemon, user  # noqa: F401 - fixtures

pytestmark = needs_rt_host

CONTAINER = "ab" * 32
NAME = "k8s-" + CONTAINER[:12]


def test_reservation_is_pending_idempotent_durable_and_given_back(daemon_factory):
    agent = daemon_factory(reserved_cpus=[])
    body = {"name": NAME, "k8s_container": CONTAINER, "k8s_pod": "team/trainer-0", "cores": 1, "priority": 25}
    first = agent.client.request("POST", "/v1/training-jobs", json=body)
    assert first["state"] == "pending" and first["source"] == "k8s" and len(first["cpus"]) == 1
    assert first["scheduler"] == {"kind": "kubernetes", "container_id": CONTAINER, "pod": "team/trainer-0"}
    assert not set(first["cpus"]) & set(agent.client.capacity()["spare_cpus"])

    again = agent.client.request("POST", "/v1/training-jobs", json=body)  # a restarted plugin posts again
    assert again["cpus"] == first["cpus"]
    assert [j["name"] for j in agent.client.request("GET", "/v1/training-jobs")["jobs"]] == [NAME]

    agent.restart()
    kept = agent.client.request("GET", f"/v1/training-jobs/{NAME}")
    assert kept["cpus"] == first["cpus"] and kept["state"] == "pending" and kept["priority"] == 25

    agent.client.request("DELETE", f"/v1/training-jobs/{NAME}")
    assert agent.client.request("GET", "/v1/training-jobs")["jobs"] == []
    assert set(first["cpus"]) <= set(agent.client.capacity()["spare_cpus"])


def test_another_container_under_the_same_name_is_a_conflict(daemon_factory):
    agent = daemon_factory(reserved_cpus=[])
    agent.client.request("POST", "/v1/training-jobs", json={"name": NAME, "k8s_container": CONTAINER, "cores": 1})
    from reamer.host.errors import ReamerError

    with pytest.raises(ReamerError) as refused:
        agent.client.request("POST", "/v1/training-jobs", json={"name": NAME, "k8s_container": "cd" * 32, "cores": 1})
    assert "already attached" in str(refused.value)


def test_capacity_in_kubernetes_units(daemon_factory):
    agent = daemon_factory(reserved_cpus=[])
    capacity = agent.client.capacity()
    assert capacity["kubernetes"] == {"reamer.io/spare-cores": str(capacity["spare_cores"]),
                                      "reamer.io/batch-cpu": str(capacity["offline_capacity_millicores"])}


def test_only_root_or_the_admin_group_hands_over_kubernetes_containers(as_user, secure_daemon):  # noqa: F811
    status, body = as_user.call("POST", "/v1/training-jobs",
                                {"name": NAME, "k8s_container": CONTAINER, "cores": 1})
    assert status == 403 and body["error"]["data"]["rule"] == "k8s_container"
    assert secure_daemon.client.request("GET", "/v1/training-jobs")["jobs"] == []


def test_cli_prints_the_capacity_and_the_kubectl_patch_that_publishes_it(daemon_factory):
    import json
    import subprocess
    import sys

    agent = daemon_factory(reserved_cpus=[])
    base = [sys.executable, "-m", "reamer.cli.main", "--socket", agent.socket]
    shown = json.loads(subprocess.run(base + ["-o", "json", "nri", "capacity"], capture_output=True, text=True,
                                      timeout=120, check=True).stdout)
    assert shown["reamer.io/spare-cores"] == str(agent.client.capacity()["spare_cores"])
    command = subprocess.run(base + ["nri", "capacity", "--kubectl-patch", "gpu-7"], capture_output=True,
                             text=True, timeout=120, check=True).stdout
    assert command.startswith("kubectl patch node gpu-7 --subresource=status --type=json -p ")
    assert "/status/capacity/reamer.io~1spare-cores" in command
    refused = subprocess.run(base + ["nri", "capacity", "--apply"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--kubectl-patch NODE" in refused.stderr and "Traceback" not in refused.stderr
