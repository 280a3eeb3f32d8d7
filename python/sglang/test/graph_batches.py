"""Hand-built batches and model runners for CUDA graph runner tests (CPU tensors)."""

from __future__ import annotations

import torch

from sglang.srt.batch.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.cuda_graph_runner import CapturedMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs

PLAIN = CapturedMode(1)  # plain decode: one token per request


def decode_fb(rows: list[int], seq_lens: list[int], tokens: list[int], slots: list[int]) -> ForwardBatch:
    """A decode batch: one token per request, at position seq_len - 1, into KV slot slots[i]."""
    t = lambda x: torch.tensor(x, dtype=torch.int64)
    return ForwardBatch(
        mode=ForwardMode.DECODE,
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


def lengths_agree(fb: ForwardBatch) -> bool:
    """The device lengths a graph reads are the host lengths the batch was shaped with."""
    return (
        fb.seq_lens.tolist() == list(fb.seq_lens_cpu)
        and fb.extend_seq_lens.tolist() == list(fb.extend_seq_lens_cpu)
        and sum(fb.extend_seq_lens_cpu) == fb.num_tokens
    )


def make_runner(path: str, device: str, dtype: str, **args) -> ModelRunner:
    """A model runner of a 2048-token KV pool and 16 request rows."""
    server_args = ServerArgs(model_path=path, device=device, dtype=dtype, max_total_tokens=2048, max_running_requests=16, **args)
    return ModelRunner(ModelConfig(path, dtype=dtype, device=device), server_args, gpu_id=0)


def _kv_buffers(runner: ModelRunner) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for i in range(runner.num_kv_layers):
        kv = runner.kv_pool.get_kv_buffer(i)
        out += list(kv) if isinstance(kv, tuple) else [kv]
    return out


def kv_snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    """Copies of every KV buffer of the runner's pool."""
    return [t.clone() for t in _kv_buffers(runner)]


def kv_restore(runner: ModelRunner, snapshot: list[torch.Tensor]) -> None:
    """Put back the KV buffers of a kv_snapshot."""
    for buf, saved in zip(_kv_buffers(runner), snapshot):
        buf.copy_(saved)
