"""Prefill (extend) CUDA graphs: token buckets, the graph-vs-eager choice and ragged padding
(CPU); the captured work equals eager prefill for tiny Llama and DeepSeek-V3 (Triton
interpreter on CPU), through the scheduler too; replay equals eager (CUDA only)."""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import ClassVar, Optional
from unittest import mock

import pytest
import torch

from sglang.srt.batch.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.scheduler_comm import GlobalPlan, LocalPlan
from sglang.srt.mem_cache.memory_pool import DUMMY_KV_SLOT, DUMMY_REQ_ROW, ReqToTokenPool
from sglang.srt.model_executor.cuda_graph_runner import (
    CapturedMode,
    CudaGraphCaptureError,
    CudaGraphRunner,
    GraphKey,
    ModeKey,
    StaticInputs,
)
from sglang.srt.model_executor.model_runner import PLAIN_GRAPH_MODES, ModelRunner, greedy_decode
from sglang.srt.model_executor.prefill_graphs import (
    RaggedTokens,
    default_token_buckets,
    prefill_ragged_tokens,
    prefill_token_buckets,
)
from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang.srt.speculative.spec_info import SpecInput
from sglang.srt.speculative.spec_plan import SpecIterationPlan, SpecSizes, SubForward
from sglang.srt.speculative.spec_tier import draft_prefill_graph_mode, target_graph_modes
from sglang.test.graph_batches import kv_restore, kv_snapshot, lengths_agree, make_runner
from sglang.test.prefill_batches import PREFILL_CASES, PROMPTS, case_batches
from sglang.test.sync_counter import SyncCounter
from sglang.test.triton_harness import INTERPRETED, patch_interpreter_for_numpy2, rerun_under_interpreter

EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE
# Small buckets: every case below pads differently; 128 holds a request longer than one block
# of the extend kernel's query rows (64).
RAGGED = RaggedTokens((8, 16, 32, 128), max_rows=4)
PREFILL = CapturedMode(0, ragged=RAGGED)
MODES = {ModeKey(DECODE): CapturedMode(1), ModeKey(EXTEND): PREFILL}
_CHAIN = dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ---------------------------------------------------------------------- buckets
def test_default_token_buckets():
    up_to_2048 = [64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048]
    assert default_token_buckets(2048) == up_to_2048
    assert default_token_buckets(3000) == up_to_2048 + [2560, 3000]
    assert default_token_buckets(64) == [64] and default_token_buckets(20) == [20]
    assert default_token_buckets(100) == [64, 80, 96, 100]
    # A prompt past 64 tokens pads by less than a quarter of its length.
    buckets = default_token_buckets(2048)
    assert all(min(b for b in buckets if b >= n) < 1.25 * n for n in range(65, 2049))


@pytest.mark.parametrize(
    "given, max_tokens, limit, expected",
    [
        (None, None, 8192, default_token_buckets(2048)),
        (None, 512, 8192, [64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]),
        (None, None, 1000, default_token_buckets(896) + [1000]),  # the batch / table limit gets its own graph
        ([300, 100, 100], None, 8192, [100, 300]),  # the list alone: its largest is the max
        ([100, 300, 600], 400, 8192, [100, 300]),  # the max caps the list
        ([100, 300, 600], None, 500, [100, 300, 500]),
        ([600], None, 500, [500]),
    ],
)
def test_prefill_token_buckets(given, max_tokens, limit, expected):
    assert prefill_token_buckets(given, max_tokens, limit) == expected


def _gpu_args(**args) -> ServerArgs:
    """Arguments as on a GPU server (parsing does not need one)."""
    return ServerArgs(model_path="m", device="cuda", **args)


def test_which_prefills_are_captured():
    # On by default on CUDA.
    assert prefill_ragged_tokens(_gpu_args(), 4096, 256) == RaggedTokens(tuple(default_token_buckets(2048)), 16)
    assert prefill_ragged_tokens(_gpu_args(enable_piecewise_cuda_graph=True), 4096, 256) is not None  # SGLang's old flag
    assert prefill_ragged_tokens(_gpu_args(disable_piecewise_cuda_graph=True), 4096, 256) is None
    assert prefill_ragged_tokens(_gpu_args(disable_cuda_graph=True), 4096, 256) is None
    assert prefill_ragged_tokens(_gpu_args(tp_size=2), 4096, 256) is not None  # TP without DP attention
    assert prefill_ragged_tokens(_gpu_args(piecewise_cuda_graph_tokens=[64]), 4096, 256).buckets == (64,)
    # Speculative prefills too (the target's keeping hidden states, the draft's extend).
    spec = _gpu_args(speculative_algorithm="NEXTN")
    assert spec.enable_piecewise_cuda_graph and prefill_ragged_tokens(spec, 4096, 256) is not None
    # DP attention too (every rank replays the bucket chosen from the plan).
    dp = _gpu_args(tp_size=2, dp_size=2, enable_dp_attention=True)
    assert dp.enable_piecewise_cuda_graph and prefill_ragged_tokens(dp, 4096, 256) is not None
    # Two running requests at most: rows for them and the padding request.
    assert prefill_ragged_tokens(_gpu_args(), 4096, 2).max_rows == 3


