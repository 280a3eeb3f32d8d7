"""Hand-built batches for CUDA graph runner tests (CPU tensors)."""

from __future__ import annotations

import torch

from sglang.srt.batch.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.cuda_graph_runner import CapturedMode

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
