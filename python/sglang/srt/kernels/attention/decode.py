"""Paged decode attention, one query token per request, split-KV (flash-decoding).

Stage 1: each program takes one request, one block of BLOCK_H query heads that share a
KV head (GQA group, or all heads for MLA's single latent head) and one contiguous split
of the request's KV; it writes that split's normalized output and its base-2
log-sum-exp. Stage 2 merges the splits. The number of splits per request is a device
tensor (more splits for longer contexts), so the grid is static for a given batch size.
Wide keys (MLA's 576 channels) take 32-token KV blocks (default_tile); they split each
request twice as finely (SPLIT_SCALE), so that a short context still costs each program a
single block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.kernels.attention.common import LOG2E, HeadDimTiling, attend_kv_block, load_q_tile
from sglang.srt.kernels.launch import cache_line_elems, pdl_launch, prefetch_l2, signals_dependents
from sglang.srt.utils.int_math import cdiv, next_power_of_2
from sglang.srt.utils.triton_precision import dot_precision

MAX_KV_SPLITS = 16  # grid size along the split axis (a power of two: stage 2 tiles it)
MIN_TOKENS_PER_SPLIT = 64
BLOCK_H = 16  # query heads per program; tl.dot needs >= 16 rows


@dataclass(frozen=True)
class DecodeTile:
    """Stage 1's launch: KV tokens per block step (also a split's fewest tokens: a short
    context costs each program one block), warps and pipeline stages."""

    block_n: int
    num_warps: int
    num_stages: int = 2


def default_tile(tiling: HeadDimTiling) -> DecodeTile:
    """Wide keys (MLA's 576 channels) take 32-token blocks and 8 warps: with 4, the [16, 512]
    accumulator, q and the K and V blocks need more than 255 registers a thread and spill.
    No other tile of benchmark/kernels/bench_mla_decode.py is faster at every batch size and
    context (16-token blocks win below ~256 tokens, 64-token ones beyond ~1K; docs/benchmarks.md)."""
    return DecodeTile(64, 4) if tiling.block_d <= 256 else DecodeTile(32, 8)


def num_kv_splits(seq_lens: torch.Tensor) -> torch.Tensor:
    """Split units per request: one per MIN_TOKENS_PER_SPLIT tokens, capped (device op, no sync).
    A kernel of BLOCK_N-token blocks runs MIN_TOKENS_PER_SPLIT // BLOCK_N splits per unit.
    common.build_kv_metadata computes the same in its kernel, from these constants."""
    return ((seq_lens + MIN_TOKENS_PER_SPLIT - 1) // MIN_TOKENS_PER_SPLIT).clamp(1, MAX_KV_SPLITS).to(torch.int32)


@triton.jit
def _decode_stage1_kernel(
    Q,
    K,
    V,
    kv_indptr,
    kv_indices,
    num_splits_ptr,
    Part_O,
    Part_LSE,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    LK: tl.constexpr,
    LV: tl.constexpr,
    D_MAIN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_SCALE: tl.constexpr,
    PDL: tl.constexpr,
    K_LINES: tl.constexpr,
    LINE_ELEMS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)

    num_splits = tl.minimum(tl.load(num_splits_ptr + b) * SPLIT_SCALE, tl.num_programs(2))
    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    split_len = (kv_len + num_splits - 1) // num_splits
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_len)  # empty (lo >= hi) for splits past num_splits
    if PDL:
        # Launched while the previous kernel (MLA's rope step, which stores the new token's
        # K) still runs: the metadata read above was written before the forward. Stream the
        # first block's K rows into L2 (a prefetch binds no value, so the new token's row is
        # read after the wait), then wait for that kernel's writes (q, the new row).
        offs_n = lo + tl.arange(0, BLOCK_N)
        slots = tl.load(kv_indices + kv_start + offs_n, mask=offs_n < hi, other=0).to(tl.int64)
        lines = tl.minimum(tl.arange(0, K_LINES) * LINE_ELEMS, LK - 1)
        prefetch_l2(K + slots[:, None] * stride_kn + kv_head * stride_kh + lines[None, :])
        tl.extra.cuda.gdc_wait()

    offs_g = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    valid_h = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_dv = tl.arange(0, BLOCK_DV)
    q, q_pe = load_q_tile(Q + b * stride_qb + heads[:, None] * stride_qh, valid_h, D_MAIN, LK, BLOCK_D, BLOCK_DPE)

    k_head, v_head = K + kv_head * stride_kh, V + kv_head * stride_vh
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid_n = offs_n < hi
        acc, l_i, m_i = attend_kv_block(
            q,
            q_pe,
            acc,
            l_i,
            m_i,
            kv_indices + kv_start,
            offs_n,
            valid_n,
            valid_n[None, :],
            k_head,
            v_head,
            stride_kn,
            stride_vn,
            qk_scale,
            D_MAIN,
            LK,
            LV,
            BLOCK_D,
            BLOCK_DPE,
            BLOCK_DV,
            DOT_PRECISION,
        )

    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    tl.store(
        Part_O + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_dv[None, :],
        out,
        mask=valid_h[:, None] & (offs_dv[None, :] < LV),
    )
    tl.store(Part_LSE + b * stride_lb + heads * stride_lh + split, lse, mask=valid_h)


@triton.jit
def _decode_stage2_kernel(
    Part_O,
    Part_LSE,
    O,  # noqa: E741  (O: the output)
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_fb,
    stride_fh,
    LV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    SIGNAL_DEPENDENTS: tl.constexpr,
):
    # Merges all MAX_SPLITS splits: stage 1 writes every one, an empty split as lse -inf and
    # output 0 (weight 0). So no load waits for the request's split count. The next kernel
    # (MLA's W_UV matmul, PDL-launched) may start at once and load its weights.
    if SIGNAL_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, MAX_SPLITS)
    offs_dv = tl.arange(0, BLOCK_DV)
    lse = tl.load(Part_LSE + b * stride_lb + h * stride_lh + offs_s)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # empty KV: every weight is 0
    w = tl.exp2(lse - m)
    part = tl.load(
        Part_O + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_dv[None, :],
        mask=offs_dv[None, :] < LV,
        other=0.0,
    )
    denom = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(O + b * stride_fb + h * stride_fh + offs_dv, out.to(O.dtype.element_ty), mask=offs_dv < LV)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_splits: torch.Tensor,
    scaling: float,
    tile: Optional[DecodeTile] = None,
) -> None:
    """q: [bs, H, Lk]; k_cache: [slots, Hkv, Lk]; v_cache: [slots, Hkv, Lv]; out: [bs, H, Lv].

    Request i attends to the slots kv_indices[kv_indptr[i]:kv_indptr[i+1]]; num_splits[i]
    (int32, 1..MAX_KV_SPLITS, num_kv_splits's units) sets how many programs share its KV.
    `tile` overrides default_tile (benchmarks).
    """
    bs, num_heads, lk = q.shape
    num_kv_heads, lv = k_cache.shape[1], v_cache.shape[-1]
    if bs == 0:
        return
    tiling = HeadDimTiling.of(lk, lv)
    group = num_heads // num_kv_heads
    head_blocks = cdiv(group, BLOCK_H)
    part_o = torch.empty((bs, num_heads, MAX_KV_SPLITS, lv), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((bs, num_heads, MAX_KV_SPLITS), dtype=torch.float32, device=q.device)
    tile = tile or default_tile(tiling)
    pdl = signals_dependents(q.device)
    line = cache_line_elems(k_cache)
    split_scale = MIN_TOKENS_PER_SPLIT // tile.block_n
    _decode_stage1_kernel[(bs, num_kv_heads * head_blocks, MAX_KV_SPLITS)](
        q,
        k_cache,
        v_cache,
        kv_indptr,
        kv_indices,
        num_splits,
        part_o,
        part_lse,
        scaling * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        HEAD_BLOCKS=head_blocks,
        LK=lk,
        LV=lv,
        D_MAIN=tiling.d_main,
        BLOCK_D=tiling.block_d,
        BLOCK_DPE=tiling.block_dpe,
        BLOCK_DV=tiling.block_dv,
        BLOCK_H=BLOCK_H,
        BLOCK_N=tile.block_n,
        SPLIT_SCALE=split_scale,
        PDL=pdl,
        K_LINES=next_power_of_2(cdiv(lk, line)),
        LINE_ELEMS=line,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl_launch(pdl),
    )
    merge_kv_splits(part_o, part_lse, out, signal_dependents=pdl)


def merge_kv_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, signal_dependents: bool = False) -> None:
    """Stage 2: out[r, h] = the splits' partial outputs part_o[r, h, s] ([R, H, S, Lv] float32)
    weighted by exp2 of their base-2 LSEs part_lse[r, h, s] ([R, H, S]; S a power of two,
    every split written, an empty one as -inf). signal_dependents: the next kernel is
    PDL-launched and waits for this one's writes."""
    rows, num_heads, splits, lv = part_o.shape
    _decode_stage2_kernel[(rows, num_heads)](
        part_o,
        part_lse,
        out,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        LV=lv,
        BLOCK_DV=HeadDimTiling.of(lv, lv).block_dv,
        MAX_SPLITS=splits,
        SIGNAL_DEPENDENTS=signal_dependents,
        num_warps=4,
    )
