"""Paged prefill/extend attention: new query tokens over cached prefix + themselves.

One program per (request, query head, block of BLOCK_M new tokens); under a tree mask and for
short queries (verify trees, draft extends: at most SHORT_QUERY_ROWS rows of token x query
head), per (request, KV head, block): the KV head's query heads share the tile's rows. New tokens' K/V are already in
the pool (the backend saves them first), so every key is read through the flattened slot
index. Visibility is causal (query row r of a request with prefix p sees columns 0..p+r), or,
with a custom mask of `tree_cols` columns per query row, every column before the request's
last tree_cols and, of those last tree_cols, the ones the row's mask marks (tree verify,
draft steps).

Short queries of few requests would leave most SMs idle while one program walks a long
prefix, so their KV is split (flash-decoding): each of `splits` programs per tile takes a
contiguous run of whole KV blocks and writes its normalized partial output and base-2
log-sum-exp; decode's stage 2 merges them per (token, head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.kernels.attention.common import LOG2E, HeadDimTiling, attend_kv_block, load_q_tile
from sglang.srt.kernels.attention.decode import MAX_KV_SPLITS, merge_kv_splits
from sglang.srt.kernels.launch import sm_count
from sglang.srt.utils.int_math import cdiv, next_power_of_2
from sglang.srt.utils.triton_precision import dot_precision

SHORT_QUERY_ROWS = 64  # token x query-head rows of a KV head up to which a query is "short"


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    O,  # noqa: E741  (O: the output)
    qo_indptr,
    kv_indptr,
    kv_indices,
    Mask,
    tree_cols,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ot,
    stride_oh,
    Part_O,
    Part_LSE,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    GROUP: tl.constexpr,
    LK: tl.constexpr,
    LV: tl.constexpr,
    D_MAIN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_MASK: tl.constexpr,
    PACK: tl.constexpr,
    SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # PACK query heads of one KV head share a program: tile row g holds token g // PACK of
    # head first_head + g % PACK, so short queries (trees) fill the tile and read K/V once.
    # Axis 2 enumerates (query block, KV split); with SPLITS > 1 a program writes its split's
    # partial output and LSE (every split, an empty one as lse -inf) instead of O.
    b = tl.program_id(0)
    first_head = tl.program_id(1) * PACK
    m_block = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    kv_head = first_head // GROUP

    q_start = tl.load(qo_indptr + b)
    q_len = tl.load(qo_indptr + b + 1) - q_start
    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    prefix = kv_len - q_len

    if m_block * BLOCK_M < q_len * PACK:
        offs_g = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_m = offs_g // PACK  # token of each tile row
        heads = first_head + offs_g % PACK
        valid_m = offs_m < q_len
        offs_dv = tl.arange(0, BLOCK_DV)
        rows = (q_start + offs_m).to(tl.int64)
        q, q_pe = load_q_tile(Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh, valid_m, D_MAIN, LK, BLOCK_D, BLOCK_DPE)
        if USE_MASK:
            kv_end = kv_len
            mask_row = rows * tree_cols
            tree_start = kv_len - tree_cols  # columns before it are always visible
        else:  # causal: columns past this block's last token are never visible
            kv_end = tl.minimum(kv_len, prefix + ((m_block + 1) * BLOCK_M - 1) // PACK + 1)

        # This program's KV columns [lo, hi): SPLITS runs of whole BLOCK_N blocks.
        split_len = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), SPLITS) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, kv_end)

        k_head, v_head = K + kv_head * stride_kh, V + kv_head * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            valid_n = offs_n < hi
            visible = valid_m[:, None] & valid_n[None, :]
            if USE_MASK:
                in_tree = offs_n[None, :] >= tree_start
                custom = tl.load(Mask + mask_row[:, None] + (offs_n[None, :] - tree_start), mask=visible & in_tree, other=0)
                visible = visible & ((custom != 0) | ~in_tree)
            else:
                visible = visible & (offs_n[None, :] <= prefix + offs_m[:, None])
            acc, l_i, m_i = attend_kv_block(
                q,
                q_pe,
                acc,
                l_i,
                m_i,
                kv_indices + kv_start,
                offs_n,
                valid_n,
                visible,
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
        out_mask = valid_m[:, None] & (offs_dv[None, :] < LV)
        if SPLITS == 1:
            tl.store(
                O + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :],
                out.to(O.dtype.element_ty),
                mask=out_mask,
            )
        else:
            lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
            part = Part_O + rows[:, None] * stride_pt + heads[:, None] * stride_ph + split * stride_ps
            tl.store(part + offs_dv[None, :], out, mask=out_mask)
            tl.store(Part_LSE + rows * stride_lt + heads * stride_lh + split, lse, mask=valid_m)


def _tile_sizes(tiling: HeadDimTiling) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) keeping the K/V tiles within shared memory."""
    width = tiling.block_d + tiling.block_dpe
    if width <= 128:
        return 64, 64, 4
    if width <= 256:
        return 64, 32, 4
    return 32, 16, 8


