"""Helpers shared by the attention kernels: KV index flattening, head-dim tiling, and the
query load and running-softmax step of the decode and extend kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang.srt.utils.int_math import next_power_of_2

LOG2E = 1.4426950408889634  # the kernels keep scores in base 2: exp(x) = exp2(x * LOG2E)


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
    _fill_kv_indices_kernel[(bs,)](req_to_token, req_pool_indices, kv_indptr, kv_indices, req_to_token.stride(0), BLOCK=512)


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
    def of(lk: int, lv: int) -> HeadDimTiling:
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


@triton.jit
def load_q_tile(q_rows, valid_rows, D_MAIN: tl.constexpr, LK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr):
    """(q [rows, BLOCK_D], q_pe [rows, BLOCK_DPE]): a query tile's first D_MAIN channels and its
    channels D_MAIN..LK (HeadDimTiling's split; q_pe is q, unused, when BLOCK_DPE is 0).
    q_rows: [rows, 1] pointers to each row's channel 0; invalid rows load as 0."""
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_rows + offs_d[None, :], mask=valid_rows[:, None] & (offs_d[None, :] < D_MAIN), other=0.0)
    q_pe = q
    if BLOCK_DPE > 0:
        offs_pe = D_MAIN + tl.arange(0, BLOCK_DPE)
        q_pe = tl.load(q_rows + offs_pe[None, :], mask=valid_rows[:, None] & (offs_pe[None, :] < LK), other=0.0)
    return q, q_pe


@triton.jit
def attend_kv_block(
    q,
    q_pe,
    acc,
    l_i,
    m_i,
    slot_ptr,
    offs_n,
    valid_n,
    visible,
    K_head,
    V_head,
    stride_kn,
    stride_vn,
    qk_scale,
    D_MAIN: tl.constexpr,
    LK: tl.constexpr,
    LV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One step of the running (online) softmax over the KV block of tokens offs_n.

    Reads the block's slots (slot_ptr[offs_n], valid_n: [BLOCK_N]), scores the query tile
    (load_q_tile's q, q_pe) against their keys, masks the scores to `visible` ([rows,
    BLOCK_N]) in base 2 (qk_scale includes LOG2E), and returns (acc, l_i, m_i) updated with
    the block's values: acc [rows, BLOCK_DV] and l_i [rows] the sums of exp2(score - m_i)
    times values and alone, m_i [rows] the running maximum. A row with no visible column
    so far keeps acc = l_i = 0 and m_i = -inf. K_head / V_head point at the KV head's
    channel 0 of slot 0.
    """
    slots = tl.load(slot_ptr + offs_n, mask=valid_n, other=0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    k = tl.load(  # [BLOCK_D, BLOCK_N]
        K_head + slots[None, :] * stride_kn + offs_d[:, None],
        mask=valid_n[None, :] & (offs_d[:, None] < D_MAIN),
        other=0.0,
    )
    qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION)
    if BLOCK_DPE > 0:
        offs_pe = D_MAIN + tl.arange(0, BLOCK_DPE)
        k_pe = tl.load(
            K_head + slots[None, :] * stride_kn + offs_pe[:, None],
            mask=valid_n[None, :] & (offs_pe[:, None] < LK),
            other=0.0,
        )
        qk += tl.dot(q_pe, k_pe.to(q_pe.dtype), input_precision=DOT_PRECISION)
    qk = tl.where(visible, qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    offs_dv = tl.arange(0, BLOCK_DV)
    v = tl.load(
        V_head + slots[:, None] * stride_vn + offs_dv[None, :],
        mask=valid_n[:, None] & (offs_dv[None, :] < LV),
        other=0.0,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, l_i, m_new
