"""CUDA graph runner without a model (CPU): the batch sizes captured, padding, the graph key
a batch replays (or eager), DP attention's key from the plan, and the static inputs a graph
reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.batch.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.cuda_graph_runner import (
    PAD_KV_SLOT,
    CapturedMode,
    CudaGraphRunner,
    GraphKey,
    ModeKey,
    StaticInputs,
    capture_batch_sizes,
    default_capture_sizes,
    padded_batch_size,
)
from sglang.test.graph_batches import PLAIN, decode_fb, lengths_agree

DECODE = ForwardMode.DECODE


# ---------------------------------------------------------------------- batch sizes
def test_default_capture_sizes():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(8) == [1, 2, 4, 8]
    assert default_capture_sizes(12) == [1, 2, 4, 8, 12]
    assert default_capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert default_capture_sizes(256)[-3:] == [240, 248, 256]


@pytest.mark.parametrize(
    "bs_list, max_bs, max_running, expected",
    [
        (None, None, 4096, default_capture_sizes(256)),
        (None, 32, 4096, [1, 2, 4, 8, 16, 24, 32]),
        (None, 256, 20, [1, 2, 4, 8, 16, 20]),  # the running-request cap gets its own graph
        (None, 16, 16, [1, 2, 4, 8, 16]),
        ([5, 1, 3, 3], None, 100, [1, 3, 5]),  # --cuda-graph-bs alone: max is its largest
        ([1, 3, 5], 4, 100, [1, 3]),  # --cuda-graph-max-bs caps the list
        ([1, 3, 5], None, 4, [1, 3, 4]),
        ([8], None, 4, [4]),  # the fullest batch possible still gets a graph
    ],
)
def test_capture_batch_sizes(bs_list, max_bs, max_running, expected):
    assert capture_batch_sizes(bs_list, max_bs, max_running) == expected


def test_padded_batch_size():
    captured = [1, 2, 4, 8]
    assert [padded_batch_size(b, captured, False) for b in range(10)] == [None, 1, 2, 4, 4, 8, 8, 8, 8, None]
    # --disable-cuda-graph-padding: exact sizes only
    assert [padded_batch_size(b, captured, True) for b in range(10)] == [None, 1, 2, None, 4, None, None, None, 8, None]


def test_dp_key_comes_from_the_plan_alone():
    """Under DP attention every rank replays the graph of the largest DP rank's batch."""
    table = ReqToTokenPool(16, 64, "cpu")
    graphs = CudaGraphRunner(_runner_stub(table), {ModeKey(DECODE): PLAIN}, [1, 2, 4, 8], disable_padding=False, dp_size=2)
    assert graphs.dp_key(DECODE, [3, 1]) == GraphKey(DECODE, 4, 1)
    assert graphs.dp_key(DECODE, [0, 5]) == GraphKey(DECODE, 8, 1)
    assert graphs.dp_key(DECODE, [9, 1]) is None  # larger than every graph: all ranks eager
    assert graphs.dp_key(ForwardMode.EXTEND, [3, 1]) is None  # a rank extends: all eager
    exact = CudaGraphRunner(_runner_stub(table), {ModeKey(DECODE): PLAIN}, [1, 2, 4, 8], disable_padding=True, dp_size=2)
    assert exact.dp_key(DECODE, [3, 1]) is None and exact.dp_key(DECODE, [4, 1]) == GraphKey(DECODE, 4, 1)


def test_dp_key_for_decode_and_idle_ranks():
    table = ReqToTokenPool(16, 64, "cpu")
    graphs = CudaGraphRunner(_runner_stub(table), {ModeKey(DECODE): PLAIN}, [1, 2, 4], disable_padding=False, dp_size=2)
    busy = decode_fb([0, 1, 2], [5] * 3, [1] * 3, [1, 2, 3])
    idle = decode_fb([], [], [], [])
    idle.mode = ForwardMode.IDLE
    for fb in (busy, idle):
        fb.global_num_tokens, fb.global_forward_mode = [3, 0], DECODE
        assert _choice(graphs, fb, table) == GraphKey(DECODE, 4, 1)
    busy.global_forward_mode = ForwardMode.EXTEND
    assert _choice(graphs, busy, table) is None
    # The padded batch carries every rank's padded rows and the agreed mode.
    padded = StaticInputs(4, 1, "cpu", dp_size=2).load(idle, GraphKey(DECODE, 4, 1), PLAIN)
    assert padded.global_num_tokens == [4, 4] and padded.global_forward_mode == DECODE
    assert padded.out_cache_loc.tolist() == [PAD_KV_SLOT] * 4


# ---------------------------------------------------------------------- static inputs
def test_static_inputs_pad_rows_are_valid():
    inputs = StaticInputs(max_bs=8, max_tokens_per_req=1, device="cpu")
    key = GraphKey(DECODE, 4, 1)
    # A larger batch first leaves stale values that the next load must overwrite.
    inputs.load(decode_fb([5, 6, 7, 1, 2], [9, 9, 9, 9, 9], [11] * 5, [40, 41, 42, 43, 44]), GraphKey(DECODE, 8, 1), PLAIN)
    fb = inputs.load(decode_fb([3, 7], [10, 4], [17, 23], [33, 34]), key, PLAIN)
    assert fb.batch_size == 4 and fb.num_tokens == 4
    assert fb.input_ids.tolist() == [17, 23, 0, 0]
    assert fb.positions.tolist() == [9, 3, 0, 0]
    assert fb.out_cache_loc.tolist() == [33, 34, PAD_KV_SLOT, PAD_KV_SLOT]
    assert fb.req_pool_indices.tolist() == [3, 7, 0, 0]
    assert fb.seq_lens.tolist() == [10, 4, 1, 1]
    assert fb.extend_seq_lens.tolist() == [1, 1, 1, 1]
    assert fb.seq_lens_cpu == [10, 4, 1, 1] and fb.extend_seq_lens_cpu == [1, 1, 1, 1]
    # The batch views the static buffers (what the graph reads).
    assert fb.input_ids.data_ptr() == inputs.input_ids.data_ptr()