def is_short_query(max_extend_len: int, group: int) -> bool:
    """Whether an extend of max_extend_len tokens per request, group query heads per KV head,
    packs its heads into one tile row set and splits its KV (verify trees, draft extends)."""
    return max_extend_len * group <= SHORT_QUERY_ROWS


def short_query_kv_splits(bs: int, tiles_per_request: int, device: torch.device) -> int:
    """KV splits per tile for a short query's launch: enough (a power of two, at most
    MAX_KV_SPLITS) to give each SM a program; 1 once the tiles alone do. The batch counts
    as its size rounded up to a power of two, which the padded batch a CUDA graph replays
    rounds to as well (the captured sizes include every power of two up to the largest), so
    a graph splits, and sums, exactly as the eager forward does. (Under DP attention a rank
    replays the fullest rank's size, so its splits follow that size: sums within rounding of
    one rank's.)"""
    per_tile = sm_count(device) // (next_power_of_2(bs) * tiles_per_request)
    return min(MAX_KV_SPLITS, 1 << (per_tile.bit_length() - 1)) if per_tile > 1 else 1


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    max_extend_len: int,
    scaling: float,
    custom_mask: torch.Tensor | None = None,
    kv_splits: int | None = None,
) -> None:
    """q: [T, H, Lk] (requests' new tokens concatenated); out: [T, H, Lv].

    Request i owns query rows qo_indptr[i]:qo_indptr[i+1] and KV slots
    kv_indices[kv_indptr[i]:kv_indptr[i+1]] (prefix then its new tokens). max_extend_len
    bounds the query blocks (a host value). custom_mask (bool, [T, tree_cols], contiguous):
    query row t sees the columns before its request's last tree_cols, and the last tree_cols
    where custom_mask[t] is set. kv_splits (a power of two up to MAX_KV_SPLITS, short queries
    only) overrides short_query_kv_splits (tests, benchmarks).
    """
    num_tokens, num_heads, lk = q.shape
    num_kv_heads, lv = k_cache.shape[1], v_cache.shape[-1]
    bs = qo_indptr.shape[0] - 1
    if num_tokens == 0 or bs == 0 or max_extend_len == 0:
        return
    tiling = HeadDimTiling.of(lk, lv)
    block_m, block_n, num_warps = _tile_sizes(tiling)
    use_mask = custom_mask is not None
    # q: a placeholder pointer, never read without a mask
    mask, tree_cols = (custom_mask.view(torch.uint8), custom_mask.shape[1]) if custom_mask is not None else (q, 0)
    group = num_heads // num_kv_heads
    # Trees and short queries (verify, draft extends: a few tokens per request, under CUDA
    # graphs) pack a KV head's query heads into the tile rows; short ones also split the KV.
    # Other extends keep one head per program and the whole KV (variants of their own,
    # compiled once).
    short = is_short_query(max_extend_len, group)
    packed = use_mask or short
    pack = group if packed else 1
    if packed:
        block_m = min(block_m, max(16, next_power_of_2(max_extend_len * pack)))
    splits = 1
    if short:
        splits = kv_splits or short_query_kv_splits(bs, num_kv_heads * cdiv(max_extend_len * pack, block_m), q.device)
    if splits > 1:
        part_o = torch.empty((num_tokens, num_heads, splits, lv), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_o, part_lse = out, out  # placeholder pointers, never read or written
    _extend_kernel[(bs, num_heads // pack, cdiv(max_extend_len * pack, block_m) * splits)](
        q,
        k_cache,
        v_cache,
        out,
        qo_indptr,
        kv_indptr,
        kv_indices,
        mask,
        tree_cols,
        scaling * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        part_o,
        part_lse,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2) if splits > 1 else 0,
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        LK=lk,
        LV=lv,
        D_MAIN=tiling.d_main,
        BLOCK_D=tiling.block_d,
        BLOCK_DPE=tiling.block_dpe,
        BLOCK_DV=tiling.block_dv,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_MASK=use_mask,
        PACK=pack,
        SPLITS=splits,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=1,
    )
    if splits > 1:
        merge_kv_splits(part_o, part_lse, out)
