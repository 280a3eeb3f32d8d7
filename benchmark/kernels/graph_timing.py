"""Timing a captured CUDA graph: the median of several replays, each between CUDA events."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def capture(launches: Callable[[], object], warmups: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of what `launches` enqueues (its kernels compiled beforehand), replayed `warmups` times."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launches()
    for _ in range(warmups):
        graph.replay()
    torch.cuda.synchronize()
    return graph


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
