"""Fused Triton element-wise kernels (RMSNorm, SiLU-and-mul, RoPE) vs the layers' plain-PyTorch path.

The reference is each layer's `forward_native` on CPU; the kernel is its `forward_triton`
on DEVICE, reached through the layer's own dispatch on CUDA (compiled, fp32 and bf16) and
called directly under Triton's CPU interpreter (float32, small shapes, in a subprocess as
in test_triton_kernels). Without triton the module is skipped.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from test_triton_kernels import NEEDS_SUBPROCESS, ON_CUDA, kernel_test, rerun_under_interpreter  # patches the interpreter for NumPy >= 2.4

from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.deepseek_rotary import DeepseekScalingRotaryEmbedding
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.rotary_embedding import Llama3RotaryEmbedding, RotaryEmbedding

DEVICE = "cuda" if ON_CUDA else "cpu"
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
        # Unsorted positions; past the table for DeepSeek's module, which has none.
        max_pos = 100_000 if isinstance(layer, DeepseekScalingRotaryEmbedding) else 4096
        positions = torch.randint(0, max_pos, (tokens,), generator=torch.Generator().manual_seed(tokens))
        _compare(layer, positions, q, k)
