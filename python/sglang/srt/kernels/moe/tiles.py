"""Tile configurations of the fused-MoE kernels, chosen by the number of (token, slot) pairs.

`python benchmark/kernels/bench_moe.py --write-table` times candidate configs on
DeepSeek-V2-Lite's MoE layer and stores the best as kernels/tuned/moe-<GPU>.json, which
replaces TILE_TABLE's rows on that GPU up to its largest measured pair count.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.kernels.tuned import load_table


@dataclass(frozen=True)
class GemmTile:
    """One GEMM's launch: output channels and reduction channels per step of a program."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeKernelConfig:
    """block_m 1: per-pair GEMV kernels (no alignment; the w2 kernel also sums each token's
    slots, so there is no combine kernel). block_m >= 16: pairs sorted by expert into blocks
    of block_m rows for the grouped tl.dot GEMMs, then a combine kernel."""

    block_m: int
    w13: GemmTile
    w2: GemmTile

    def __post_init__(self) -> None:
        if self.block_m != 1 and (self.block_m < 16 or self.block_m & (self.block_m - 1)):
            raise ValueError(f"block_m is 1 (GEMV) or a power of two >= 16 (tl.dot), not {self.block_m}")


# (largest pair count, config): the first row whose bound is >= the batch's pairs is used.
# Up to 4 V2-Lite tokens (8 slots each) the GEMV kernels (tiles not yet tuned on an H200);
# then main's grouped-GEMM tiles: narrow N tiles for decode-sized blocks, as vLLM's tuned
# DeepSeek-V2-Lite H100 table picks at batch 1-2 (more programs in flight), 64 rows for prefill.
TILE_TABLE: tuple[tuple[int, MoeKernelConfig], ...] = (
    (32, MoeKernelConfig(1, GemmTile(16, 256, 4, 3), GemmTile(8, 128, 4, 4))),
    (64, MoeKernelConfig(16, GemmTile(32, 64, 4, 4), GemmTile(32, 64, 4, 4))),
    (sys.maxsize, MoeKernelConfig(64, GemmTile(64, 64, 4, 3), GemmTile(64, 64, 4, 3))),
)


def table_from_json(rows: list[dict]) -> tuple[tuple[int, MoeKernelConfig], ...]:
    """Measured rows ({"max_pairs", "config"}), then TILE_TABLE's rows for larger batches."""
    measured = tuple(
        (r["max_pairs"], MoeKernelConfig(r["config"]["block_m"], GemmTile(**r["config"]["w13"]), GemmTile(**r["config"]["w2"])))
        for r in rows
    )
    largest = measured[-1][0] if measured else 0
    return measured + tuple((bound, config) for bound, config in TILE_TABLE if bound > largest)


@functools.cache
def _device_table(device_index: int) -> tuple[tuple[int, MoeKernelConfig], ...]:
    stored = load_table("moe", torch.cuda.get_device_name(device_index))
    return TILE_TABLE if stored is None else table_from_json(stored)


def kernel_config(num_pairs: int, device: Optional[torch.device] = None) -> MoeKernelConfig:
    """The config for a batch of num_pairs (token, slot) pairs on `device` (TILE_TABLE off CUDA)."""
    table = _device_table(device.index or 0) if device is not None and device.type == "cuda" else TILE_TABLE
    return next(config for max_pairs, config in table if num_pairs <= max_pairs)
