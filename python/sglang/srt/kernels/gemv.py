"""Triton GEMV for the dense layers at decode batch sizes: y = x W^T (+ bias) for a few rows of x.

At batch 1-32 a decode GEMM only streams W from HBM; cuBLAS reaches 3.1-3.3 TB/s of an H200's
~4.4 on Llama-8B's 4096-wide q/k/v and o projections and adds split-K reduce kernels. Here
each program owns BLOCK_N rows of W and walks all of K once in BLOCK_K steps, for one row of x
(FMAs; the programs of one W tile run side by side, so W comes from HBM once), for every row of
a few (FMAs, `all_rows`: each step of W is loaded once and multiplied by each row, so W passes
through L2 once, not once per row), or for 16-32 rows (tensor cores, x zero-padded). Products
accumulate in float32.

Invariants: no split-K, so every output is one program's sum in a fixed order: the same on
every call and replay. The wrapper launches nothing for zero rows and never reads device data
on the host, so it can be captured in a CUDA graph. `gated` computes silu(x W_gate^T) * (x W_up^T)
for a [gate | up] weight in the same pass (SiluAndMul folded into the GEMV's epilogue), rounded
where the unfused GEMM + SiluAndMul round. A `pdl` config is launched before the previous
kernel ends (programmatic dependent launch, sm90+): it prefetches its first W steps into L2,
then waits for that kernel's writes before touching anything else; RMSNorm, which precedes
most GEMVs, signals its dependents at once.

Which shapes take the kernel is `pick_config`'s table, measured by benchmark/kernels/bench_gemv.py.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.kernels.elementwise import silu_mul
from sglang.srt.kernels.launch import cache_line_elems, pdl_launch, prefetch_l2, signals_dependents
from sglang.srt.kernels.tuned import load_table
from sglang.srt.utils.int_math import cdiv, next_power_of_2
from sglang.srt.utils.triton_precision import dot_precision


@dataclass(frozen=True)
class GemvConfig:
    """One tile shape of the kernel."""

    block_n: int  # rows of W per program
    block_k: int  # columns of W per loop step
    num_warps: int = 4
    num_stages: int = 1  # loop steps in flight per program; > 1 software-pipelines W through shared memory
    use_dot: bool = False  # tensor cores (x padded to >= 16 rows) rather than FMAs
    # Programmatic dependent launch (where launch.signals_dependents): the kernel starts
    # before the previous one ends and streams its first two steps of W into L2 meanwhile.
    pdl: bool = False
    # FMAs for up to MAX_ALL_ROWS rows of x in each program (rows padded to a power of two),
    # rather than a program per row.
    all_rows: bool = False

    def __post_init__(self):
        assert self.block_n & (self.block_n - 1) == 0 and self.block_k & (self.block_k - 1) == 0, "powers of two"
        assert not self.use_dot or min(self.block_n, self.block_k) >= 16, "tl.dot tiles are at least 16 wide"
        assert not (self.use_dot and self.all_rows), "all_rows is an FMA tile"

    def __str__(self) -> str:
        kind = "dot" if self.use_dot else "fma-all-rows" if self.all_rows else "fma"
        return f"{kind} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages}" + (" pdl" if self.pdl else "")


# Loop steps of W a PDL program prefetches into L2 while the previous kernel ends: about what
# HBM delivers in that time, without flooding L2 when the first wave of programs covers more.
_PREFETCH_STEPS = 2


MAX_ALL_ROWS = 4  # rows of x an `all_rows` program holds at most: its accumulator grows with them


def block_m(rows: int, config: GemvConfig) -> int:
    """Rows of x per program: one for FMAs (programs of one W tile run side by side, so W comes
    from HBM once and from L2 for the other rows), all of them for `all_rows` FMAs; tensor cores
    take 16 or 32."""
    if config.use_dot:
        return max(16, min(next_power_of_2(rows), 32))
    if config.all_rows:
        assert rows <= MAX_ALL_ROWS, f"an all_rows tile takes at most {MAX_ALL_ROWS} rows of x, not {rows}"
        return next_power_of_2(rows)
    return 1


# ---------------------------------------------------------------------- the kernel


@triton.jit
def _load_tile(ptrs, rows_ok, in_k, MASK_ROWS: tl.constexpr, MASK_K: tl.constexpr):
    # tl.load with only the masks that can be false (a mask costs a predicate per vector and
    # keeps the compiler from merging a thread's repeated loads of x).
    if MASK_ROWS and MASK_K:
        tile = tl.load(ptrs, mask=rows_ok & in_k, other=0.0)
    elif MASK_ROWS:
        tile = tl.load(ptrs, mask=rows_ok, other=0.0)
    elif MASK_K:
        tile = tl.load(ptrs, mask=in_k, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _acc_add(acc, x, w, USE_DOT: tl.constexpr, ALL_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Tensor cores: acc [BM, BN] += x [BM, BK] @ w [BN, BK]^T. FMAs: x is one row ([1, BK], or
    # w's [BN, BK] tile of it), and acc [BN, BK] keeps a partial sum per column, reduced over K
    # once at the end; with ALL_ROWS the same per row of x ([BM, 1 or BN, BK]), acc [BM, BN, BK].
    if USE_DOT:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    elif ALL_ROWS:
        acc += x.to(tl.float32) * w.to(tl.float32)[None, :, :]
    else:
        acc += x.to(tl.float32) * w.to(tl.float32)
    return acc


@triton.jit
def _acc_result(acc, USE_DOT: tl.constexpr, ALL_ROWS: tl.constexpr):
    # The [BM, BN] sums of an accumulator.
    if USE_DOT:
        out = acc
    elif ALL_ROWS:
        out = tl.sum(acc, axis=2)
    else:
        out = tl.sum(acc, axis=1)[None, :]
    return out


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    x_stride,
    w_stride,
    y_stride,
    m_tiles,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    MASK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_DOT: tl.constexpr,
    ALL_ROWS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    LINE_ELEMS: tl.constexpr,
):
    # Program j * m_tiles + i writes y[i*BM : (i+1)*BM, j*BN : (j+1)*BN]; N is y's width.
    # GATED: rows [0, N) of W are the gate, rows [N, 2N) the up projection.
    pid = tl.program_id(0)
    rows = (pid % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    # A last W tile past N re-reads row N - 1 rather than masking every load; those outputs
    # are not stored. Rows of x past M (tensor cores and ALL_ROWS: other FMA programs hold one
    # row < M) load as zeros, which costs no traffic.
    w_rows = tl.minimum(cols, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    w_tile = w_ptr + w_rows[:, None] * w_stride + offs_k
    up_tile = w_ptr + (N + w_rows)[:, None] * w_stride + offs_k
    x_tile = x_ptr + rows.to(tl.int64)[:, None] * x_stride + offs_k
    x_rows_ok = (rows < M)[:, None]
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif ALL_ROWS:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        x_tile = x_tile[:, None, :]
        x_rows_ok = x_rows_ok[:, :, None]
        if NUM_STAGES == 1:  # as below: each row of x in w's layout
            x_tile += 0 * w_rows[None, :, None]
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if NUM_STAGES == 1:
            # The row of x as w's [BN, BK] tile: loaded in w's layout (each thread loads its
            # columns once) instead of shuffled into it through shared memory every step.
            # Pipelined loads go through shared memory anyway and stay [1, BK].
            x_tile += 0 * w_rows[:, None]
    acc_up = tl.zeros_like(acc)
    if PDL:
        # Launched while the previous kernel still runs: stream the first PREFETCH_LINES cache
        # lines (the first loop steps) of this program's W rows into L2 (weights never change),
        # then wait for that kernel's writes before any other load or store (x, and y's
        # memory, which it may still read).
        lines = tl.minimum(tl.arange(0, PREFETCH_LINES) * LINE_ELEMS, K - 1)[None, :]
        prefetch_l2(w_ptr + w_rows[:, None] * w_stride + lines)
        if GATED:
            prefetch_l2(w_ptr + (N + w_rows)[:, None] * w_stride + lines)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        in_k = offs_k < K - k0
        x = _load_tile(x_tile + k0, x_rows_ok, in_k, BLOCK_M > 1, MASK_K)
        w = _load_tile(w_tile + k0, x_rows_ok, in_k, False, MASK_K)
        acc = _acc_add(acc, x, w, USE_DOT, ALL_ROWS, DOT_PRECISION)
        if GATED:
            w_up = _load_tile(up_tile + k0, x_rows_ok, in_k, False, MASK_K)
            acc_up = _acc_add(acc_up, x, w_up, USE_DOT, ALL_ROWS, DOT_PRECISION)

    dtype = x_ptr.dtype.element_ty
    y = _acc_result(acc, USE_DOT, ALL_ROWS)
    if HAS_BIAS:
        y += tl.load(bias_ptr + w_rows).to(tl.float32)[None, :]
    if GATED:  # the unfused path rounds gate and up to x's dtype (the GEMM's output), then SiluAndMul
        up = _acc_result(acc_up, USE_DOT, ALL_ROWS)
        if HAS_BIAS:
            up += tl.load(bias_ptr + N + w_rows).to(tl.float32)[None, :]
        y = silu_mul(y.to(dtype), up.to(dtype))
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    # Rounded to x's dtype first, as F.linear(...).to(y's dtype) rounds.
    tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], y.to(dtype).to(y_ptr.dtype.element_ty), mask=mask)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    config: GemvConfig,
    gated: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias).to(out_dtype) for x [..., K] and weight [N, K] of x's dtype.

    gated: SiluAndMul of that product, silu(y[..., :N/2]) * y[..., N/2:], width N/2.
    weight needs a unit column stride (row views of a stacked weight are fine); x may have
    any row stride. Returns a new contiguous tensor.
    """
    n, k = weight.shape
    assert x.shape[-1] == k > 0 and x.dtype == weight.dtype and weight.stride(1) == 1
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous())
    assert not gated or n % 2 == 0, "a gated weight stacks gate and up rows of one width"
    width = n // 2 if gated else n
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    line = cache_line_elems(x)
    pdl = config.pdl and signals_dependents(x.device)
    y = torch.empty((rows, width), dtype=out_dtype or x.dtype, device=x.device)
    if rows and width:
        bm = block_m(rows, config)
        m_tiles = cdiv(rows, bm)
        _gemv_kernel[(cdiv(width, config.block_n) * m_tiles,)](
            x2,
            weight,
            bias,
            y,
            rows,
            width,
            k,
            x2.stride(0),
            weight.stride(0),
            y.stride(0),
            m_tiles,
            HAS_BIAS=bias is not None,
            GATED=gated,
            MASK_K=k % config.block_k != 0,
            BLOCK_M=bm,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            NUM_STAGES=config.num_stages,
            USE_DOT=config.use_dot,
            ALL_ROWS=not config.use_dot and bm > 1,
            DOT_PRECISION=dot_precision(x.dtype),
            PDL=pdl,
            PREFETCH_LINES=next_power_of_2(cdiv(min(k, _PREFETCH_STEPS * config.block_k), line)),
            LINE_ELEMS=line,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **pdl_launch(pdl),
        )
    return y.view(*x.shape[:-1], width)


