"""Triton kernels for the element-wise layers: RMSNorm (optionally after a residual add),
SiLU-and-mul and rotary embedding, each one launch where plain PyTorch takes 3 to 10; the
rotary kernel can also store k and v into the KV pool (one launch for rope + KV store).

Every wrapper returns new contiguous tensors (the pool store writes in place), launches nothing for zero rows and never
reads device data on the host, so all of them can be captured in a CUDA graph. Inputs may
be row-strided views (column slices of a fused projection) but are copied when their last
dim is not unit-stride. Arithmetic is float32. RMSNorm and SiLU-and-mul round to the input
dtype wherever the plain-PyTorch layers round; RoPE rounds once, at the end (as DeepSeek's
plain path does, while RotaryEmbedding's rounds cos/sin and each product: a few bf16 ulps).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.kernels.launch import signals_dependents
from sglang.srt.utils.heads import as_heads
from sglang.srt.utils.int_math import cdiv, next_power_of_2


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [..., width] as [rows, width] with unit column stride (a view when the layout allows)."""
    return _unit_last_stride(x.reshape(-1, width))


def rms_norm_warps(block: int) -> int:
    """Warps of a one-row program over a BLOCK-wide row (the norm kernels')."""
    return 4 if block < 2048 else 8 if block < 8192 else 16


# ---------------------------------------------------------------------- RMSNorm


@triton.jit
def weighted_rms_norm(s, w_ptr, cols, mask, n, eps):
    """weight * rmsnorm(s) in float32 for one row s (zero past n); like RMSNorm, the norm is
    rounded to s's dtype before the weight."""
    h = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
    normed = (h * rstd).to(s.dtype).to(tl.float32)
    return normed * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def residual_sum(x_row, res_row, cols, mask, dtype: tl.constexpr):
    """s = x + residual for one row, rounded to `dtype` (the sum's) as torch's add rounds."""
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    r = tl.load(res_row + cols, mask=mask, other=0.0)
    return (x.to(tl.float32) + r.to(tl.float32)).to(dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    x_stride,
    res_stride,
    n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    SIGNAL_DEPENDENTS: tl.constexpr,
):
    # One program per row; the whole row (n <= BLOCK) stays in registers. The next kernel (a
    # PDL-launched GEMV streaming its weights) may start at once.
    if SIGNAL_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    if HAS_RESIDUAL:
        s = residual_sum(x_ptr + row * x_stride, res_ptr + row * res_stride, cols, mask, res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n + cols, s, mask=mask)
    else:
        s = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    y = weighted_rms_norm(s, w_ptr, cols, mask, n, eps)
    tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_pair_kernel(
    a_ptr,
    b_ptr,
    wa_ptr,
    wb_ptr,
    out_ptr,
    a_stride,
    b_stride,
    na,
    nb,
    eps_a,
    eps_b,
    BLOCK: tl.constexpr,
    SIGNAL_DEPENDENTS: tl.constexpr,
):
    # Program (row, 0) norms a's row into out[row, :na], program (row, 1) b's into out[row, na:].
    if SIGNAL_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    second = tl.program_id(1)
    if second == 0:
        x_row, w_ptr, n, eps = a_ptr + row * a_stride, wa_ptr, na, eps_a
    else:
        x_row, w_ptr, n, eps = b_ptr + row * b_stride, wb_ptr, nb, eps_b
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    y = weighted_rms_norm(tl.load(x_row + cols, mask=mask, other=0.0), w_ptr, cols, mask, n, eps)
    tl.store(out_ptr + row * (na + nb) + second * na + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    n = x.shape[-1]
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, sum_dtype), device=x.device)
    new_residual = None if residual is None else torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    x2 = _rows(x, n)
    if x2.shape[0]:
        r2 = x2 if residual is None else _rows(residual, n)
        block = next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out,
            out if new_residual is None else new_residual,
            x2.stride(0),
            r2.stride(0),
            n,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            SIGNAL_DEPENDENTS=signals_dependents(x.device),
            num_warps=rms_norm_warps(block),
        )
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) over the last dim, as `RMSNorm.forward_native(x)`."""
    return _rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual), as `RMSNorm.forward_native(x, residual)`."""
    return _rms_norm(x, residual, weight, eps)


