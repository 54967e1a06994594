"""The lab's VM images: Debian's kernel, a busybox initrd and an ext4 root filesystem with systemd and the
host's software, all from Debian packages, built once and cached outside the checkout, keyed by a hash of
the recipe (its constants and the files in lab/guest/image/). One recipe per image: `bookworm` (python3,
podman, docker, Slurm) and `trixie-k8s` (Debian 13 with containerd 1.7 for NRI); a profile names its image."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lab.errors import LabSkip

SUITE = "bookworm"
KERNEL_META = "linux-image-amd64"  # resolved with the host's apt (bookworm): every image boots Debian 12's kernel
PACKAGES = (
    "systemd-sysv", "udev", "dbus", "kmod", "python3", "iproute2", "procps", "numactl", "util-linux",
    "libsqlite3-0", "libssl3", "libffi8",  # what the shared CPython build links against
    "podman", "docker.io", "containerd", "runc", "crun",
    "slurmctld", "slurmd", "slurm-client", "munge",  # tests/hosts/test_slurm.py: a private cluster per test run
)
# Drivers a q35 VM never uses: less to copy, smaller image.
STRIP_MODULES = (
    "sound", "drivers/gpu", "drivers/media", "drivers/net/wireless", "drivers/net/ethernet", "drivers/net/usb",
    "drivers/net/can", "drivers/infiniband", "drivers/usb", "drivers/staging", "drivers/iio", "drivers/hid",
    "drivers/comedi", "drivers/mtd", "drivers/isdn", "drivers/bluetooth", "drivers/video", "drivers/target",
    "drivers/mmc", "drivers/hwmon", "drivers/platform",
)
INITRD_MODULES = ("virtio_pci", "virtio_blk", "ext4")
BUSYBOX_APPLETS = ("sh", "ls", "cat", "echo", "id", "hostname", "uname", "ps", "sleep", "mount", "true")
IMAGE_SIZE = "6G"
HOST_TOOLS = {  # command -> Debian package
    "qemu-system-x86_64": "qemu-system-x86",
    "mmdebstrap": "mmdebstrap",
    "mkfs.ext4": "e2fsprogs",
    "cpio": "cpio",
    "dpkg-deb": "dpkg",
    "apt-get": "apt",
}
CACHE_ROOT = Path(os.environ.get("REAMER_LAB_CACHE", "/var/cache/reamer-lab"))
GUEST_DIR = Path(__file__).resolve().parent / "guest"


@dataclass(frozen=True)
class Recipe:
    """What goes into one image. The bookworm recipe hashes exactly as the single image before it did, so
    its cached image stays valid; that hash leaves out its name and disable_units (changing those for
    bookworm needs the trailing format number in hash_fields bumped)."""
    name: str
    suite: str
    packages: tuple[str, ...]
    disable_units: tuple[tuple[str, ...], ...]  # units the packages enable that a profile starts only on demand

    def hash_fields(self) -> list:
        fields = [self.suite, KERNEL_META, self.packages, STRIP_MODULES, INITRD_MODULES, BUSYBOX_APPLETS,
                  IMAGE_SIZE, 2]
        return fields if self.name == "bookworm" else [*fields, self.name, self.disable_units]


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("bookworm", SUITE, PACKAGES, (("docker.service", "docker.socket", "containerd.service"),
                                         ("slurmctld.service", "slurmd.service", "munge.service"))),
    # Debian 13: containerd 1.7 (NRI v2) and runc, nothing else, so it builds fast. The t64 names are the
    # libraries the shared CPython build links against (`ldd` of its lib-dynload; libcrypt1, zlib, lzma and
    # bzip2 come with minbase).
    Recipe("trixie-k8s", "trixie",
           ("systemd-sysv", "udev", "dbus", "kmod", "iproute2", "procps", "util-linux",
            "libssl3t64", "libffi8", "libsqlite3-0", "libexpat1", "libncursesw6", "libreadline8t64", "libuuid1",
            "containerd", "runc"),
           (("containerd.service",),)),
)}


@dataclass(frozen=True)
class Image:
    directory: Path
    kernel: Path
    initrd: Path
    rootfs: Path
    kernel_version: str


def recipe_hash(recipe: Recipe = RECIPES["bookworm"]) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps(recipe.hash_fields()).encode())
    for file in sorted([*(GUEST_DIR / "image").rglob("*"), GUEST_DIR / "initrd-init"]):
        if file.is_file():
            digest.update(str(file.relative_to(GUEST_DIR)).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def _run(cmd: list[str] | str, log: Path, *, cwd: Path | None = None, timeout: float = 900) -> str:
    with log.open("a") as out:
        out.write(f"$ {cmd if isinstance(cmd, str) else ' '.join(cmd)}\n")
        out.flush()
        result = subprocess.run(cmd, cwd=cwd, shell=isinstance(cmd, str), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, timeout=timeout)
        out.write(result.stdout)
    if result.returncode != 0:
        raise RuntimeError(f"{cmd!r} failed with exit code {result.returncode}; see {log}")
    return result.stdout


def ensure_host_tools(log: Path) -> None:
    """Install the missing host tools with apt-get (we are root on lab hosts); skip the lab where we cannot."""
    missing = sorted({pkg for tool, pkg in HOST_TOOLS.items() if shutil.which(tool) is None})
    if not missing:
        return
    if os.geteuid() != 0:
        raise LabSkip(f"host tools missing ({', '.join(missing)}) and not root to install them",
                      f"apt-get install {' '.join(missing)}, or run make test-hosts as root")
    if shutil.which("apt-get") is None:
        raise LabSkip(f"host tools missing ({', '.join(missing)}) and no apt-get to install them",
                      "install QEMU, mmdebstrap, e2fsprogs and cpio by hand")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]):
        result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
        with log.open("a") as out:
            out.write(result.stdout)
        if result.returncode != 0:
            raise LabSkip(f"cannot install host tools {', '.join(missing)} ({' '.join(cmd)} exit "
                          f"{result.returncode}; see {log})", "install them by hand, or give the host the Debian archive")


def _fetch_deb(package: str, into: Path, log: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    _run(["apt-get", "download", package], log, cwd=into)
    debs = sorted(into.glob(f"{package}_*.deb"))
    if not debs:
        raise RuntimeError(f"apt-get download {package} left no .deb in {into}")
    return debs[-1]


def _kernel_package(log: Path) -> str:
    out = _run(["apt-cache", "depends", KERNEL_META], log)
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Depends: linux-image-"):
            return line.split()[1]
    raise RuntimeError(f"cannot resolve {KERNEL_META} to a kernel package (apt-cache depends); see {log}")


def _build_initrd(work: Path, rootfs: Path, busybox: Path, kver: str, log: Path) -> Path:
    root = work / "initrd-root"
    for sub in ("bin", "dev", "proc", "sys", "newroot", "mod"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox, root / "bin/busybox")
    for applet in ("sh", "mount", "umount", "insmod", "switch_root", "sleep", "cat", "mkdir", "echo"):
        (root / "bin" / applet).symlink_to("busybox")
    out = _run(["chroot", str(rootfs), "modprobe", "-S", kver, "--show-depends", "-a", *INITRD_MODULES], log)
    modules: list[str] = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "insmod" and parts[1] not in modules:
            modules.append(parts[1])
    for i, module in enumerate(modules, 1):
        shutil.copy2(rootfs / module.lstrip("/"), root / "mod" / f"{i:02d}-{Path(module).name}")
    shutil.copy2(GUEST_DIR / "initrd-init", root / "init")
    (root / "init").chmod(0o755)
    initrd = work / "initrd.img"
    _run(f"cd {root} && find . | cpio -o -H newc --quiet | gzip -1 > {initrd}", log)
    return initrd


def build_image(log: Path, *, rebuild: bool = False, recipe: Recipe = RECIPES["bookworm"]) -> Image:
    """The cached image for this recipe, built first if missing (about a minute on 2 cores)."""
    key = recipe_hash(recipe)
    final = CACHE_ROOT / key
    if rebuild and final.exists():
        shutil.rmtree(final)
    if not (final / "image.json").exists():
        if os.geteuid() != 0:
            raise LabSkip("the lab image is not built and building it needs root (mmdebstrap, chroot)",
                          "run make test-hosts as root once")
        CACHE_ROOT.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f"build-{key}-", dir=CACHE_ROOT))
        try:
            _build_into(work, log, recipe)
            if not final.exists():  # another run may have finished the same recipe meanwhile
                os.replace(work / "out", final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    meta = json.loads((final / "image.json").read_text())
    return Image(final, final / "vmlinuz", final / "initrd.img", final / "rootfs.ext4", meta["kernel_version"])


def _build_into(work: Path, log: Path, recipe: Recipe) -> None:
    kernel_pkg = _kernel_package(log)
    kernel_root = work / "kernel"
    _run(["dpkg-deb", "-x", str(_fetch_deb(kernel_pkg, work / "debs", log)), str(kernel_root)], log)
    kver = kernel_pkg.removeprefix("linux-image-")
    bb_root = work / "busybox"
    _run(["dpkg-deb", "-x", str(_fetch_deb("busybox-static", work / "debs", log)), str(bb_root)], log)
    busybox = bb_root / "bin/busybox"

    rootfs = work / "rootfs"
    overlay = GUEST_DIR / "image"
    modules = kernel_root / "lib/modules" / kver
    hooks = [
        f"sync-in {overlay} /",
        'chroot "$1" passwd -d root',
        f'mkdir -p "$1/lib/modules" && cp -a {modules} "$1/lib/modules/"',
        f'cd "$1/lib/modules/{kver}/kernel" && rm -rf {" ".join(STRIP_MODULES)}',
        f'chroot "$1" depmod {kver}',
        # The kernel's config where Debian puts it, so tools (and reamer doctor) can read it.
        f'cp {kernel_root}/boot/config-{kver} "$1/boot/"',
        'chroot "$1" systemctl enable reamer-lab.service',
        # Container engines and Slurm stay off unless a profile or a test starts them (systemd.wants= on the
        # kernel line).
        *(f'chroot "$1" systemctl disable {" ".join(units)} || true' for units in recipe.disable_units),
        'chroot "$1" useradd -m -s /bin/bash labuser',
        'rm -f "$1"/etc/machine-id "$1"/var/lib/dbus/machine-id; : > "$1"/etc/machine-id',
    ]
    cmd = ["mmdebstrap", "--variant=minbase", "--mode=root", f"--include={','.join(recipe.packages)}"]
    cmd += [f"--customize-hook={hook}" for hook in hooks]
    cmd += [recipe.suite, str(rootfs)]
    _run(cmd, log, timeout=1800)

    # A tiny busybox root filesystem for local container images (no registry is reachable from the VM).
    ctr = rootfs / "opt/ctr-rootfs"
    for sub in ("bin", "etc", "proc", "sys", "dev", "tmp"):
        (ctr / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox, ctr / "bin/busybox")
    for applet in BUSYBOX_APPLETS:
        (ctr / "bin" / applet).symlink_to("busybox")
    _run(["tar", "-C", str(ctr), "-cf", str(rootfs / "opt/ctr-rootfs.tar"), "."], log)

    out = work / "out"
    out.mkdir()
    initrd = _build_initrd(work, rootfs, busybox, kver, log)
    shutil.move(str(initrd), out / "initrd.img")
    shutil.copy2(kernel_root / "boot" / f"vmlinuz-{kver}", out / "vmlinuz")
    _run(["mkfs.ext4", "-q", "-F", "-L", "vmroot", "-E", "lazy_itable_init=0,lazy_journal_init=0", "-d", str(rootfs),
          str(out / "rootfs.ext4"), IMAGE_SIZE], log)
    (out / "image.json").write_text(json.dumps({"kernel_version": kver, "kernel_package": kernel_pkg,
                                                "packages": list(recipe.packages), "suite": recipe.suite,
                                                "recipe": recipe.name}, indent=1))
