"""Fused Triton kernels vs their plain-PyTorch paths: the element-wise layers (RMSNorm,
SiLU-and-mul, RoPE), the KV-cache store and the greedy argmax (step_ops).

The reference is the plain path on CPU (a layer's `forward_native`, the CPU pool's index_put,
torch.argmax); the kernel runs on DEVICE, reached through the caller's own dispatch on CUDA
(compiled, fp32 and bf16) and called directly under Triton's CPU interpreter (float32 math,
small shapes, in a subprocess, see sglang.test.triton_harness). Without triton the module is skipped.
"""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch

from sglang.srt.kernels.step_ops import argmax, store_kv
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm, rms_norm_pair
from sglang.srt.layers.rotary_embedding import DeepseekScalingRotaryEmbedding, Llama3RotaryEmbedding, RotaryEmbedding
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.sampling.sampler import NAN_TOKEN_ID, Sampler, SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.heads import as_heads
from sglang.test.triton_harness import DEVICE, NEEDS_SUBPROCESS, ON_CUDA, kernel_test, rerun_under_interpreter

DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32]
# bf16: the reference rounds intermediates (RoPE rounds cos/sin and every product) where the kernel does not.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.skipif(not NEEDS_SUBPROCESS, reason="already compiled or interpreted in this process")
def test_fused_ops_under_triton_interpreter():
    rerun_under_interpreter(__file__, timeout=600)


def _fused(layer: torch.nn.Module, *args):
    """The layer's Triton path: through its own dispatch on CUDA, called directly when interpreted."""
    if not ON_CUDA:
        return layer.forward_triton(*args)
    with mock.patch.object(layer, "forward_native", side_effect=AssertionError("CUDA input took the torch path")):
        return layer(*args)


