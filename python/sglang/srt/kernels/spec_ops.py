"""Triton kernels of the speculative decode cycle, each one launch where plain PyTorch takes
several small ones:

- chain_outcome: the verify's greedy outcome of chains (topk 1), the acceptance and
  everything the rest of the cycle reads from it (eagle_utils.greedy_accept_chain +
  verify_outcome: about 25 ops);
- write_table_rows: spans of request->token table rows (ReqToTokenPool.write_rows_from:
  an add and an index_put);
- gather_states / store_states: a cycle's request states at its start and its end
  (RequestStates.cycle_start: 4 index ops; store_cycle_end: 4 index_copy_ and 3 more);
- draft_step_inputs: a later draft step's slots, positions and lengths from the first
  step's batch (DraftLoop's next step: 8 ops).

Each takes any strided views of its inputs (every stride is a kernel argument), launches
nothing for zero requests and never reads device data on the host, so it can be captured in
a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.utils.int_math import next_power_of_2

# ---------------------------------------------------------------------- chain outcome


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


# ---------------------------------------------------------------------- table rows


@triton.jit
def _write_table_rows_kernel(
    table_ptr,
    rows_ptr,
    starts_ptr,
    slots_ptr,
    table_stride_r,
    table_stride_c,
    table_columns,
    rows_stride,
    starts_stride,
    slots_stride_b,
    slots_stride_w,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Program b: table[rows[b], starts[b] + j] = slots[b, j] for j < WIDTH; a column past the
    # table's end is not written (it would be the next row's).
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + b * rows_stride).to(tl.int64)
    start = tl.load(starts_ptr + b * starts_stride).to(tl.int64)
    j = tl.arange(0, BLOCK)
    cols = start + j
    mask = (j < WIDTH) & (cols < table_columns)
    slots = tl.load(slots_ptr + b * slots_stride_b + j * slots_stride_w, mask=mask)
    tl.store(table_ptr + row * table_stride_r + cols * table_stride_c, slots.to(table_ptr.dtype.element_ty), mask=mask)


def write_table_rows(table: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> None:
    """table[rows[i], starts[i] : starts[i] + w] = slots[i], cast to the table's dtype, in one
    launch. table [R, C]; rows, starts [bs] integer; slots [bs, w]; any strides;
    starts[i] + w <= C. A row given twice keeps one of its writes (as index_put)."""
    bs, width = slots.shape
    assert table.dim() == 2 and rows.shape == starts.shape == (bs,)
    if not bs or not width:
        return
    _write_table_rows_kernel[(bs,)](
        table,
        rows,
        starts,
        slots,
        *table.stride(),
        table.shape[1],
        *rows.stride(),
        *starts.stride(),
        *slots.stride(),
        WIDTH=width,
        BLOCK=next_power_of_2(width),
        num_warps=1,
    )


# ---------------------------------------------------------------------- request states
#
# The state buffers (RequestStates.buffers), contiguous: cursors [R, 2], probs and tokens
# [R, TOPK], hidden [R, HIDDEN]; the kernels address their rows as row * width.

# Hidden-state elements a program copies per loop iteration.
_HIDDEN_BLOCK = 1024


@triton.jit
def _copy_row(src, src_stride, dst, dst_stride, N: tl.constexpr, BLOCK: tl.constexpr):
    # dst[:N] = src[:N] cast to dst's dtype (element strides), BLOCK elements at a time.
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(src + cols * src_stride, mask=mask)
        tl.store(dst + cols * dst_stride, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _gather_states_kernel(
    rows_ptr,
    rows_stride,
    cursors_ptr,
    probs_ptr,
    tokens_ptr,
    hidden_ptr,
    out_cursors_ptr,
    out_probs_ptr,
    out_tokens_ptr,
    out_hidden_ptr,
    TOPK: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # Program b: output row b (contiguous) = state row rows[b] of each buffer.
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + b * rows_stride).to(tl.int64)
    _copy_row(cursors_ptr + row * 2, 1, out_cursors_ptr + b * 2, 1, 2, 2)
    _copy_row(probs_ptr + row * TOPK, 1, out_probs_ptr + b * TOPK, 1, TOPK, BLOCK_K)
    _copy_row(tokens_ptr + row * TOPK, 1, out_tokens_ptr + b * TOPK, 1, TOPK, BLOCK_K)
    _copy_row(hidden_ptr + row * HIDDEN, 1, out_hidden_ptr + b * HIDDEN, 1, HIDDEN, BLOCK_H)


@triton.jit
def _store_states_kernel(
    rows_ptr,
    cursors_ptr,
    probs_ptr,
    tokens_ptr,
    hidden_ptr,
    new_cursors_ptr,
    new_probs_ptr,
    new_tokens_ptr,
    new_hidden_ptr,
    rows_stride,
    new_cursors_stride_b,
    new_cursors_stride_c,
    new_probs_stride_b,
    new_probs_stride_k,
    new_tokens_stride_b,
    new_tokens_stride_k,
    new_hidden_stride_b,
    new_hidden_stride_h,
    TOPK: tl.constexpr,
    HIDDEN: tl.constexpr,
    DUMMY_ROW: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # Program b: state row rows[b] of each buffer = input row b, cast to the buffer's dtype;
    # the dummy row's cursors are (0, 0).
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + b * rows_stride).to(tl.int64)
    _copy_row(new_probs_ptr + b * new_probs_stride_b, new_probs_stride_k, probs_ptr + row * TOPK, 1, TOPK, BLOCK_K)
    _copy_row(new_tokens_ptr + b * new_tokens_stride_b, new_tokens_stride_k, tokens_ptr + row * TOPK, 1, TOPK, BLOCK_K)
    _copy_row(new_hidden_ptr + b * new_hidden_stride_b, new_hidden_stride_h, hidden_ptr + row * HIDDEN, 1, HIDDEN, BLOCK_H)
    cols = tl.arange(0, 2)
    cursors = tl.load(new_cursors_ptr + b * new_cursors_stride_b + cols * new_cursors_stride_c)
    cursors = tl.where(row != DUMMY_ROW, cursors, 0)
    tl.store(cursors_ptr + row * 2 + cols, cursors.to(cursors_ptr.dtype.element_ty))


def _state_blocks(buffers: tuple[torch.Tensor, ...]) -> dict[str, int]:
    """The kernels' shape constants for the state buffers (asserted contiguous)."""
    cursors, probs, tokens, hidden_states = buffers
    assert all(t.is_contiguous() for t in buffers) and cursors.shape[1] == 2 and tokens.shape == probs.shape
    topk, hidden = probs.shape[1], hidden_states.shape[1]
    return dict(TOPK=topk, HIDDEN=hidden, BLOCK_K=next_power_of_2(topk), BLOCK_H=min(next_power_of_2(hidden), _HIDDEN_BLOCK))


