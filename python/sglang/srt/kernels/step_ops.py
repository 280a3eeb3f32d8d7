"""Triton kernels for the per-step work around the layers: the KV-cache store and the greedy
argmax, each fewer and shorter launches than plain PyTorch's (two index_put kernels; one
single-block reduction that takes 27 us over a 128k vocabulary at batch 1).

Both take any strided views (every stride is a kernel argument; Triton specializes unit
strides), launch nothing for zero rows and never read device data on the host, so both
can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.utils.int_math import cdiv, next_power_of_2

# ---------------------------------------------------------------------- KV-cache store

# Elements of one k (or v) tile: a program stores up to this many per token.
_KV_TILE = 2048


@triton.jit
def _store_heads(src, src_stride_h, src_stride_d, dst, heads, HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    # Copies the heads `heads` ([BLOCK_H, 1] indices) of one token's [HEADS, DIM] k or v
    # into its contiguous pool row `dst`, cast to the pool's dtype.
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < HEADS) & (cols < DIM)
    x = tl.load(src + heads * src_stride_h + cols * src_stride_d, mask=mask)
    tl.store(dst + heads * DIM + cols, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    loc_ptr,
    k_ptr,
    v_ptr,
    k_buf,
    v_buf,
    k_stride_t,
    k_stride_h,
    k_stride_d,
    v_stride_t,
    v_stride_h,
    v_stride_d,
    HEADS: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Program (t, j) stores heads [j * BLOCK_H, (j + 1) * BLOCK_H) of token t's k and v
    # into row loc[t] of the contiguous [slots, HEADS, dim] buffers.
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    slot = tl.load(loc_ptr + t).to(tl.int64)
    k_dst, v_dst = k_buf + slot * (HEADS * K_DIM), v_buf + slot * (HEADS * V_DIM)
    _store_heads(k_ptr + t * k_stride_t, k_stride_h, k_stride_d, k_dst, heads, HEADS, K_DIM, BLOCK_K)
    _store_heads(v_ptr + t * v_stride_t, v_stride_h, v_stride_d, v_dst, heads, HEADS, V_DIM, BLOCK_V)


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k_buf[loc] = k and v_buf[loc] = v, cast to the buffers' dtype, in one launch.

    k_buf [slots, H, D] and v_buf [slots, H, Dv] contiguous; k [T, H, D], v [T, H, Dv] any
    strides; loc [T] integer slots. Duplicate slots keep one of their rows (as index_put).
    """
    num_tokens, heads, k_dim = k.shape
    v_dim = v.shape[-1]
    assert k_buf.is_contiguous() and v_buf.is_contiguous() and k_buf.shape[1:] == (heads, k_dim)
    assert v.shape == (num_tokens, heads, v_dim) == (loc.shape[0], *v_buf.shape[1:])
    if not num_tokens:
        return
    block_k, block_v = next_power_of_2(k_dim), next_power_of_2(v_dim)
    block_h = min(next_power_of_2(heads), max(1, _KV_TILE // max(block_k, block_v)))
    _store_kv_kernel[(num_tokens, cdiv(heads, block_h))](
        loc,
        k,
        v,
        k_buf,
        v_buf,
        *k.stride(),
        *v.stride(),
        HEADS=heads,
        K_DIM=k_dim,
        V_DIM=v_dim,
        BLOCK_H=block_h,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
    )


# ---------------------------------------------------------------------- greedy argmax
#
# Each column becomes one int64 key whose maximum over a row is torch.argmax's answer:
# the high 32 bits order the values (an int32 whose signed order is the float order, every
# NaN above +inf, as torch.argmax takes NaN for the maximum), the low 32 bits are
# 2**31 - 1 - column, so among equal values the first column wins. The max of keys is
# associative, so a row splits into blocks whose maxima a second kernel merges.

# Columns per program of the first stage: 126 programs for a 128k vocabulary at batch 1.
_ARGMAX_BLOCK = 1024
_NO_KEY = tl.constexpr(-(2**63))  # below every column's key (whose high half is > -2**31)


@triton.jit
def _column_keys(x, cols, mask):
    x = x.to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with +0.0, as in torch
    bits = x.to(tl.int32, bitcast=True)
    order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: reverse the magnitude bits
    order = tl.where(x != x, 0x7FFFFFFF, order)  # every NaN (either sign) above +inf
    keys = (order.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)
    return tl.where(mask, keys, _NO_KEY)


@triton.jit
def _key_column(key):
    return 0x7FFFFFFF - (key & 0x7FFFFFFF)


@triton.jit
def _argmax_blocks_kernel(x_ptr, out_ptr, stride_row, stride_col, n, BLOCK: tl.constexpr, FINAL: tl.constexpr):
    # Program (row, j) writes the best key of columns [j * BLOCK, (j + 1) * BLOCK) to
    # out[row, j]; FINAL (one block per row): its column instead.
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_row + cols.to(tl.int64) * stride_col, mask=mask, other=0.0)
    best = tl.max(_column_keys(x, cols, mask), axis=0)
    tl.store(out_ptr + row * tl.num_programs(1) + blk, _key_column(best) if FINAL else best)


@triton.jit
def _argmax_merge_kernel(keys_ptr, out_ptr, num_blocks, BLOCK: tl.constexpr):
    # One program per row: the column of the best of its num_blocks (<= BLOCK) keys.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    keys = tl.load(keys_ptr + row * num_blocks + offs, mask=offs < num_blocks, other=_NO_KEY)
    tl.store(out_ptr + row, _key_column(tl.max(keys, axis=0)))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for x [rows, n] (n >= 1, any strides; fp32, fp16 or bf16): int64 [rows].

    Ties go to the first column and NaN counts as the maximum (first NaN wins), as in torch.
    One launch when n <= 1024, else two (per-block maxima, then their merge).
    """
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), "compared in float32"
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if not rows:
        return out
    num_blocks = cdiv(n, _ARGMAX_BLOCK)
    block = min(next_power_of_2(n), _ARGMAX_BLOCK)
    keys = out if num_blocks == 1 else torch.empty((rows, num_blocks), dtype=torch.int64, device=x.device)
    _argmax_blocks_kernel[(rows, num_blocks)](x, keys, *x.stride(), n, BLOCK=block, FINAL=num_blocks == 1)
    if num_blocks > 1:
        _argmax_merge_kernel[(rows,)](keys, out, num_blocks, BLOCK=next_power_of_2(num_blocks), num_warps=1)
    return out