def test_runners_put_the_server_buckets_in_their_prefill_modes():
    """A runner's modes at SERVER_PREFILL_BUCKETS get the server's buckets, or are left out
    when the flag is off: a plain runner's prefill, a speculative target's (hidden states
    kept) and the draft's extend over the prompt."""
    plain = SimpleNamespace(graph_modes=PLAIN_GRAPH_MODES)
    decode = {ModeKey(DECODE): CapturedMode(1), ModeKey(DECODE, greedy_decode): CapturedMode(1)}
    assert ModelRunner.captured_modes(plain, None) == decode
    assert ModelRunner.captured_modes(plain, RAGGED) == {**decode, ModeKey(EXTEND): PREFILL}
    target = SimpleNamespace(graph_modes=target_graph_modes(SpecSizes.tiers(_gpu_args(**_CHAIN))))
    draft = SimpleNamespace(graph_modes=draft_prefill_graph_mode(64, torch.float32))
    target_prefill = ModelRunner.captured_modes(target, RAGGED)[ModeKey(EXTEND)]
    assert target_prefill.ragged == RAGGED and target_prefill.capture_hidden == CaptureHiddenMode.FULL
    assert ModeKey(EXTEND) not in ModelRunner.captured_modes(target, None)
    draft_prefill = ModelRunner.captured_modes(draft, RAGGED)[ModeKey(ForwardMode.DRAFT_EXTEND)]
    assert draft_prefill.ragged == RAGGED and draft_prefill.spec_info is not None
    assert ModelRunner.captured_modes(draft, None) == {}


def test_bucket_for():
    """The smallest bucket holding the tokens and the requests, plus the padding request when
    some of the bucket's tokens are padding."""
    assert RAGGED.rows(8) == 4 and RaggedTokens((2,), 4).rows(2) == 2
    assert RAGGED.bucket_for(5, 1) == 8
    assert RAGGED.bucket_for(8, 4) == 8  # no padding token: no padding request
    assert RAGGED.bucket_for(7, 4) is None  # 4 requests and a padding request do not fit 4 rows
    assert RAGGED.bucket_for(9, 3) == 16
    assert RAGGED.bucket_for(32, 1) == 32 and RAGGED.bucket_for(33, 1) == 128
    assert RAGGED.bucket_for(129, 1) is None  # too many tokens
    assert RAGGED.bucket_for(12, 5) is None  # too many requests
    assert RAGGED.bucket_for(0, 0) is None
    # DP ranks: one bucket for all; an empty batch needs a row for the padding request only.
    assert RAGGED.bucket_for_all([(5, 1), (0, 0), (12, 3)]) == 16
    assert RAGGED.bucket_for_all([(8, 4), (9, 1)]) is None  # 4 requests fit 8 exactly, not 16 with padding
    assert RAGGED.bucket_for_all([(0, 0)]) == 8


# ---------------------------------------------------------------------- graph-vs-eager choice
def _extend_fb(lens: list[int], prefix: int = 0) -> ForwardBatch:
    t = lambda x: torch.tensor(x, dtype=torch.int64)
    n = sum(lens)
    return ForwardBatch(
        mode=EXTEND,
        batch_size=len(lens),
        input_ids=t([3 + i % 50 for i in range(n)]),
        positions=t([prefix + i for e in lens for i in range(e)]),
        out_cache_loc=t(list(range(1, n + 1))),
        req_pool_indices=t(list(range(1, len(lens) + 1))),
        seq_lens=t([prefix + e for e in lens]),
        extend_seq_lens=t(lens),
        seq_lens_cpu=[prefix + e for e in lens],
        extend_seq_lens_cpu=list(lens),
    )


def _draft_extend_fb(lens: list[int]) -> ForwardBatch:
    """A draft's extend over a prefill's tokens: the target's hidden states in, the last row's out."""
    fb = _extend_fb(lens)
    fb.mode, fb.capture_hidden_mode = ForwardMode.DRAFT_EXTEND, CaptureHiddenMode.LAST
    fb.spec_info = SpecInput(torch.zeros(fb.num_tokens, 64))
    return fb


def _graphs(table: ReqToTokenPool, modes=MODES, dp_size=None) -> CudaGraphRunner:
    return CudaGraphRunner(SimpleNamespace(device="cpu", req_to_token_pool=table), modes, [1, 2, 4], False, dp_size)


def _spec_prefill_modes(graph_modes: dict[ModeKey, CapturedMode]) -> dict[ModeKey, CapturedMode]:
    """A speculative runner's prefill mode at RAGGED's buckets (its cycles' modes left out)."""
    modes = ModelRunner.captured_modes(SimpleNamespace(graph_modes=graph_modes), RAGGED)
    return {key: mode for key, mode in modes.items() if mode.ragged is not None}


def _choice(graphs: CudaGraphRunner, fb: ForwardBatch, table: ReqToTokenPool):
    fb.req_to_token_pool = table
    return graphs.key_for(fb)


def _prefill_key(tokens: int) -> GraphKey:
    return GraphKey(EXTEND, RAGGED.rows(tokens), 0, 0, None, ragged_tokens=tokens)


