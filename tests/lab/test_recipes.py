"""The lab's image recipes and the pieces the v2-k8s profile brings (checked on the host, no VM)."""
from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

from lab import image as lab_image
from lab.image import RECIPES, recipe_hash
from lab.profiles import PROFILES


def test_the_bookworm_recipe_hashes_as_the_single_image_did_so_its_cache_stays_valid():
    # The formula before images were per recipe: a change here would rebuild every existing lab cache.
    digest = hashlib.sha256()
    digest.update(json.dumps([lab_image.SUITE, lab_image.KERNEL_META, lab_image.PACKAGES, lab_image.STRIP_MODULES,
                              lab_image.INITRD_MODULES, lab_image.BUSYBOX_APPLETS, lab_image.IMAGE_SIZE, 2]).encode())
    guest = lab_image.GUEST_DIR
    for file in sorted([*(guest / "image").rglob("*"), guest / "initrd-init"]):
        if file.is_file():
            digest.update(str(file.relative_to(guest)).encode())
            digest.update(file.read_bytes())
    assert recipe_hash(RECIPES["bookworm"]) == recipe_hash() == digest.hexdigest()[:16]
    assert recipe_hash(RECIPES["trixie-k8s"]) != recipe_hash()


def test_every_profile_names_a_recipe_and_the_k8s_one_is_trixie_with_containerd_only():
    assert {p.image for p in PROFILES.values()} <= set(RECIPES)
    k8s = PROFILES["v2-k8s"]
    recipe = RECIPES[k8s.image]
    assert recipe.suite == "trixie" and k8s.cgroup_v2 and not k8s.runs_unmarked_tests
    assert {"containerd", "runc", "libssl3t64"} <= set(recipe.packages)
    assert not {"docker.io", "podman", "slurmd", "python3"} & set(recipe.packages)  # a small image, built fast
    assert all(PROFILES[name].runs_unmarked_tests for name in ("v1", "v2-numa", "v2-containers"))


def test_oci_image_tar_is_a_layout_ctr_can_import(tmp_path):
    from tests.hosts.cri.images import oci_image_tar

    root = tmp_path / "rootfs"
    (root / "bin").mkdir(parents=True)
    (root / "bin/busybox").write_bytes(b"\x7fELF not really")
    (root / "bin/sh").symlink_to("busybox")
    tar_path = oci_image_tar(root, tmp_path / "img.tar", "docker.io/reamer/busybox:1", ["/bin/sh"])
    with tarfile.open(tar_path) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    blob = lambda digest: files["blobs/sha256/" + digest.removeprefix("sha256:")]  # noqa: E731
    index = json.loads(files["index.json"])
    desc = index["manifests"][0]
    assert desc["annotations"]["io.containerd.image.name"] == "docker.io/reamer/busybox:1"
    assert desc["platform"] == {"architecture": "amd64", "os": "linux"}
    manifest = json.loads(blob(desc["digest"]))
    config = json.loads(blob(manifest["config"]["digest"]))
    layer = blob(manifest["layers"][0]["digest"])
    for d in (desc, manifest["config"], manifest["layers"][0]):  # every blob is what its descriptor says
        data = blob(d["digest"])
        assert d["size"] == len(data) and d["digest"] == "sha256:" + hashlib.sha256(data).hexdigest()
    assert config["rootfs"]["diff_ids"] == [manifest["layers"][0]["digest"]] and config["config"]["Cmd"] == ["/bin/sh"]
    layer_path = tmp_path / "layer.tar"
    layer_path.write_bytes(layer)
    with tarfile.open(layer_path) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["bin/sh"].issym() and members["bin/sh"].linkname == "busybox"
    assert members["bin/busybox"].uid == 0 and members["bin/busybox"].isfile()


def test_the_cri_stubs_have_the_calls_the_client_makes():
    from tests.hosts.cri import api_pb2
    from tests.hosts.cri.api_pb2_grpc import RuntimeServiceStub

    service = api_pb2.DESCRIPTOR.services_by_name["RuntimeService"]
    for call in ("RunPodSandbox", "CreateContainer", "StartContainer", "StopContainer", "RemoveContainer",
                 "ContainerStatus", "StopPodSandbox", "RemovePodSandbox", "Status", "Version"):
        assert call in service.methods_by_name
    assert api_pb2.DESCRIPTOR.package == "runtime.v1" and RuntimeServiceStub


def test_an_image_that_cannot_be_built_fails_only_the_profiles_that_boot_it(monkeypatch, capsys):
    import shutil
    import tempfile

    import lab.__main__ as driver
    from lab.image import Image
    from lab.vm import VmRun

    (driver.REPO / "build").mkdir(exist_ok=True)  # a clean checkout has none yet
    out = Path(tempfile.mkdtemp(prefix="lab-test-", dir=driver.REPO / "build"))
    booted: list[str] = []

    def build(log, *, rebuild=False, recipe=RECIPES["bookworm"]):
        if recipe.name == "trixie-k8s":
            raise RuntimeError("mmdebstrap failed with exit code 1")
        return Image(out, out / "k", out / "i", out / "r", "6.1.0-test")

    def run_profile(image, profile, out_dir, *rest):
        booted.append(profile.name)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "junit.xml").write_text('<testsuite tests="1" failures="0" errors="0" skipped="0">'
                                           '<testcase classname="t" name="ok"/></testsuite>')
        return VmRun(profile.name, out_dir, booted=True, boot_s=1.0, wall_s=2.0)

    monkeypatch.setattr(driver, "build_image", build)
    monkeypatch.setattr(driver, "run_profile", run_profile)
    monkeypatch.setattr(driver, "ensure_host_tools", lambda log: None)
    monkeypatch.setattr(driver, "shares_for", lambda venv: {})
    monkeypatch.setattr(driver, "build_models", lambda out, venv: out)
    try:
        rc = driver.main(["--profile", "v2-k8s", "--profile", "v1", "--out", str(out)])
        summary = json.loads((out / "summary.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    status = {p["profile"]: p for p in summary["profiles"]}
    assert booted == ["v1"] and status["v1"]["status"] == "passed"
    assert status["v2-k8s"]["status"] == "error" and "trixie-k8s could not be built" in status["v2-k8s"]["reason"]
    assert rc == 1 and "FAILED" in capsys.readouterr().out
