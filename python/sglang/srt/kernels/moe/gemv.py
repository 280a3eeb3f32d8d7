"""Fused MoE for a few tokens: two GEMV kernels over (token, slot) pairs, no alignment.

At decode batch sizes almost every expert block of the grouped GEMMs holds one real row,
and the work is streaming the selected experts' weights. Here program (pair, n-tile) of the
first kernel reads its expert's gate and up rows once and writes SiLU(gate) * up; program
(token, n-tile) of the second reads the w2 rows of each of the token's slots in turn and
writes the token's weighted sum, rounded once: what the grouped path's w2 GEMM and combine
kernel compute, in float32 in another order (the routing weight scales the activation, not
the product). An expert chosen by several tokens of the batch is read once per pair (mostly
from L2, as the grid runs a tile's pairs together), so this path is for small batches only.
Weights must have unit stride along their last (reduction) dimension.

The loops pipeline their loads (tl.range's num_stages: loads that feed no tl.dot are only
pipelined when the loop itself asks for it). The w2 kernel runs one flat loop over
(slot, k-tile) so that the pipeline does not drain between slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.kernels.launch import cache_line_elems, pdl_launch, prefetch_l2, signals_dependents
from sglang.srt.kernels.moe.tiles import GemmTile
from sglang.srt.utils.int_math import cdiv, next_power_of_2


@triton.jit
def _gate_up_gemv_kernel(
    hidden,
    w13,
    topk_ids,
    act,
    N,
    K,
    stride_h,
    stride_we,
    stride_wn,
    num_expert_slots,
    SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
    SHARED_SLOTS: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    LINE_ELEMS: tl.constexpr,
):
    # act[p, n] = silu(x . w13[e, n]) * (x . w13[e, N + n]) for pair p (token p // SLOTS, expert e).
    pair = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid_n = offs_n < N
    if PDL:
        # Launched while the routing kernel runs. A token's last SHARED_SLOTS slots hold the
        # last expert slots of w13 (the shared experts, chosen by no routing): their programs
        # stream their rows' first PREFETCH_LINES cache lines into L2 meanwhile. Then wait for
        # the routing's writes before any other load or store.
        slot = pair % SLOTS
        if slot >= SLOTS - SHARED_SLOTS:
            lines = tl.minimum(tl.arange(0, PREFETCH_LINES) * LINE_ELEMS, K - 1)[None, :]
            shared_rows = w13 + (num_expert_slots - SLOTS + slot) * stride_we + tl.minimum(offs_n, N - 1)[:, None] * stride_wn
            prefetch_l2(shared_rows + lines)
            prefetch_l2(shared_rows + N * stride_wn + lines)
        tl.extra.cuda.gdc_wait()
    x_row = hidden + (pair // SLOTS) * stride_h
    gate_rows = w13 + tl.load(topk_ids + pair) * stride_we + offs_n[:, None] * stride_wn
    up_rows = gate_rows + N * stride_wn
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        valid_k = offs_k < K
        x = tl.load(x_row + offs_k, mask=valid_k, other=0.0).to(tl.float32)[None, :]
        mask = valid_n[:, None] & valid_k[None, :]
        acc_gate += tl.load(gate_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * x
        acc_up += tl.load(up_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * x
    gate = tl.sum(acc_gate, axis=1)
    up = tl.sum(acc_up, axis=1)
    tl.store(act + pair * N + offs_n, (gate * tl.sigmoid(gate) * up).to(act.dtype.element_ty), mask=valid_n)


@triton.jit
def _down_gemv_combine_kernel(
    act,
    w2,
    topk_ids,
    topk_weights,
    out,
    N,
    K,
    stride_we,
    stride_wn,
    stride_out,
    SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # out[t, n] = sum over the slots s of t's pairs p = t * SLOTS + s of (weight[p] * act[p]) . w2[e, n],
    # all in one float32 accumulator, reduced over its BLOCK_K lanes at the end.
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid_n = offs_n < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in tl.range(0, SLOTS * k_tiles, num_stages=NUM_STAGES):
        pair = token * SLOTS + i // k_tiles
        offs_k = (i % k_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
        valid_k = offs_k < K
        a = tl.load(act + pair * K + offs_k, mask=valid_k, other=0.0).to(tl.float32) * tl.load(topk_weights + pair)
        w_rows = w2 + tl.load(topk_ids + pair) * stride_we + offs_n[:, None] * stride_wn
        w = tl.load(w_rows + offs_k[None, :], mask=valid_n[:, None] & valid_k[None, :], other=0.0)
        acc += w.to(tl.float32) * a[None, :]
    tl.store(out + token * stride_out + offs_n, tl.sum(acc, axis=1).to(out.dtype.element_ty), mask=valid_n)


def moe_gemv(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    w13_tile: GemmTile,
    w2_tile: GemmTile,
    shared_slots: int = 0,
) -> None:
    """out [T, H] = the fused MoE of hidden [T, H] over topk_* [T, slots] (T >= 1). The last
    `shared_slots` slots of every token are the last expert slots of w13, in order (shared
    experts): their weights start streaming before the routing kernel ends (sm90+)."""
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1 and hidden.stride(-1) == 1
    num_tokens, slots = topk_ids.shape
    hidden_size, inter = hidden.shape[1], w2.shape[2]
    act = hidden.new_empty((num_tokens * slots, inter))  # SiLU(gate) * up per pair, in hidden's dtype
    ids = topk_ids.flatten()
    pdl = shared_slots > 0 and signals_dependents(hidden.device)
    line = cache_line_elems(w13)
    _gate_up_gemv_kernel[(num_tokens * slots, cdiv(inter, w13_tile.block_n))](
        hidden,
        w13,
        ids,
        act,
        inter,
        hidden_size,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13.shape[0],
        SLOTS=slots,
        BLOCK_N=w13_tile.block_n,
        BLOCK_K=w13_tile.block_k,
        NUM_STAGES=w13_tile.num_stages,
        PDL=pdl,
        SHARED_SLOTS=shared_slots,
        PREFETCH_LINES=min(next_power_of_2(cdiv(hidden_size, line)), 32),
        LINE_ELEMS=line,
        num_warps=w13_tile.num_warps,
        **pdl_launch(pdl),
    )
    _down_gemv_combine_kernel[(num_tokens, cdiv(hidden_size, w2_tile.block_n))](
        act,
        w2,
        ids,
        topk_weights.flatten().float(),
        out,
        hidden_size,
        inter,
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        SLOTS=slots,
        BLOCK_N=w2_tile.block_n,
        BLOCK_K=w2_tile.block_k,
        NUM_STAGES=w2_tile.num_stages,
        num_warps=w2_tile.num_warps,
    )