def test_key_for_prefill_buckets_or_eager():
    table = ReqToTokenPool(16, 64, "cpu")
    graphs = _graphs(table)
    assert sorted(k.num_tokens for k in graphs.keys if k.mode == EXTEND) == [8, 16, 32, 128]
    assert _choice(graphs, _extend_fb([5]), table) == _prefill_key(8)
    assert _choice(graphs, _extend_fb([5, 9, 13], prefix=4), table) == _prefill_key(32)
    assert _choice(graphs, _extend_fb([2, 2, 2, 2]), table) == _prefill_key(8)  # exactly full
    assert _choice(graphs, _extend_fb([100, 29]), table) is None  # too many tokens
    assert _choice(graphs, _extend_fb([1] * 5), table) is None  # too many requests
    logprobs = _extend_fb([5])
    logprobs.input_logprob_rows = torch.tensor([0, 1])
    assert _choice(graphs, logprobs, table) is None  # prompt logprobs
    hidden = _extend_fb([5])
    hidden.capture_hidden_mode = CaptureHiddenMode.FULL
    assert _choice(graphs, hidden, table) is None  # a plain runner's prefill graphs keep no hidden states
    draft = _draft_extend_fb([5])
    assert _choice(graphs, draft, table) is None  # nor run a draft
    # A speculative target's prefill and the draft's extend over it replay their runners' graphs.
    target = _graphs(table, _spec_prefill_modes(target_graph_modes(SpecSizes.tiers(_gpu_args(**_CHAIN)))))
    assert _choice(target, hidden, table) == _prefill_key(8)
    assert _choice(target, _extend_fb([5]), table) is None  # it keeps the hidden states
    draft_graphs = _graphs(table, _spec_prefill_modes(draft_prefill_graph_mode(64, torch.float32)))
    assert _choice(draft_graphs, _draft_extend_fb([5, 9, 13]), table) == replace(_prefill_key(32), mode=ForwardMode.DRAFT_EXTEND)
    # A decode batch still replays its own graphs.
    decode = _extend_fb([1, 1, 1], prefix=6)
    decode.mode = DECODE
    assert _choice(graphs, decode, table) == GraphKey(DECODE, 4, 1)


def _dp_fb(lens: list[int], mode: ForwardMode, global_tokens: list[int], global_reqs) -> ForwardBatch:
    """This DP rank's batch (lens: its requests' new tokens) in an EXTEND iteration."""
    fb = _extend_fb(lens, prefix=4)
    fb.mode, fb.global_num_tokens, fb.global_forward_mode, fb.global_num_reqs = mode, global_tokens, EXTEND, global_reqs
    return fb


def test_dp_ranks_choose_one_prefill_bucket_from_the_plan():
    """Under DP attention every rank of a prefill iteration (prefilling, decoding, idle) chooses
    the same key from the plan's tokens and requests per rank, or all run eagerly."""
    table = ReqToTokenPool(16, 64, "cpu")
    dp_graphs = _graphs(table, dp_size=2)
    plan = ([5, 3], [1, 3])  # rank 0 prefills 5 tokens of one request, rank 1 decodes 3 requests
    assert _choice(dp_graphs, _dp_fb([5], EXTEND, *plan), table) == _prefill_key(8)
    assert _choice(dp_graphs, _dp_fb([1, 1, 1], DECODE, *plan), table) == _prefill_key(8)
    idle = _dp_fb([], ForwardMode.IDLE, [20, 0], [1, 0])
    assert _choice(dp_graphs, idle, table) == _prefill_key(32)  # the other rank's bucket; its padding alone here
    # Rank 0's 8 tokens of 4 requests fill bucket 8, but rank 1's 20 tokens need 32, whose 4
    # rows cannot hold rank 0's 4 requests and a padding request: the next bucket has none either.
    assert _choice(dp_graphs, _dp_fb([2, 2, 2, 2], EXTEND, [8, 20], [4, 1]), table) is None
    assert _choice(dp_graphs, _dp_fb([5], EXTEND, [5, 3], None), table) is None  # a rank's prompt logprobs: all eager
    assert _choice(_graphs(table), _dp_fb([5], EXTEND, *plan), table) is None  # a runner without DP attention


def test_the_plan_carries_the_prefill_graph_requests():
    """Every DP rank's requests reach the prefill graph choice, unless a rank computes prompt
    logprobs (then none: every rank eager); a speculative prefill phase counts only the ranks
    that prefill (the others are idle in it)."""
    prefill, decode = LocalPlan(num_tokens=9, num_reqs=2, is_extend=1), LocalPlan(num_tokens=3, num_reqs=3)
    plan = GlobalPlan((prefill, decode))
    assert plan.prefill_graph_reqs == [2, 3]
    assert GlobalPlan((replace(prefill, prompt_logprobs=1), decode)).prefill_graph_reqs is None
    it = SpecIterationPlan.from_global(plan, SpecSizes.tiers(_gpu_args(**_CHAIN))[-1])
    assert it.global_num_reqs(SubForward.TARGET_EXTEND) == it.global_num_reqs(SubForward.DRAFT_EXTEND_PREFILL) == [2, 0]
    assert it.global_num_tokens(SubForward.TARGET_EXTEND) == [9, 0] and it.global_num_reqs(SubForward.TARGET_VERIFY) is None


# ---------------------------------------------------------------------- static inputs
def test_static_inputs_pad_a_ragged_batch():
    """Padding tokens: token 0 at position 0 writing the dummy slot, all in one padding request
    (no prefix, on the dummy table row) right after the real ones; the other rows are empty."""
    inputs = StaticInputs(4, 1, "cpu", max_ragged_tokens=128)
    inputs.load(_extend_fb([9, 9, 9], prefix=3), _prefill_key(32), PREFILL)  # stale values to overwrite
    fb = inputs.load(_extend_fb([3, 2], prefix=7), _prefill_key(8), PREFILL)
    assert fb.batch_size == 4 and fb.num_tokens == 8 and lengths_agree(fb)
    assert fb.input_ids.tolist() == [3, 4, 5, 6, 7, 0, 0, 0]
    assert fb.positions.tolist() == [7, 8, 9, 7, 8, 0, 0, 0]
    assert fb.out_cache_loc.tolist() == [1, 2, 3, 4, 5] + [DUMMY_KV_SLOT] * 3
    assert fb.req_pool_indices.tolist() == [1, 2, DUMMY_REQ_ROW, DUMMY_REQ_ROW]
    assert fb.seq_lens.tolist() == [10, 9, 3, 0] and fb.extend_seq_lens.tolist() == [3, 2, 3, 0]
    # Exactly full: nothing padded.
    full = inputs.load(_extend_fb([2, 2, 2, 2]), _prefill_key(8), PREFILL)
    assert lengths_agree(full) and full.extend_seq_lens.tolist() == [2, 2, 2, 2]
    assert full.out_cache_loc.tolist() == list(range(1, 9))
    # Full of tokens, not of requests: empty rows only.
    one = inputs.load(_extend_fb([8]), _prefill_key(8), PREFILL)
    assert lengths_agree(one) and one.extend_seq_lens.tolist() == [8, 0, 0, 0]


