"""Expert routing on CUDA: the router's float32 logits and `select_experts`, one kernel each.

`router_logits`: x @ W^T with W float32 and x read in its own dtype (cast in registers),
for decode-sized batches (and a small model's verify batches) in one launch where a float32
copy of x plus cuBLAS's GEMM take two or three; larger batches take cuBLAS.

`select_experts_triton`: one program per token row holds the row's expert scores in
registers and does what the plain-PyTorch `select_experts` does in a dozen kernels: scoring
(softmax or sigmoid), group ranking and masking, top-k by repeated arg-max, renormalization
and scaling, then the shared experts' slots. Experts of a group are contiguous (group g
owns experts [g * group_size, (g + 1) * group_size)).

No host reads: every grid and loop bound comes from shapes and the routing config.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sglang.srt.kernels.elementwise import fused_add_rms_norm, residual_sum, rms_norm_warps, weighted_rms_norm
from sglang.srt.kernels.launch import pdl_launch, signals_dependents
from sglang.srt.kernels.moe.routing_config import RoutingConfig
from sglang.srt.utils.int_math import cdiv, next_power_of_2

_METHOD_CODES = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}
NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))

# Router logits from one Triton launch: program (e, j) computes expert e's logits of the j-th
# block of up to ROUTER_BLOCK_TOKENS tokens, so x is read once per expert (from L2 after the
# first). Batches of up to ROUTER_BLOCK_TOKENS rows (timed: one launch where a float32 copy of
# x and cuBLAS's GEMM take three), or whose reads of x stay within ROUTER_REREAD_BYTES (a
# small model's verify and draft batches: 8 experts x 128 tokens x 256 wide read 0.5 MiB),
# take the kernel; larger batches take cuBLAS's float32 GEMM.
ROUTER_BLOCK_TOKENS = 16
ROUTER_REREAD_BYTES = 8 << 20
_ROUTER_TILE = 4096  # float32 products one program keeps in registers per step


def router_takes_kernel(num_tokens: int, num_experts: int, hidden: int, itemsize: int) -> bool:
    """Whether router_logits of this batch run the kernel (else cuBLAS); itemsize: x's."""
    return num_tokens <= ROUTER_BLOCK_TOKENS or num_experts * num_tokens * hidden * itemsize <= ROUTER_REREAD_BYTES


