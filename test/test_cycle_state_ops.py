"""The decode cycle's table and request-state kernels (spec_ops.write_table_rows,
gather_states, store_states) vs their plain-PyTorch paths (ReqToTokenPool.write_rows_from,
RequestStates.cycle_start and store_cycle_end, on CPU): equal results, dtypes included.

On CUDA the kernels are reached through those methods' own dispatch; without CUDA they are
called directly under Triton's CPU interpreter (in a subprocess, see sglang.test.triton_harness).
Without triton the module is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from sglang.srt.batch.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.mem_cache.memory_pool import DUMMY_KV_SLOT, DUMMY_REQ_ROW, ReqToTokenPool
from sglang.srt.model_executor.cuda_graph_runner import PAD_KV_SLOT
from sglang.srt.speculative.draft_loop import DraftLoop
from sglang.srt.speculative.spec_info import RequestStates
from sglang.srt.utils.device_constants import DeviceConstants
from sglang.test.triton_harness import DEVICE, NEEDS_SUBPROCESS, ON_CUDA, kernel_test, rerun_under_interpreter

spec_ops = pytest.importorskip("sglang.srt.kernels.spec_ops")  # imports triton

TABLE_ROWS = 41  # the dummy row 0 and rows 1..40
COLUMNS = 12
BATCH_SIZES = [0, 1, 3, 32]


@pytest.mark.skipif(not NEEDS_SUBPROCESS, reason="already compiled or interpreted in this process")
def test_cycle_state_ops_under_triton_interpreter():
    rerun_under_interpreter(__file__, timeout=600)


@contextmanager
def _launches(name: str) -> Iterator[None]:
    """On CUDA: the block must reach spec_ops.<name> (never the torch path)."""
    with mock.patch.object(spec_ops, name, wraps=getattr(spec_ops, name)) as kernel:
        yield
    assert kernel.call_count == 1, f"CUDA took the torch path instead of {name}"


def _strided(t: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    """t's values on `device` as a view whose last dimension has stride 2 (and rows a longer stride)."""
    base = torch.zeros((*t.shape[:-1], 2 * t.shape[-1] + 1), dtype=t.dtype, device=device)
    view = base[..., 1::2]
    view.copy_(t)
    return view


