"""Container images built here, with no registry: an OCI image tar of a one-layer busybox rootfs."""
from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

BUSYBOX = shutil.which("busybox") or "/bin/busybox"
APPLETS = ("sh", "sleep", "cat", "grep", "ls", "true", "echo", "nproc", "head")


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


def _layer() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("bin", "tmp", "proc", "sys", "dev", "etc"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if directory == "tmp" else 0o755
            tar.addfile(info)
        binary = Path(BUSYBOX).read_bytes()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = len(binary), 0o755
        tar.addfile(info, io.BytesIO(binary))
        for applet in APPLETS:
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
    return buf.getvalue()


def build_image(tar_path: Path, refs: list[str], entrypoint: list[str]) -> Path:
    """An OCI image layout tar with one image, named by every ref (`ctr images import` reads the
    io.containerd.image.name annotation)."""
    layer = _layer()
    layer_digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": entrypoint, "Env": ["PATH=/bin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }).encode()
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest,
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest,
                    "size": len(layer)}],
    }).encode()
    manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    index = json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest,
         "size": len(manifest), "platform": {"architecture": "amd64", "os": "linux"},
         "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[-1]}}
        for ref in refs]}).encode()
    with tarfile.open(tar_path, "w") as tar:
        _add(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _add(tar, "index.json", index)
        for digest, data in ((layer_digest, layer), (config_digest, config), (manifest_digest, manifest)):
            _add(tar, "blobs/sha256/" + digest.split(":", 1)[1], data)
    return tar_path
