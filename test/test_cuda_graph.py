"""CUDA graph runner: batch-size choice, padding, graph-vs-eager choice (CPU), and replay
equal to eager (CUDA only)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace
from typing import Optional
from unittest import mock

import pytest
import torch
from sglang.srt.batch.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.cuda_graph_runner import (
    PAD_KV_SLOT,
    CapturedMode,
    CudaGraphCaptureError,
    CudaGraphRunner,
    GraphKey,
    ModeKey,
    StaticInputs,
    capture_batch_sizes,
    default_capture_sizes,
    padded_batch_size,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs
from sglang.test.tiny_deepseek import make_tiny_deepseek_v3
from sglang.test.triton_harness import INTERPRETED, patch_interpreter_for_numpy2, rerun_under_interpreter

DECODE = ForwardMode.DECODE
PLAIN = CapturedMode(1)  # plain decode: one token per request
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


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
    busy = _decode_fb([0, 1, 2], [5] * 3, [1] * 3, [1, 2, 3])
    idle = _decode_fb([], [], [], [])
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
def _decode_fb(rows: list[int], seq_lens: list[int], tokens: list[int], slots: list[int]) -> ForwardBatch:
    t = lambda x: torch.tensor(x, dtype=torch.int64)
    return ForwardBatch(
        mode=DECODE,
        batch_size=len(rows),
        input_ids=t(tokens),
        positions=t([s - 1 for s in seq_lens]),
        out_cache_loc=t(slots),
        req_pool_indices=t(rows),
        seq_lens=t(seq_lens),
        extend_seq_lens=t([1] * len(rows)),
        seq_lens_cpu=list(seq_lens),
        extend_seq_lens_cpu=[1] * len(rows),
    )


def test_static_inputs_pad_rows_are_valid():
    inputs = StaticInputs(max_bs=8, max_tokens_per_req=1, device="cpu")
    key = GraphKey(DECODE, 4, 1)
    # A larger batch first leaves stale values that the next load must overwrite.
    inputs.load(_decode_fb([5, 6, 7, 1, 2], [9, 9, 9, 9, 9], [11] * 5, [40, 41, 42, 43, 44]), GraphKey(DECODE, 8, 1), PLAIN)
    fb = inputs.load(_decode_fb([3, 7], [10, 4], [17, 23], [33, 34]), key, PLAIN)
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
            mode=verify, batch_size=len(rows), input_ids=t(tokens),
            positions=t([s - 2 + j for s in seq_lens for j in range(2)]), out_cache_loc=t(slots),
            req_pool_indices=t(rows), seq_lens=t(seq_lens), extend_seq_lens=t([2] * len(rows)),
            seq_lens_cpu=list(seq_lens), extend_seq_lens_cpu=[2] * len(rows),
        )

    inputs.load(batch([5, 6, 7], [9, 9, 9], [11] * 6, list(range(40, 46))), GraphKey(verify, 4, 2), mode)
    fb = inputs.load(batch([3], [10], [17, 23], [33, 34]), GraphKey(verify, 2, 2), mode)
    assert fb.input_ids.tolist() == [17, 23, 0, 0]
    assert fb.positions.tolist() == [8, 9, 0, 0]
    assert fb.out_cache_loc.tolist() == [33, 34, PAD_KV_SLOT, PAD_KV_SLOT]
    assert fb.req_pool_indices.tolist() == [3, 0]
    assert fb.seq_lens.tolist() == [10, 2] and fb.extend_seq_lens.tolist() == [2, 2]
    assert fb.seq_lens_cpu == [10, 2] and fb.extend_seq_lens_cpu == [2, 2]


def _lengths_agree(fb: ForwardBatch) -> bool:
    """The device lengths a graph reads are the host lengths the batch was shaped with."""
    return (
        fb.seq_lens.tolist() == list(fb.seq_lens_cpu)
        and fb.extend_seq_lens.tolist() == list(fb.extend_seq_lens_cpu)
        and sum(fb.extend_seq_lens_cpu) == fb.num_tokens
    )


def test_padding_batch_resets_the_lengths_of_other_keys():
    """Capture order mixes token counts (verify and draft extend: 4 per request; draft steps:
    1, with trees of 1 and 2 columns): each captured batch has its own key's lengths."""
    modes = {ModeKey(ForwardMode.TARGET_VERIFY): CapturedMode(4, (4,)), ModeKey(ForwardMode.DRAFT_DECODE): CapturedMode(1, (1, 2))}
    inputs = StaticInputs(max_bs=4, max_tokens_per_req=4, device="cpu", max_tree_cols=4)
    keys = [GraphKey(ForwardMode.TARGET_VERIFY, 4, 4, 4), GraphKey(ForwardMode.DRAFT_DECODE, 4, 1, 2),
            GraphKey(ForwardMode.DRAFT_DECODE, 2, 1, 1), GraphKey(ForwardMode.TARGET_VERIFY, 2, 4, 4)]
    for key in keys:
        fb = inputs.padding_batch(key, modes[key.mode_key])
        assert _lengths_agree(fb), key
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
    fb = lambda n: _decode_fb(list(range(n)), [5] * n, [1] * n, list(range(1, n + 1)))
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


