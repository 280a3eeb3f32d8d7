"""Process groups of one model replica: tensor parallel (TP) and, under DP attention,
attention-TP inside each attention data-parallel (DP) rank.

The world is the tp_size ranks of one replica. With DP attention, the TP group (MLP/MoE)
spans all of them and attention runs data-parallel over dp_size groups of
attn_tp_size = tp_size // dp_size consecutive ranks (DP rank d = ranks
[d * attn_tp_size, (d + 1) * attn_tp_size)). Without it, the attention-TP group is the TP
group and there is one DP rank.

Defaults to a single rank with no torch.distributed: every collective is the identity.
If torch.distributed is not initialized, initialize_model_parallel only records sizes and
ranks (enough to build one rank's sharded layers in one process); collectives then fail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroup:
    """A group of ranks a layer shards over; size 1 makes every collective the identity."""

    size: int = 1
    rank: int = 0
    group: Optional[dist.ProcessGroup] = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate each rank's x along dim, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


@dataclass(frozen=True)
class _State:
    tp: ParallelGroup = ParallelGroup()
    attn_tp: ParallelGroup = ParallelGroup()
    dp_size: int = 1  # attention DP ranks (1 unless DP attention is on)
    cpu_group: Optional[dist.ProcessGroup] = None


_state = _State()


def initialize_model_parallel(tp_size: int, tp_rank: int, dp_size: int = 1, enable_dp_attention: bool = False) -> None:
    """Create this replica's groups; call on every rank (after init_process_group when tp_size > 1).

    dp_size only matters with enable_dp_attention (independent replicas are the launcher's).
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    dp = dp_size if enable_dp_attention else 1
    if dp < 1 or tp_size % dp:
        raise ValueError(f"tp_size {tp_size} must be a multiple of dp_size {dp} under DP attention")
    attn_tp_size = tp_size // dp
    global _state
    if not dist.is_initialized():
        tp = ParallelGroup(tp_size, tp_rank)
        _state = _State(tp, ParallelGroup(attn_tp_size, tp_rank % attn_tp_size), dp)
        return
    if dist.get_world_size() != tp_size:
        raise ValueError(f"world size {dist.get_world_size()} != tp_size {tp_size}")
    # Every rank creates every group in the same order (new_group is collective).
    tp_group = dist.new_group(list(range(tp_size))) if tp_size > 1 else None
    attn_group = tp_group if attn_tp_size == tp_size else None  # None: one rank, no collectives
    if 1 < attn_tp_size < tp_size:
        for d in range(dp):
            g = dist.new_group(list(range(d * attn_tp_size, (d + 1) * attn_tp_size)))
            if d == tp_rank // attn_tp_size:
                attn_group = g
    cpu_group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    _state = _State(
        ParallelGroup(tp_size, tp_rank, tp_group),
        ParallelGroup(attn_tp_size, tp_rank % attn_tp_size, attn_group),
        dp,
        cpu_group,
    )


def get_tp() -> ParallelGroup:
    return _state.tp


def get_attn_tp() -> ParallelGroup:
    return _state.attn_tp


def get_tp_size() -> int:
    return _state.tp.size


def get_tp_rank() -> int:
    return _state.tp.rank


def get_tp_group() -> Optional[dist.ProcessGroup]:
    return _state.tp.group


def get_attn_tp_size() -> int:
    return _state.attn_tp.size


def get_attn_tp_rank() -> int:
    return _state.attn_tp.rank


def get_attn_tp_group() -> Optional[dist.ProcessGroup]:
    return _state.attn_tp.group


def get_attn_dp_size() -> int:
    return _state.dp_size


def get_attn_dp_rank() -> int:
    return _state.tp.rank // _state.attn_tp.size


def is_dp_attention_enabled() -> bool:
    return _state.dp_size > 1


def get_cpu_group() -> Optional[dist.ProcessGroup]:
    """Gloo group over all ranks of the replica, for scheduler metadata (None on one rank)."""
    return _state.cpu_group


def min_over_ranks(value: int) -> int:
    """The smallest `value` of all ranks of the replica (a startup agreement, on the CPU group)."""
    group = get_cpu_group()
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _state.tp.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _state.tp.all_gather(x, dim)


def attn_tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _state.attn_tp.all_reduce(x)


def attn_tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _state.attn_tp.all_gather(x, dim)