def test_padding_batches_of_ragged_keys():
    """What each graph is captured with: one padding request holding every token."""
    inputs = StaticInputs(4, 1, "cpu", max_ragged_tokens=128)
    for tokens in (128, 8, 32, 16):
        fb = inputs.padding_batch(_prefill_key(tokens), PREFILL)
        assert lengths_agree(fb) and fb.extend_seq_lens.tolist() == [tokens, 0, 0, 0]
        assert set(fb.out_cache_loc.tolist()) == {DUMMY_KV_SLOT} and set(fb.req_pool_indices.tolist()) == {DUMMY_REQ_ROW}


def test_replay_host_work_reads_and_uploads_nothing():
    """Choosing the graph and filling its inputs read nothing back and upload nothing (the
    padding request's length is a kernel argument)."""
    table = ReqToTokenPool(16, 64, "cpu")
    graphs = _graphs(table)
    for key in graphs.capture_order():  # capture makes the padding values
        graphs.inputs.padding_batch(key, graphs.modes[key.mode_key])
    fb = _extend_fb([5, 9, 13], prefix=2)
    with SyncCounter(trace=True) as counter:
        key = _choice(graphs, fb, table)
        graphs.inputs.fill(fb, key, PREFILL)
    assert key == _prefill_key(32)
    assert counter.reads == counter.uploads == counter.transfers == 0, counter.sites


# ---------------------------------------------------------------------- flags
def test_flag_is_ignored_on_cpu(caplog):
    with caplog.at_level(logging.WARNING):
        args = ServerArgs(model_path="m", device="cpu", enable_piecewise_cuda_graph=True)
    assert not args.enable_piecewise_cuda_graph and args.disable_cuda_graph
    assert "--enable-piecewise-cuda-graph is ignored on CPU" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert not ServerArgs(model_path="m", device="cpu").enable_piecewise_cuda_graph
        assert not ServerArgs(model_path="m", device="cuda", disable_cuda_graph=True).enable_piecewise_cuda_graph
    assert not caplog.text  # off without a warning where nobody asked for it


def test_default_and_disable_flags():
    assert prepare_server_args(["--model-path", "m", "--device", "cuda"]).enable_piecewise_cuda_graph
    assert not prepare_server_args(
        ["--model-path", "m", "--device", "cuda", "--disable-piecewise-cuda-graph"]
    ).enable_piecewise_cuda_graph
    assert not prepare_server_args(["--model-path", "m", "--device", "cuda", "--disable-cuda-graph"]).enable_piecewise_cuda_graph


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--piecewise-cuda-graph-max-tokens", "0"], "--piecewise-cuda-graph-max-tokens must be >= 1"),
        (["--piecewise-cuda-graph-tokens", "64", "0"], "--piecewise-cuda-graph-tokens values must be >= 1"),
        (
            ["--enable-piecewise-cuda-graph", "--disable-piecewise-cuda-graph"],
            "--enable-piecewise-cuda-graph and --disable-piecewise-cuda-graph contradict each other",
        ),
    ],
)
def test_bad_flag_values_name_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", "m", "--device", "cpu", *flags])
    assert message in capsys.readouterr().err


def test_parsed_flags():
    args = prepare_server_args(
        ["--model-path", "m", "--device", "cuda", "--enable-piecewise-cuda-graph", "--piecewise-cuda-graph-tokens", "128", "512"]
    )
    assert args.enable_piecewise_cuda_graph and args.piecewise_cuda_graph_tokens == [128, 512]
    assert prefill_ragged_tokens(args, 8192, 256).buckets == (128, 512)


def test_scheduler_on_cpu_runs_the_flag_eagerly(tiny_llama_dir):
    """A CPU server given --enable-piecewise-cuda-graph starts, captures nothing and gives the
    tokens it gives without the flag."""
    from sglang.test.inprocess_scheduler import greedy, start_scheduler

    prompts, max_new = [[5, 9, 13, 2, 7, 11], [3, 3, 8]], [6, 4]
    outputs = []
    for flag in (False, True):
        args = ServerArgs(
            model_path=tiny_llama_dir,
            device="cpu",
            dtype="float32",
            max_total_tokens=1024,
            max_running_requests=4,
            enable_piecewise_cuda_graph=flag,
        )
        scheduler = start_scheduler(args)
        assert scheduler.runner.graph_runner is None
        outputs.append(greedy(scheduler, prompts, max_new))
    assert outputs[0] == outputs[1]


# ---------------------------------------------------------------------- padded batches through a model
def _eager(runner: ModelRunner, fb: ForwardBatch) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """fb's eager logits, the KV before it and the KV it leaves; the pool is left as before."""
    before = kv_snapshot(runner)
    logits = runner.forward_eager(fb).next_token_logits
    after = kv_snapshot(runner)
    kv_restore(runner, before)
    return logits, before, after


