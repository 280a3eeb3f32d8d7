"""Scheduler-side communication between ranks (CPU, gloo): request broadcast inside a
model's TP group and the one per-iteration plan all-gather under DP attention.

Invariants:
- every rank of a group calls the same collectives in the same order each iteration;
- under DP attention exactly one all-gather of a fixed-size int vector per iteration
  carries everything the ranks must agree on (no GPU->CPU sync, no extra agreement step).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from sglang.srt.distributed.collective_trace import CollectiveRecord, first_difference

logger = logging.getLogger(__name__)


def init_distributed(
    device: str, world_size: int, rank: int, init_method: str, timeout_s: float, ranks_share_gpu: bool = False
) -> None:
    """One process group per model replica: NCCL on CUDA, gloo on CPU and for ranks that share
    a GPU (NCCL refuses those; their GPU collectives go through the IPC buffers)."""
    backend = "nccl" if device == "cuda" and not ranks_share_gpu else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, world_size=world_size, rank=rank, timeout=timedelta(seconds=timeout_s)
    )


@dataclass(frozen=True)
class LocalPlan:
    """What one rank contributes to the iteration plan (packed as ints)."""

    num_tokens: int = 0  # rows this rank feeds the model in the main forward
    num_reqs: int = 0
    is_extend: int = 0  # 1 when this rank runs a prefill batch
    # With a prefill under speculation (--enable-mixed-chunk): the running requests whose decode
    # cycle is queued in the same iteration.
    alongside_decode_reqs: int = 0
    has_work: int = 0  # 1 when this rank holds requests (queued, running or in flight)
    prefill_wait: int = 0  # iterations this rank has held prefills (managers/dp_prefill_align.py)
    prompt_logprobs: int = 0  # 1 when this rank's prefill computes prompt logprobs (no prefill graph holds them)
    # --speculative-adaptive: the previous iteration's wall time when it ran a decode cycle alone (us).
    spec_cycle_us: int = 0
    # --speculative-adaptive: per draft position, accepted and rejected over this rank's recent
    # verify cycles (speculative/adaptive.py); the same length on every rank. Packed last.
    spec_trials: tuple[int, ...] = ()

    @property
    def decode_reqs(self) -> int:
        """Requests whose decode step (or speculative cycle) this rank runs this iteration."""
        return self.alongside_decode_reqs if self.is_extend else self.num_reqs

    @classmethod
    def scalar_names(cls) -> list[str]:
        """The one-int fields, packed first in declaration order."""
        return [f.name for f in dataclasses.fields(cls) if f.name != "spec_trials"]

    def pack(self) -> list[int]:
        return [getattr(self, name) for name in self.scalar_names()] + list(self.spec_trials)

    @classmethod
    def unpack(cls, ints: list[int]) -> LocalPlan:
        names = cls.scalar_names()
        return cls(**dict(zip(names, ints)), spec_trials=tuple(ints[len(names) :]))


@dataclass(frozen=True)
class GlobalPlan:
    """The same on every rank: derived from the one all-gather."""

    per_rank: tuple[LocalPlan, ...]  # one entry per DP rank (its attention-TP rank 0)

    @property
    def global_num_tokens(self) -> list[int]:
        return [p.num_tokens for p in self.per_rank]

    @property
    def any_extend(self) -> bool:
        return any(p.is_extend for p in self.per_rank)

    @property
    def prefill_graph_reqs(self) -> Optional[list[int]]:
        """ForwardBatch.global_num_reqs of an EXTEND iteration: every DP rank's requests, or
        None when some rank computes prompt logprobs (every rank's prefill runs eagerly)."""
        if any(p.prompt_logprobs for p in self.per_rank):
            return None
        return [p.num_reqs for p in self.per_rank]

    @property
    def all_idle(self) -> bool:
        """No rank runs a batch this iteration."""
        return all(p.num_reqs == 0 for p in self.per_rank)

    @property
    def any_work(self) -> bool:
        """Some rank holds requests, possibly none scheduled this iteration (e.g. waiting
        for a step in flight that may end them)."""
        return any(p.has_work for p in self.per_rank)


class SchedulerComm:
    """Collectives a scheduler rank takes part in; all no-ops on a single rank."""

    def __init__(self, tp_size: int, tp_rank: int, attn_tp_size: int, dp_attention: bool):
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.attn_tp_size = attn_tp_size
        self.attn_tp_rank = tp_rank % attn_tp_size
        self.dp_attention = dp_attention
        self.world_cpu_group = None
        self.attn_tp_cpu_group = None
        self.num_plan_gathers = 0  # counted for tests
        if tp_size > 1:
            self.world_cpu_group = dist.new_group(list(range(tp_size)), backend="gloo")
            for start in range(0, tp_size, attn_tp_size):
                group = dist.new_group(list(range(start, start + attn_tp_size)), backend="gloo")
                if start <= tp_rank < start + attn_tp_size:
                    self.attn_tp_cpu_group = group

    @property
    def is_entry_rank(self) -> bool:
        """The rank that receives requests and sends outputs for its DP rank."""
        return self.attn_tp_rank == 0

    def broadcast_requests(self, msgs: list[Any]) -> list[Any]:
        """Entry rank's received messages, copied to every attention-TP peer."""
        if self.attn_tp_size == 1:
            return msgs
        box: list[Optional[list[Any]]] = [msgs if self.is_entry_rank else None]
        src = self.tp_rank - self.attn_tp_rank
        dist.broadcast_object_list(box, src=src, group=self.attn_tp_cpu_group)
        received = box[0]
        assert received is not None  # the entry rank broadcast its list
        return received

    def gather_plan(self, local: LocalPlan) -> GlobalPlan:
        """The per-iteration all-gather (DP attention only)."""
        self.num_plan_gathers += 1
        vec = torch.tensor(local.pack(), dtype=torch.int64)
        parts = [torch.empty_like(vec) for _ in range(self.tp_size)]
        dist.all_gather(parts, vec, group=self.world_cpu_group)
        plans = [LocalPlan.unpack(p.tolist()) for p in parts]
        return GlobalPlan(tuple(plans[:: self.attn_tp_size]))

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's obj, in rank order (picklable objects; a check's cost, not a step's)."""
        if self.tp_size == 1:
            return [obj]
        everyone: list[Any] = [None] * self.tp_size
        dist.all_gather_object(everyone, obj, group=self.world_cpu_group)
        return everyone

    def check_agreement(self, descriptor: dict[str, Any], same_within_dp_group: dict[str, Any]) -> None:
        """--debug-collectives: every rank must derive the same descriptor (global sizes, the
        speculative sub-forwards), and ranks of one DP group the same local batch; else raise with a per-rank diff."""
        if self.tp_size == 1:
            return
        everyone = self.gather_objects((descriptor, same_within_dp_group))
        bad = any(d != everyone[0][0] for d, _ in everyone) or any(
            local != everyone[r - r % self.attn_tp_size][1] for r, (_, local) in enumerate(everyone)
        )
        if bad:
            diff = "\n".join(f"  rank {r}: {d} local={local}" for r, (d, local) in enumerate(everyone))
            raise CollectiveMismatch(f"--debug-collectives: ranks disagree on the step plan:\n{diff}")

    def check_collective_traces(self, trace: list[CollectiveRecord]) -> None:
        """--debug-collectives: what this rank's collectives moved in the iteration agrees with
        its groups' other ranks; else raise with the first difference and both ranks' traces."""
        if self.tp_size == 1:
            return
        difference = first_difference(self.gather_objects(trace), self.attn_tp_size)
        if difference is not None:
            raise CollectiveMismatch(f"--debug-collectives: the ranks' collectives differ: {difference}")


class CollectiveMismatch(RuntimeError):
    pass
