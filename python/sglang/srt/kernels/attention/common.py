"""Helpers shared by the attention kernels: a batch's index arrays (KV and query offsets,
flattened KV slots, KV splits) built in one launch, head-dim tiling, and the query load and
running-softmax step of the decode and extend kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.utils.int_math import next_power_of_2

LOG2E = 1.4426950408889634  # the kernels keep scores in base 2: exp(x) = exp2(x * LOG2E)
PREFIX_BLOCK = 256  # earlier requests' lengths summed per step (one kernel variant for every bs)


@triton.jit
def _exclusive_sum(lengths, i, BLOCK: tl.constexpr):
    """sum(lengths[:i]) as int64, BLOCK entries a step."""
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for off in range(0, i, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        acc += tl.load(lengths + idx, mask=idx < i, other=0)
    return tl.sum(acc)


@triton.jit
def _kv_metadata_kernel(
    req_to_token,
    req_pool_indices,
    seq_lens,
    kv_indptr,
    kv_indices,
    extend_seq_lens,
    qo_indptr,
    num_kv_splits,
    stride_row,
    PREFIX_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    WRITE_QO: tl.constexpr,
    WRITE_SPLITS: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    # One program per request; each sums the lengths before its own, so no program reads
    # another's output. Stores cast to the outputs' dtypes (int32 indptrs and splits).
    i = tl.program_id(0)
    start = _exclusive_sum(seq_lens, i, PREFIX_BLOCK)
    n = tl.load(seq_lens + i)
    if i == 0:
        tl.store(kv_indptr, 0)
    tl.store(kv_indptr + i + 1, start + n)
    # Copy the request's first seq_len slots from the request->token table.
    row = tl.load(req_pool_indices + i).to(tl.int64)
    for off in range(0, n, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        valid = cols < n
        slots = tl.load(req_to_token + row * stride_row + cols, mask=valid)
        tl.store(kv_indices + start + cols, slots, mask=valid)
    if WRITE_QO:
        q_start = _exclusive_sum(extend_seq_lens, i, PREFIX_BLOCK)
        if i == 0:
            tl.store(qo_indptr, 0)
        tl.store(qo_indptr + i + 1, q_start + tl.load(extend_seq_lens + i))
    if WRITE_SPLITS:
        # decode.num_kv_splits's formula.
        splits = tl.minimum(tl.maximum((n + SPLIT_TOKENS - 1) // SPLIT_TOKENS, 1), MAX_SPLITS)
        tl.store(num_kv_splits + i, splits)


def build_kv_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    split_tokens: int,
    max_splits: int,
    num_kv_splits: Optional[torch.Tensor] = None,
    extend_seq_lens: Optional[torch.Tensor] = None,
    qo_indptr: Optional[torch.Tensor] = None,
) -> None:
    """Fill the paged-attention index arrays of a batch of bs requests in one launch, on device.

    kv_indptr ([bs + 1] int32) gets [0, cumsum(seq_lens)] and kv_indices[kv_indptr[i]:
    kv_indptr[i+1]] request i's KV slots; kv_indices must hold at least sum(seq_lens) entries
    (callers size it from host lengths or a static capacity, so nothing is read back). With
    num_kv_splits ([bs] int32): clamp(ceil(seq_lens / split_tokens), 1, max_splits), as
    decode.num_kv_splits with its constants. With qo_indptr ([bs + 1] int32): [0,
    cumsum(extend_seq_lens)].
    """
    bs = req_pool_indices.shape[0]
    if bs == 0:
        kv_indptr.zero_()
        if qo_indptr is not None:
            qo_indptr.zero_()
        return
    write_qo, write_splits = qo_indptr is not None, num_kv_splits is not None
    _kv_metadata_kernel[(bs,)](
        req_to_token,
        req_pool_indices,
        seq_lens,
        kv_indptr,
        kv_indices,
        extend_seq_lens if write_qo else seq_lens,  # placeholder pointers, never read or written
        qo_indptr if write_qo else kv_indptr,
        num_kv_splits if write_splits else kv_indptr,
        req_to_token.stride(0),
        PREFIX_BLOCK=PREFIX_BLOCK,
        BLOCK=512,
        WRITE_QO=write_qo,
        WRITE_SPLITS=write_splits,
        SPLIT_TOKENS=split_tokens,
        MAX_SPLITS=max_splits,
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
