"""DP attention: gather every DP rank's rows before the MLP/MoE, hand each its rows back after.

`global_num_tokens[d]` is the number of rows DP rank d contributes to this forward (the same
list on every rank; 0 for an idle rank). The gathered rows live in one buffer per rank,
allocated once by the model runner and sliced per forward.

Invariants: every function accepts 0 local rows; rows copied into the buffer never exceed
the local tensor; nothing returned by dp_scatter aliases the buffer.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from sglang.srt.distributed.parallel_state import (
    get_attn_dp_rank,
    get_attn_tp_rank,
    tensor_model_parallel_all_reduce,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def gathered_buffer_rows(
    max_running_requests_per_rank: int,
    tokens_per_request: int,
    chunked_prefill_size: Optional[int],
    dp_size: int,
) -> int:
    """Rows of the gathered buffer.

    tokens_per_request = max(num_draft_tokens, topk, steps + 1, 1) over the enabled features
    (1 without speculation); chunked_prefill_size is the largest extend a rank runs (None or
    <= 0: no chunk budget to cover).
    """
    per_rank = max_running_requests_per_rank * max(tokens_per_request, 1)
    if chunked_prefill_size is not None and chunked_prefill_size > 0:
        per_rank = max(per_rank, chunked_prefill_size)
    return per_rank * dp_size


def _local_range(global_num_tokens: list[int]) -> tuple[int, int]:
    dp_rank = get_attn_dp_rank()
    start = sum(global_num_tokens[:dp_rank])
    return start, start + global_num_tokens[dp_rank]


def dp_gather(local: torch.Tensor, global_num_tokens: list[int], buffer: torch.Tensor) -> torch.Tensor:
    """buffer[:sum(global_num_tokens)] filled with every DP rank's rows in DP-rank order.

    One all-reduce over the TP group: each DP rank's rows are written by its attention-TP
    rank 0 only (the other attention-TP ranks hold the same rows). Every rank must call it.
    """
    start, end = _local_range(global_num_tokens)
    total = sum(global_num_tokens)
    if total > buffer.shape[0]:  # the same sizes on every rank: all of them raise here
        raise ValueError(f"{total} gathered rows exceed the gathered buffer's {buffer.shape[0]}")
    out = buffer[:total]
    out.zero_()
    rows_ok = local.shape[0] == end - start
    if rows_ok and get_attn_tp_rank() == 0:
        out[start:end].copy_(local)
    tensor_model_parallel_all_reduce(out)  # joined even by a rank about to fail: no peer waits for it
    if not rows_ok:
        raise ValueError(f"local rows {local.shape[0]} != global_num_tokens[dp_rank] {end - start}")
    return out


def dp_scatter(global_out: torch.Tensor, global_num_tokens: list[int]) -> torch.Tensor:
    """This DP rank's rows of global_out, as a fresh tensor."""
    start, end = _local_range(global_num_tokens)
    return global_out[start:end].clone()


def mlp_over_dp(mlp: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
    """Apply a TP-sharded MLP/MoE to x; under DP attention over all DP ranks' rows at once."""
    if forward_batch.global_num_tokens is None:
        return mlp(x)
    gathered = dp_gather(x, forward_batch.global_num_tokens, forward_batch.gathered_buffer)
    return dp_scatter(mlp(gathered), forward_batch.global_num_tokens)
