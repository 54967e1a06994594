"""The host side of the lab (lab/): QEMU arguments per profile, recipe hash, reports and the summary.
Booting VMs is `make test-hosts`; these run in `make test`."""
from __future__ import annotations

from pathlib import Path

from lab.image import Image, recipe_hash
from lab.profiles import PROFILES
from lab.report import ProfileResult, read_junit, summary_lines, write_skip_junit
from lab.vm import qemu_command


def test_profiles_boot_the_topologies_the_issue_asks_for(tmp_path):
    image = Image(tmp_path, tmp_path / "vmlinuz", tmp_path / "initrd.img", tmp_path / "rootfs.ext4", "6.1.0-x")
    numa = qemu_command(image, PROFILES["v2-numa"], tmp_path / "out", {"checkout": Path("/src")}, tmp_path / "c.log")
    text = " ".join(numa)
    assert "-smp 8,sockets=2,cores=2,threads=2" in text and "max,vendor=GenuineIntel" in text
    assert "node,nodeid=0,cpus=0-3,memdev=m0" in text and "node,nodeid=1,cpus=4-7,memdev=m1" in text
    assert "systemd.unified_cgroup_hierarchy=1" in text and "reamer_lab.checkout=/src" in text
    assert "snapshot=on" in text and "kvm" not in text
    assert "path=/src,mount_tag=checkout,security_model=passthrough,readonly=on" in text
    v1 = " ".join(qemu_command(image, PROFILES["v1"], tmp_path, {}, tmp_path / "c.log"))
    assert "systemd.unified_cgroup_hierarchy=0" in v1 and "-numa" not in v1
    ctr = " ".join(qemu_command(image, PROFILES["v2-containers"], tmp_path, {}, tmp_path / "c.log"))
    assert "systemd.wants=docker.service" in ctr


def test_recipe_hash_is_stable():
    assert recipe_hash() == recipe_hash() and len(recipe_hash()) == 16


def test_a_skipped_profile_is_reported_as_skipped_never_passed(tmp_path):
    junit = tmp_path / "v1" / "junit.xml"
    write_skip_junit(junit, "v1", "no <qemu> & \"tools\"")
    assert read_junit(junit)[:4] == (0, 0, 0, 1)
    lines = summary_lines([ProfileResult("v1", "skipped", reason="no qemu")], 3.0)
    assert "SKIPPED" in lines[-1] and "NOT a pass" in lines[-1]
    failed = summary_lines([ProfileResult("v1", "passed", passed=3), ProfileResult("v2-numa", "failed", failed=1)], 9.0)
    assert failed[-1].startswith("test-hosts: FAILED: v2-numa")