def _assert_kv_like_eager(runner: ModelRunner, fb: ForwardBatch, before, after_eager, tol: float) -> None:
    """The batch's own slots hold eager's KV; every other slot but the dummy one is untouched."""
    written = fb.out_cache_loc.cpu()
    untouched = torch.ones(before[0].shape[0], dtype=torch.bool)
    untouched[written] = False
    untouched[DUMMY_KV_SLOT] = False
    for got, old, want in zip(kv_snapshot(runner), before, after_eager):
        assert torch.equal(got[untouched.to(got.device)], old[untouched.to(old.device)])
        torch.testing.assert_close(got[written.to(got.device)], want[written.to(want.device)], rtol=tol, atol=tol)


def _assert_same_greedy(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Logits close, and the same greedy token wherever the top two are further apart than tol."""
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    top2 = want.float().topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


# With RAGGED, the cases (sglang.test.prefill_batches) pad every way: one prompt of 11 tokens in
# bucket 16 (a padding request and two empty rows), several of 27 in 32, a cached prefix (two
# requests, 11 new tokens) in 16, a second chunk of exactly 8 in 8 (empty rows only), a full
# bucket (4 x 4 tokens in 16: nothing padded), and a long prompt of 100 + 5 in 128 (a request
# longer than one 64-row query block of the extend kernel).


@pytest.fixture(scope="module")
def model_dirs(tiny_llama_dir, tiny_deepseek_v3_dir) -> dict[str, str]:
    return {"llama": tiny_llama_dir, "deepseek_v3": tiny_deepseek_v3_dir}


@pytest.mark.parametrize("model", ["llama", "deepseek_v3"])
def test_padded_prefill_matches_unpadded_eager(model_dirs, model):
    """The padding StaticInputs adds (a padding request, empty rows) changes neither the real
    requests' logits nor any real KV slot (reference attention, host lengths padded too)."""
    runner = make_runner(model_dirs[model], "cpu", "float32")
    for case in PREFILL_CASES:
        *warm, fb = case_batches(runner, case)
        for batch in warm:
            runner.forward_eager(batch)
        runner.attach(fb)
        key = _graphs(runner.req_to_token_pool).key_for(fb)
        assert key is not None, case
        eager, before, after = _eager(runner, fb)
        padded = StaticInputs(4, 1, "cpu", max_ragged_tokens=128).load(fb, key, PREFILL)
        logits = runner.forward_eager(padded).next_token_logits
        assert logits.shape[0] == key.batch_size
        _assert_same_greedy(logits[: fb.batch_size], eager, 1e-5)
        _assert_kv_like_eager(runner, fb, before, after, 1e-5)


# ---------------------------------------------------------------------- the captured work, run eagerly
class _GraphStandIn:
    """A CUDA graph's stand-in: replay() runs the captured work on the static inputs, a ragged
    key's with the padded batch's host lengths removed (its graph reads none: they were the
    capture's; a uniform key's are the capture's anyway). Counts replays per forward mode."""

    replays: ClassVar[dict[ForwardMode, int]] = {}

    def __init__(self, graphs: CudaGraphRunner, key: GraphKey):
        self.graphs, self.key = graphs, key

    def replay(self) -> None:
        batch = self.graphs.inputs.batch(self.key, self.graphs.modes[self.key.mode_key])
        if self.key.ragged_tokens:
            assert int(batch.extend_seq_lens.sum()) == self.key.num_tokens, "the padding must complete the bucket"
        self.graphs.run_into_outputs(_without_host_lengths(batch, self.key), self.key)
        _GraphStandIn.replays[self.key.mode] = _GraphStandIn.replays.get(self.key.mode, 0) + 1


def _without_host_lengths(fb: ForwardBatch, key: GraphKey) -> ForwardBatch:
    """fb without host lengths when key is ragged (a prefill graph's work must not read them)."""
    return replace(fb, seq_lens_cpu=None, extend_seq_lens_cpu=None) if key.ragged_tokens else fb


def emulated_capture(graphs: CudaGraphRunner) -> None:
    """CudaGraphRunner.capture without CUDA: the same buffers and warm-up runs (largest key
    first), with _GraphStandIn graphs."""
    runner = graphs.model_runner
    width = runner.req_to_token_pool.req_to_token.shape[1]
    runner.attn_backend.init_cuda_graph_state(graphs.max_bs, graphs.max_bs * width, torch.device(runner.device))
    for key in graphs.capture_order():
        batch = graphs.inputs.padding_batch(key, graphs.modes[key.mode_key])
        assert graphs.modes[key.mode_key].slots_only or lengths_agree(batch), key
        graphs.ensure_outputs(key, graphs._run(_without_host_lengths(batch, key), key))
        graphs.graphs[key] = _GraphStandIn(graphs, key)


@pytest.mark.skipif(torch.cuda.is_available() or INTERPRETED, reason="CPU only; spawns the interpreter run")
def test_prefill_work_under_triton_interpreter():
    """On CPU, run the graph_path tests below in a fresh TRITON_INTERPRET=1 process (see
    test_triton_kernels)."""
    rerun_under_interpreter(__file__, "-k", "graph_path", timeout=1500)


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED), reason="needs compiled or interpreted Triton")
@pytest.mark.parametrize("model", ["llama", "deepseek_v3"])
def test_graph_path_matches_eager_triton(model_dirs, model):
    """What a prefill graph captures (static padded inputs, metadata from device tensors with
    the bucket's bounds, the model, logits of each request's last row), replayed through
    ModelRunner.forward: eager Triton's logits and KV, for every case."""
    patch_interpreter_for_numpy2()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runner = make_runner(model_dirs[model], device, "float32", attention_backend="triton", disable_cuda_graph=True)
    runner.graph_runner = CudaGraphRunner(runner, {ModeKey(EXTEND): PREFILL}, [1], False)
    emulated_capture(runner.graph_runner)
    _check_cases_replay_like_eager(runner, 1e-3 if device == "cuda" else 1e-4)  # CUDA: the bucket's GEMM shapes differ


