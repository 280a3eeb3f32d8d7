"""What one CUDA graph replay costs the host and the device, by the number of kernels in it.

A graph of N dependent tiny kernels (an in-place add on a few hundred floats) is captured for
each N; then, per N, the host time of `graph.replay()` alone (the cudaGraphLaunch call,
timed with perf_counter, the device drained between replays so no queue backs up) and the
device time of a replay between CUDA events. The host figure says whether a cycle's launch
cost grows with its graph's node count; the device figure is the floor a graph of N kernels
costs the GPU however small each kernel is.

    python benchmark/kernels/bench_graph_launch.py --kernels 25 100 200 400 800

Prints one JSON line per N: host us per replay (median), device us per replay (median), and
both per kernel.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_timing import capture, median_replay_ms


def add_n_times(x: torch.Tensor, n: int) -> None:
    for _ in range(n):
        x.add_(1.0)


def host_replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median host time of one replay call, the device idle before each."""
    times = []
    for _ in range(replays):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, nargs="+", default=[25, 100, 200, 400, 800])
    parser.add_argument("--numel", type=int, default=256, help="floats each kernel touches")
    parser.add_argument("--replays", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    x = torch.zeros(args.numel, device="cuda")
    for n in args.kernels:
        graph = capture(functools.partial(add_n_times, x, n), warmups=3)
        host_us = host_replay_us(graph, args.replays)
        device_us = median_replay_ms(graph, args.replays) * 1e3
        line = {
            "kernels": n,
            "host_us": round(host_us, 1),
            "device_us": round(device_us, 1),
            "host_us_per_kernel": round(host_us / n, 3),
            "device_us_per_kernel": round(device_us / n, 3),
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