def rms_norm_pair(
    a: torch.Tensor, a_weight: torch.Tensor, a_eps: float, b: torch.Tensor, b_weight: torch.Tensor, b_eps: float
) -> torch.Tensor:
    """rms_norm(a, a_weight) ‖ rms_norm(b, b_weight) along the last dim, in one launch; a and b
    have the same leading dims and dtype (views of one projection's columns are fine)."""
    na, nb = a.shape[-1], b.shape[-1]
    assert a.shape[:-1] == b.shape[:-1] and a.dtype == b.dtype and a_weight.dtype == b_weight.dtype
    out = torch.empty((*a.shape[:-1], na + nb), dtype=torch.promote_types(a_weight.dtype, a.dtype), device=a.device)
    a2, b2 = _rows(a, na), _rows(b, nb)
    if a2.shape[0]:
        block = next_power_of_2(max(na, nb))
        _rms_norm_pair_kernel[(a2.shape[0], 2)](
            a2,
            b2,
            a_weight,
            b_weight,
            out,
            a2.stride(0),
            b2.stride(0),
            na,
            nb,
            a_eps,
            b_eps,
            BLOCK=block,
            SIGNAL_DEPENDENTS=signals_dependents(a.device),
            num_warps=rms_norm_warps(block),
        )
    return out


# ---------------------------------------------------------------------- SiLU and mul


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in float32, silu rounded to gate's dtype first as F.silu rounds (the
    caller rounds the product). Shared with the gated GEMV so both round alike."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return silu * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, d, BLOCK: tl.constexpr):
    # Program (row, j) writes columns [j * BLOCK, (j + 1) * BLOCK) of silu(gate) * up.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * d + cols, silu_mul(gate, up).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x of last dim 2d, as `SiluAndMul.forward_native`."""
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    x2 = _rows(x, 2 * d)
    if x2.shape[0] and d:
        block = min(next_power_of_2(d), 1024)
        _silu_and_mul_kernel[(x2.shape[0], cdiv(d, block))](x2, out, x2.stride(0), d, BLOCK=block)
    return out


# ---------------------------------------------------------------------- rotary embedding