# ---------------------------------------------------------------------- padded batches through a model
def make_runner(path: str, device: str, dtype: str, **args) -> ModelRunner:
    server_args = ServerArgs(
        model_path=path, device=device, dtype=dtype, max_total_tokens=2048, max_running_requests=16, **args
    )
    return ModelRunner(ModelConfig(path, dtype=dtype, device=device), server_args, gpu_id=0)


class HandDriver:
    """Requests driven through a ModelRunner by hand: one prefill, then decode batches.
    Under DP attention the prefill needs every DP rank's token count."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]], global_prefill_tokens: Optional[list[int]] = None):
        self.runner, self.device = runner, runner.device
        self.rows = [runner.req_to_token_pool.alloc() for _ in prompts]
        self.seqs = [list(p) for p in prompts]
        slots = runner.token_allocator.alloc(sum(map(len, prompts)))
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)
        start = 0
        for row, p in zip(self.rows, prompts):
            runner.req_to_token_pool.write(row, 0, slots[start : start + len(p)])
            start += len(p)
        lens = [len(p) for p in prompts]
        fb = ForwardBatch(
            mode=ForwardMode.EXTEND,
            batch_size=len(prompts),
            input_ids=t(sum(prompts, [])),
            positions=t([i for n in lens for i in range(n)]),
            out_cache_loc=slots.to(self.device),
            req_pool_indices=t(self.rows),
            seq_lens=t(lens),
            extend_seq_lens=t(lens),
            seq_lens_cpu=lens,
            extend_seq_lens_cpu=list(lens),
            global_num_tokens=global_prefill_tokens,
        )
        self.next_tokens = runner.forward_eager(fb).next_token_logits.argmax(-1).tolist()

    def decode_batch(self) -> ForwardBatch:
        """Feed each request its last sampled token (a fresh KV slot each)."""
        for s, tok in zip(self.seqs, self.next_tokens):
            s.append(tok)
        slots = self.runner.token_allocator.alloc(len(self.rows))
        for row, s, slot in zip(self.rows, self.seqs, slots):
            self.runner.req_to_token_pool.write(row, len(s) - 1, slot.view(1))
        fb = _decode_fb(self.rows, [len(s) for s in self.seqs], self.next_tokens, slots.tolist())
        for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "extend_seq_lens"):
            setattr(fb, name, getattr(fb, name).to(self.device))
        return fb


PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8], [11, 4, 6, 1, 9, 2, 10]]


def _kv_buffers(runner: ModelRunner) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for i in range(runner.num_kv_layers):
        kv = runner.kv_pool.get_kv_buffer(i)
        out += list(kv) if isinstance(kv, tuple) else [kv]
    return out


def _kv_snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    return [t.clone() for t in _kv_buffers(runner)]


def _key_and_eager_logits(graphs: CudaGraphRunner, runner: ModelRunner, fb: ForwardBatch):
    """The graph key fb would replay, and its eager logits (the KV it wrote undone)."""
    runner.attach(fb)
    key = graphs.key_for(fb)
    before = _kv_snapshot(runner)
    eager = runner.forward_eager(fb).next_token_logits
    _kv_restore(runner, before)
    return key, eager


def _kv_restore(runner: ModelRunner, snapshot: list[torch.Tensor]) -> None:
    for buf, saved in zip(_kv_buffers(runner), snapshot):
        buf.copy_(saved)


def test_padded_decode_batch_matches_unpadded_eager(tiny_llama_dir):
    """The rows StaticInputs adds change neither the real rows' logits nor any real KV slot."""
    runner = make_runner(tiny_llama_dir, "cpu", "float32")
    assert runner.graph_runner is None  # graphs are off on CPU
    driver = HandDriver(runner, PROMPTS)
    fb = driver.decode_batch()
    before = _kv_snapshot(runner)
    eager = runner.forward_eager(fb).next_token_logits
    after_eager = _kv_snapshot(runner)
    _kv_restore(runner, before)
    padded = StaticInputs(8, 1, "cpu").load(fb, GraphKey(DECODE, 8, 1), PLAIN)
    logits = runner.forward_eager(padded).next_token_logits
    assert logits.shape[0] == 8
    torch.testing.assert_close(logits[:3], eager, rtol=1e-5, atol=1e-5)
    written = fb.out_cache_loc
    untouched = torch.ones(before[0].shape[0], dtype=torch.bool)
    untouched[written] = False
    untouched[PAD_KV_SLOT] = False
    for got, old, want in zip(_kv_snapshot(runner), before, after_eager):
        assert torch.equal(got[untouched], old[untouched])  # padded rows wrote only the dummy slot
        torch.testing.assert_close(got[written], want[written], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- the captured work, run eagerly
@pytest.mark.skipif(torch.cuda.is_available() or INTERPRETED, reason="CPU only; spawns the interpreter run")
def test_captured_work_under_triton_interpreter():
    """On CPU, run the tests below in a fresh TRITON_INTERPRET=1 process (see sglang.test.triton_harness)."""
    rerun_under_interpreter(__file__, "-k", "captured_work_matches", timeout=900)


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED), reason="needs compiled or interpreted Triton")
def test_captured_work_matches_eager_triton(tiny_llama_dir):
    """What a graph captures (static padded inputs, metadata built from device tensors into
    the max-size kv index buffer, the model) gives eager Triton's logits on the real rows."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runner = make_runner(tiny_llama_dir, device, "float32", attention_backend="triton", disable_cuda_graph=True)
    graphs = CudaGraphRunner(runner, {ModeKey(DECODE): PLAIN}, [1, 2, 4], disable_padding=False)
    width = runner.req_to_token_pool.req_to_token.shape[1]
    runner.attn_backend.init_cuda_graph_state(4, 4 * width, torch.device(device))
    driver = HandDriver(runner, PROMPTS)
    for _ in range(2):
        fb = driver.decode_batch()
        key, eager = _key_and_eager_logits(graphs, runner, fb)
        graphs.inputs.load(fb, key, PLAIN)
        (out,) = graphs._run(graphs.inputs.batch(key, PLAIN), key)
        torch.testing.assert_close(out[:3], eager, rtol=1e-4, atol=1e-4)
        driver.next_tokens = eager.argmax(-1).tolist()


def _dp_captured_work_worker(rank: int, world: int, path: str) -> None:
    """Rank 0 decodes 3 requests, rank 1 decodes 1 and then idles: both replay the batch-4
    graph's work with [4, 4] gathered rows and match eager (which gathers [3, 1] / [3, 0])."""
    patch_interpreter_for_numpy2()  # a spawned rank: no conftest ran here
    from sglang.srt.distributed.parallel_state import initialize_model_parallel

    initialize_model_parallel(2, rank, dp_size=2, enable_dp_attention=True)
    args = ServerArgs(
        model_path=path, device="cpu", dtype="float32", max_total_tokens=2048, max_running_requests=16,
        attention_backend="triton", disable_cuda_graph=True, tp_size=2, dp_size=2, enable_dp_attention=True,
    )
    runner = ModelRunner(ModelConfig(path, dtype="float32", device="cpu"), args, gpu_id=0, tp_rank=rank, tp_size=2)
    graphs = CudaGraphRunner(runner, {ModeKey(DECODE): PLAIN}, [1, 2, 4], disable_padding=False, dp_size=2)
    width = runner.req_to_token_pool.req_to_token.shape[1]
    runner.attn_backend.init_cuda_graph_state(4, 4 * width, torch.device("cpu"))
    prompts = PROMPTS if rank == 0 else PROMPTS[:1]
    driver = HandDriver(runner, prompts, global_prefill_tokens=[sum(map(len, PROMPTS)), len(PROMPTS[0])])
    for step in range(3):
        idle = rank == 1 and step == 2
        fb = _idle_fb() if idle else driver.decode_batch()
        fb.global_num_tokens, fb.global_forward_mode = [3, 0 if step == 2 else 1], DECODE
        key, eager = _key_and_eager_logits(graphs, runner, fb)
        assert key == GraphKey(DECODE, 4, 1)
        graphs.inputs.load(fb, key, PLAIN)
        (out,) = graphs._run(graphs.inputs.batch(key, PLAIN), key)
        torch.testing.assert_close(out[: fb.batch_size], eager, rtol=1e-4, atol=1e-4)
        if not idle:
            driver.next_tokens = eager.argmax(-1).tolist()


