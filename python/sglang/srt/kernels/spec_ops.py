"""Triton kernel for the speculative verify's greedy outcome of chains (topk 1): the
acceptance and everything the rest of the cycle reads from it, in one launch where plain
PyTorch takes about 25 small ones (eagle_utils.greedy_accept_chain + verify_outcome).

It takes any strided views (every stride is a kernel argument), launches nothing for zero
requests and never reads device data on the host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.utils.int_math import next_power_of_2


@triton.jit
def _chain_outcome_kernel(
    tokens_ptr,
    target_ptr,
    kv_len_ptr,
    slots_ptr,
    accept_len_ptr,
    nodes_ptr,
    emitted_ptr,
    extend_slots_ptr,
    hidden_rows_ptr,
    logits_rows_ptr,
    cursors_ptr,
    host_reads_ptr,
    tokens_stride_b,
    tokens_stride_n,
    target_stride_b,
    target_stride_n,
    kv_len_stride,
    slots_stride_b,
    slots_stride_n,
    N: tl.constexpr,
    WIDTH: tl.constexpr,
    DUMMY_SLOT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Program b: request b's chain of N nodes (node 0 the root). Draft node j >= 1 is
    # accepted iff every node 1..j holds the target's argmax at the node before it.
    b = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    drafts = (cols >= 1) & (cols < N)
    target = target_ptr + b * target_stride_b
    tokens = tl.load(tokens_ptr + b * tokens_stride_b + cols * tokens_stride_n, mask=drafts)
    before = tl.load(target + (cols - 1) * target_stride_n, mask=drafts)
    first_miss = tl.min(tl.where(drafts & (tokens != before), cols, N), axis=0)
    accept_len = tl.minimum(first_miss - 1, WIDTH - 1).to(tl.int64)  # in [0, WIDTH - 1]
    # Column j < WIDTH: emitted token j is the target's argmax at node min(j, accept_len);
    # past accept_len it pads (token 0, the last node, the dummy slot). nodes <= accept_len < N.
    real = cols <= accept_len
    row = cols < WIDTH
    nodes = tl.minimum(cols, accept_len)
    emitted = tl.load(target + nodes * target_stride_n, mask=real, other=0)
    extend_slots = tl.load(slots_ptr + b * slots_stride_b + nodes * slots_stride_n, mask=real, other=DUMMY_SLOT)
    last_token = tl.load(target + accept_len * target_stride_n).to(tl.int64)
    kv_len = tl.load(kv_len_ptr + b * kv_len_stride).to(tl.int64)
    out = b * WIDTH + cols
    tl.store(accept_len_ptr + b, accept_len)
    tl.store(nodes_ptr + out, nodes, mask=row)
    tl.store(emitted_ptr + out, emitted, mask=row)
    tl.store(extend_slots_ptr + out, extend_slots.to(extend_slots_ptr.dtype.element_ty), mask=row)
    tl.store(hidden_rows_ptr + out, b * N + nodes, mask=row)
    tl.store(logits_rows_ptr + b, b * WIDTH + accept_len)
    tl.store(cursors_ptr + 2 * b, kv_len + accept_len + 1)
    tl.store(cursors_ptr + 2 * b + 1, last_token)
    reads = host_reads_ptr + b * (1 + 2 * WIDTH)
    tl.store(reads, accept_len)
    tl.store(reads + 1 + cols, nodes, mask=row)
    tl.store(reads + 1 + WIDTH + cols, emitted.to(tl.int64), mask=row)


def chain_outcome(
    tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor,
    target_hidden: torch.Tensor,
    width: int,
    dummy_slot: int,
) -> tuple[torch.Tensor, ...]:
    """The greedy outcome of a batch of chains, in VerifyOutcome.as_tuple()'s order:
    (accept_len [bs], nodes [bs, width], emitted [bs, width], extend_slots [bs, width],
    extend_hidden [bs * width, hidden], extend_logits_rows [bs], cursors [bs, 2],
    host_reads [bs, 1 + 2 * width]). One launch, then the hidden rows' index_select.

    tokens, target_tokens (integer), slots: [bs, n] any strides; kv_len [bs]; target_hidden
    [bs * n, hidden]; 1 <= width <= n. emitted keeps target_tokens' dtype, extend_slots
    slots' dtype, extend_hidden target_hidden's; the rest is int64.
    """
    bs, n = tokens.shape
    assert target_tokens.shape == slots.shape == (bs, n) and kv_len.shape == (bs,) and 1 <= width <= n
    assert not target_tokens.dtype.is_floating_point and target_hidden.shape[0] == bs * n

    def new(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=tokens.device)

    accept_len, nodes, hidden_rows = new(bs), new(bs, width), new(bs * width)
    emitted, extend_slots = new(bs, width, dtype=target_tokens.dtype), new(bs, width, dtype=slots.dtype)
    logits_rows, cursors, host_reads = new(bs), new(bs, 2), new(bs, 1 + 2 * width)
    if bs:
        _chain_outcome_kernel[(bs,)](
            tokens,
            target_tokens,
            kv_len,
            slots,
            accept_len,
            nodes,
            emitted,
            extend_slots,
            hidden_rows,
            logits_rows,
            cursors,
            host_reads,
            *tokens.stride(),
            *target_tokens.stride(),
            *kv_len.stride(),
            *slots.stride(),
            N=n,
            WIDTH=width,
            DUMMY_SLOT=dummy_slot,
            BLOCK=next_power_of_2(n),
            num_warps=1,
        )
    extend_hidden = target_hidden.index_select(0, hidden_rows)  # fresh rows, never a view
    return accept_len, nodes, emitted, extend_slots, extend_hidden, logits_rows, cursors, host_reads
