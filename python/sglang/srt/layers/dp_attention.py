"""DP attention: gather every DP rank's rows before the MLP/MoE, hand each its rows back after.

`global_num_tokens[d]` is the number of rows DP rank d contributes to this forward (the same
list on every rank; 0 for an idle rank). The gathered rows live in one buffer per rank,
allocated once by the model runner and sliced per forward.

Invariants: every function accepts 0 local rows; rows copied into the buffer never exceed
the local tensor; nothing returned by dp_scatter aliases the buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.batch.forward_batch_info import ForwardBatch
from sglang.srt.distributed.parallel_state import ParallelGroup, get_attn_dp_rank, get_attn_tp_rank, get_tp


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


@dataclass(frozen=True)
class DpRanks:
    """This rank's place under DP attention, as a layer reads it when it is built (like the
    groups it shards over): its DP rank, its rank inside the DP rank's attention-TP group
    (rank 0 writes the DP rank's rows into a gather), and the TP group the gather reduces over."""

    dp_rank: int
    attn_tp_rank: int
    tp_group: ParallelGroup

    @classmethod
    def current(cls) -> DpRanks:
        """This process's ranks, from the model-parallel state (initialize_model_parallel)."""
        return cls(get_attn_dp_rank(), get_attn_tp_rank(), get_tp())


def _local_range(global_num_tokens: list[int], dp_rank: int) -> tuple[int, int]:
    start = sum(global_num_tokens[:dp_rank])
    return start, start + global_num_tokens[dp_rank]


def dp_gather(local: torch.Tensor, global_num_tokens: list[int], buffer: torch.Tensor, ranks: DpRanks) -> torch.Tensor:
    """buffer[:sum(global_num_tokens)] filled with every DP rank's rows in DP-rank order.

    One all-reduce over the TP group: each DP rank's rows are written by its attention-TP
    rank 0 only (the other attention-TP ranks hold the same rows). Every rank must call it.
    """
    start, end = _local_range(global_num_tokens, ranks.dp_rank)
    total = sum(global_num_tokens)
    if total > buffer.shape[0]:  # the same sizes on every rank: all of them raise here
        raise ValueError(f"{total} gathered rows exceed the gathered buffer's {buffer.shape[0]}")
    out = buffer[:total]
    out.zero_()
    rows_ok = local.shape[0] == end - start
    if rows_ok and ranks.attn_tp_rank == 0:
        out[start:end].copy_(local)
    ranks.tp_group.all_reduce(out)  # joined even by a rank about to fail: no peer waits for it
    if not rows_ok:
        raise ValueError(f"local rows {local.shape[0]} != global_num_tokens[dp_rank] {end - start}")
    return out


def dp_scatter(global_out: torch.Tensor, global_num_tokens: list[int], dp_rank: int) -> torch.Tensor:
    """This DP rank's rows of global_out, as a fresh tensor."""
    start, end = _local_range(global_num_tokens, dp_rank)
    return global_out[start:end].clone()


def mlp_over_dp(
    mlp: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, forward_batch: ForwardBatch, ranks: DpRanks
) -> torch.Tensor:
    """Apply a TP-sharded MLP/MoE to x; under DP attention over all DP ranks' rows at once."""
    if forward_batch.global_num_tokens is None:
        return mlp(x)
    gathered = dp_gather(x, forward_batch.global_num_tokens, forward_batch.gathered_buffer, ranks)
    return dp_scatter(mlp(gathered), forward_batch.global_num_tokens, ranks.dp_rank)
