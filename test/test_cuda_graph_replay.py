"""CUDA graph runner through a tiny model: padded batches give the unpadded eager logits
(CPU); what a graph captures, run eagerly under Triton, gives eager's logits, alone and under
DP attention; on CUDA, replay equals eager."""

from __future__ import annotations

import os
from typing import Optional

import pytest
import torch

from sglang.srt.batch.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.cuda_graph_runner import (
    PAD_KV_SLOT,
    CudaGraphCaptureError,
    CudaGraphRunner,
    GraphKey,
    ModeKey,
    StaticInputs,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs
from sglang.test.graph_batches import PLAIN, decode_fb, kv_restore, kv_snapshot, make_runner
from sglang.test.triton_harness import INTERPRETED, patch_interpreter_for_numpy2, rerun_under_interpreter

DECODE = ForwardMode.DECODE
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Its captured-work tests run in the same interpreter process as this module's.
SPEC_MODULE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_cuda_graph_spec.py")


# ---------------------------------------------------------------------- padded batches through a model
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
            input_ids=t([tok for p in prompts for tok in p]),
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
        fb = decode_fb(self.rows, [len(s) for s in self.seqs], self.next_tokens, slots.tolist())
        for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "extend_seq_lens"):
            setattr(fb, name, getattr(fb, name).to(self.device))
        return fb


PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8], [11, 4, 6, 1, 9, 2, 10]]


def _key_and_eager_logits(graphs: CudaGraphRunner, runner: ModelRunner, fb: ForwardBatch):
    """The graph key fb would replay, and its eager logits (the KV it wrote undone)."""
    runner.attach(fb)
    key = graphs.key_for(fb)
    before = kv_snapshot(runner)
    eager = runner.forward_eager(fb).next_token_logits
    kv_restore(runner, before)
    return key, eager


def test_padded_decode_batch_matches_unpadded_eager(tiny_llama_dir):
    """The rows StaticInputs adds change neither the real rows' logits nor any real KV slot."""
    runner = make_runner(tiny_llama_dir, "cpu", "float32")
    assert runner.graph_runner is None  # graphs are off on CPU
    driver = HandDriver(runner, PROMPTS)
    fb = driver.decode_batch()
    before = kv_snapshot(runner)
    eager = runner.forward_eager(fb).next_token_logits
    after_eager = kv_snapshot(runner)
    kv_restore(runner, before)
    padded = StaticInputs(8, 1, "cpu").load(fb, GraphKey(DECODE, 8, 1), PLAIN)
    logits = runner.forward_eager(padded).next_token_logits
    assert logits.shape[0] == 8
    torch.testing.assert_close(logits[:3], eager, rtol=1e-5, atol=1e-5)
    written = fb.out_cache_loc
    untouched = torch.ones(before[0].shape[0], dtype=torch.bool)
    untouched[written] = False
    untouched[PAD_KV_SLOT] = False
    for got, old, want in zip(kv_snapshot(runner), before, after_eager):
        assert torch.equal(got[untouched], old[untouched])  # padded rows wrote only the dummy slot
        torch.testing.assert_close(got[written], want[written], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- the captured work, run eagerly
@pytest.mark.skipif(torch.cuda.is_available() or INTERPRETED, reason="CPU only; spawns the interpreter run")
def test_captured_work_under_triton_interpreter():
    """On CPU, run the tests below and those of test_cuda_graph_spec.py in a fresh
    TRITON_INTERPRET=1 process (see sglang.test.triton_harness)."""
    rerun_under_interpreter(__file__, SPEC_MODULE, "-k", "captured_work_matches", timeout=900)


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
        model_path=path,
        device="cpu",
        dtype="float32",
        max_total_tokens=2048,
        max_running_requests=16,
        attention_backend="triton",
        disable_cuda_graph=True,
        tp_size=2,
        dp_size=2,
        enable_dp_attention=True,
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
    fb = decode_fb([], [], [], [])
    fb.mode = ForwardMode.IDLE
    return fb


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess (two gloo ranks)")
def test_captured_work_matches_eager_triton_dp_attention(tiny_llama_dir):
    from sglang.test.dist_utils import spawn_gloo

    spawn_gloo(_dp_captured_work_worker, 2, tiny_llama_dir)


# ---------------------------------------------------------------------- CUDA: replay equals eager
@needs_cuda
@pytest.mark.parametrize("model", ["tiny_llama_dir", pytest.param("tiny_deepseek_v3_dir", id="tiny_dsv3_dir")])
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
