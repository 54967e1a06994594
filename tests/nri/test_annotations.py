"""What a pod asks of reamer (its annotations) and how the capacity is published, with no runtime."""
from __future__ import annotations

import json

import pytest

from reamer.cli.nri_cmd import kubectl_patch
from reamer.nri.annotations import BadAnnotation, PodRequest, parse


def test_no_role_asks_for_nothing():
    assert parse({}) is None
    assert parse({"reamer.io/cores": "4"}) is None  # cores without a role: not reamer's pod


def test_training_needs_whole_cores_and_may_name_a_priority_and_containers():
    assert parse({"reamer.io/role": "training", "reamer.io/cores": " 4 "}) == PodRequest("training", cores=4)
    request = parse({"reamer.io/role": "training", "reamer.io/cores": "2", "reamer.io/priority": "30",
                     "reamer.io/containers": "trainer, loader"})
    assert request.priority == 30 and request.covers("loader") and not request.covers("sidecar")


@pytest.mark.parametrize("annotations, named", [
    ({"reamer.io/role": "training"}, "reamer.io/cores"),
    ({"reamer.io/role": "training", "reamer.io/cores": "0"}, "reamer.io/cores"),
    ({"reamer.io/role": "training", "reamer.io/cores": "2.5"}, "reamer.io/cores"),
    ({"reamer.io/role": "training", "reamer.io/cores": "2", "reamer.io/priority": "100"}, "reamer.io/priority"),
    ({"reamer.io/role": "batch"}, "reamer.io/role"),
])
def test_malformed_annotations_are_refused_with_the_fix(annotations, named):
    with pytest.raises(BadAnnotation) as refused:
        parse(annotations)
    assert named in refused.value.message and refused.value.fix


def test_inference_takes_no_cores_count():
    assert parse({"reamer.io/role": "inference"}) == PodRequest("inference")


def test_kubectl_patch_adds_each_resource_to_the_node_status_capacity():
    command = kubectl_patch("gpu-7", {"reamer.io/spare-cores": "3", "reamer.io/batch-cpu": "4250"})
    assert command[:6] == ["kubectl", "patch", "node", "gpu-7", "--subresource=status", "--type=json"]
    assert json.loads(command[-1]) == [
        {"op": "add", "path": "/status/capacity/reamer.io~1batch-cpu", "value": "4250"},
        {"op": "add", "path": "/status/capacity/reamer.io~1spare-cores", "value": "3"}]