def _compare(layer: torch.nn.Module, *cpu_args) -> None:
    """forward_native on CPU vs the kernel on DEVICE, for every output."""
    ref = layer.forward_native(*cpu_args)
    got = _fused(copy.deepcopy(layer).to(DEVICE), *(a.to(DEVICE) for a in cpu_args))
    ref, got = (ref, got) if isinstance(ref, tuple) else ((ref,), (got,))
    for r, g in zip(ref, got, strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype and g.is_contiguous()
        tol = TOL[r.dtype]
        torch.testing.assert_close(g.cpu(), r, atol=tol, rtol=tol)


def _randn(*shape: int, dtype: torch.dtype, seed: int, pad: int = 0, scale: float = 1.0) -> torch.Tensor:
    """Random [*shape] in dtype; with pad, a view of the first columns of a wider tensor (row-strided)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(*shape[:-1], shape[-1] + pad, generator=gen) * scale
    return wide.to(dtype)[..., : shape[-1]]


# (leading dims, hidden): 0 and 1 rows, odd and non-power-of-two widths, 3-d input.
NORM_SHAPES = [((0,), 96), ((1,), 96), ((5,), 576), ((2, 3), 100)]
if ON_CUDA:
    NORM_SHAPES += [((33,), 4096), ((4,), 7168), ((7,), 8192)]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm(shape, residual, dtype):
    lead, hidden = shape
    for seed, weight_dtype in enumerate(sorted({dtype, torch.float32}, key=str)):
        norm = RMSNorm(hidden, eps=1e-5)
        norm.weight.data = _randn(hidden, dtype=weight_dtype, seed=seed)
        x = _randn(*lead, hidden, dtype=dtype, seed=seed + 1, pad=7, scale=3.0)  # a column slice, as MLA's latent
        args = (x, _randn(*lead, hidden, dtype=dtype, seed=seed + 2)) if residual else (x,)
        _compare(norm, *args)


# (leading dims, width of a, width of b, a and b column slices of one tensor as MLA's q_in and latent)
NORM_PAIR_CASES = [((0,), 128, 64, True), ((1,), 128, 64, True), ((5,), 96, 96, False), ((2, 3), 100, 60, True)]
if ON_CUDA:
    NORM_PAIR_CASES += [((33,), 1536, 512, True), ((64,), 7168, 7168, False)]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", NORM_PAIR_CASES)
def test_rms_norm_pair(case, dtype):
    lead, na, nb, one_tensor = case
    norm_a, norm_b = RMSNorm(na, eps=1e-6), RMSNorm(nb, eps=1e-3)
    norm_a.weight.data, norm_b.weight.data = _randn(na, dtype=dtype, seed=1), _randn(nb, dtype=dtype, seed=2)
    if one_tensor:  # column slices of a projection's output [.., na + nb + 32]
        wide = _randn(*lead, na + nb + 32, dtype=dtype, seed=3, scale=3.0)
        a, b = wide[..., :na], wide[..., na : na + nb]
    else:
        a, b = _randn(*lead, na, dtype=dtype, seed=3, pad=5), _randn(*lead, nb, dtype=dtype, seed=4, scale=0.1)
    ref = rms_norm_pair(norm_a, a, norm_b, b)
    assert torch.equal(ref, torch.cat([norm_a.forward_native(a), norm_b.forward_native(b)], dim=-1))
    dev_a, dev_b = copy.deepcopy(norm_a).to(DEVICE), copy.deepcopy(norm_b).to(DEVICE)
    if ON_CUDA:
        with contextlib.ExitStack() as stack:
            for norm in (dev_a, dev_b):
                torch_path = AssertionError("CUDA input took the torch path")
                stack.enter_context(mock.patch.object(norm, "forward_native", side_effect=torch_path))
            got = rms_norm_pair(dev_a, a.to(DEVICE), dev_b, b.to(DEVICE))
    else:
        from sglang.srt.kernels import elementwise

        got = elementwise.rms_norm_pair(a, dev_a.weight, 1e-6, b, dev_b.weight, 1e-3)
    assert got.shape == ref.shape and got.dtype == ref.dtype and got.is_contiguous()
    torch.testing.assert_close(got.cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


SILU_SHAPES = [((0,), 96), ((1,), 96), ((5,), 576), ((2, 3), 100), ((2,), 1100)]
if ON_CUDA:
    SILU_SHAPES += [((64,), 14336), ((3,), 2304)]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SILU_SHAPES)
def test_silu_and_mul(shape, dtype):
    lead, d = shape
    _compare(SiluAndMul(), _randn(*lead, 2 * d, dtype=dtype, seed=d, scale=4.0))


# (head_size, rotary_dim, q heads, k heads, neox, 3-d input): full and partial rotary, both
# pair layouts, k with fewer heads than q, flat [T, H*D] column slices and [T, H, D] slices.
ROPE_CASES = [
    (64, 64, 4, 2, True, False),
    (128, 64, 2, 1, True, True),
    (64, 64, 3, 1, False, True),
    (96, 32, 2, 2, False, False),
]
if ON_CUDA:
    ROPE_CASES += [(128, 128, 32, 8, True, False), (64, 64, 128, 1, False, True)]
ROPE_TOKENS = [0, 1, 7] + ([300] if ON_CUDA else [])


def _rope_inputs(head: int, q_heads: int, k_heads: int, three_d: bool, tokens: int, dtype: torch.dtype):
    """q, k as the models pass them: slices of a fused qkv [T, (Hq + 2 Hk) * D], or the rope
    channels of [T, H, nope + rope] heads (DeepSeek's q_pe) and a [T, 1, rope] slice (k_pe)."""
    if three_d:
        q = _randn(tokens, q_heads, 16 + head, dtype=dtype, seed=tokens)[..., 16:]
        k = _randn(tokens, k_heads, head, dtype=dtype, seed=tokens + 1, pad=16)
        return q, k
    qkv = _randn(tokens, (q_heads + 2 * k_heads) * head, dtype=dtype, seed=tokens)
    return qkv[:, : q_heads * head], qkv[:, q_heads * head : (q_heads + k_heads) * head]


def _rope_layers(head: int, rot: int, neox: bool) -> list[torch.nn.Module]:
    llama3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=512)
    deepseek = dict(scaling_factor=40.0, mscale=1.0, mscale_all_dim=0.5, beta_fast=32, beta_slow=1)
    return [
        RotaryEmbedding(head, rot, 4096, 10000.0, neox),
        Llama3RotaryEmbedding(head, rot, 4096, 500000.0, neox, **llama3),
        DeepseekScalingRotaryEmbedding(head, rot, 4096, 10000.0, neox, **deepseek),  # mscale != 1
    ]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", ROPE_TOKENS)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rotary_embedding(case, tokens, dtype):
    head, rot, q_heads, k_heads, neox, three_d = case
    q, k = _rope_inputs(head, q_heads, k_heads, three_d, tokens, dtype)
    for layer in _rope_layers(head, rot, neox):
        # Unsorted positions; DeepSeek's table spans the scaled context, so go further there.
        max_pos = 100_000 if isinstance(layer, DeepseekScalingRotaryEmbedding) else 4096
        positions = torch.randint(0, max_pos, (tokens,), generator=torch.Generator().manual_seed(tokens))
        _compare(layer, positions, q, k)


@kernel_test
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", ROPE_TOKENS)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rotary_embedding_store_kv(case, tokens, pool_dtype):
    """forward_store_kv gives forward_triton's q, and stores what forward_triton's k and v
    give through store_kv, bit for bit; other pool rows stay untouched."""
    head, rot, q_heads, k_heads, neox, three_d = case
    dtype = DTYPES[-1]
    q, k = _rope_inputs(head, q_heads, k_heads, three_d, tokens, dtype)
    v = _randn(tokens, k_heads, 48, dtype=dtype, seed=tokens + 2, pad=5)  # a narrower head, row-strided
    q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    slots = 2 * tokens + 3
    loc = torch.randperm(slots, generator=torch.Generator().manual_seed(tokens))[:tokens].to(DEVICE)
    for layer in _rope_layers(head, rot, neox):
        layer = layer.to(DEVICE)
        positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
        k_ref, v_ref = (torch.zeros(slots, k_heads, d, dtype=pool_dtype, device=DEVICE) for d in (head, 48))
        q_ref, k_rot = layer.forward_triton(positions, q, k)
        store_kv(k_ref, v_ref, loc, as_heads(k_rot, head), v)
        k_buf, v_buf = torch.zeros_like(k_ref), torch.zeros_like(v_ref)
        got = layer.forward_store_kv(positions, q, k, v if three_d else v.flatten(1), k_buf, v_buf, loc)
        assert got.shape == q.shape and torch.equal(got, q_ref)
        assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)