def test_static_inputs_load_several_tokens_per_request():
    """Two tokens per request (token rows and request rows are copied and padded apart)."""
    verify = ForwardMode.TARGET_VERIFY
    mode = CapturedMode(2)
    inputs = StaticInputs(max_bs=4, max_tokens_per_req=2, device="cpu")
    t = lambda x: torch.tensor(x, dtype=torch.int64)

    def batch(rows: list[int], seq_lens: list[int], tokens: list[int], slots: list[int]) -> ForwardBatch:
        return ForwardBatch(
            mode=verify,
            batch_size=len(rows),
            input_ids=t(tokens),
            positions=t([s - 2 + j for s in seq_lens for j in range(2)]),
            out_cache_loc=t(slots),
            req_pool_indices=t(rows),
            seq_lens=t(seq_lens),
            extend_seq_lens=t([2] * len(rows)),
            seq_lens_cpu=list(seq_lens),
            extend_seq_lens_cpu=[2] * len(rows),
        )

    inputs.load(batch([5, 6, 7], [9, 9, 9], [11] * 6, list(range(40, 46))), GraphKey(verify, 4, 2), mode)
    fb = inputs.load(batch([3], [10], [17, 23], [33, 34]), GraphKey(verify, 2, 2), mode)
    assert fb.input_ids.tolist() == [17, 23, 0, 0]
    assert fb.positions.tolist() == [8, 9, 0, 0]
    assert fb.out_cache_loc.tolist() == [33, 34, PAD_KV_SLOT, PAD_KV_SLOT]
    assert fb.req_pool_indices.tolist() == [3, 0]
    assert fb.seq_lens.tolist() == [10, 2] and fb.extend_seq_lens.tolist() == [2, 2]
    assert fb.seq_lens_cpu == [10, 2] and fb.extend_seq_lens_cpu == [2, 2]


def test_padding_batch_resets_the_lengths_of_other_keys():
    """Capture order mixes token counts (verify and draft extend: 4 per request; draft steps:
    1, with trees of 1 and 2 columns): each captured batch has its own key's lengths."""
    modes = {
        ModeKey(ForwardMode.TARGET_VERIFY): CapturedMode(4, (4,)),
        ModeKey(ForwardMode.DRAFT_DECODE): CapturedMode(1, (1, 2)),
    }
    inputs = StaticInputs(max_bs=4, max_tokens_per_req=4, device="cpu", max_tree_cols=4)
    keys = [
        GraphKey(ForwardMode.TARGET_VERIFY, 4, 4, 4),
        GraphKey(ForwardMode.DRAFT_DECODE, 4, 1, 2),
        GraphKey(ForwardMode.DRAFT_DECODE, 2, 1, 1),
        GraphKey(ForwardMode.TARGET_VERIFY, 2, 4, 4),
    ]
    for key in keys:
        fb = inputs.padding_batch(key, modes[key.mode_key])
        assert lengths_agree(fb), key
        assert fb.seq_lens_cpu == [key.pad_seq_len] * key.batch_size
        assert fb.custom_mask.shape == (key.num_tokens, key.tree_cols) and bool(fb.custom_mask.all())


# ---------------------------------------------------------------------- graph-vs-eager choice
def _runner_stub(table: ReqToTokenPool) -> SimpleNamespace:
    return SimpleNamespace(device="cpu", req_to_token_pool=table)


def _choice(graphs: CudaGraphRunner, fb: ForwardBatch, table: ReqToTokenPool):
    fb.req_to_token_pool = table
    return graphs.key_for(fb)


def test_key_for_picks_padded_decode_graph_or_eager():
    table = ReqToTokenPool(16, 64, "cpu")
    graphs = CudaGraphRunner(_runner_stub(table), {ModeKey(DECODE): PLAIN}, [1, 2, 4], disable_padding=False)
    fb = lambda n: decode_fb(list(range(n)), [5] * n, [1] * n, list(range(1, n + 1)))
    assert _choice(graphs, fb(1), table) == GraphKey(DECODE, 1, 1)
    assert _choice(graphs, fb(3), table) == GraphKey(DECODE, 4, 1)
    assert _choice(graphs, fb(5), table) is None  # larger than every graph
    extend = fb(2)
    extend.mode = ForwardMode.EXTEND
    assert _choice(graphs, extend, table) is None
    masked = fb(2)
    masked.custom_mask = torch.ones((2, 5), dtype=torch.bool)
    assert _choice(graphs, masked, table) is None
    hidden = fb(2)
    hidden.capture_hidden_mode = CaptureHiddenMode.LAST
    assert _choice(graphs, hidden, table) is None
    dp = fb(2)
    dp.global_num_tokens, dp.global_forward_mode = [2, 0], DECODE
    assert _choice(graphs, dp, table) is None  # a runner built without DP attention
    # A table replaced after capture (graphs hold the old address): eager.
    assert _choice(graphs, fb(2), ReqToTokenPool(16, 128, "cpu")) is None
    exact = CudaGraphRunner(_runner_stub(table), {ModeKey(DECODE): PLAIN}, [1, 2, 4], disable_padding=True)
    assert _choice(exact, fb(3), table) is None
    assert _choice(exact, fb(4), table) == GraphKey(DECODE, 4, 1)
