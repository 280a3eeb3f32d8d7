"""Triton kernels vs their plain-PyTorch references on random inputs.

On CUDA the kernels run compiled (bf16/fp32); without CUDA they run under Triton's CPU
interpreter on small float32 shapes; without triton the module is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

ON_CUDA = torch.cuda.is_available()
# TRITON_INTERPRET is read when each @triton.jit function (triton.language's own included)
# is decorated, and triton is usually imported before this module (by transformers), so on
# CPU the kernel tests rerun in a fresh interpreter process that sets it from the start.
NEEDS_SUBPROCESS = not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1"
kernel_test = pytest.mark.skipif(NEEDS_SUBPROCESS, reason="runs in the TRITON_INTERPRET=1 subprocess")


@pytest.mark.skipif(not NEEDS_SUBPROCESS, reason="already compiled or interpreted in this process")
def test_kernels_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=1800,
    )
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]


def _interpreter_numpy2_compat() -> None:
    """Triton 3.6's interpreter turns scalar tensors (numpy shape (1,)) into loop bounds with
    int(array), which NumPy >= 2.4 rejects; use .item() instead (test-only, interpreter-only)."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_numpy2_compat()

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from sglang.srt.layers.moe.fused_moe import moe_forward_native  # noqa: E402
from sglang.srt.layers.moe.fused_moe_triton import fused_moe  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

DEVICE = "cuda" if ON_CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float32] if ON_CUDA else [torch.float32]
TOL = {torch.float32: 2e-3 if ON_CUDA else 1e-4, torch.bfloat16: 3e-2}  # CUDA fp32 dots run in tf32


# (num_heads, num_kv_heads, head_dim, v_head_dim, mla): MHA, GQA 4:1, MQA with a non-power-of-two
# head dim, MLA (one latent head: k = latent ‖ rope, v = latent) at tiny and real DeepSeek widths.
ATTN_SHAPES = [
    (4, 4, 32, 32, False),
    (8, 2, 64, 64, False),
    (6, 1, 48, 48, False),
    (4, 1, 48, 32, True),
]
if ON_CUDA:
    ATTN_SHAPES += [(32, 8, 128, 128, False), (16, 1, 576, 512, True), (128, 1, 576, 512, True)]


def _layer(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int) -> RadixAttention:
    return RadixAttention(num_heads, head_dim, head_dim**-0.5, num_kv_heads, layer_id=0, v_head_dim=v_head_dim)