def gather_states(buffers: tuple[torch.Tensor, ...], rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Rows `rows` [bs] (any stride) of the state buffers (cursors, probs, tokens, hidden):
    fresh contiguous tensors of the buffers' dtypes, in one launch."""
    bs = rows.shape[0]
    out = tuple(t.new_empty((bs, t.shape[1])) for t in buffers)
    if bs:
        _gather_states_kernel[(bs,)](rows, *rows.stride(), *buffers, *out, **_state_blocks(buffers))
    return out


def store_states(buffers: tuple[torch.Tensor, ...], rows: torch.Tensor, new: tuple[torch.Tensor, ...], dummy_row: int) -> None:
    """Row rows[i] of each state buffer (cursors, probs, tokens, hidden) = row i of its
    counterpart in `new` ([bs, 2], [bs, topk], [bs, topk], [bs, hidden], any strides), cast
    to the buffer's dtype, in one launch; the dummy row's cursors become (0, 0). Rows other
    than dummy_row are distinct. The padded requests' programs store into the dummy row at
    once, so each of its values is that of one of them, not necessarily the same one for every
    column (a mix of padded rows' values: only padded requests read it)."""
    bs = rows.shape[0]
    assert all(n.shape == (bs, t.shape[1]) for n, t in zip(new, buffers, strict=True))
    if not bs:
        return
    _store_states_kernel[(bs,)](
        rows,
        *buffers,
        *new,
        *rows.stride(),
        *(s for n in new for s in n.stride()),
        DUMMY_ROW=dummy_row,
        **_state_blocks(buffers),
    )


# ---------------------------------------------------------------------- draft steps


@triton.jit
def _draft_step_inputs_kernel(
    table_ptr,
    rows_ptr,
    seq_lens_ptr,
    positions_ptr,
    loc_ptr,
    out_loc_ptr,
    out_positions_ptr,
    out_seq_lens_ptr,
    table_stride_r,
    table_stride_c,
    rows_stride,
    seq_lens_stride,
    positions_stride,
    loc_stride,
    step,
    max_position,
    TOPK: tl.constexpr,
    PAD_SLOT: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program b: request b's TOPK inputs of draft step `step` from the first step's batch
    # (seq_lens L + TOPK): input j's KV slot is table column L + step * TOPK + j of its row
    # (PAD_SLOT where the first step's was: a padded row), its position the first step's
    # + step, clamped; the step's seq_lens are L + (step + 1) * TOPK.
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + b * rows_stride).to(tl.int64)
    first_seq_len = tl.load(seq_lens_ptr + b * seq_lens_stride)
    j = tl.arange(0, BLOCK_K)
    mask = j < TOPK
    inputs = b * TOPK + j
    cols = (first_seq_len + (step - 1) * TOPK + j).to(tl.int64)
    slot = tl.load(table_ptr + row * table_stride_r + cols * table_stride_c, mask=mask)
    first_loc = tl.load(loc_ptr + inputs * loc_stride, mask=mask)
    slot = tl.where(first_loc == PAD_SLOT, PAD_SLOT, slot)
    tl.store(out_loc_ptr + inputs, slot.to(out_loc_ptr.dtype.element_ty), mask=mask)
    position = tl.load(positions_ptr + inputs * positions_stride, mask=mask)
    tl.store(out_positions_ptr + inputs, tl.minimum(position + step, max_position), mask=mask)
    tl.store(out_seq_lens_ptr + b, first_seq_len + step * TOPK)


def draft_step_inputs(
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    step: int,
    topk: int,
    max_position: int,
    pad_slot: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out_cache_loc [bs * topk], positions [bs * topk], seq_lens [bs]) of draft step `step`
    (>= 1) from the first step's batch (rows, seq_lens [bs]; positions, out_cache_loc
    [bs * topk]; any strides), in one launch; each keeps its input's dtype, the slots the
    table's."""
    bs = rows.shape[0]
    assert seq_lens.shape == (bs,) and positions.shape == out_cache_loc.shape == (bs * topk,) and step >= 1
    out_loc = table.new_empty(bs * topk)
    out_positions, out_seq_lens = positions.new_empty(bs * topk), seq_lens.new_empty(bs)
    if bs:
        _draft_step_inputs_kernel[(bs,)](
            table,
            rows,
            seq_lens,
            positions,
            out_cache_loc,
            out_loc,
            out_positions,
            out_seq_lens,
            *table.stride(),
            *rows.stride(),
            *seq_lens.stride(),
            *positions.stride(),
            *out_cache_loc.stride(),
            step,
            max_position,
            TOPK=topk,
            PAD_SLOT=pad_slot,
            BLOCK_K=next_power_of_2(topk),
            num_warps=1,
        )
    return out_loc, out_positions, out_seq_lens