def _rows(bs: int, gen: torch.Generator) -> torch.Tensor:
    """[bs] table rows: distinct real rows, and from bs 3 the dummy row at two or more random places."""
    rows = torch.randperm(TABLE_ROWS - 1, generator=gen)[:bs] + 1
    num_dummy = 0 if bs < 3 else max(2, bs // 6)
    rows[torch.randperm(bs, generator=gen)[:num_dummy]] = DUMMY_REQ_ROW
    return rows


# ---------------------------------------------------------------------- table rows


def _table_write(bs: int, width: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(table, rows, starts, slots) on CPU: every other span ends at the table's last column;
    a padded request (dummy row) writes the dummy slot from column 0, as in a cycle."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 1000, (TABLE_ROWS, COLUMNS), generator=gen)
    rows = _rows(bs, gen)
    starts = torch.randint(0, COLUMNS - width + 1, (bs,), generator=gen)
    starts[::2] = COLUMNS - width
    slots = torch.randint(1, 1000, (bs, width), generator=gen)
    dummy = rows == DUMMY_REQ_ROW
    starts[dummy], slots[dummy] = 0, DUMMY_KV_SLOT
    return table, rows, starts, slots


def _kernel_table(table: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The table after the kernel's write of strided rows, starts and slots on DEVICE."""
    args = tuple(_strided(t, DEVICE) for t in (rows, starts, slots))
    if not ON_CUDA:
        table = table.clone()
        spec_ops.write_table_rows(table, *args)
        return table
    pool = ReqToTokenPool(TABLE_ROWS - 1, COLUMNS, DEVICE)
    pool.req_to_token.copy_(table)
    with _launches("write_table_rows"):
        pool.write_rows_from(*args)
    return pool.req_to_token.cpu()


@kernel_test
@pytest.mark.parametrize("bs", BATCH_SIZES)
@pytest.mark.parametrize("width", range(1, 7))
def test_write_table_rows_matches_torch(bs, width):
    table, rows, starts, slots = _table_write(bs, width, seed=bs * 10 + width)
    ref = ReqToTokenPool(TABLE_ROWS - 1, COLUMNS, "cpu")
    ref.req_to_token.copy_(table)
    ref.write_rows_from(rows, starts, slots)
    assert torch.equal(_kernel_table(table, rows, starts, slots), ref.req_to_token)


# ---------------------------------------------------------------------- request states

STATE_SHAPES = [
    pytest.param(40, torch.float32, torch.float32, id="h40-f32"),
    pytest.param(256, torch.bfloat16, torch.float32, id="h256-bf16<-f32"),
    pytest.param(1100, torch.bfloat16, torch.bfloat16, id="h1100-bf16"),  # two hidden blocks, the second partial
]


def _cursors(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, 2] (L, last token), L leaving room in the table for the 3 slots of the graph test."""
    return torch.stack([torch.randint(0, COLUMNS - 2, (n,), generator=gen), torch.randint(0, 1000, (n,), generator=gen)], 1)


def _random_states(topk: int, hidden: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> RequestStates:
    gen = torch.Generator().manual_seed(seed)
    states = RequestStates(TABLE_ROWS, topk, hidden, dtype, device)
    states.cursors.copy_(_cursors(TABLE_ROWS, gen))
    states.probs.copy_(torch.rand((TABLE_ROWS, topk), generator=gen))
    states.tokens.copy_(torch.randint(0, 1000, (TABLE_ROWS, topk), generator=gen))
    states.hidden.copy_(torch.randn((TABLE_ROWS, hidden), generator=gen))
    return states


def _cycle_end(bs: int, topk: int, hidden: int, in_dtype: torch.dtype, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """(rows, probs, tokens, hidden, cursors) on CPU, store_cycle_end's arguments for states
    of `dtype`, the hidden states in_dtype. The interpreter rounds float32 -> bf16 by
    truncation, so there the hidden states are values of `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    new_hidden = torch.randn((bs, hidden), generator=gen)
    return (
        _rows(bs, gen),
        torch.rand((bs, topk), generator=gen),
        torch.randint(0, 1000, (bs, topk), generator=gen),
        (new_hidden if ON_CUDA else new_hidden.to(dtype)).to(in_dtype),
        _cursors(bs, gen),
    )


def _kernel_store(states: RequestStates, *args: torch.Tensor) -> None:
    """store_cycle_end's kernel with strided views on DEVICE of its arguments."""
    rows, probs, tokens, hidden, cursors = (_strided(t, DEVICE) for t in args)
    if not ON_CUDA:
        spec_ops.store_states(states.buffers, rows, (cursors, probs, tokens, hidden), DUMMY_REQ_ROW)
        return
    with _launches("store_states"):
        states.store_cycle_end(rows, probs, tokens, hidden, cursors)


@kernel_test
@pytest.mark.parametrize("bs", BATCH_SIZES)
@pytest.mark.parametrize("topk", [1, 2])
@pytest.mark.parametrize("hidden,dtype,in_dtype", STATE_SHAPES)
def test_store_states_matches_torch(bs, topk, hidden, dtype, in_dtype):
    """Real rows exactly as the torch path; the dummy row's cursors (0, 0), and each of its
    guesses' and hidden state's values that of one of its requests (on CUDA the padded rows'
    programs store at once: the row may mix them, column by column)."""
    seed = bs * 100 + topk * 10 + hidden
    args = _cycle_end(bs, topk, hidden, in_dtype, dtype, seed)
    ref, got = _random_states(topk, hidden, dtype, seed), _random_states(topk, hidden, dtype, seed, DEVICE)
    ref.store_cycle_end(*args)
    _kernel_store(got, *args)
    rows, probs, tokens, new_hidden, _ = args
    padded = rows == DUMMY_REQ_ROW
    for buf, ref_buf, new in zip(got.buffers, ref.buffers, (None, probs, tokens, new_hidden.to(dtype)), strict=True):
        buf = buf.cpu()
        assert buf.dtype == ref_buf.dtype and torch.equal(buf[1:], ref_buf[1:])
        if new is None or not padded.any():  # the cursors, or no padded request
            assert torch.equal(buf[DUMMY_REQ_ROW], ref_buf[DUMMY_REQ_ROW])
        else:
            assert (buf[DUMMY_REQ_ROW] == new[padded].cpu()).any(dim=0).all()  # column by column
    if padded.any():
        assert not got.cursors[DUMMY_REQ_ROW].any()


def _kernel_start(states: RequestStates, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """cycle_start's values through its kernel, for strided rows on DEVICE."""
    rows = _strided(rows, DEVICE)
    if not ON_CUDA:
        cursors, *guesses = spec_ops.gather_states(states.buffers, rows)
        return *cursors.unbind(1), *guesses
    with _launches("gather_states"):
        return states.cycle_start(rows)


@kernel_test
@pytest.mark.parametrize("bs", BATCH_SIZES)
@pytest.mark.parametrize("topk", [1, 2])
@pytest.mark.parametrize("hidden,dtype,in_dtype", STATE_SHAPES)
def test_gather_states_matches_torch(bs, topk, hidden, dtype, in_dtype):
    """Equal values, dtypes and strides, in fresh tensors (never views of the states)."""
    seed = bs * 100 + topk * 10 + hidden
    rows = _rows(bs, torch.Generator().manual_seed(seed))
    states = _random_states(topk, hidden, dtype, seed, DEVICE)
    ref = _random_states(topk, hidden, dtype, seed).cycle_start(rows)
    got = _kernel_start(states, rows)
    own = {t.untyped_storage().data_ptr() for t in states.buffers}
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape and g.stride() == r.stride() and torch.equal(g.cpu(), r)
        assert g.untyped_storage().data_ptr() not in own


# ---------------------------------------------------------------------- draft steps


def _draft_first_step(bs: int, topk: int, seed: int) -> ForwardBatch:
    """A draft loop's first-step batch on CPU (as DecodeCycle.draft builds it): KV lengths
    L, seq_lens L + topk, the scratch slots of columns L.., the dummy slot for padded rows."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(1, 1000, (TABLE_ROWS, COLUMNS), generator=gen)
    rows = _rows(bs, gen)
    kv_lens = torch.randint(0, COLUMNS - 3 * topk + 1, (bs,), generator=gen)
    kv_lens[rows == DUMMY_REQ_ROW] = 0
    loc = table[rows.view(-1, 1), kv_lens.view(-1, 1) + torch.arange(topk)]
    loc[rows == DUMMY_REQ_ROW] = PAD_KV_SLOT
    return ForwardBatch(
        mode=ForwardMode.DRAFT_DECODE,
        batch_size=bs,
        input_ids=torch.zeros(bs * topk, dtype=torch.int64),
        positions=kv_lens.repeat_interleave(topk),
        out_cache_loc=loc.flatten(),
        req_pool_indices=rows,
        seq_lens=kv_lens + topk,
        extend_seq_lens=torch.full((bs,), topk),
        seq_lens_cpu=(kv_lens + topk).tolist(),
        req_to_token_pool=SimpleNamespace(req_to_token=table),
    )


@kernel_test
@pytest.mark.parametrize("bs", BATCH_SIZES)
@pytest.mark.parametrize("topk", [1, 2, 3])
@pytest.mark.parametrize("step", [1, 2])
def test_draft_step_inputs_match_torch(bs, topk, step):
    """A later draft step's slots, positions and lengths: the kernel (strided inputs on DEVICE)
    against DraftLoop's torch path; max_position clamps the largest position."""
    first = _draft_first_step(bs, topk, seed=100 * bs + 10 * topk + step)
    max_position = int(first.positions.max()) + step - 1 if bs else 0  # the last position clamped
    loop = DraftLoop(step + 2, topk, step + 3, max_position, DeviceConstants("cpu"))
    want = loop._step_inputs(first, step)
    args = [
        _strided(t.view(-1, 1), DEVICE).view(-1)
        for t in (first.req_pool_indices, first.seq_lens, first.positions, first.out_cache_loc)
    ]
    table = first.req_to_token_pool.req_to_token.to(DEVICE)
    if ON_CUDA:
        device_first = replace(
            first,
            req_pool_indices=args[0],
            seq_lens=args[1],
            positions=args[2],
            out_cache_loc=args[3],
            req_to_token_pool=SimpleNamespace(req_to_token=table),
        )
        with _launches("draft_step_inputs"):
            got = replace(loop, constants=DeviceConstants(DEVICE))._step_inputs(device_first, step)
    else:
        got = spec_ops.draft_step_inputs(table, *args, step, topk, max_position, PAD_KV_SLOT)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g.cpu(), w)


def test_kernels_launch_nothing_for_zero_requests():
    states = _random_states(2, 40, torch.float32, seed=0)
    before = [t.clone() for t in states.buffers]
    table = torch.zeros((TABLE_ROWS, COLUMNS), dtype=torch.int64)
    empty = torch.zeros(0, dtype=torch.int64)
    kernels = ("_write_table_rows_kernel", "_gather_states_kernel", "_store_states_kernel", "_draft_step_inputs_kernel")
    with mock.patch.multiple(spec_ops, **dict.fromkeys(kernels, mock.DEFAULT)) as launched:
        spec_ops.write_table_rows(table, empty, empty, empty.view(0, 3))
        got = spec_ops.gather_states(states.buffers, empty)
        spec_ops.store_states(states.buffers, empty, tuple(t[:0] for t in states.buffers), DUMMY_REQ_ROW)
        step = spec_ops.draft_step_inputs(table, empty, empty, empty, empty, 1, 2, 100, PAD_KV_SLOT)
    assert not any(k.mock_calls for k in launched.values())
    assert not table.any() and all(torch.equal(t, b) for t, b in zip(states.buffers, before, strict=True))
    assert [g.shape for g in got] == [(0, 2), (0, 2), (0, 2), (0, 40)] and [t.shape for t in step] == [(0,)] * 3


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need CUDA")
def test_cycle_state_ops_replay_in_cuda_graph():
    """The three kernels capture (no host reads) and a replay follows the static inputs' new values."""
    bs, topk, hidden, dtype = 8, 2, 40, torch.bfloat16
    states, ref = _random_states(topk, hidden, dtype, 1, DEVICE), _random_states(topk, hidden, dtype, 1)
    pool, ref_pool = ReqToTokenPool(TABLE_ROWS - 1, COLUMNS, DEVICE), ReqToTokenPool(TABLE_ROWS - 1, COLUMNS, "cpu")
    rows, probs, tokens, new_hidden, cursors = (t.to(DEVICE) for t in _cycle_end(bs, topk, hidden, torch.float32, dtype, 1))
    slots = torch.arange(bs * 3, device=DEVICE).view(bs, 3)

    def cycle(states: RequestStates, pool: ReqToTokenPool, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows, probs, tokens, new_hidden, cursors, slots = args
        kv_len, *rest = states.cycle_start(rows)
        pool.write_rows_from(rows, kv_len, slots)
        states.store_cycle_end(rows, probs, tokens, new_hidden, cursors)
        return kv_len, *rest

    static = (rows, probs, tokens, new_hidden, cursors, slots)
    cycle(states, pool, *static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = cycle(states, pool, *static)
    new = (*_cycle_end(bs, topk, hidden, torch.float32, dtype, 2), torch.randint(1, 1000, (bs, 3)))
    new[0].copy_(torch.randperm(TABLE_ROWS - 1)[:bs] + 1)  # real rows only: every result is specified
    for t, value in zip(static, new, strict=True):
        t.copy_(value)
    for s, r in zip(states.buffers, ref.buffers, strict=True):  # the same states before the replay
        r.copy_(s)
    ref_pool.req_to_token.copy_(pool.req_to_token)
    graph.replay()
    torch.cuda.synchronize()
    want = cycle(ref, ref_pool, *new)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
    assert all(torch.equal(s.cpu(), r) for s, r in zip(states.buffers, ref.buffers, strict=True))
    assert torch.equal(pool.req_to_token.cpu(), ref_pool.req_to_token)