@triton.jit(do_not_specialize=["num_tokens"])
def _router_logits_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    num_tokens,
    hidden,
    x_stride,
    w_stride,
    out_stride,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program (e, j): logit of expert e for tokens [j * BLOCK_T, (j + 1) * BLOCK_T), float32 throughout.
    e = tl.program_id(0).to(tl.int64)
    toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    acc = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        valid_k = cols < hidden
        w = tl.load(w_ptr + e * w_stride + cols, mask=valid_k, other=0.0).to(tl.float32)
        x = tl.load(
            x_ptr + toks[:, None] * x_stride + cols[None, :],
            mask=(toks[:, None] < num_tokens) & valid_k[None, :],
            other=0.0,
        )
        acc += x.to(tl.float32) * w[None, :]
    tl.store(out_ptr + toks * out_stride + e, tl.sum(acc, axis=1), mask=toks < num_tokens)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 [T, E] = x.float() @ weight.T for x [T, hidden] (any float dtype) and weight
    [E, hidden] float32; the same products and float32 sums, in another order than cuBLAS's."""
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if not router_takes_kernel(num_tokens, num_experts, hidden, x.element_size()):
        return F.linear(x.float(), weight)
    out = torch.empty((num_tokens, num_experts), dtype=torch.float32, device=x.device)
    if num_tokens:
        x = x if x.stride(-1) == 1 else x.contiguous()
        block_t = min(next_power_of_2(num_tokens), ROUTER_BLOCK_TOKENS)
        block_k = min(next_power_of_2(hidden), _ROUTER_TILE // block_t)
        _router_logits_kernel[(num_experts, cdiv(num_tokens, block_t))](
            x,
            weight,
            out,
            num_tokens,
            hidden,
            x.stride(0),
            weight.stride(0),
            out.stride(0),
            BLOCK_T=block_t,
            BLOCK_K=block_k,
        )
    return out


# The residual add and RMSNorm before the MoE fold into the router launch (the norm's own
# launch saved) while every program can redo the row's norm: each program of that kernel is
# one (token, expert) pair and reads the whole row (from L2 after the first), so the fused
# path stops at this many programs.
FUSED_NORM_MAX_PROGRAMS = 256


def router_fuses_add_norm(num_tokens: int, num_experts: int) -> bool:
    """Whether add_rms_norm_router_logits takes one kernel for this batch (else norm, then router)."""
    return num_tokens * num_experts <= FUSED_NORM_MAX_PROGRAMS


@triton.jit
def _add_rms_norm_router_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    router_w_ptr,
    normed_ptr,
    res_out_ptr,
    logits_ptr,
    hidden,
    x_stride,
    res_stride,
    router_stride,
    num_experts,
    eps,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (t, e): token t's s = x + residual and normed = norm_w * rmsnorm(s), computed as
    # elementwise.py's add-RMSNorm kernel computes them (same helpers, same block and warps), then
    # expert e's float32 logit of normed. Program (t, 0) also stores s and normed. PDL:
    # launched before the previous kernel ends, it loads its router row, then waits for that
    # kernel's writes.
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    w = tl.load(router_w_ptr + e * router_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    s = residual_sum(x_ptr + t * x_stride, res_ptr + t * res_stride, cols, mask, res_out_ptr.dtype.element_ty)
    normed = weighted_rms_norm(s, norm_w_ptr, cols, mask, hidden, eps).to(normed_ptr.dtype.element_ty)
    tl.store(logits_ptr + t * num_experts + e, tl.sum(normed.to(tl.float32) * w, axis=0))
    if e == 0:
        tl.store(res_out_ptr + t * hidden + cols, s, mask=mask)
        tl.store(normed_ptr + t * hidden + cols, normed, mask=mask)


def add_rms_norm_router_logits(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, router_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed, s, logits) for s = x + residual [T, hidden], normed = elementwise.fused_add_rms_norm's
    output and logits = router_logits(normed, router_weight): one launch where those take two
    (router_fuses_add_norm's batches; others take them in turn)."""
    num_tokens, hidden = x.shape
    num_experts = router_weight.shape[0]
    if not router_fuses_add_norm(num_tokens, num_experts):
        normed, s = fused_add_rms_norm(x, residual, norm_weight, eps)
        return normed, s, router_logits(normed, router_weight)
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    s = torch.empty((num_tokens, hidden), dtype=sum_dtype, device=x.device)
    normed = torch.empty_like(s, dtype=torch.promote_types(norm_weight.dtype, sum_dtype))
    logits = torch.empty((num_tokens, num_experts), dtype=torch.float32, device=x.device)
    if num_tokens:
        x, residual = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, residual))
        block = next_power_of_2(hidden)
        pdl = signals_dependents(x.device)
        _add_rms_norm_router_kernel[(num_tokens, num_experts)](
            x,
            residual,
            norm_weight,
            router_weight,
            normed,
            s,
            logits,
            hidden,
            x.stride(0),
            residual.stride(0),
            router_weight.stride(0),
            num_experts,
            eps,
            BLOCK=block,
            PDL=pdl,
            num_warps=rms_norm_warps(block),
            **pdl_launch(pdl),
        )
    return normed, s, logits


@triton.jit
def _top_group_mask(
    choice,
    offs,
    GROUP_SIZE: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    TOP2: tl.constexpr,
):
    """Experts of the TOPK_GROUP groups ranked best by their best (TOP2: two best) choices."""
    goffs = tl.arange(0, BLOCK_G)
    group_scores = tl.full([BLOCK_G], NEG_INF, tl.float32)
    for g in tl.static_range(N_GROUP):
        vals = tl.where(offs // GROUP_SIZE == g, choice, NEG_INF)
        best = tl.max(vals, axis=0)
        score = best
        if TOP2:
            second = tl.max(tl.where(offs == tl.argmax(vals, axis=0), NEG_INF, vals), axis=0)
            score = best + second
        group_scores = tl.where(goffs == g, score, group_scores)
    keep = offs < 0
    for _ in tl.static_range(TOPK_GROUP):
        g = tl.argmax(group_scores, axis=0)
        keep = keep | (offs // GROUP_SIZE == g)
        group_scores = tl.where(goffs == g, NEG_INF, group_scores)
    return keep


@triton.jit
def _route_kernel(
    logits,
    bias,
    out_weights,
    out_ids,
    stride_row,
    scale,
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    METHOD: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SIGNAL_DEPENDENTS: tl.constexpr,
):
    # The experts' first kernel (PDL-launched at decode sizes) may start at once: it streams
    # the shared experts' weights, which no routing decides, while this kernel routes.
    if SIGNAL_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits + row * stride_row + offs, mask=valid, other=NEG_INF).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        p = tl.exp(x - tl.max(x, axis=0))
        scores = p / tl.sum(p, axis=0)
    scores = tl.where(valid, scores, 0.0)
    choice = scores
    if METHOD == 2:  # noaux_tc: choose by bias-corrected score, weigh by the plain score
        if HAS_BIAS:
            choice = scores + tl.load(bias + offs, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, choice, NEG_INF)
        keep = _top_group_mask(choice, offs, GROUP_SIZE, N_GROUP, TOPK_GROUP, BLOCK_G, GROUP_SIZE >= 2)
        choice = tl.where(keep, choice, NEG_INF)
    elif METHOD == 1:  # group_limited_greedy: experts outside the best groups score 0
        keep = _top_group_mask(tl.where(valid, scores, NEG_INF), offs, GROUP_SIZE, N_GROUP, TOPK_GROUP, BLOCK_G, False)
        choice = tl.where(keep, scores, 0.0)
    choice = tl.where(valid, choice, NEG_INF)

    koffs = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0)
        picked = offs == best
        ids = tl.where(koffs == k, best.to(tl.int64), ids)
        weights = tl.where(koffs == k, tl.sum(tl.where(picked, scores, 0.0), axis=0), weights)
        choice = tl.where(picked, NEG_INF, choice)
    if RENORMALIZE:  # the slots past TOP_K still hold weight 0
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    shared = koffs >= TOP_K  # slot TOP_K + j: shared expert E + j, weight 1, unscaled
    ids = tl.where(shared, (E + koffs - TOP_K).to(tl.int64), ids)
    weights = tl.where(shared, 1.0, weights * scale)
    out = row * SLOTS + koffs
    tl.store(out_ids + out, ids, mask=koffs < SLOTS)
    tl.store(out_weights + out, weights, mask=koffs < SLOTS)


def select_experts_triton(
    router_logits: torch.Tensor, cfg: RoutingConfig, correction_bias: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `select_experts`: (weights [T, slots] float32, expert ids [T, slots]
    int64). The top_k routed experts of a row may come in another order than torch.topk's."""
    num_tokens = router_logits.shape[0]
    device = router_logits.device
    weights = torch.empty((num_tokens, cfg.slots), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, cfg.slots), dtype=torch.int64, device=device)
    if num_tokens == 0:
        return weights, ids
    logits = router_logits.contiguous()
    n_group = cfg.num_expert_group or 1
    block_e = next_power_of_2(cfg.num_experts)
    _route_kernel[(num_tokens,)](
        logits,
        correction_bias if correction_bias is not None else logits,
        weights,
        ids,
        logits.stride(0),
        cfg.routed_scaling_factor,
        E=cfg.num_experts,
        BLOCK_E=block_e,
        TOP_K=cfg.top_k,
        SLOTS=cfg.slots,
        BLOCK_K=next_power_of_2(cfg.slots),
        SIGMOID=cfg.scoring_func == "sigmoid",
        HAS_BIAS=correction_bias is not None,
        METHOD=_METHOD_CODES[cfg.topk_method],
        GROUP_SIZE=cfg.num_experts // n_group,
        N_GROUP=n_group,
        TOPK_GROUP=cfg.topk_group or 1,
        BLOCK_G=next_power_of_2(n_group),
        RENORMALIZE=cfg.renormalize,
        SIGNAL_DEPENDENTS=signals_dependents(device),
        num_warps=_route_warps(block_e),
    )
    return weights, ids


def _route_warps(block_e: int) -> int:
    """One warp per 64 experts (up to 4): a row of 64 scores sits in one warp's registers,
    so each of the kernel's ~20 max/argmax/sum reductions is warp shuffles alone, with no
    shared-memory round trip and barrier across warps."""
    return min(4, max(1, block_e // 64))
