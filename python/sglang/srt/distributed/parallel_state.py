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

GPU collectives of ranks on one node go through the IPC buffers (ipc_collectives.py) once
init_ipc_collectives has run, when the message fits the buffer; NCCL takes the rest. With
ranks sharing one GPU (`ipc_only`) NCCL does not exist: torch.distributed runs gloo for the
host's metadata and every GPU collective must fit the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from sglang.srt.distributed.collective_trace import ATTN_TP, CollectiveRecorder
from sglang.srt.distributed.ipc_collectives import IpcCommunicator, MessageTooLarge

# --debug-collectives only (set_collective_recorder); None costs each collective one test.
_recorder: Optional[CollectiveRecorder] = None


def use_ipc(nbytes: int, slot_bytes: Optional[int], ipc_only: bool) -> bool:
    """Whether a GPU collective of nbytes goes through the IPC buffers (slot_bytes None: none
    opened) rather than NCCL; the same answer on every rank, whose message sizes agree."""
    if ipc_only:
        if slot_bytes is None:
            raise RuntimeError("ranks share a GPU but the IPC collectives are not initialized")
        if nbytes > slot_bytes:  # raised on every rank alike: no rank waits for another
            raise MessageTooLarge(
                f"a collective of {nbytes} bytes exceeds the IPC buffer's {slot_bytes} bytes per slot, and ranks "
                f"sharing a GPU have no NCCL (raise --custom-collective-buffer-mb)"
            )
        return True
    return slot_bytes is not None and nbytes <= slot_bytes


@dataclass(eq=False)
class ParallelGroup:
    """A group of ranks a layer shards over; size 1 makes every collective the identity.
    Layers keep the object they were built with: init_ipc_collectives sets `ipc` on it."""

    size: int = 1
    rank: int = 0
    group: Optional[dist.ProcessGroup] = None
    cpu_group: Optional[dist.ProcessGroup] = None  # gloo, the same ranks
    ipc: Optional[IpcCommunicator] = None
    ipc_only: bool = False  # GPU collectives must go through `ipc` (ranks share a GPU: no NCCL)
    name: str = "tp"  # how --debug-collectives records name the group

    def _ipc_for(self, x: torch.Tensor) -> Optional[IpcCommunicator]:
        """The IPC communicator that carries a collective of x, or None: NCCL or gloo does."""
        on_ipc_device = self.ipc is not None and x.device == self.ipc.device
        if not (on_ipc_device or (self.ipc_only and x.is_cuda)):
            return None
        slot_bytes = self.ipc.slot_bytes if self.ipc else None
        return self.ipc if use_ipc(x.numel() * x.element_size(), slot_bytes, self.ipc_only) else None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place."""
        if self.size == 1:
            return x
        if _recorder is not None:
            _recorder.record(self.name, "all_reduce", x)
        if (ipc := self._ipc_for(x)) is not None:
            return ipc.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate each rank's x along dim, in rank order."""
        if self.size == 1:
            return x
        if _recorder is not None:
            _recorder.record(self.name, f"all_gather({dim})", x)
        if (ipc := self._ipc_for(x)) is not None:
            return ipc.all_gather(x, dim)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


@dataclass(frozen=True)
class _State:
    tp: ParallelGroup = field(default_factory=ParallelGroup)
    attn_tp: ParallelGroup = field(default_factory=ParallelGroup)
    dp_size: int = 1  # attention DP ranks (1 unless DP attention is on)
    cpu_group: Optional[dist.ProcessGroup] = None


_state = _State()


def initialize_model_parallel(
    tp_size: int, tp_rank: int, dp_size: int = 1, enable_dp_attention: bool = False, ipc_only: bool = False
) -> None:
    """Create this replica's groups; call on every rank (after init_process_group when tp_size > 1).

    dp_size only matters with enable_dp_attention (independent replicas are the launcher's).
    ipc_only: the ranks share a GPU, so GPU collectives fail until init_ipc_collectives.
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
        _state = _State(tp, ParallelGroup(attn_tp_size, tp_rank % attn_tp_size, name=ATTN_TP), dp)
        return
    if dist.get_world_size() != tp_size:
        raise ValueError(f"world size {dist.get_world_size()} != tp_size {tp_size}")
    # Every rank creates every group in the same order (new_group is collective).
    gloo_world = dist.get_backend() == "gloo"
    tp_group = dist.new_group(list(range(tp_size))) if tp_size > 1 else None
    cpu_group = dist.group.WORLD if gloo_world else dist.new_group(backend="gloo")
    attn_group = tp_group if attn_tp_size == tp_size else None  # None: one rank, no collectives
    attn_cpu_group = cpu_group if attn_tp_size == tp_size else None
    if 1 < attn_tp_size < tp_size:
        for d in range(dp):
            ranks = list(range(d * attn_tp_size, (d + 1) * attn_tp_size))
            g = dist.new_group(ranks)
            g_cpu = g if gloo_world else dist.new_group(ranks, backend="gloo")
            if d == tp_rank // attn_tp_size:
                attn_group, attn_cpu_group = g, g_cpu
    _state = _State(
        ParallelGroup(tp_size, tp_rank, tp_group, cpu_group, ipc_only=ipc_only),
        ParallelGroup(attn_tp_size, tp_rank % attn_tp_size, attn_group, attn_cpu_group, ipc_only=ipc_only, name=ATTN_TP),
        dp,
        cpu_group,
    )


def init_ipc_collectives(tp_slot_bytes: int, attn_tp_slot_bytes: int, device: torch.device) -> None:
    """Open the IPC buffers of the TP group and of this rank's attention-TP group (collective
    over the replica's ranks, which must all be on this node); slot sizes must agree across
    ranks. The attention-TP group shares the TP group's buffers when they are the same group."""
    tp, attn = _state.tp, _state.attn_tp
    if tp.size > 1:
        tp.ipc = IpcCommunicator(tp.rank, tp.size, tp_slot_bytes, device, tp.cpu_group)
    if attn.size == tp.size:
        attn.ipc = tp.ipc
    elif attn.size > 1:
        attn.ipc = IpcCommunicator(attn.rank, attn.size, attn_tp_slot_bytes, device, attn.cpu_group)


def set_collective_recorder(recorder: Optional[CollectiveRecorder]) -> None:
    """--debug-collectives: record every collective of this process's groups (None: stop)."""
    global _recorder
    _recorder = recorder


def record_graph_replay(key: object) -> None:
    """A CUDA graph replay runs its collectives without Python: its key stands for them."""
    if _recorder is not None:
        _recorder.record_graph(key)


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
    return _reduce_over_ranks(value, dist.ReduceOp.MIN)


def max_over_ranks(value: int) -> int:
    """The largest `value` of all ranks of the replica (a startup agreement, on the CPU group)."""
    return _reduce_over_ranks(value, dist.ReduceOp.MAX)


def _reduce_over_ranks(value: int, op: dist.ReduceOp.RedOpType) -> int:
    group = get_cpu_group()
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=op, group=group)
    return int(t.item())


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _state.tp.all_reduce(x)
