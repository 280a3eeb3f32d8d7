"""Where the time of profiled iterations goes, from a torch profiler trace (chrome JSON).

    python benchmark/trace_summary.py TRACE.trace.json.gz --iterations 20

Prints one JSON object: the traced span, how much of it the device was busy (the union of
kernel, memcpy and memset intervals), the device's idle gaps by size, and per CUDA runtime
or driver call (graph launches, kernel launches, copies, synchronizations) its count and
host time. Figures per iteration divide by --iterations. The profiler itself slows host
calls down, so the host figures are upper bounds; the device busy time is not inflated.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from itertools import pairwise

_DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
_HOST_CALL_CATEGORIES = {"cuda_runtime", "cuda_driver"}
_GAP_BOUNDS_US = (5, 20, 100, 1000)


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """The union of the device's activity intervals (microseconds), sorted."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in _DEVICE_CATEGORIES)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _gap_label(gap_us: float) -> str:
    """The size class of an idle gap: "<5us", "5-20us", ..., ">=1000us"."""
    lower = 0
    for upper in _GAP_BOUNDS_US:
        if gap_us < upper:
            return f"<{upper}us" if lower == 0 else f"{lower}-{upper}us"
        lower = upper
    return f">={lower}us"


def summarize(events: list[dict], iterations: int) -> dict:
    busy = busy_intervals(events)
    if not busy:
        return {"error": "no device activity in the trace"}
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(e - s for s, e in busy)
    gaps = [b[0] - a[1] for a, b in pairwise(busy)]
    gap_counts: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for gap in gaps:
        counts = gap_counts[_gap_label(gap)]
        counts[0] += 1
        counts[1] += gap
    calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in _HOST_CALL_CATEGORIES:
            calls[e["name"]][0] += 1
            calls[e["name"]][1] += e["dur"]
    kernels = sum(1 for e in events if e.get("cat") == "kernel")
    per = float(iterations)
    return {
        "iterations": iterations,
        "device_span_us_per_iter": round(span / per, 1),
        "device_busy_us_per_iter": round(busy_us / per, 1),
        "device_busy_fraction": round(busy_us / span, 3),
        "kernels_per_iter": round(kernels / per, 1),
        "idle_gaps_per_iter": {
            k: {"count": round(n / per, 1), "us": round(t / per, 1)} for k, (n, t) in sorted(gap_counts.items())
        },
        "host_calls_per_iter": {
            name: {"count": round(n / per, 1), "us": round(t / per, 1)}
            for name, (n, t) in sorted(calls.items(), key=lambda kv: -kv[1][1])
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--iterations", type=int, default=1, help="profiled iterations in the trace")
    args = parser.parse_args()
    print(json.dumps(summarize(load_events(args.trace), args.iterations), indent=1))


if __name__ == "__main__":
    main()