def _tree_mask(ext: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """Prefix fully visible; each new token sees itself and a random subset of earlier new tokens."""
    mask = torch.ones(ext, seq, dtype=torch.bool)
    new = torch.rand(ext, ext, generator=gen) < 0.5
    mask[:, seq - ext :] = (new.tril(-1) | torch.eye(ext, dtype=torch.bool))
    return mask.flatten()


def _make_batch(shape, ext_lens, prefix_lens, dtype, tree: bool, seed: int):
    """A one-layer pool with random cached prefixes at scattered slots, plus this forward's q/k/v."""
    num_heads, num_kv_heads, head_dim, v_head_dim, mla = shape
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, ext_lens)]
    pool_size = sum(seq_lens) + 37
    if mla:
        pool = MLATokenToKVPool(pool_size, dtype, v_head_dim, head_dim - v_head_dim, 1, DEVICE)
        pool.kv_buffer[0].copy_(torch.randn(pool.kv_buffer[0].shape, generator=gen))
    else:
        pool = MHATokenToKVPool(pool_size, dtype, num_kv_heads, head_dim, 1, DEVICE, v_head_dim)
        pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=gen))
        pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=gen))
    bs = len(ext_lens)
    req_pool = ReqToTokenPool(bs + 3, max(seq_lens, default=1) + 4, DEVICE)
    rows = torch.randperm(bs + 3, generator=gen)[:bs]
    slots = (torch.randperm(pool_size, generator=gen) + 1).tolist()  # scattered: crosses every block
    out_loc = []
    for row, seq, ext in zip(rows.tolist(), seq_lens, ext_lens):
        mine, slots = slots[:seq], slots[seq:]
        req_pool.write(row, 0, torch.tensor(mine, device=DEVICE))
        out_loc += mine[seq - ext :]
    num_tokens = sum(ext_lens)
    as_dev = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)
    mask = None
    if tree:
        mask = torch.cat([_tree_mask(e, s, gen) for e, s in zip(ext_lens, seq_lens)] + [torch.zeros(0, dtype=torch.bool)])
        mask = mask.to(DEVICE)
    fb = ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY if tree else ForwardMode.EXTEND,
        batch_size=bs,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE),
        positions=torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE),
        out_cache_loc=as_dev(out_loc),
        req_pool_indices=rows.to(DEVICE),
        seq_lens=as_dev(seq_lens),
        extend_seq_lens=as_dev(ext_lens),
        seq_lens_cpu=seq_lens,
        extend_seq_lens_cpu=list(ext_lens),
        custom_mask=mask,
        req_to_token_pool=req_pool,
        token_to_kv_pool=pool,
    )
    q = torch.randn(num_tokens, num_heads * head_dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(num_tokens, num_kv_heads * head_dim, generator=gen).to(DEVICE, dtype)
    v = k[:, :v_head_dim] if mla else torch.randn(num_tokens, num_kv_heads * v_head_dim, generator=gen).to(DEVICE, dtype)
    return fb, q, k, v


def _compare(shape, ext_lens, prefix_lens, dtype, tree=False, seed=0):
    fb, q, k, v = _make_batch(shape, ext_lens, prefix_lens, dtype, tree, seed)
    layer = _layer(*shape[:4])
    outs = []
    for backend in (TorchNativeAttnBackend(), TritonAttnBackend()):
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(q, k, v, layer, fb).float())
    ref, got = outs
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=TOL[dtype], rtol=TOL[dtype])
    return fb


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_decode_matches_torch_native(shape, dtype):
    # KV lengths 1, block-boundary-adjacent, and long enough for several KV splits.
    prefix_lens = [0, 63, 64, 200, 7]
    fb = _compare(shape, [1] * len(prefix_lens), prefix_lens, dtype)
    assert fb.attn_backend.metadata.use_decode_kernel
    assert fb.attn_backend.metadata.num_kv_splits.tolist() == [1, 1, 2, 4, 1]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_extend_with_prefix_matches_torch_native(shape, dtype):
    # Fresh prefill, prefix + chunk across block sizes, a request with no new tokens.
    fb = _compare(shape, [5, 17, 0, 70, 1], [0, 40, 3, 16, 9], dtype, seed=1)
    assert not fb.attn_backend.metadata.use_decode_kernel


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_verify_tree_mask_matches_torch_native(shape, dtype):
    fb = _compare(shape, [4, 6, 1], [10, 0, 65], dtype, tree=True, seed=2)
    assert fb.attn_backend.metadata.mask_indptr.tolist() == [0, 4 * 14, 4 * 14 + 36, 4 * 14 + 36 + 66]


@kernel_test
@pytest.mark.parametrize("shape", [ATTN_SHAPES[1], ATTN_SHAPES[3]])
def test_zero_row_batch(shape):
    num_heads, _, _, v_head_dim, _ = shape
    fb, q, k, v = _make_batch(shape, [], [], DTYPES[0], tree=False, seed=3)
    backend = TritonAttnBackend()
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, _layer(*shape[:4]), fb)
    assert out.shape == (0, num_heads * v_head_dim)


# (tokens, experts, top_k, hidden, intermediate): 0 rows, decode-sized, several blocks per
# expert, widths that are not multiples of the tiles, more experts than routed pairs.
MOE_SHAPES = [(0, 4, 2, 32, 48), (1, 8, 2, 32, 48), (5, 4, 1, 40, 24), (33, 6, 3, 64, 80), (3, 16, 2, 32, 32)]
if ON_CUDA:
    MOE_SHAPES += [(200, 64, 6, 1024, 352), (1, 256, 8, 2048, 256)]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MOE_SHAPES)
def test_fused_moe_matches_native(shape, dtype):
    num_tokens, num_experts, top_k, hidden, inter = shape
    gen = torch.Generator().manual_seed(num_tokens * 7 + num_experts)
    rand = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(DEVICE, dtype)
    x = rand(num_tokens, hidden)
    w13, w2 = rand(num_experts, 2 * inter, hidden, scale=hidden**-0.5), rand(num_experts, hidden, inter, scale=inter**-0.5)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    ref = moe_forward_native(x, w13, w2, weights, ids)
    got = fused_moe(x, w13, w2, weights, ids)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