# ---------------------------------------------------------------------- where it beats cuBLAS

# Per GPU, measured by benchmark/kernels/bench_gemv.py --write-table (kernels/tuned/gemv-<GPU>.json):
# (N, K, gated) of a bf16/fp16 weight -> ((most rows of x, config or None for cuBLAS), ...) by
# ascending rows. A GPU without a table, a shape not listed, more rows than the last entry, and
# every other dtype take cuBLAS.
Table = dict[tuple[int, int, bool], tuple[tuple[int, Optional[GemvConfig]], ...]]


def table_to_json(table: Table) -> list[dict]:
    return [
        {"n": n, "k": k, "gated": gated, "rows": [[rows, None if c is None else dataclasses.asdict(c)] for rows, c in entries]}
        for (n, k, gated), entries in sorted(table.items())
    ]


def table_from_json(rows: list[dict]) -> Table:
    return {(e["n"], e["k"], e["gated"]): tuple((r, None if c is None else GemvConfig(**c)) for r, c in e["rows"]) for e in rows}


@functools.cache
def _device_table(device: torch.device) -> Table:
    stored = load_table("gemv", torch.cuda.get_device_name(device))
    return {} if stored is None else table_from_json(stored)


def pick_config(rows: int, weight: torch.Tensor, gated: bool = False) -> Optional[GemvConfig]:
    """The kernel's config for `rows` rows of x times this CUDA weight, or None where cuBLAS is faster."""
    if weight.dtype not in (torch.bfloat16, torch.float16):
        return None
    for max_rows, config in _device_table(weight.device).get((*weight.shape, gated), ()):
        if rows <= max_rows:
            return config
    return None