def _check_cases_replay_like_eager(runner: ModelRunner, tol: float) -> None:
    """Each case's last batch replays one graph through ModelRunner.forward and gives eager's
    logits (greedy tokens) and KV."""
    graphs = runner.graph_runner
    for case in PREFILL_CASES:
        *warm, fb = case_batches(runner, case)
        for batch in warm:
            runner.forward_eager(batch)
        eager, before, after = _eager(runner, fb)
        replays = graphs.num_replays
        logits = runner.forward(fb).next_token_logits
        assert graphs.num_replays == replays + 1, case
        _assert_same_greedy(logits, eager, tol)
        _assert_kv_like_eager(runner, fb, before, after, tol)


def _tp2_worker(rank: int, world: int, path: str) -> None:
    """One of two TP ranks (gloo): the cases through emulated prefill graphs, whose captured work
    holds the TP all-reduces and the logits' all-gather, equal eager on this rank."""
    patch_interpreter_for_numpy2()
    from sglang.srt.distributed.parallel_state import initialize_model_parallel

    initialize_model_parallel(world, rank)
    args = ServerArgs(
        model_path=path,
        device="cpu",
        dtype="float32",
        max_total_tokens=2048,
        max_running_requests=16,
        attention_backend="triton",
        disable_cuda_graph=True,
        tp_size=world,
    )
    runner = ModelRunner(ModelConfig(path, dtype="float32", device="cpu"), args, gpu_id=0, tp_rank=rank, tp_size=world)
    runner.graph_runner = CudaGraphRunner(runner, {ModeKey(EXTEND): PREFILL}, [1], False)
    emulated_capture(runner.graph_runner)
    _check_cases_replay_like_eager(runner, 1e-4)


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess (two gloo ranks)")
@pytest.mark.parametrize("model", ["llama", "deepseek_v3"])
def test_graph_path_matches_eager_tp2(model_dirs, model):
    from sglang.test.dist_utils import spawn_gloo

    spawn_gloo(_tp2_worker, 2, model_dirs[model])


def _reads_outside_native_moe(counter: SyncCounter) -> int:
    """Reads but the CPU reference MoE's (moe_forward_native: its expert sizes, on the host;
    CUDA runs grouped_gemm.fused_moe instead, checked apart below)."""
    return sum(n for site, n in counter.sites.items() if site.startswith("read") and "moe/fused_moe.py" not in site)


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED), reason="needs compiled or interpreted Triton")
@pytest.mark.parametrize("model", ["llama", "deepseek_v3"])
def test_graph_path_reads_nothing_back(model_dirs, model):
    """The captured prefill work neither reads the device nor uploads host data (either would
    stall a replay, or break the capture)."""
    patch_interpreter_for_numpy2()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runner = make_runner(model_dirs[model], device, "float32", attention_backend="triton", disable_cuda_graph=True)
    graphs = CudaGraphRunner(runner, {ModeKey(EXTEND): PREFILL}, [1], False)
    emulated_capture(graphs)
    *_, fb = case_batches(runner, "several prompts")
    runner.attach(fb)
    key = graphs.key_for(fb)
    graphs.inputs.fill(fb, key, PREFILL)
    with SyncCounter(trace=True) as counter:
        graphs.run_into_outputs(_without_host_lengths(graphs.inputs.batch(key, PREFILL), key), key)
    assert _reads_outside_native_moe(counter) == counter.uploads == counter.transfers == 0, counter.sites


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED), reason="needs compiled or interpreted Triton")
@pytest.mark.parametrize("num_tokens", [64, 600])
def test_graph_path_moe_reads_nothing_back(num_tokens):
    """The CUDA MoE (routing, expert alignment: in one program up to 1024 (token, slot) pairs,
    in plain PyTorch above, grouped GEMMs) at a bucket's token count: no read, no upload."""
    patch_interpreter_for_numpy2()
    from sglang.srt.kernels.moe.grouped_gemm import fused_moe
    from sglang.srt.kernels.moe.routing import select_experts_triton
    from sglang.srt.kernels.moe.routing_config import RoutingConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(num_tokens)
    routing = RoutingConfig(2, 8, "sigmoid", "noaux_tc", 4, 2, renormalize=True, num_shared_experts=1)
    x = torch.randn(num_tokens, 16, generator=gen).to(device)
    w13, w2 = torch.randn(9, 32, 16, generator=gen).to(device), torch.randn(9, 16, 16, generator=gen).to(device)
    logits, bias = torch.randn(num_tokens, 8, generator=gen).to(device), torch.zeros(8, device=device)
    with SyncCounter(trace=True) as counter:
        weights, ids = select_experts_triton(logits, routing, bias)
        fused_moe(x, w13, w2, weights, ids, shared_slots=1)
    assert counter.reads == counter.uploads == counter.transfers == 0, counter.sites


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_graph_path_validation_script_equality_check(model_dirs, capsys):
    """benchmark/gpu/validate_prefill_graphs.py's equality check, over emulated graphs: every
    case replays and passes (what the GPU run checks with real graphs)."""
    import importlib.util

    patch_interpreter_for_numpy2()
    path = os.path.join(os.path.dirname(__file__), "..", "benchmark", "gpu", "validate_prefill_graphs.py")
    spec = importlib.util.spec_from_file_location("validate_prefill_graphs", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    runner = make_runner(model_dirs["llama"], "cpu", "float32", attention_backend="triton", disable_cuda_graph=True)
    runner.graph_runner = CudaGraphRunner(runner, {ModeKey(EXTEND): PREFILL}, [1], False)
    emulated_capture(runner.graph_runner)
    assert script.check_equal(runner, "tiny_llama")
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["case"] for r in rows] == list(PREFILL_CASES) and all(r["replayed"] and r["greedy_equal"] for r in rows)


