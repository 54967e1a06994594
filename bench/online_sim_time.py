"""How long the simulated sustained rate (reamer.plan.online_sim) takes per layout, and what it gives, for
ResNet-50 layouts with figures from a search on the 2-cpu machine (bench/RESULTS.md).

    .venv/bin/python -m bench.online_sim_time
"""
from __future__ import annotations

import statistics
import sys
import time


# layout, closed-loop samples/s and batch p99 ms as the search measured them (search_picks, 18:28 UTC)
LAYOUTS = [("2x1:b1", 38.8, 56.0), ("2x1:b4", 38.5, 215.0), ("1x2:b8", 39.1, 214.0), ("2x1:b8", 38.0, 431.0)]


def main() -> int:
    from reamer.plan.layout import parse_layout
    from reamer.plan.online_sim import layout_instances, sustained_rps

    for text, rps, p99 in LAYOUTS:
        instances = layout_instances(parse_layout(text), rps, p99, [])
        took, rate = [], 0.0
        for _ in range(5):
            started = time.perf_counter()
            rate = sustained_rps(instances, 1000.0)
            took.append(time.perf_counter() - started)
        print(f"{text:8} {rps:5.1f}/s closed loop, batch p99 {p99:4.0f} ms: sustains {rate:5.1f}/s under 1 s "
              f"({rate / rps:.0%}), {1000 * statistics.median(took):.0f} ms to simulate (median of 5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