def _idle_fb() -> ForwardBatch:
    fb = _decode_fb([], [], [], [])
    fb.mode = ForwardMode.IDLE
    return fb


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess (two gloo ranks)")
def test_captured_work_matches_eager_triton_dp_attention(tiny_llama_dir):
    from sglang.test.dist_utils import spawn_gloo

    spawn_gloo(_dp_captured_work_worker, 2, tiny_llama_dir)


# ---------------------------------------------------------------------- CUDA: replay equals eager
@pytest.fixture(scope="module")
def tiny_dsv3_dir(tmp_path_factory) -> str:
    return make_tiny_deepseek_v3(str(tmp_path_factory.mktemp("tiny_dsv3")))


@needs_cuda
@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_dsv3_dir"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_matches_eager(request, model, dtype):
    """Three requests replay the padded batch-4 graph; logits match eager on the same KV."""
    runner = make_runner(request.getfixturevalue(model), "cuda", dtype, cuda_graph_bs=[1, 2, 4])
    graphs = runner.graph_runner
    assert graphs is not None and sorted(k.batch_size for k in graphs.graphs) == [1, 2, 4]
    driver = HandDriver(runner, PROMPTS)
    for _ in range(6):
        fb = driver.decode_batch()
        key, eager = _key_and_eager_logits(graphs, runner, fb)
        assert key == GraphKey(DECODE, 4, 1)
        out = runner.forward(fb).next_token_logits
        assert out.shape == eager.shape
        tol = 1e-4 if dtype == "float32" else 2e-2
        torch.testing.assert_close(out, eager, rtol=tol, atol=tol)
        assert out.argmax(-1).tolist() == eager.argmax(-1).tolist()
        driver.next_tokens = out.argmax(-1).tolist()
    # Returned logits are copies: a later replay does not change them.
    kept = out.clone()
    runner.forward(driver.decode_batch())
    assert torch.equal(out, kept)