@contextmanager
def _emulated_prefill_graphs():
    """ModelRunners capture their modes, prefill at RAGGED's buckets up to the runner's limit
    (as prefill_ragged_tokens caps them), where a CUDA runner captures them, as _GraphStandIn
    graphs."""

    def modes(runner: ModelRunner) -> dict[ModeKey, CapturedMode]:
        buckets = prefill_token_buckets(RAGGED.buckets, None, runner.prefill_graph_token_limit())
        return runner.captured_modes(RaggedTokens(tuple(buckets), RAGGED.max_rows))

    with (
        mock.patch.object(ModelRunner, "_graph_modes", modes),
        mock.patch.object(CudaGraphRunner, "capture", emulated_capture),
    ):
        yield


_LONG_PROMPT = PROMPTS[2] + PROMPTS[1] + PROMPTS[0]  # 27 tokens: chunks of 16 and 11
# Two rounds of requests (the second reuses the first's prefixes from the radix cache).
_ROUNDS = [
    ([PROMPTS[0], _LONG_PROMPT], [5, 4]),
    ([PROMPTS[0] + [40, 41, 42], _LONG_PROMPT[:20] + [50, 51], PROMPTS[1]], [4, 3, 5]),
]


@dataclass
class _SchedulerRun:
    tokens: list[list[int]]
    replays: dict[ForwardMode, int]  # graph replays per key mode
    eager: dict[ForwardMode, int]  # eager forwards per batch mode
    replayed_as: set[tuple[str, str]]  # (batch mode, key mode) of each replay
    accept_length: Optional[float]


def _scheduler_greedy(args: ServerArgs, graphs: bool, rounds=_ROUNDS, tp_rank: int = 0, port_args=None) -> _SchedulerRun:
    """Each round's requests sent at once and run to completion, through eager forwards or
    emulated graphs (the prefill ones at RAGGED's buckets)."""
    from sglang.test.inprocess_scheduler import greedy, start_scheduler

    _GraphStandIn.replays, eager, replayed_as = {}, {}, set()
    forward_eager, replay = ModelRunner.forward_eager, CudaGraphRunner.replay

    def counted(model_runner: ModelRunner, fb: ForwardBatch, *rest, **kwargs):
        eager[fb.mode] = eager.get(fb.mode, 0) + 1
        return forward_eager(model_runner, fb, *rest, **kwargs)

    def recorded(graph_runner: CudaGraphRunner, fb: ForwardBatch, key: GraphKey):
        replayed_as.add((fb.mode.name, key.mode.name))
        return replay(graph_runner, fb, key)

    with mock.patch.object(ModelRunner, "forward_eager", counted), mock.patch.object(CudaGraphRunner, "replay", recorded):
        if graphs:
            with _emulated_prefill_graphs():
                scheduler = start_scheduler(replace(args, cuda_graph_bs=[1, 2, 4]), tp_rank, port_args)
        else:
            scheduler = start_scheduler(args, tp_rank, port_args)
        tokens = [ids for prompts, max_new in rounds for ids in greedy(scheduler, prompts, max_new)]
    return _SchedulerRun(tokens, dict(_GraphStandIn.replays), eager, replayed_as, scheduler.avg_spec_accept_length())


def _scheduler_args(path: str, **args) -> ServerArgs:
    """A CPU server on Triton kernels (the interpreter) with prompts chunked at 16 tokens."""
    return ServerArgs(
        model_path=path,
        device="cpu",
        dtype="float32",
        attention_backend="triton",
        max_total_tokens=1024,
        max_running_requests=4,
        chunked_prefill_size=16,
        **args,
    )


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed chunk"])
def test_graph_path_matches_eager_through_the_scheduler(tiny_deepseek_v3_dir, mixed):
    """Whole requests through the scheduler (chunked prefill, radix-cache hits, overlap
    scheduling; with --enable-mixed-chunk, decode rows inside prefills) with prefills and
    decodes through the graphs' captured work: the eager tokens."""
    patch_interpreter_for_numpy2()
    args = _scheduler_args(tiny_deepseek_v3_dir, enable_mixed_chunk=mixed)
    eager, graphs = _scheduler_greedy(args, graphs=False), _scheduler_greedy(args, graphs=True)
    assert graphs.tokens == eager.tokens
    # Every prefill fits a bucket: all of them replay (and every decode).
    assert graphs.replays == {mode: n for mode, n in eager.eager.items() if mode in (EXTEND, DECODE)}, (
        graphs.replays,
        eager.eager,
    )
    assert EXTEND not in graphs.eager and DECODE not in graphs.eager, graphs.eager


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("algorithm", ["NEXTN", "EAGLE"])
def test_graph_path_matches_eager_speculative(request, algorithm):
    """Speculative servers (a draft that reproduces the target, so every draft is accepted)
    with every prefill chunk through graphs' captured work: the target's prefill keeping each
    token's hidden state, then the draft's extend over the chunk reading them (a per-token
    input and output of a ragged graph), and whole decode cycles through theirs: the eager
    tokens and accept length."""
    patch_interpreter_for_numpy2()
    if algorithm == "NEXTN":
        path, spec = request.getfixturevalue("perfect_deepseek_v3_dir"), {}
    else:
        path, head = request.getfixturevalue("perfect_llama_pair")
        spec = dict(speculative_draft_model_path=head)
    args = _scheduler_args(path, **{**_CHAIN, "speculative_algorithm": algorithm, **spec})
    eager, graphs = _scheduler_greedy(args, graphs=False), _scheduler_greedy(args, graphs=True)
    assert graphs.tokens == eager.tokens and graphs.accept_length == eager.accept_length == 4.0
    # Each prefill chunk: one target and one draft replay; greedy cycles replay whole.
    replays = graphs.replays
    assert (
        replays[EXTEND] == replays[ForwardMode.DRAFT_EXTEND] == eager.eager[EXTEND] and replays[ForwardMode.DECODE_CYCLE] > 0
    ), replays
    assert not graphs.eager, graphs.eager


