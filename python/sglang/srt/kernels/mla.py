"""MLA decode-path kernels on CUDA: the rope-and-pack step and the per-head absorbed
projections. Neither reads device data on the host (CUDA-graph capturable); nothing
launches for 0 rows.

`mla_rope_pack_triton` (deepseek_rotary.mla_rope_pack dispatches here): program (t, h)
rotates q head h of token t into q_out[t, h, L:]; program (t, H) writes k[t] = latent[t] ‖
rope(k_pe[t]), into a new tensor or straight into the KV pool's rows, and can RMS-norm the
latent first (kv_a_layernorm). One launch where the norm, the RoPE kernel, two
concatenations and the pool's store took five. cos/sin are the rotary
module's table row of the position times `scale`, and the rotation is elementwise.py's own, so
every value equals the rope module's forward_triton.

`head_matmul_triton`: out[t, h] = a[t, h] @ b[h] for up to HEAD_MATMUL_MAX_TOKENS tokens,
any strides (q_nope @ W_UK into q's latent channels, o_latent @ W_UV^T), where cuBLAS's
batched GEMM takes 3-6 us for these 16 head-sized GEMVs at batch 1. On sm90+ it is launched
before the previous kernel ends (PDL) and loads its weights meanwhile.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.kernels.elementwise import rotate_head, weighted_rms_norm
from sglang.srt.kernels.launch import pdl_launch, signals_dependents
from sglang.srt.utils.int_math import cdiv, next_power_of_2
from sglang.srt.utils.triton_precision import dot_precision

HEAD_MATMUL_MAX_TOKENS = 16  # one tl.dot row tile; larger batches take torch.bmm


@triton.jit
def _mla_rope_pack_kernel(
    pos_ptr,
    cos_sin_ptr,
    cs_stride,
    scale,
    q_pe_ptr,
    k_pe_ptr,
    latent_ptr,
    q_out,
    k_out,
    k_loc_ptr,
    norm_w_ptr,
    norm_eps,
    q_pe_stride_t,
    q_pe_stride_h,
    k_pe_stride_t,
    latent_stride_t,
    q_out_stride_t,
    q_out_stride_h,
    num_heads,
    LATENT: tl.constexpr,
    ROT: tl.constexpr,
    NEOX: tl.constexpr,
    AT_LOC: tl.constexpr,
    NORM_LATENT: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_LATENT: tl.constexpr,
    PDL: tl.constexpr,
):
    # k[t] goes to row t of k_out, or (AT_LOC) to row k_loc[t] of a KV pool's layer buffer;
    # NORM_LATENT: its latent part is norm_w * rmsnorm(latent[t]). PDL: the decode attention
    # after it may start at once (and prefetch the older KV rows); this kernel, launched
    # before the previous one ends, reads the positions (written before the forward) and the
    # cos/sin table, then waits for that kernel's writes.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = tl.load(pos_ptr + t).to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)
    mask = half < ROT // 2
    cos = tl.load(cos_sin_ptr + row * cs_stride + half, mask=mask, other=0.0).to(tl.float32) * scale
    sin = tl.load(cos_sin_ptr + row * cs_stride + ROT // 2 + half, mask=mask, other=0.0).to(tl.float32) * scale
    if PDL:
        tl.extra.cuda.gdc_wait()
    if h < num_heads:
        dst = q_out + t * q_out_stride_t + h * q_out_stride_h + LATENT
        rotate_head(q_pe_ptr + t * q_pe_stride_t + h * q_pe_stride_h, dst, cos, sin, ROT, ROT, NEOX, BLOCK_HALF, 1)
    else:
        k_row = k_out + (tl.load(k_loc_ptr + t).to(tl.int64) if AT_LOC else t) * (LATENT + ROT)
        rotate_head(k_pe_ptr + t * k_pe_stride_t, k_row + LATENT, cos, sin, ROT, ROT, NEOX, BLOCK_HALF, 1)
        cols = tl.arange(0, BLOCK_LATENT)
        valid = cols < LATENT
        latent = tl.load(latent_ptr + t * latent_stride_t + cols, mask=valid, other=0.0)
        if NORM_LATENT:
            latent = weighted_rms_norm(latent, norm_w_ptr, cols, valid, LATENT, norm_eps)
        tl.store(k_row + cols, latent.to(k_out.dtype.element_ty), mask=valid)


def mla_rope_pack_triton(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    latent: torch.Tensor,
    q_out: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    scale: float,
    is_neox_style: bool,
    kv_store: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    latent_norm: Optional[tuple[torch.Tensor, float]] = None,
) -> Optional[torch.Tensor]:
    """See deepseek_rotary.mla_rope_pack; cos_sin_cache [P, R] is cos | sin halves, float32.

    kv_store = (one layer's MLA pool buffer [slots, 1, L + R] contiguous, loc [T] slots):
    k[t] is written to the buffer's row loc[t], cast to its dtype, and nothing is returned
    (the launch that stored k in the pool is saved). latent_norm = (weight [L], eps): the
    latent is RMS-normed first, rounded as RMSNorm rounds (the norm's launch is saved)."""
    num_tokens, num_heads, rot = q_pe.shape
    latent_dim = latent.shape[-1]
    assert q_pe.stride(-1) == k_pe.stride(-1) == latent.stride(-1) == q_out.stride(-1) == 1
    if kv_store is None:
        k_out = torch.empty((num_tokens, latent_dim + rot), dtype=latent.dtype, device=latent.device)
        k_loc = k_out  # not read
    else:
        k_out, k_loc = kv_store
        assert k_out.is_contiguous() and k_out.shape[1:] == (1, latent_dim + rot) and k_loc.shape == (num_tokens,)
        k_loc = k_loc.contiguous()
    if num_tokens:
        pdl = signals_dependents(q_out.device)
        _mla_rope_pack_kernel[(num_tokens, num_heads + 1)](
            positions.contiguous(),
            cos_sin_cache,
            cos_sin_cache.stride(0),
            scale,
            q_pe,
            k_pe,
            latent,
            q_out,
            k_out,
            k_loc,
            *(latent_norm or (latent, 0.0)),
            q_pe.stride(0),
            q_pe.stride(1),
            k_pe.stride(0),
            latent.stride(0),
            q_out.stride(0),
            q_out.stride(1),
            num_heads,
            LATENT=latent_dim,
            ROT=rot,
            NEOX=is_neox_style,
            AT_LOC=kv_store is not None,
            NORM_LATENT=latent_norm is not None,
            BLOCK_HALF=next_power_of_2(rot // 2),
            BLOCK_LATENT=next_power_of_2(latent_dim),
            PDL=pdl,
            num_warps=1,
            **pdl_launch(pdl),
        )
    return k_out if kv_store is None else None


@triton.jit
def _head_matmul_b_tile(b_head, k0, K, offs_n, valid_n, stride_bk, stride_bn, BLOCK_K: tl.constexpr):
    # Rows [k0, k0 + BLOCK_K) of one head's b (zeros past K: a step past the last loads nothing).
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(
        b_head + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
        mask=(offs_k < K)[:, None] & valid_n[None, :],
        other=0.0,
    )


@triton.jit(do_not_specialize=["num_tokens"])
def _head_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    num_tokens,
    K,
    N,
    stride_at,
    stride_ah,
    stride_ak,
    stride_bh,
    stride_bk,
    stride_bn,
    stride_ct,
    stride_ch,
    stride_cn,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Program (h, j): columns [j * BLOCK_N, (j + 1) * BLOCK_N) of head h for every token.
    # PDL: launched before the previous kernel ends, it lets the next kernel launch too, loads
    # its first tile of b (weights, which no kernel writes), then waits for the previous
    # kernel's writes before it reads a or writes c.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    h = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.arange(0, BLOCK_T)
    valid_t, valid_n = toks < num_tokens, offs_n < N
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    b = _head_matmul_b_tile(b_ptr + h * stride_bh, 0, K, offs_n, valid_n, stride_bk, stride_bn, BLOCK_K)
    if PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(0, K, BLOCK_K):  # b of step k0 is loaded: the first above, each next at the end
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + toks[:, None] * stride_at + h * stride_ah + offs_k[None, :] * stride_ak,
            mask=valid_t[:, None] & (offs_k < K)[None, :],
            other=0.0,
        )
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        b = _head_matmul_b_tile(b_ptr + h * stride_bh, k0 + BLOCK_K, K, offs_n, valid_n, stride_bk, stride_bn, BLOCK_K)
    tl.store(
        c_ptr + toks[:, None] * stride_ct + h * stride_ch + offs_n[None, :] * stride_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=valid_t[:, None] & valid_n[None, :],
    )


def head_matmul_triton(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out[t, h] = a[t, h] @ b[h]: a [T, H, K], b [H, K, N], out [T, H, N], T <= HEAD_MATMUL_MAX_TOKENS."""
    num_tokens, num_heads, k_dim = a.shape
    n_dim = b.shape[-1]
    assert num_tokens <= HEAD_MATMUL_MAX_TOKENS and b.shape[:2] == (num_heads, k_dim)
    if not num_tokens:
        return
    pdl = signals_dependents(a.device)
    block_n = max(16, min(64, next_power_of_2(n_dim) // 8))  # 8 programs a head for N 512 and 128
    # One loop step for K up to 512 (W_UV's latent): a step is a dependent round trip to
    # memory, and the [512, 16] tile of b is no larger than W_UK's [128, 64].
    block_k = min(next_power_of_2(k_dim), 8192 // block_n)
    _head_matmul_kernel[(num_heads, cdiv(n_dim, block_n))](
        a,
        b,
        out,
        num_tokens,
        k_dim,
        n_dim,
        *a.stride(),
        *b.stride(),
        *out.stride(),
        BLOCK_T=16,
        BLOCK_K=block_k,
        BLOCK_N=block_n,
        PDL=pdl,
        DOT_PRECISION=dot_precision(a.dtype),
        num_warps=4,
        **pdl_launch(pdl),
    )
