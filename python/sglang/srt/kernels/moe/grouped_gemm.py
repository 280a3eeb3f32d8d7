"""Triton fused MoE: the same SiLU-gated experts as `moe_forward_native`, without host syncs.

The tile configuration comes from the number of (token, slot) pairs (tiles.py).
Decode-sized batches take the GEMV kernels of gemv.py. Otherwise the pairs are
sorted by expert on device and each expert's run is padded to a multiple of BLOCK_M, so
every block of BLOCK_M sorted rows belongs to a single expert. Two grouped GEMMs then run
over those blocks: w13 with SiLU(gate) * up fused into its epilogue, and w2 with the routing
weight applied; one more kernel sums each token's slots. The grid is sized from shapes
alone (an upper bound on the number of blocks); blocks past the last expert exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.kernels.moe.gemv import moe_gemv
from sglang.srt.kernels.moe.tiles import GemmTile, MoeKernelConfig, kernel_config
from sglang.srt.utils.int_math import cdiv, next_power_of_2
from sglang.srt.utils.triton_precision import dot_precision

# One program aligns up to this many (token, slot) pairs in registers (decode batches up to
# 128 tokens at top-8); larger batches take the plain-PyTorch path, which has no host syncs
# either. Its kernel variants (one per power of two of the pairs, see align_by_expert) compile
# in seconds each for thousands of pairs, and a batch that meets a new one waits for it.
MAX_PAIRS_ONE_PROGRAM = 1024


def _max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    # Blocks used <= ceil(pairs / block_m) + (number of non-empty experts).
    return cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def _alignment_lanes(num_pairs: int) -> int:
    """The one-program alignment's lanes for num_pairs >= 1 pairs: their power of two, so that the
    batches of one power share a compiled variant; 0 past MAX_PAIRS_ONE_PROGRAM (the
    plain-PyTorch alignment)."""
    return next_power_of_2(num_pairs) if num_pairs <= MAX_PAIRS_ONE_PROGRAM else 0


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (token, slot) pairs by expert and pad each expert's run to block_m rows.

    Returns sorted_pairs [max_blocks * block_m] (flat pair index, or the pair count as
    padding) and block_expert [max_blocks] (expert of each block; num_experts when unused).
    """
    num_pairs = topk_ids.numel()
    max_blocks = _max_blocks(num_pairs, num_experts, block_m)
    block_p = _alignment_lanes(num_pairs)
    if not block_p:
        return _align_by_expert_torch(topk_ids.flatten(), num_experts, block_m, max_blocks)
    device = topk_ids.device
    # Every block size follows from block_p alone (the bound for block_p pairs), so that the
    # batches of one power of two share a compiled variant.
    bound = _max_blocks(block_p, num_experts, block_m)
    block_pad = next_power_of_2(bound * block_m)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int64, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    scratch = torch.empty(block_p, dtype=torch.int64, device=device)
    _align_kernel[(1,)](
        topk_ids.flatten(),
        scratch,
        sorted_pairs,
        block_expert,
        num_pairs,
        max_blocks,
        NUM_EXPERTS=num_experts,
        BLOCK_P=block_p,
        BLOCK_M=block_m,
        BLOCK_PAD=block_pad,
        BLOCK_B=next_power_of_2(bound),
        num_warps=min(8, max(1, block_pad // 256)),  # decode at batch 1: 128 slots, one warp, no cross-warp syncs
    )
    return sorted_pairs, block_expert


def variant_key(num_pairs: int, device: torch.device) -> tuple[int, MoeKernelConfig]:
    """What decides the kernel variants fused_moe compiles for a batch of num_pairs pairs: the
    alignment's power of two (0: the plain-PyTorch alignment) and the tile config."""
    return _alignment_lanes(num_pairs), kernel_config(num_pairs, device)


def variant_token_counts(slots: int, max_tokens: int, device: torch.device) -> list[int]:
    """The smallest token count of each variant key that batches of 1..max_tokens tokens meet."""
    first: dict[tuple[int, MoeKernelConfig], int] = {}
    for tokens in range(1, max_tokens + 1):
        first.setdefault(variant_key(tokens * slots, device), tokens)
    return sorted(first.values())


def warm_up_variants(w13: torch.Tensor, w2: torch.Tensor, slots: int, max_tokens: int) -> int:
    """Run fused_moe once per kernel variant that batches of up to max_tokens tokens can meet,
    so that each compiles (or loads from Triton's cache) at startup instead of stalling the
    first batch that meets it while serving (seconds for the largest alignment). Zero inputs;
    returns the number of batches run."""
    counts = variant_token_counts(slots, max_tokens, w13.device)
    for tokens in counts:
        hidden = torch.zeros((tokens, w2.shape[1]), dtype=w13.dtype, device=w13.device)
        ids = (torch.arange(tokens * slots, device=w13.device) % w13.shape[0]).view(tokens, slots)
        fused_moe(hidden, w13, w2, torch.ones(ids.shape, device=w13.device), ids)
    return len(counts)


def _align_by_expert_torch(
    flat: torch.Tensor, num_experts: int, block_m: int, max_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    sorted_pairs = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs[dest] = order
    block_starts = torch.arange(max_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])  # batch-sized: one variant for many
def _align_kernel(
    topk_ids,
    scratch,
    sorted_pairs,
    block_expert,
    num_pairs,
    max_blocks,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """align_by_expert in one program: sort the pairs by (expert, pair), find each expert's
    run in the sorted order, and scatter every pair to its run's padded start + its rank."""
    p = tl.arange(0, BLOCK_P)
    valid = p < num_pairs
    expert = tl.load(topk_ids + p, mask=valid, other=NUM_EXPERTS).to(tl.int64)
    key = tl.sort(expert * BLOCK_P + p)  # unique keys; lanes past num_pairs sort last
    tl.store(scratch + p, key)
    pad = tl.arange(0, BLOCK_PAD)
    tl.store(sorted_pairs + pad, tl.zeros([BLOCK_PAD], tl.int64) + num_pairs, mask=pad < max_blocks * BLOCK_M)
    tl.debug_barrier()  # scratch and the padding are visible to every thread from here
    run_expert = key // BLOCK_P
    prev_expert = tl.load(scratch + p - 1, mask=p > 0, other=0) // BLOCK_P
    next_expert = tl.load(scratch + p + 1, mask=p + 1 < BLOCK_P, other=0) // BLOCK_P
    starts = (p == 0) | (prev_expert != run_expert)
    ends = (p == num_pairs - 1) | (next_expert != run_expert)
    rank = p - tl.associative_scan(tl.where(starts, p, 0), 0, _maximum)
    run_padded = tl.where(ends & valid, (rank + BLOCK_M) // BLOCK_M * BLOCK_M, 0)
    padded_start = tl.cumsum(run_padded, 0) - run_padded  # padded sizes of the runs before
    tl.store(sorted_pairs + padded_start + rank, key % BLOCK_P, mask=valid)
    tl.debug_barrier()
    # Every used block starts with a real pair (padding only ends a run): its expert names it.
    b = tl.arange(0, BLOCK_B)
    first = tl.load(sorted_pairs + b * BLOCK_M, mask=b < max_blocks, other=num_pairs)
    used = first < num_pairs
    block_exp = tl.load(topk_ids + first, mask=used, other=NUM_EXPERTS)
    tl.store(block_expert + b, tl.where(used, block_exp, NUM_EXPERTS).to(tl.int32), mask=b < max_blocks)


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    A,
    W,
    C,
    sorted_pairs,
    block_expert,
    topk_weights,
    num_pairs,
    N,
    K,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_cm,
    stride_cn,
    NUM_EXPERTS: tl.constexpr,
    ROWS_PER_A: tl.constexpr,
    GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """C[pair, n] = A[pair // ROWS_PER_A] . W[expert, n] for the pairs of one sorted block.

    GATED: W has 2N rows (gate then up) and C = silu(A.W_gate) * (A.W_up).
    MUL_WEIGHT: C is scaled by the pair's routing weight.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert + pid_m)
    if expert < NUM_EXPERTS:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_pairs + offs_m)
        valid_m = pairs < num_pairs
        a_rows = pairs // ROWS_PER_A
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        valid_n = offs_n < N
        w_base = W + expert.to(tl.int64) * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if GATED:
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            valid_k = offs_k < K
            a = tl.load(
                A + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                mask=valid_m[:, None] & valid_k[None, :],
                other=0.0,
            )
            w_mask = valid_k[:, None] & valid_n[None, :]
            w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
            acc += tl.dot(a, w, input_precision=DOT_PRECISION)
            if GATED:
                w_up = tl.load(w_base + (offs_n[None, :] + N) * stride_wn + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
                acc_up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up
        if MUL_WEIGHT:
            acc = acc * tl.load(topk_weights + pairs, mask=valid_m, other=0.0)[:, None]
        tl.store(
            C + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn,
            acc.to(C.dtype.element_ty),
            mask=valid_m[:, None] & valid_n[None, :],
        )


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    c: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    topk_weights: torch.Tensor,
    block_m: int,
    tile: GemmTile,
    rows_per_a: int,
    gated: bool,
) -> None:
    n_out, k_in = c.shape[1], a.shape[1]
    grid = (block_expert.shape[0], cdiv(n_out, tile.block_n))
    _grouped_gemm_kernel[grid](
        a,
        w,
        c,
        sorted_pairs,
        block_expert,
        topk_weights,
        c.shape[0],
        n_out,
        k_in,
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        c.stride(0),
        c.stride(1),
        NUM_EXPERTS=w.shape[0],
        ROWS_PER_A=rows_per_a,
        GATED=gated,
        MUL_WEIGHT=not gated,
        BLOCK_M=block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        DOT_PRECISION=dot_precision(a.dtype),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


@triton.jit
def _combine_kernel(per_pair, out, hidden, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    # Program (t, j), columns [j * BLOCK, (j + 1) * BLOCK) of token t: the float32 sum of its
    # SLOTS rows in slot order, rounded to out's dtype.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.load(per_pair + t * SLOTS * hidden + cols, mask=mask, other=0.0)
    for k in tl.static_range(1, SLOTS):
        acc += tl.load(per_pair + (t * SLOTS + k) * hidden + cols, mask=mask, other=0.0)
    tl.store(out + t * hidden + cols, acc.to(out.dtype.element_ty), mask=mask)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeKernelConfig | None = None,
    shared_slots: int = 0,
) -> torch.Tensor:
    """Same contract as moe_forward_native: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I],
    topk_weights/topk_ids [T, slots] -> [T, H] in hidden's dtype (partial sum of this rank).
    `config` overrides the tile table's choice (for benchmarks and tests); `shared_slots`:
    see moe_gemv."""
    num_tokens, slots = topk_ids.shape
    hidden_size, inter = hidden.shape[1], w2.shape[2]
    out = hidden.new_empty(hidden.shape)
    if num_tokens == 0:
        return out
    num_pairs = num_tokens * slots
    config = config or kernel_config(num_pairs, hidden.device)
    if config.block_m == 1:
        moe_gemv(hidden, w13, w2, topk_weights, topk_ids, out, config.w13, config.w2, shared_slots)
        return out
    block_m = config.block_m
    sorted_pairs, block_expert = align_by_expert(topk_ids, w13.shape[0], block_m)
    weights = topk_weights.flatten().float()
    act = hidden.new_empty((num_pairs, inter))  # SiLU(gate) * up per pair, in hidden's dtype
    _grouped_gemm(hidden, w13, act, sorted_pairs, block_expert, weights, block_m, config.w13, slots, gated=True)
    per_pair = torch.empty((num_pairs, hidden_size), dtype=torch.float32, device=hidden.device)
    _grouped_gemm(act, w2, per_pair, sorted_pairs, block_expert, weights, block_m, config.w2, 1, gated=False)
    block = min(next_power_of_2(hidden_size), 512)
    _combine_kernel[(num_tokens, cdiv(hidden_size, block))](per_pair, out, hidden_size, SLOTS=slots, BLOCK=block)
    return out
