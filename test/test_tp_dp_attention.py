"""Tensor parallelism and DP attention on gloo (CPU, float32) against one rank.

- `--tp 2`: prefill logits (chunked) and greedy tokens equal the single-rank run.
- `--tp 2 --dp 2 --enable-dp-attention` and `--tp 4 --dp 2 --enable-dp-attention`
  (attention TP 2): each DP rank generates its own prompts in lockstep (one rank idles
  while the other prefills, ranks prefill and decode at once with different token counts,
  requests finish at different steps); every rank's logits and greedy tokens equal what one
  rank computes for that DP rank's prompts alone. The collectives of every forward are
  counted per group.
- dp_gather / dp_scatter on uneven sizes (including 0 rows): contents, one TP all-reduce
  for the gather, none for the scatter, a scatter result that does not alias the buffer.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import (
    get_attn_dp_rank,
    get_attn_tp_group,
    get_attn_tp_size,
    get_cpu_group,
    get_tp_group,
    initialize_model_parallel,
)
from sglang.srt.layers.dp_attention import DpRanks, dp_gather, dp_scatter, gathered_buffer_rows
from sglang.srt.model_loader import get_model
from sglang.test.dist_utils import spawn_gloo
from sglang.test.model_harness import ModelHarness
from sglang.test.tiny_models import make_tiny_llama

CHUNK = 4
# Per DP rank: (prompts, max new tokens per prompt, step at which the requests arrive).
# DP rank 1 idles for 3 steps, then prefills its long prompt in chunks while rank 0 decodes.
SCENARIOS = [
    ([[5, 17, 42, 7, 99, 3, 11, 23, 8], [60, 61, 62, 63, 64]], [6, 3], 0),
    ([list(range(20, 33))], [4], 3),
]


@pytest.fixture(scope="module")
def llama_tied(tmp_path_factory) -> str:
    """4 heads / 2 KV heads, tied embeddings (the LM head is the attention-TP embedding)."""
    return make_tiny_llama(str(tmp_path_factory.mktemp("llama_tied")), tie_word_embeddings=True)


@pytest.fixture(params=["llama_tied", "tiny_deepseek_v3_no_mtp_dir"], ids=["llama_tied", "deepseek_v3"])
def model_dir(request) -> str:
    return request.getfixturevalue(request.param)


def _harness(path: str) -> ModelHarness:
    config = ModelConfig(path, dtype="float32", device="cpu")
    return ModelHarness(get_model(config, "auto", "cpu"), config, max_context_len=64)


def _num_layers(path: str) -> int:
    return ModelConfig(path, dtype="float32", device="cpu").num_hidden_layers


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Counts torch.distributed all_reduce / all_gather calls by (op, group name)."""
    names = {id(get_cpu_group()): "cpu", id(get_attn_tp_group()): "attn_tp", id(get_tp_group()): "tp"}
    counts: Counter = Counter()

    def wrap(op: str, fn):
        def counted(*args, group=None, **kwargs):
            counts[op, names.get(id(group), repr(group))] += 1
            return fn(*args, group=group, **kwargs)

        return counted

    with (
        mock.patch.object(dist, "all_reduce", wrap("all_reduce", dist.all_reduce)),
        mock.patch.object(dist, "all_gather", wrap("all_gather", dist.all_gather)),
    ):
        yield counts


# ---- single-rank references (computed in the test process) -----------------------------


def _reference(path: str) -> list[list[torch.Tensor]]:
    """Per DP rank: the single-rank logits its requests' tokens are picked from."""
    initialize_model_parallel(1, 0)
    harness = _harness(path)
    refs = []
    for prompts, max_new, _ in SCENARIOS:
        logits = harness.greedy_generate_lockstep(prompts, max_new, chunk_size=CHUNK)
        greedy = harness.greedy_generate(prompts, max(max_new), chunk_size=CHUNK)
        assert [l.argmax(-1).tolist() for l in logits] == [g[:n] for g, n in zip(greedy, max_new)]
        refs.append(logits)
    return refs


# ---- --tp 2 ------------------------------------------------------------------------------


def _tp_worker(rank: int, world: int, path: str, prompts, ref_prefill, ref_tokens) -> None:
    initialize_model_parallel(world, rank)
    harness = _harness(path)
    for ours, ref in zip(harness.run_prefill(prompts, chunk_size=CHUNK), ref_prefill):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert harness.greedy_generate(prompts, 5) == ref_tokens


@pytest.mark.timeout(300)
def test_tp2_matches_single_rank(model_dir):
    prompts = SCENARIOS[0][0] + SCENARIOS[1][0]
    initialize_model_parallel(1, 0)
    harness = _harness(model_dir)
    ref_prefill = harness.run_prefill(prompts)
    ref_tokens = harness.greedy_generate(prompts, 5)
    spawn_gloo(_tp_worker, 2, model_dir, prompts, ref_prefill, ref_tokens)


