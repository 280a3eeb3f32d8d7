"""The chain verify outcome's Triton kernel (spec_ops) vs its plain-PyTorch path
(eagle_utils.greedy_accept_chain + verify_outcome, on CPU): every output equal, dtypes included.

On CUDA the kernel is reached through chain_verify_outcome's own dispatch; without CUDA it is
called directly under Triton's CPU interpreter (in a subprocess, see sglang.test.triton_harness).
Without triton the module is skipped.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from sglang.srt.mem_cache.memory_pool import DUMMY_KV_SLOT
from sglang.srt.speculative import eagle_utils
from sglang.srt.speculative.eagle_utils import VerifyOutcome, greedy_accept_chain, verify_outcome
from sglang.test.triton_harness import DEVICE, NEEDS_SUBPROCESS, ON_CUDA, kernel_test, rerun_under_interpreter

spec_ops = pytest.importorskip("sglang.srt.kernels.spec_ops")  # imports triton

VOCAB = 5  # small, so drafts after the first mismatch often match again (they must not count)


@pytest.mark.skipif(not NEEDS_SUBPROCESS, reason="already compiled or interpreted in this process")
def test_spec_ops_under_triton_interpreter():
    rerun_under_interpreter(__file__, timeout=600)


def _chain_batch(bs: int, n: int, shift: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """(tokens, target_tokens, kv_len, slots, target_hidden) on CPU, row b accepting exactly
    (b + shift) % n drafts before any clamp to the width; tokens, kv_len and slots are strided views."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, VOCAB, (bs, n), generator=gen).to(dtype)
    tokens = torch.randint(0, VOCAB, (bs, n + 3), generator=gen).to(dtype)[:, 1 : n + 1]
    for b in range(bs):
        p = (b + shift) % n
        tokens[b, 1 : p + 1] = target[b, :p]
        if p + 1 < n:
            tokens[b, p + 1] = (target[b, p] + 1) % VOCAB
    kv_len = torch.randint(0, 1000, (2 * bs,), generator=gen).to(dtype)[::2]
    slots = (torch.randperm(2 * bs * n, generator=gen) + 1).to(dtype).view(bs, 2 * n)[:, ::2]
    return tokens, target, kv_len, slots, torch.randn(bs * n, 8, generator=gen)


def _kernel_outcome(*args: torch.Tensor, width: int) -> VerifyOutcome:
    """The kernel's outcome on DEVICE: through chain_verify_outcome's dispatch on CUDA
    (never the torch path), called directly when interpreted."""
    args = tuple(a.to(DEVICE) for a in args)
    if not ON_CUDA:
        return VerifyOutcome.from_tuple(spec_ops.chain_outcome(*args, width, DUMMY_KV_SLOT))
    with mock.patch.object(eagle_utils, "greedy_accept_chain", side_effect=AssertionError("CUDA took the torch path")):
        return eagle_utils.chain_verify_outcome(*args, width)


def _assert_same(got: VerifyOutcome, ref: VerifyOutcome) -> None:
    for g, r in zip(got.as_tuple(), ref.as_tuple(), strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape and torch.equal(g.cpu(), r)


@kernel_test
@pytest.mark.parametrize("bs", [1, 3, 32, 33])
@pytest.mark.parametrize("n", [2, 4, 6])
@pytest.mark.parametrize("short", [False, True], ids=["width=n", "width<n"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_chain_outcome_matches_torch(bs, n, short, dtype):
    """Every accepted-prefix length 0..n-1 (all drafts rejected .. all accepted) in every row."""
    width = n - 1 if short else n
    for shift in range(n):
        tokens, target, kv_len, slots, hidden = _chain_batch(bs, n, shift, dtype, seed=bs * 100 + n * 10 + shift)
        ref = verify_outcome(greedy_accept_chain(tokens, target, width), kv_len, slots, hidden)
        got = _kernel_outcome(tokens, target, kv_len, slots, hidden, width=width)
        _assert_same(got, ref)
        assert got.extend_hidden.data_ptr() != hidden.data_ptr()  # a fresh tensor


def test_chain_outcome_launches_nothing_for_zero_requests():
    tokens, target, kv_len, slots, hidden = _chain_batch(0, 4, 0, torch.int64, seed=0)
    ref = verify_outcome(greedy_accept_chain(tokens, target, 3), kv_len, slots, hidden)
    with mock.patch.object(spec_ops, "_chain_outcome_kernel") as kernel:
        got = spec_ops.chain_outcome(tokens, target, kv_len, slots, hidden, 3, DUMMY_KV_SLOT)
    assert not kernel.mock_calls
    _assert_same(VerifyOutcome.from_tuple(got), ref)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need CUDA")
def test_chain_outcome_replays_in_cuda_graph():
    """The kernel captures (no host reads) and a replay follows the static inputs' new values."""
    bs, n, width = 8, 4, 4
    inputs = [t.cuda() for t in _chain_batch(bs, n, 0, torch.int64, seed=1)]
    eagle_utils.chain_verify_outcome(*inputs, width)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = eagle_utils.chain_verify_outcome(*inputs, width)
    new = _chain_batch(bs, n, 2, torch.int64, seed=2)
    for static, value in zip(inputs, new, strict=True):
        static.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(got, verify_outcome(greedy_accept_chain(*new[:2], width), *new[2:]))