@triton.jit
def rotate_head(
    src,
    dst,
    cos,
    sin,
    HEAD: tl.constexpr,
    ROT: tl.constexpr,
    NEOX: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
):
    # Rotates the pairs (x[i], x[i + ROT/2]) (neox) or (x[2i], x[2i+1]) (interleaved) of one
    # head by the angle of cos[i], sin[i]; channels ROT..HEAD are copied unchanged. Values
    # round to src's dtype, then to dst's (a KV pool's, which may differ) as a store of the
    # rotated head would.
    half = tl.arange(0, BLOCK_HALF)
    mask = half < ROT // 2
    i1 = half if NEOX else 2 * half
    i2 = i1 + (ROT // 2 if NEOX else 1)
    x1 = tl.load(src + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2, mask=mask, other=0.0).to(tl.float32)
    src_ty = src.dtype.element_ty
    dst_ty = dst.dtype.element_ty
    tl.store(dst + i1, (x1 * cos - x2 * sin).to(src_ty).to(dst_ty), mask=mask)
    tl.store(dst + i2, (x2 * cos + x1 * sin).to(src_ty).to(dst_ty), mask=mask)
    if HEAD > ROT:
        rest = ROT + tl.arange(0, BLOCK_REST)
        rest_mask = rest < HEAD
        tl.store(dst + rest, tl.load(src + rest, mask=rest_mask).to(dst_ty), mask=rest_mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    cos_ptr,
    sin_ptr,
    cs_stride,
    scale,
    q_ptr,
    k_ptr,
    v_ptr,
    loc_ptr,
    q_out,
    k_out,
    v_out,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    num_q_heads,
    num_k_heads,
    HAS_POSITIONS: tl.constexpr,
    STORE_KV: tl.constexpr,
    HEAD: tl.constexpr,
    ROT: tl.constexpr,
    NEOX: tl.constexpr,
    V_HEAD: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Program (t, h) rotates q head h of token t, or k head h - num_q_heads when h >= num_q_heads,
    # into row t of q_out / k_out. STORE_KV: k heads go to row loc[t] of the pool buffer k_out
    # [slots, Hk, HEAD] instead, and programs h >= Hq + Hk copy v head h - Hq - Hk to row loc[t]
    # of v_out [slots, Hk, V_HEAD].
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = tl.load(pos_ptr + t).to(tl.int64) if HAS_POSITIONS else t
    half = tl.arange(0, BLOCK_HALF)
    mask = half < ROT // 2
    cos = tl.load(cos_ptr + row * cs_stride + half, mask=mask, other=0.0).to(tl.float32) * scale
    sin = tl.load(sin_ptr + row * cs_stride + half, mask=mask, other=0.0).to(tl.float32) * scale
    if h < num_q_heads:
        src = q_ptr + t * q_stride_t + h * q_stride_h
        rotate_head(src, q_out + (t * num_q_heads + h) * HEAD, cos, sin, HEAD, ROT, NEOX, BLOCK_HALF, BLOCK_REST)
    elif h < num_q_heads + num_k_heads:
        h = h - num_q_heads
        k_row = tl.load(loc_ptr + t).to(tl.int64) if STORE_KV else t
        src = k_ptr + t * k_stride_t + h * k_stride_h
        rotate_head(src, k_out + (k_row * num_k_heads + h) * HEAD, cos, sin, HEAD, ROT, NEOX, BLOCK_HALF, BLOCK_REST)
    elif STORE_KV:  # (a constexpr: the v programs exist only when storing)
        h = h - num_q_heads - num_k_heads
        slot = tl.load(loc_ptr + t).to(tl.int64)
        cols = tl.arange(0, BLOCK_V)
        valid = cols < V_HEAD
        v = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + cols, mask=valid)
        tl.store(v_out + (slot * num_k_heads + h) * V_HEAD + cols, v.to(v_out.dtype.element_ty), mask=valid)


def _launch_rotary(
    positions: Optional[torch.Tensor],
    q3: torch.Tensor,
    k3: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    rotary_dim: int,
    is_neox_style: bool,
    scale: float,
    store: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> None:
    """q3 [T, Hq, D], k3 [T, Hk, D] (unit last stride) rotated into q_out and k_out, or with
    store = (v3, v_out, loc) into the pool rows loc of k_out and v_out, v3 copied there."""
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1, "cos and sin must share one row layout"
    num_tokens, num_q_heads, head_size = q3.shape
    num_k_heads = k3.shape[1]
    if not num_tokens:
        return
    v3, v_out, loc = store or (None, None, None)
    v_head = 1 if v3 is None else v3.shape[-1]
    _rotary_kernel[(num_tokens, num_q_heads + num_k_heads * (1 if v3 is None else 2))](
        None if positions is None else positions.contiguous(),
        cos,
        sin,
        cos.stride(0),
        scale,
        q3,
        k3,
        v3,
        loc,
        q_out,
        k_out,
        v_out,
        q3.stride(0),
        q3.stride(1),
        k3.stride(0),
        k3.stride(1),
        *((0, 0) if v3 is None else v3.stride()[:2]),
        num_q_heads,
        num_k_heads,
        HAS_POSITIONS=positions is not None,
        STORE_KV=v3 is not None,
        HEAD=head_size,
        ROT=rotary_dim,
        NEOX=is_neox_style,
        V_HEAD=v_head,
        BLOCK_HALF=next_power_of_2(rotary_dim // 2),
        BLOCK_REST=next_power_of_2(max(head_size - rotary_dim, 1)),
        BLOCK_V=next_power_of_2(v_head),
        num_warps=1,
    )


def rotary_embedding(
    positions: Optional[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q, k ([T, H*D] or [T, H, D], head counts may differ), same shapes.

    cos, sin: [P, rotary_dim // 2] with one row stride (halves of a cos|sin table); token t
    uses row positions[t], or row t when positions is None, both multiplied by `scale`.
    The first rotary_dim channels of each head rotate, in float32; the rest pass through.
    """
    q3, k3 = _unit_last_stride(as_heads(q, head_size)), _unit_last_stride(as_heads(k, head_size))
    q_out = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k3.shape, dtype=k.dtype, device=k.device)
    _launch_rotary(positions, q3, k3, cos, sin, q_out, k_out, rotary_dim, is_neox_style, scale)
    return q_out.view(q.shape), k_out.view(k.shape)


def rotary_embedding_store_kv(
    positions: Optional[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    loc: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """rotary_embedding's q; its k, and v, stored as step_ops.store_kv(k_buf, v_buf, loc, k, v)
    stores them, all in one launch. k_buf [slots, Hk, D] and v_buf [slots, Hk, Dv] are one
    layer's contiguous pool buffers; v is [T, Hk*Dv] or [T, Hk, Dv]; loc [T] distinct slots."""
    q3, k3 = _unit_last_stride(as_heads(q, head_size)), _unit_last_stride(as_heads(k, head_size))
    v3 = _unit_last_stride(as_heads(v, v_buf.shape[-1]))
    assert k_buf.is_contiguous() and v_buf.is_contiguous() and loc.is_contiguous() and loc.shape == k3.shape[:1]
    assert k_buf.shape[1:] == k3.shape[1:] and v_buf.shape[1:] == v3.shape[1:] and v3.shape[0] == k3.shape[0]
    q_out = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
    _launch_rotary(positions, q3, k3, cos, sin, q_out, k_buf, rotary_dim, is_neox_style, scale, (v3, v_buf, loc))
    return q_out.view(q.shape)