@needs_cuda
def test_capture_out_of_memory_is_a_clear_error(tiny_llama_dir, monkeypatch):
    def oom(*_args, **_kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(CudaGraphRunner, "_capture_one", oom)
    with pytest.raises(CudaGraphCaptureError, match="--cuda-graph-max-bs"):
        make_runner(tiny_llama_dir, "cuda", "float32", cuda_graph_bs=[1, 2])


@needs_cuda
def test_disable_cuda_graph_flag(tiny_llama_dir):
    assert make_runner(tiny_llama_dir, "cuda", "float32", disable_cuda_graph=True).graph_runner is None


# ---------------------------------------------------------------------- speculative sub-forwards
def _weight_addresses(runner: ModelRunner) -> list[int]:
    return [p.data_ptr() for p in runner.model.parameters()]


class _WorkAsGraph:
    """A CUDA graph's stand-in on CPU: replay() runs the captured work on the static inputs and
    leaves the outputs where a replayed graph would. Like a graph, it reads the weights at
    the addresses they had at capture: replacing a weight afterwards fails the replay.
    Counts replays per mode, and keeps the keys replayed with their groups."""

    replays: dict[ForwardMode, int] = {}
    keys: set[tuple[GraphKey, int]] = set()

    def __init__(self, graphs: CudaGraphRunner, key: GraphKey):
        self.graphs, self.key = graphs, key
        self.weights = _weight_addresses(graphs.model_runner)

    def replay(self) -> None:
        assert _weight_addresses(self.graphs.model_runner) == self.weights, "a weight moved after capture"
        mode = self.graphs.modes[self.key.mode_key]
        batch = self.graphs.inputs.batch(self.key, mode)
        if not mode.slots_only:  # else the work reads no lengths from the batch
            assert batch.extend_seq_lens.tolist() == [self.key.tokens_per_req] * self.key.batch_size, self.key
        self.graphs.run_into_outputs(batch, self.key)
        _WorkAsGraph.replays[self.key.mode] = _WorkAsGraph.replays.get(self.key.mode, 0) + 1
        _WorkAsGraph.keys.add((self.key, self.graphs.group(self.key)))


def _emulated_capture(graphs: CudaGraphRunner) -> None:
    """CudaGraphRunner.capture on CPU: the same buffers and warm-up runs (largest key first),
    with _WorkAsGraph graphs."""
    runner = graphs.model_runner
    width = runner.req_to_token_pool.req_to_token.shape[1]
    runner.attn_backend.init_cuda_graph_state(graphs.max_bs, graphs.max_bs * width, torch.device("cpu"))
    for key in graphs.capture_order():
        batch = graphs.inputs.padding_batch(key, graphs.modes[key.mode_key])
        assert graphs.modes[key.mode_key].slots_only or _lengths_agree(batch), key
        graphs.ensure_outputs(key, graphs._run(batch, key))
        graphs.graphs[key] = _WorkAsGraph(graphs, key)


@contextmanager
def _cpu_graphs():
    """ModelRunners built inside capture the modes they are given as on CUDA (at the same
    point of their construction), as _WorkAsGraph graphs."""
    with (
        mock.patch.object(ModelRunner, "_graph_modes", lambda runner: runner.graph_modes),
        mock.patch.object(CudaGraphRunner, "capture", _emulated_capture),
    ):
        yield


SPEC_PROMPTS = [[5, 17, 42, 99, 7, 3], [8, 9, 10], [100, 101, 102, 103, 104]]
SPEC_MAX_NEW = [10, 4, 7]  # finishing at different cycles: batches of 3, 2, 1 replay padded graphs


def _spec_args(path: str, **args) -> ServerArgs:
    return ServerArgs(
        model_path=path, device="cpu", dtype="float32", attention_backend="triton", max_total_tokens=1024,
        max_running_requests=4, disable_radix_cache=True, **args,
    )


def _spec_greedy(
    args: ServerArgs,
    graphs: bool,
    prompts: list[list[int]],
    max_new: list[int],
    tp_rank: int = 0,
    port_args=None,
    return_logprob: bool = False,
) -> tuple[list[list[int]], float]:
    from sglang.test.inprocess_scheduler import greedy, start_scheduler

    if graphs:
        with _cpu_graphs():
            scheduler = start_scheduler(replace(args, cuda_graph_bs=[1, 2, 4]), tp_rank, port_args)
    else:
        scheduler = start_scheduler(args, tp_rank, port_args)
    return greedy(scheduler, prompts, max_new, return_logprob=return_logprob), scheduler.avg_spec_accept_length()


@pytest.fixture(scope="module")
def perfect_dsv3_dir(tmp_path_factory) -> str:
    from sglang.test.spec_models import make_perfect_deepseek_v3

    return make_perfect_deepseek_v3(str(tmp_path_factory.mktemp("perfect_dsv3")))


@pytest.fixture(scope="module")
def llama_eagle_head(tiny_llama_dir, tmp_path_factory) -> str:
    from sglang.test.spec_models import make_eagle_head

    return make_eagle_head(tiny_llama_dir, str(tmp_path_factory.mktemp("eagle_head")))


# Greedy batches run each cycle as one graph (DECODE_CYCLE); logprobs need the verify logits,
# so those batches replay the draft loop's, the verify's and the draft extend's graphs instead.
_CYCLE_GRAPHS = {False: {ForwardMode.DECODE_CYCLE}, True: {ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE, ForwardMode.DRAFT_EXTEND}}


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("logprobs", [False, True], ids=["whole cycle", "sub-forwards"])
@pytest.mark.parametrize("case", ["perfect NEXTN chain", "NEXTN tree", "EAGLE tree"])
def test_captured_work_matches_eager_spec(request, case, logprobs):
    """A cycle through its graphs' captured work (padded batches, static tree masks and hidden
    states), as one graph or sub-forward by sub-forward: the same tokens and accept length as
    eagerly."""
    chain = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    tree = dict(speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    path, spec = {
        "perfect NEXTN chain": ("perfect_dsv3_dir", dict(speculative_algorithm="NEXTN", **chain)),
        "NEXTN tree": ("tiny_dsv3_dir", dict(speculative_algorithm="NEXTN", **tree)),
        "EAGLE tree": ("tiny_llama_dir", dict(speculative_algorithm="EAGLE", **tree)),
    }[case]
    path = request.getfixturevalue(path)
    if spec["speculative_algorithm"] == "EAGLE":
        spec["speculative_draft_model_path"] = request.getfixturevalue("llama_eagle_head")
    args = _spec_args(path, **spec)
    eager_ids, eager_accept = _spec_greedy(args, False, SPEC_PROMPTS, SPEC_MAX_NEW, return_logprob=logprobs)
    _WorkAsGraph.replays = {}
    graph_ids, graph_accept = _spec_greedy(args, True, SPEC_PROMPTS, SPEC_MAX_NEW, return_logprob=logprobs)
    assert graph_ids == eager_ids and graph_accept == eager_accept
    assert set(_WorkAsGraph.replays) == _CYCLE_GRAPHS[logprobs]
    if case == "perfect NEXTN chain":
        assert eager_accept == 4.0


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_captured_work_matches_eager_adaptive(tmp_path):
    """--speculative-adaptive with tiers forced to change every few cycles (1, 3 and 5 steps, a
    draft that agrees with the target on part of the tokens): each tier's cycles go through
    its own graphs (their group is the tier), with the eager tokens and accept length; the
    graphs hold no other tier's programs."""
    from sglang.test.spec_models import make_perfect_deepseek_v3

    path = make_perfect_deepseek_v3(str(tmp_path / "partial"), draft_noise=0.04)
    spec = dict(
        speculative_algorithm="NEXTN", speculative_adaptive=True, speculative_adaptive_steps="1,3,5",
        speculative_num_steps=3, speculative_adaptive_schedule="3:2,1:2,5:2",
    )
    args = _spec_args(path, **spec)
    eager_ids, eager_accept = _spec_greedy(args, False, SPEC_PROMPTS, SPEC_MAX_NEW)
    _WorkAsGraph.replays, _WorkAsGraph.keys = {}, set()
    graph_ids, graph_accept = _spec_greedy(args, True, SPEC_PROMPTS, SPEC_MAX_NEW)
    assert graph_ids == eager_ids and graph_accept == eager_accept
    assert {(k.mode, group, k.tokens_per_req) for k, group in _WorkAsGraph.keys} == {
        (ForwardMode.DECODE_CYCLE, steps, steps + 1) for steps in (1, 3, 5)
    }


def _dp_spec_worker(rank: int, args: ServerArgs, port_args, results) -> None:
    patch_interpreter_for_numpy2()  # a spawned rank: no conftest ran here
    torch.set_num_threads(1)
    # DP rank 0 decodes three requests; DP rank 1 one short request, then idles through the
    # other rank's cycles: rank 0 replays each cycle as one graph while rank 1 replays the
    # padded graphs of the draft loop, the verify and the draft extend (the same collectives).
    prompts, max_new = (SPEC_PROMPTS, SPEC_MAX_NEW) if rank == 0 else ([[30, 31, 32, 33]], [3])
    ids, accept = _spec_greedy(args, True, prompts, max_new, tp_rank=rank, port_args=port_args)
    results[rank] = (ids, accept, sorted(m.name for m in _WorkAsGraph.replays))


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_captured_work_matches_eager_spec_dp_attention(perfect_dsv3_dir):
    """NEXTN under --tp 2 --dp 2 --enable-dp-attention with every cycle going through the
    graphs' captured work (the key from the plan; a busy rank's whole-cycle graph against an
    idle rank's sub-forward graphs): the single-rank eager tokens, and accept length 4.0 on
    both DP ranks."""
    import torch.multiprocessing as mp
    from sglang.srt.server_args import PortArgs

    spec = dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    single, _ = _spec_greedy(_spec_args(perfect_dsv3_dir, **spec), False, SPEC_PROMPTS + [[30, 31, 32, 33]], SPEC_MAX_NEW + [3])
    args = _spec_args(perfect_dsv3_dir, tp_size=2, dp_size=2, enable_dp_attention=True, **spec)
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_dp_spec_worker, args=(args, PortArgs.init_new(args), results), nprocs=2)
    assert results[0][0] == single[:3] and results[1][0] == single[3:]
    assert results[0][1] == results[1][1] == 4.0
    assert results[0][2] == ["DECODE_CYCLE"]
    assert results[1][2] == ["DECODE_CYCLE", "DRAFT_DECODE", "DRAFT_EXTEND", "TARGET_VERIFY"]


def _dp_adaptive_worker(rank: int, args: ServerArgs, port_args, results) -> None:
    patch_interpreter_for_numpy2()  # a spawned rank: no conftest ran here
    torch.set_num_threads(1)
    # As _dp_spec_worker: rank 1's one request ends early, then it idles through rank 0's cycles.
    prompts, max_new = (SPEC_PROMPTS, [16, 4, 7]) if rank == 0 else ([[30, 31, 32, 33]], [3])
    _WorkAsGraph.keys = set()
    ids, _ = _spec_greedy(args, True, prompts, max_new, tp_rank=rank, port_args=port_args)
    results[rank] = (ids, {(k.mode.name, group) for k, group in _WorkAsGraph.keys})


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_captured_work_matches_eager_adaptive_dp_attention(tmp_path):
    """--speculative-adaptive under --tp 2 --dp 2 --enable-dp-attention, a tier change every
    cycle: the busy rank replays each tier's whole-cycle graph and the idle rank the same
    tier's sub-forward graphs (the tier is part of the key chosen from the plan), with the
    single-rank tokens."""
    import torch.multiprocessing as mp
    from sglang.srt.server_args import PortArgs
    from sglang.test.spec_models import make_perfect_deepseek_v3

    path = make_perfect_deepseek_v3(str(tmp_path / "partial"), draft_noise=0.04)
    single, _ = _spec_greedy(_spec_args(path), False, SPEC_PROMPTS + [[30, 31, 32, 33]], [16, 4, 7, 3])
    args = _spec_args(
        path, tp_size=2, dp_size=2, enable_dp_attention=True, speculative_algorithm="NEXTN", speculative_adaptive=True,
        speculative_adaptive_steps="1,3,5", speculative_num_steps=3, speculative_adaptive_schedule="3:1,1:1,5:1",
    )
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_dp_adaptive_worker, args=(args, PortArgs.init_new(args), results), nprocs=2)
    assert results[0][0] == single[:3] and results[1][0] == single[3:]
    assert results[0][1] == {("DECODE_CYCLE", steps) for steps in (1, 3, 5)}
    assert results[1][1] >= {(mode, steps) for mode in ("TARGET_VERIFY", "DRAFT_EXTEND") for steps in (1, 3, 5)}
    assert {steps for mode, steps in results[1][1] if mode == "DRAFT_DECODE"} == {3, 5}  # 1 step: no draft loop
