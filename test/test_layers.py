"""Layer unit tests: logits row selection and hidden capture, RoPE/RMSNorm shapes, TP weight sharding."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from sglang.srt.batch.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import initialize_model_parallel
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.model_loader import get_model
from sglang.test.model_harness import ModelHarness
from sglang.test.server_utils import find_free_port


def _batch(mode: ForwardMode, extend_lens: list[int], capture=CaptureHiddenMode.NULL) -> ForwardBatch:
    n = sum(extend_lens)
    lens = torch.tensor(extend_lens, dtype=torch.int64)
    z = torch.zeros(n, dtype=torch.int64)
    return ForwardBatch(
        mode, len(extend_lens), z, z, z, torch.zeros(len(extend_lens), dtype=torch.int64), lens, lens, capture_hidden_mode=capture
    )


@pytest.fixture
def lm_head():
    head = VocabParallelEmbedding(10, 8)
    torch.nn.init.normal_(head.weight)
    return head


def test_logits_rows_and_hidden_capture(lm_head):
    proc = LogitsProcessor(10)
    hidden = torch.randn(5, 8)
    full = hidden @ lm_head.weight.T

    out = proc(hidden, lm_head, _batch(ForwardMode.EXTEND, [2, 3], CaptureHiddenMode.LAST))
    assert out.next_token_logits.dtype == torch.float32
    torch.testing.assert_close(out.next_token_logits, full[[1, 4]])
    torch.testing.assert_close(out.hidden_states, hidden[[1, 4]])

    out = proc(hidden, lm_head, _batch(ForwardMode.DRAFT_EXTEND, [2, 3], CaptureHiddenMode.FULL))
    assert out.next_token_logits.shape == (2, 10)
    torch.testing.assert_close(out.hidden_states, hidden)
    assert out.hidden_states.data_ptr() != hidden.data_ptr()  # a fresh tensor

    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE):
        out = proc(hidden, lm_head, _batch(mode, [1] * 5))
        torch.testing.assert_close(out.next_token_logits, full)
        assert out.hidden_states is None

    fb = _batch(ForwardMode.EXTEND, [2, 3], CaptureHiddenMode.LAST)
    fb.logits_indices = torch.tensor([0, 2, 3])
    out = proc(hidden, lm_head, fb)
    torch.testing.assert_close(out.next_token_logits, full[[0, 2, 3]])
    torch.testing.assert_close(out.hidden_states, hidden[[0, 2, 3]])

    out = proc(hidden[:0], lm_head, _batch(ForwardMode.IDLE, [], CaptureHiddenMode.FULL))
    assert out.next_token_logits.shape == (0, 10) and out.hidden_states.shape == (0, 8)


def test_rope_accepts_flat_and_3d_and_is_identity_at_zero():
    rope = get_rope(16, 8, 64, 10000.0, None)  # partial rotary: 8 of 16 channels
    q, k = torch.randn(3, 4 * 16), torch.randn(3, 2 * 16)
    pos = torch.tensor([0, 5, 9])
    q1, k1 = rope(pos, q, k)
    q2, k2 = rope(pos, q.view(3, 4, 16), k.view(3, 2, 16))
    assert q1.shape == q.shape and q2.shape == (3, 4, 16)
    torch.testing.assert_close(q1.view(3, 4, 16), q2)
    torch.testing.assert_close(k1.view(3, 2, 16), k2)
    torch.testing.assert_close(q1[0], q[0])  # position 0 rotates by nothing
    torch.testing.assert_close(q1.view(3, 4, 16)[..., 8:], q.view(3, 4, 16)[..., 8:])
    assert not torch.allclose(q1[1], q[1])
    assert get_rope(16, 8, 64, 10000.0, None) is rope  # shared across layers


def test_rmsnorm_fused_residual():
    norm = RMSNorm(8, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    x, r = torch.randn(4, 8), torch.randn(4, 8)
    out, new_r = norm(x, r)
    torch.testing.assert_close(new_r, x + r)
    torch.testing.assert_close(out, norm(x + r))
    assert norm(x[:0]).shape == (0, 8)


@pytest.fixture
def restore_tp():
    yield
    initialize_model_parallel(1, 0)


@pytest.mark.parametrize("tp,kv_heads", [(2, 2), (4, 2), (2, 1)])
def test_qkv_and_mlp_sharding_reassemble(restore_tp, tp, kv_heads):
    """Each simulated rank's output slice equals the matching slice of the unsharded layer."""
    hidden, head, heads = 16, 4, 4
    wq, wk, wv = torch.randn(heads * head, hidden), torch.randn(kv_heads * head, hidden), torch.randn(kv_heads * head, hidden)
    bq, bk, bv = torch.randn(heads * head), torch.randn(kv_heads * head), torch.randn(kv_heads * head)
    wg, wu, wd = torch.randn(32, hidden), torch.randn(32, hidden), torch.randn(hidden, 32)
    x = torch.randn(3, hidden)
    q_parts, mlp_sum = [], torch.zeros(3, hidden)
    for rank in range(tp):
        initialize_model_parallel(tp, rank)
        qkv = QKVParallelLinear(hidden, head, heads, kv_heads, bias=True)
        for shard, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            qkv.weight.weight_loader(qkv.weight, w, shard)
            qkv.bias.weight_loader(qkv.bias, b, shard)
        q, k, v = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=-1)
        q_parts.append(q)
        kv_head = rank // (tp // kv_heads) if tp >= kv_heads else rank
        lo = kv_head * qkv.kv_size
        torch.testing.assert_close(k, (x @ wk.T + bk)[:, lo : lo + qkv.kv_size])
        torch.testing.assert_close(v, (x @ wv.T + bv)[:, lo : lo + qkv.kv_size])

        gate_up = MergedColumnParallelLinear(hidden, [32, 32])
        gate_up.weight.weight_loader(gate_up.weight, wg, 0)
        gate_up.weight.weight_loader(gate_up.weight, wu, 1)
        down = RowParallelLinear(32, hidden, reduce_results=False)
        down.weight.weight_loader(down.weight, wd)
        g, u = gate_up(x).chunk(2, dim=-1)
        n = 32 // tp
        torch.testing.assert_close(g, (x @ wg.T)[:, rank * n : (rank + 1) * n])
        torch.testing.assert_close(u, (x @ wu.T)[:, rank * n : (rank + 1) * n])
        mlp_sum += down(torch.nn.functional.silu(g) * u)
    torch.testing.assert_close(torch.cat(q_parts, dim=-1), x @ wq.T + bq)
    ref = (torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)) @ wd.T
    torch.testing.assert_close(mlp_sum, ref, atol=1e-4, rtol=1e-4)


def test_vocab_embedding_sharding_pads_last_rank(restore_tp):
    full = torch.randn(10, 4)
    initialize_model_parallel(3, 2)
    emb = VocabParallelEmbedding(10, 4)
    emb.weight.weight_loader(emb.weight, full)
    assert emb.weight.shape == (4, 4)
    torch.testing.assert_close(emb.weight[:2], full[8:])
    assert not emb.weight[2:].any()


def _tp_worker(rank: int, world: int, port: int, path: str, prompts, refs) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        initialize_model_parallel(world, rank)
        config = ModelConfig(path, dtype="float32", device="cpu")
        logits = ModelHarness(get_model(config, "auto", "cpu"), config).run_prefill(prompts, chunk_size=4)
        for ours, ref in zip(logits, refs):
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_tp2_gloo_matches_hf(tiny_qwen2_dir):
    prompts = [[5, 17, 42, 7, 99], list(range(20, 31))]
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0] for p in prompts]
    mp.spawn(_tp_worker, args=(2, find_free_port(), tiny_qwen2_dir, prompts, refs), nprocs=2)
