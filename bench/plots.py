"""PNG plots of a co-location bench run (matplotlib, no display needed)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

PLOTS = ("latency_cdf.png", "training_slowdown.png", "offline_throughput.png")


def _titles(data: dict[str, Any]) -> dict[str, str]:
    return {name: e["title"] for name, e in data["summary"].items()}


def plot_latency_cdfs(data: dict[str, Any], path: Path) -> None:
    titles = _titles(data)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    pooled: dict[str, list[float]] = {}
    for phase in data["phases"]:
        if phase["latencies_ms"]:
            pooled.setdefault(phase["strategy"], []).extend(phase["latencies_ms"])
    for name, lat in pooled.items():
        xs = np.sort(np.asarray(lat))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.plot(xs, ys, label=f"{titles.get(name, name)} (n={len(xs)})")
    slo = data["config"]["slo_ms"]
    ax.axvline(slo, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo:g} ms")
    ax.set_xscale("log")
    ax.set_xlabel("online latency (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Online latency CDF per strategy (all trials pooled)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, names: list[str], spreads: list[dict], scale: float, color: str) -> None:
    med = [s["median"] * scale if s and s["n"] else math.nan for s in spreads]
    lo = [(s["median"] - s["lo"]) * scale if s and s["n"] else 0 for s in spreads]
    hi = [(s["hi"] - s["median"]) * scale if s and s["n"] else 0 for s in spreads]
    x = np.arange(len(names))
    ax.bar(x, med, yerr=[lo, hi], capsize=4, color=color)
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    for xi, m in zip(x, med):
        if math.isfinite(m):
            ax.annotate(f"{m:.1f}", (xi, m), ha="center", va="bottom", fontsize=8)


def plot_training_slowdown(data: dict[str, Any], path: Path) -> None:
    rows = [(e["title"], e.get("slowdown_median")) for name, e in data["summary"].items()
            if "slowdown_median" in e and name != "training_alone"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if rows:
        _bars(ax, [r[0] for r in rows], [r[1] for r in rows], 100.0, "tab:red")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_ylabel("median iteration time vs training alone (%)")
    ax.set_title("Training slowdown per strategy (median of trials, bars: min–max)")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_offline_throughput(data: dict[str, Any], path: Path) -> None:
    rows = [(e["title"], e.get("offline_rps")) for e in data["summary"].values() if "offline_rps" in e]
    harvest = [(e["title"], e.get("harvest_ratio"), e.get("harvest_of_unused")) for e in data["summary"].values()
               if e.get("harvest_of_unused")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    if rows:
        _bars(axes[0], [r[0] for r in rows], [r[1] for r in rows], 1.0, "tab:blue")
    if harvest:
        x = np.arange(len(harvest))
        for offset, idx, label, color in ((-0.2, 1, "÷ idle time with training alone (/proc/stat)", "tab:green"),
                                          (0.2, 2, "÷ time training alone left unused", "tab:olive")):
            vals = [h[idx]["median"] if h[idx] and h[idx]["n"] else math.nan for h in harvest]
            axes[1].bar(x + offset, vals, width=0.4, label=label, color=color)
        axes[1].set_xticks(x)
        axes[1].set_xticklabels([h[0] for h in harvest], rotation=20, ha="right", fontsize=8)
        axes[1].legend(fontsize=7)
    axes[0].set_ylabel("offline inferences / s")
    axes[0].set_title("Offline throughput (median of trials, bars: min–max)")
    axes[1].set_ylabel("offline CPU time on training cores ÷ …")
    axes[1].set_title("Harvest ratio")
    axes[1].axhline(0.8, color="grey", linestyle="--", linewidth=1)
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(data: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in PLOTS]
    plot_latency_cdfs(data, paths[0])
    plot_training_slowdown(data, paths[1])
    plot_offline_throughput(data, paths[2])
    return paths


if __name__ == "__main__":
    import json
    import sys

    src = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/colocation/colocation.json")
    for p in plot_all(json.loads(src.read_text()), src.parent):
        print(p)
