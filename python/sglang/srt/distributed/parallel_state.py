"""Tensor-parallel group state.

Defaults to a single rank (tp_size 1, rank 0) with no torch.distributed: every
collective is then the identity, so models run unchanged in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _TPState:
    size: int = 1
    rank: int = 0
    group: Optional[dist.ProcessGroup] = None  # None with size > 1 means the default group


_tp = _TPState()


def initialize_model_parallel(tp_size: int, tp_rank: int, group: Optional[dist.ProcessGroup] = None) -> None:
    """Set the tensor-parallel group used by the layers (call once per process before building models)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    global _tp
    _tp = _TPState(tp_size, tp_rank, group)


def get_tp_size() -> int:
    return _tp.size


def get_tp_rank() -> int:
    return _tp.rank


def get_tp_group() -> Optional[dist.ProcessGroup]:
    return _tp.group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the TP group (in place when tp_size > 1); identity on one rank."""
    if _tp.size == 1:
        return x
    dist.all_reduce(x, group=_tp.group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's x along dim, in rank order; identity on one rank."""
    if _tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp.size)]
    dist.all_gather(parts, x.contiguous(), group=_tp.group)
    return torch.cat(parts, dim=dim)
