"""Timing a captured CUDA graph: the median of several replays, each between CUDA events."""

from __future__ import annotations

import statistics

import torch


def median_replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
