"""Helpers shared by the attention kernels: KV index flattening and head-dim tiling."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang.srt.utils.int_math import next_power_of_2


@triton.jit
def _fill_kv_indices_kernel(
    req_to_token,
    req_pool_indices,
    kv_indptr,
    kv_indices,
    stride_row,
    BLOCK: tl.constexpr,
):
    # One program per request: copy its first seq_len slots from the request->token table.
    i = tl.program_id(0)
    row = tl.load(req_pool_indices + i).to(tl.int64)
    start = tl.load(kv_indptr + i)
    n = tl.load(kv_indptr + i + 1) - start
    for off in range(0, n, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        valid = cols < n
        slots = tl.load(req_to_token + row * stride_row + cols, mask=valid)
        tl.store(kv_indices + start + cols, slots, mask=valid)


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    """Fill kv_indices[kv_indptr[i]:kv_indptr[i+1]] with request i's KV slots, on device.

    kv_indices must hold at least kv_indptr[-1] entries (callers size it from host lengths
    or a static capacity, so nothing is read back).
    """
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    _fill_kv_indices_kernel[(bs,)](
        req_to_token, req_pool_indices, kv_indptr, kv_indices, req_to_token.stride(0), BLOCK=512
    )


@dataclass(frozen=True)
class HeadDimTiling:
    """How a key of lk channels and a value of lv channels map onto power-of-two tiles.

    Keys are split into a main part (the first d_main channels, shared with the value
    when lk > lv, as in MLA where k = latent ‖ rope and v = latent) and a remainder.
    """

    lk: int
    lv: int
    d_main: int
    block_d: int
    block_dpe: int  # 0 when the key has no remainder
    block_dv: int

    @staticmethod
    def of(lk: int, lv: int) -> "HeadDimTiling":
        if lk < lv:
            raise ValueError(f"key head dim {lk} smaller than value head dim {lv} is not supported")
        d_main = lv if lk > lv else lk
        tile = lambda d: max(16, next_power_of_2(d))  # tl.dot needs >= 16
        block_dpe = tile(lk - d_main) if lk > d_main else 0
        return HeadDimTiling(lk, lv, d_main, tile(d_main), block_dpe, tile(lv))


def q_heads_view(q: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """[T, H*D] (possibly a column slice of a fused projection) -> [T, H, D] with unit last stride."""
    q = q.view(q.shape[0], num_heads, head_dim)
    return q if q.stride(-1) == 1 else q.contiguous()
