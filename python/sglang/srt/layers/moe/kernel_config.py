"""Tile configurations of the fused-MoE kernels, chosen by the number of (token, slot) pairs.

To retune, edit TILE_TABLE: `python benchmark/kernels/bench_moe.py` times candidate configs
on DeepSeek-V2-Lite's MoE layer and prints the rows it recommends.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


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


def kernel_config(num_pairs: int) -> MoeKernelConfig:
    return next(config for max_pairs, config in TILE_TABLE if num_pairs <= max_pairs)