# ---------------------------------------------------------------------- KV-cache store

# (heads, k head dim, v head dim, v with a non-unit last stride): Llama-8B's 8 x 128, an odd
# head count, v narrower than k (a transposed view, which save_kv never passes but the kernel
# takes), and 12 wide heads, which two programs per token share (8 + 4 masked).
KV_CASES = [(8, 128, 128, False), (3, 64, 64, False), (2, 96, 64, True), (12, 256, 128, False)]
KV_TOKENS = [0, 1, 5] + ([300] if ON_CUDA else [])
# (k/v dtype, pool dtype). The interpreter rounds float32 -> bf16 by truncation, so that cast only on CUDA.
KV_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
if ON_CUDA:
    KV_DTYPES += [(torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16)]


def _store(pool: MHATokenToKVPool, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The kernel: through the pool's dispatch on CUDA, called directly when interpreted."""
    if not ON_CUDA:
        return store_kv(pool.k_buffer[layer], pool.v_buffer[layer], loc, k, v)
    index_put = mock.patch.object(torch.Tensor, "__setitem__", side_effect=AssertionError("CUDA pool took index_put"))
    with index_put:
        pool.set_kv_buffer(layer, loc, k, v)


@kernel_test
@pytest.mark.parametrize("dtypes", KV_DTYPES)
@pytest.mark.parametrize("tokens", KV_TOKENS)
@pytest.mark.parametrize("case", KV_CASES)
def test_store_kv(case, tokens, dtypes):
    heads, k_dim, v_dim, v_transposed = case
    src_dtype, pool_dtype = dtypes
    size = 2 * tokens + 3
    # k as save_kv passes it: heads of a column slice of a fused qkv projection.
    qkv = _randn(tokens, (2 * heads) * k_dim + heads * v_dim, dtype=src_dtype, seed=tokens)
    k = qkv[:, heads * k_dim : 2 * heads * k_dim].view(-1, heads, k_dim)
    if v_transposed:
        v = _randn(tokens, v_dim, heads, dtype=src_dtype, seed=tokens + 1).transpose(1, 2)
    else:
        v = qkv[:, 2 * heads * k_dim :].view(-1, heads, v_dim)
    # Distinct random slots, the dummy slot 0 (padded rows) among the candidates.
    loc = torch.randperm(size + 1, generator=torch.Generator().manual_seed(tokens))[:tokens]
    ref, got = (MHATokenToKVPool(size, pool_dtype, heads, k_dim, 2, dev, v_head_dim=v_dim) for dev in ("cpu", DEVICE))
    ref.set_kv_buffer(1, loc, k, v)
    _store(got, 1, loc.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    for name in ("k_buffer", "v_buffer"):
        for layer in range(2):  # layer 0 stays untouched
            assert torch.equal(getattr(got, name)[layer].cpu(), getattr(ref, name)[layer]), (name, layer)
    if tokens:
        assert ref.k_buffer[1][loc].abs().sum() > 0 and ref.v_buffer[1][loc].abs().sum() > 0


# ---------------------------------------------------------------------- greedy argmax

ARGMAX_ROWS = [0, 1, 3, 64]
# One block (1024 columns), one column over it, and block counts that do not divide the width.
ARGMAX_VOCABS = [1, 7, 1024, 1025, 3000]
if ON_CUDA:
    ARGMAX_VOCABS += [32000, 49152, 128256, 151936, 256000]
ARGMAX_DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if ON_CUDA else [])


def _check_argmax(x: torch.Tensor) -> None:
    """argmax on DEVICE vs torch.argmax on CPU: the same column for every row."""
    got = argmax(x.to(DEVICE))
    assert got.dtype == torch.int64 and got.shape == x.shape[:1]
    ref = torch.argmax(x, dim=-1)
    wrong = [(row, g, r) for row, (g, r) in enumerate(zip(got.tolist(), ref.tolist())) if g != r]
    assert not wrong, wrong  # (row, got, torch's)


@kernel_test
@pytest.mark.parametrize("dtype", ARGMAX_DTYPES)
@pytest.mark.parametrize("vocab", ARGMAX_VOCABS)
@pytest.mark.parametrize("rows", ARGMAX_ROWS)
def test_argmax(rows, vocab, dtype):
    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    x = _randn(rows, vocab, dtype=dtype, seed=vocab, pad=5, scale=4.0)  # a row-strided view
    # Ties: each row's maximum (odd rows: a new, larger one) set at 3 random columns, which
    # fall in different blocks of the wide rows.
    for r in range(rows):
        x[r, torch.randint(0, vocab, (3,), generator=gen)] = x[r].max() + (r % 2)
    _check_argmax(x)


def _edge_rows(vocab: int) -> torch.Tensor:
    """Rows where the order of equal values, signed zeros, infinities, NaN and subnormals decide."""
    inf, nan, last = float("inf"), float("nan"), vocab - 1
    rows = torch.full((10, vocab), -1.0)
    rows[0] = 0.0  # all equal: column 0
    rows[1] = -inf  # all -inf: column 0
    rows[2, last] = 0.0
    rows[2, last // 2] = -0.0  # -0.0 ties with the later +0.0
    rows[3, last // 3] = inf
    rows[3, last] = inf
    rows[4, last] = nan  # NaN above everything, even an earlier +inf
    rows[4, 0] = inf
    rows[5, last // 2 :] = nan  # the first NaN
    rows[6] = -inf
    rows[6, last] = -3.0e38
    rows[7] = torch.arange(vocab, 0, -1, dtype=torch.float32) * -1.0  # increasing: the last column
    rows[8] = -rows[7]  # decreasing: the first column
    rows[9] = 1.0e-40  # subnormal values
    rows[9, last] = 2.0e-40
    return rows


@kernel_test
@pytest.mark.parametrize("dtype", ARGMAX_DTYPES)
@pytest.mark.parametrize("vocab", ARGMAX_VOCABS)
def test_argmax_edge_values(vocab, dtype):
    rows = _edge_rows(vocab).to(dtype)
    if dtype == torch.bfloat16 and not ON_CUDA:
        rows = rows[:-1]  # the interpreter flushes bf16 subnormals when converting to float32
    _check_argmax(rows)


@kernel_test
@pytest.mark.parametrize("detect_nan", [False, True])
def test_greedy_sampler_uses_the_kernel(detect_nan):
    """The greedy path on CUDA never calls torch.argmax and keeps its answers: NaN rows give
    the first NaN's column, or NAN_TOKEN_ID under --enable-nan-detection."""
    logits = _edge_rows(3000)
    info = SamplingBatchInfo.from_requests(
        [SamplingParams(temperature=0)] * len(logits), [([0], [])] * len(logits), [None] * len(logits), 3000, DEVICE
    )
    ref = torch.argmax(logits, dim=-1)
    if detect_nan:
        ref = torch.where(torch.isfinite(logits).all(dim=-1), ref, NAN_TOKEN_ID)
    no_torch_argmax = mock.patch("torch.argmax", side_effect=AssertionError("CUDA logits took torch.argmax"))
    with no_torch_argmax if ON_CUDA else contextlib.nullcontext():
        got = Sampler(detect_nan)(logits.to(DEVICE), info).next_token_ids
    assert torch.equal(got.cpu(), ref)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need CUDA")
def test_step_ops_replay_in_cuda_graph():
    """Both kernels capture (no host reads) and a replay follows the static inputs' new values."""
    heads, dim, tokens, slots, vocab = 8, 128, 4, 32, 128256
    k_buf, v_buf = (torch.zeros(slots, heads, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    k, v = (torch.randn(tokens, heads, dim, device="cuda") for _ in range(2))
    loc = torch.arange(1, tokens + 1, device="cuda")
    logits = torch.randn(tokens, vocab, device="cuda")
    store_kv(k_buf, v_buf, loc, k, v)  # compile outside the capture
    argmax(logits)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv(k_buf, v_buf, loc, k, v)
        ids = argmax(logits)
    for t in (k, v, logits):
        t.normal_()
    loc.copy_(torch.tensor([9, 3, 30, 17]))
    k_buf.zero_()
    v_buf.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ids, torch.argmax(logits, dim=-1))
    assert torch.equal(k_buf[loc], k.to(torch.bfloat16)) and torch.equal(v_buf[loc], v.to(torch.bfloat16))
    assert k_buf.float().abs().sum() == k_buf[loc].float().abs().sum()  # nothing written elsewhere