# DP rank 0 prefills 59 tokens in four chunks of at most 16; rank 1 prefills its one request
# with rank 0's first chunk, decodes it beside the second chunk, then idles beside the others.
_DP_REQUESTS = [
    ([_LONG_PROMPT, _LONG_PROMPT[::-1], PROMPTS[0]], [4, 3, 5]),
    ([PROMPTS[1]], [2]),
]


def _dp_prefill_worker(rank: int, args: ServerArgs, port_args, results) -> None:
    patch_interpreter_for_numpy2()  # a spawned rank: no conftest ran here
    torch.set_num_threads(1)
    run = _scheduler_greedy(args, True, [_DP_REQUESTS[rank]], rank, port_args)
    results[rank] = (run.tokens, {m.name for m in run.eager}, run.replayed_as, run.accept_length)


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "NEXTN"])
def test_graph_path_matches_eager_dp_attention(request, spec):
    """--tp 2 --dp 2 --enable-dp-attention with prefill graphs: in every prefill iteration
    both ranks replay the one bucket chosen from the plan, the rank that prefills, the one
    that decodes (plain: through the prefill graph; NEXTN: idle in the prefill phase) and the
    idle one; nothing runs eagerly, and the tokens (and NEXTN's accept length 4.0 with a
    draft that reproduces the target) are the single-rank eager ones."""
    import torch.multiprocessing as mp

    from sglang.srt.server_args import PortArgs

    path = request.getfixturevalue("perfect_deepseek_v3_dir" if spec else "tiny_deepseek_v3_dir")
    spec_args = {**_CHAIN, "speculative_algorithm": "NEXTN"} if spec else {}
    everything = tuple(map(list.__add__, *_DP_REQUESTS))
    single = _scheduler_greedy(_scheduler_args(path, **spec_args), False, [everything])
    args = _scheduler_args(path, tp_size=2, dp_size=2, enable_dp_attention=True, **spec_args)
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_dp_prefill_worker, args=(args, PortArgs.init_new(args), results), nprocs=2)
    (tokens0, eager0, replayed0, accept0), (tokens1, eager1, replayed1, accept1) = results[0], results[1]
    assert tokens0 == single.tokens[:3] and tokens1 == single.tokens[3:]
    assert not eager0 and not eager1, (eager0, eager1)
    assert ("EXTEND", "EXTEND") in replayed0 and ("EXTEND", "EXTEND") in replayed1
    if spec:
        assert accept0 == accept1 == 4.0
        assert {("IDLE", "EXTEND"), ("IDLE", "DRAFT_EXTEND")} <= replayed1, replayed1
    else:
        assert ("DECODE", "EXTEND") in replayed1 and ("IDLE", "EXTEND") in replayed1, replayed1


# ---------------------------------------------------------------------- CUDA: replay equals eager
@needs_cuda
@pytest.mark.parametrize("model", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_graph_replay_matches_eager(model_dirs, model, dtype):
    """Real graphs captured at startup next to the decode graphs; each case replays one and
    matches eager prefill (logits, greedy tokens, KV)."""
    runner = make_runner(
        model_dirs[model],
        "cuda",
        dtype,
        cuda_graph_bs=[1, 2, 4],
        enable_piecewise_cuda_graph=True,
        piecewise_cuda_graph_tokens=list(RAGGED.buckets),
    )
    graphs = runner.graph_runner
    assert sorted(k.num_tokens for k in graphs.graphs if k.mode == EXTEND) == list(RAGGED.buckets)
    assert sorted(k.batch_size for k in graphs.graphs if k.mode == DECODE) == [1, 2, 4]
    _check_cases_replay_like_eager(runner, 1e-3 if dtype == "float32" else 3e-2)


@needs_cuda
def test_prefill_capture_out_of_memory_names_the_prefill_flags(model_dirs, monkeypatch):
    capture_one = CudaGraphRunner._capture_one

    def oom_on_prefill(graphs, key, *args):
        if key.mode == EXTEND:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return capture_one(graphs, key, *args)

    monkeypatch.setattr(CudaGraphRunner, "_capture_one", oom_on_prefill)
    with pytest.raises(CudaGraphCaptureError, match="--piecewise-cuda-graph-max-tokens"):
        make_runner(model_dirs["llama"], "cuda", "float32", cuda_graph_bs=[1, 2], enable_piecewise_cuda_graph=True)