# ---- DP attention --------------------------------------------------------------------------


def _dp_worker(rank: int, world: int, path: str, dp: int, refs, num_layers: int) -> None:
    initialize_model_parallel(world, rank, dp_size=dp, enable_dp_attention=True)
    harness = _harness(path)
    prompts, max_new, start = SCENARIOS[get_attn_dp_rank()]
    with count_collectives() as counts:
        logits = harness.greedy_generate_lockstep(prompts, max_new, chunk_size=CHUNK, start_step=start)
    for ours, ref in zip(logits, refs[get_attn_dp_rank()]):
        assert ours.argmax(-1).tolist() == ref.argmax(-1).tolist()
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)

    # One CPU all-gather per step plus the final one that finds every rank done.
    steps = counts["all_gather", "cpu"] - 1
    assert steps == 10  # rank 0: 3 extend + 5 decode; rank 1: 3 idle + 4 extend + 3 decode
    # Per layer: dp_gather's all-reduce and the MLP/MoE reduction, over the TP group.
    expected = Counter({("all_gather", "cpu"): steps + 1, ("all_reduce", "tp"): steps * 2 * num_layers})
    if get_attn_tp_size() > 1:  # embedding + o_proj per layer; LM head gather
        expected["all_reduce", "attn_tp"] = steps * (1 + num_layers)
        expected["all_gather", "attn_tp"] = steps
    assert counts == expected, counts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,dp", [(2, 2), (4, 2)])
def test_dp_attention_matches_single_rank(model_dir, tp, dp):
    spawn_gloo(_dp_worker, tp, model_dir, dp, _reference(model_dir), _num_layers(model_dir))


# ---- gather / scatter --------------------------------------------------------------------


def _gather_worker(rank: int, world: int, dp: int) -> None:
    initialize_model_parallel(world, rank, dp_size=dp, enable_dp_attention=True)
    ranks = DpRanks.current()
    dp_rank = ranks.dp_rank
    buffer = torch.full((16, 3), -1.0)
    for sizes in ([3, 0], [0, 0], [2, 5]):
        local = torch.arange(sizes[dp_rank] * 3, dtype=torch.float32).view(-1, 3) + 100 * dp_rank
        with count_collectives() as counts:
            gathered = dp_gather(local, sizes, buffer, ranks)
        assert counts == Counter({("all_reduce", "tp"): 1})
        expected = [torch.arange(n * 3, dtype=torch.float32).view(-1, 3) + 100 * d for d, n in enumerate(sizes)]
        torch.testing.assert_close(gathered, torch.cat(expected))
        assert gathered.numel() == 0 or gathered.data_ptr() == buffer.data_ptr()  # no extra copy
        with count_collectives() as counts:
            mine = dp_scatter(gathered * 2, sizes, dp_rank)
            own = dp_scatter(gathered, sizes, dp_rank)
        assert not counts
        torch.testing.assert_close(mine, 2 * local)
        assert own.numel() == 0 or own.data_ptr() != buffer.data_ptr()
        buffer.fill_(-1.0)
        torch.testing.assert_close(own, local)  # not a view of the buffer
    too_many = torch.zeros(sizes[dp_rank] + 1, 3)
    with pytest.raises(ValueError, match="local rows"):
        dp_gather(too_many, sizes, buffer, ranks)
    # One rank wrong alone: it still joins the all-reduce before raising, so its peer is not
    # left waiting, and both stay in step for the next collective.
    local = torch.ones(sizes[dp_rank] + (dp_rank == 1), 3)
    if dp_rank == 1:
        with pytest.raises(ValueError, match="local rows"):
            dp_gather(local, sizes, buffer, ranks)
    else:
        dp_gather(local, sizes, buffer, ranks)
    torch.testing.assert_close(dp_gather(torch.ones(sizes[dp_rank], 3), sizes, buffer, ranks), torch.ones(sum(sizes), 3))


@pytest.mark.timeout(120)
def test_dp_gather_scatter_uneven_and_empty():
    spawn_gloo(_gather_worker, 2, 2)


def test_gathered_buffer_rows():
    assert gathered_buffer_rows(8, 1, None, 2) == 16
    assert gathered_buffer_rows(8, 4, 16, 2) == 64  # speculative tokens per request dominate
    assert gathered_buffer_rows(8, 4, 512, 2) == 1024  # chunked-prefill budget dominates
    assert gathered_buffer_rows(8, 0, -1, 3) == 24


def test_single_rank_defaults_need_no_torch_distributed():
    initialize_model_parallel(1, 0)
    assert get_attn_tp_size() == 1 and get_attn_dp_rank() == 0 and get_cpu_group() is None
