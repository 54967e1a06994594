"""Container images built locally (no registry is reachable from the lab VM): an OCI image layout tar of a
directory tree, one uncompressed layer, importable with `ctr -n k8s.io images import`."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


def _layer(rootfs: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(rootfs.rglob("*")):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(rootfs)))
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            if info.isreg():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return buf.getvalue()


def oci_image_tar(rootfs: Path, out: Path, name: str, cmd: list[str]) -> Path:
    """Writes `out`, an OCI image layout tar of `rootfs` named `name` (a full reference such as
    docker.io/reamer/busybox:1, the form the CRI plugin looks images up by) whose default command is `cmd`."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes, media_type: str) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    layer = _layer(rootfs)
    layer_desc = blob(layer, OCI_LAYER)
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Cmd": cmd, "Env": ["PATH=/bin:/usr/bin:/sbin:/usr/sbin"], "WorkingDir": "/"},
              "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]}}  # uncompressed: digest == diff_id
    config_desc = blob(json.dumps(config, sort_keys=True).encode(), OCI_CONFIG)
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config_desc, "layers": [layer_desc]}
    manifest_desc = blob(json.dumps(manifest, sort_keys=True).encode(), OCI_MANIFEST)
    manifest_desc["platform"] = {"architecture": "amd64", "os": "linux"}
    manifest_desc["annotations"] = {"io.containerd.image.name": name,
                                    "org.opencontainers.image.ref.name": name.rpartition(":")[2]}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [manifest_desc]}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w") as tar:
        def add(arcname: str, data: bytes) -> None:
            info = tarfile.TarInfo(arcname)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        add("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        add("index.json", json.dumps(index).encode())
        for digest, data in blobs.items():
            add(f"blobs/sha256/{digest.removeprefix('sha256:')}", data)
    return out
