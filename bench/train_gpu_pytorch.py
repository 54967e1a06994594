"""A real PyTorch GPU training loop, for users who have a GPU (optional; not imported by tests).

It writes per-iteration times in the same JSON format as the training emulator
(`reamer.workloads.training_emulator`, format "reamer-training-report/1", source "pytorch"),
so a real job can be measured — alone, or attached to reamer with `reamer train attach` — and
compared with the emulator's numbers. Needs `pip install torch` (torchvision optional: with it,
--model can name any torchvision classification model).

    python -m bench.train_gpu_pytorch --iterations 200 --model resnet18 --batch 64 \
        --loader-workers 4 --report train.json

The data pipeline does the same kind of CPU work as the emulator's loaders: decode (zlib),
random crop + flip + brightness, normalise — in DataLoader worker processes.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import zlib
from pathlib import Path

import numpy as np

FORMAT = "reamer-training-report/1"


def _need_torch():
    try:
        import torch
    except ImportError:
        sys.exit("error: PyTorch is not installed — fix: pip install torch (a CUDA build for a GPU), "
                 "or use the emulator: python -m reamer.workloads.training_emulator")
    return torch


class SyntheticImages:
    """A map-style dataset of compressed synthetic images, preprocessed on access."""

    MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
    STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

    def __init__(self, size: int, length: int, classes: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        yy, xx = np.mgrid[0:size, 0:size]
        self.blobs = []
        for _ in range(16):
            base = (xx * rng.uniform(0.5, 2) + yy * rng.uniform(0.5, 2)) % 256
            img = np.stack([base, base[::-1], base.T], axis=-1) + rng.integers(0, 24, (size, size, 3))
            self.blobs.append(zlib.compress(np.clip(img, 0, 255).astype(np.uint8).tobytes(), 6))
        self.size, self.length, self.classes = size, length, classes

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        rng = np.random.default_rng(i)
        s = self.size
        img = np.frombuffer(zlib.decompress(self.blobs[i % len(self.blobs)]), dtype=np.uint8).reshape(s, s, 3)
        padded = np.pad(img, ((8, 8), (8, 8), (0, 0)), mode="reflect")
        y, x = rng.integers(0, 17, 2)
        img = padded[y : y + s, x : x + s]
        if rng.random() < 0.5:
            img = img[:, ::-1]
        img = np.clip(img.astype(np.int16) + int(rng.integers(-20, 21)), 0, 255)
        norm = ((img.astype(np.float32) / 255.0 - self.MEAN) / self.STD).transpose(2, 0, 1)
        return np.ascontiguousarray(norm), i % self.classes


def _model(torch, name: str, classes: int):
    try:
        import torchvision

        return torchvision.models.get_model(name, num_classes=classes)
    except Exception:
        nn = torch.nn
        return nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.BatchNorm2d(128), nn.ReLU(),
            nn.Conv2d(128, 256, 3, stride=2, padding=1), nn.BatchNorm2d(256), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, classes),
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--duration", type=float, default=None, help="stop after S seconds instead")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--loader-workers", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--allow-cpu", action="store_true", help="run on the CPU when no GPU is present (for trying it)")
    p.add_argument("--ready-file", default=None)
    p.add_argument("--report", required=True)
    args = p.parse_args(argv)

    torch = _need_torch()
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        if not args.allow_cpu:
            sys.exit("error: no CUDA GPU visible to PyTorch — fix: run on a GPU machine, pass --allow-cpu to try it "
                     "on the CPU, or use the emulator: python -m reamer.workloads.training_emulator")
        device = "cpu"
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("now", True))

    data = SyntheticImages(args.image_size, 1 << 30, args.classes)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=False, num_workers=args.loader_workers,
                                         pin_memory=device != "cpu", persistent_workers=args.loader_workers > 0,
                                         prefetch_factor=2 if args.loader_workers > 0 else None)
    model = _model(torch, args.model, args.classes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    sync = (lambda: torch.cuda.synchronize()) if device != "cpu" else (lambda: None)

    records = []
    it = iter(loader)
    t_start = time.monotonic()
    cpu_start = time.process_time()
    deadline = t_start + args.duration if args.duration else None
    reason = "iterations"
    index = 0
    while True:
        if args.duration is None and index >= args.iterations:
            break
        if deadline is not None and time.monotonic() >= deadline:
            reason = "duration"
            break
        if stop["now"]:
            reason = "signal"
            break
        start = time.monotonic()
        x, y = next(it)
        got = time.monotonic()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        sync()
        end = time.monotonic()
        records.append({"index": index, "start": start, "end": end, "data_wait_ms": (got - start) * 1e3,
                        "synced": False})
        if index == 0 and args.ready_file:
            Path(args.ready_file).write_text(str(os.getpid()))
        index += 1
    wall = time.monotonic() - t_start
    # main process only: DataLoader workers' CPU is not included (they are still alive here)
    cpu = time.process_time() - cpu_start
    cpus = sorted(os.sched_getaffinity(0))
    report = {
        "format": FORMAT, "source": "pytorch",
        "config": {k: v for k, v in vars(args).items()}, "calibration": {}, "plan": {},
        "iterations": records, "iteration_ms": [(r["end"] - r["start"]) * 1e3 for r in records],
        "wall_s": wall, "cpu_s": cpu, "cpus": cpus, "duty_measured": cpu / (wall * len(cpus)) if wall else 0.0,
        "pid": os.getpid(), "stopped_by": reason,
        "extra": {"device": device, "torch": torch.__version__,
                  "gpu": torch.cuda.get_device_name(0) if device != "cpu" else None,
                  "cpu_s_note": "main process only (DataLoader workers excluded)"},
    }
    tmp = Path(f"{args.report}.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, args.report)
    ms = report["iteration_ms"][1:] or report["iteration_ms"]
    print(f"{len(records)} iterations on {device}, median {np.median(ms):.1f} ms; report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
