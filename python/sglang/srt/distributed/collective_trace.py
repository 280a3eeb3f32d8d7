"""--debug-collectives: what the model's collectives of this rank moved in one scheduler
iteration, compared across ranks after it.

Invariants:
- a record is (group, op, shape, dtype) of one collective issued from Python, or one CUDA
  graph replay (group "graph", its key): a replay's collectives never pass through Python;
- the ranks of a group issue the same records in the same order: "tp" and "graph" records
  agree on every rank of the replica, "attn_tp" records inside each DP rank's group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

GRAPH = "graph"
ATTN_TP = "attn_tp"


@dataclass(frozen=True)
class CollectiveRecord:
    group: str  # "tp", "attn_tp" or "graph"
    op: str  # all_reduce, all_gather(dim), or the replayed graph key
    shape: tuple[int, ...] = ()
    dtype: str = ""

    def __str__(self) -> str:
        if self.group == GRAPH:
            return f"graph {self.op}"
        return f"{self.group}.{self.op}{list(self.shape)} {self.dtype}"


class CollectiveRecorder:
    """Collects this rank's records until `take`."""

    def __init__(self) -> None:
        self.records: list[CollectiveRecord] = []

    def record(self, group: str, op: str, x: torch.Tensor) -> None:
        self.records.append(CollectiveRecord(group, op, tuple(x.shape), str(x.dtype).removeprefix("torch.")))

    def record_graph(self, key: object) -> None:
        self.records.append(CollectiveRecord(GRAPH, str(key)))

    def take(self) -> list[CollectiveRecord]:
        records, self.records = self.records, []
        return records


def first_difference(traces: Sequence[Sequence[CollectiveRecord]], attn_tp_size: int) -> Optional[str]:
    """The first disagreement between the ranks' traces of one iteration (rank r's trace at
    index r), with both ranks' traces in full; None when every group agrees."""
    for rank, trace in enumerate(traces):
        # Replica-wide records against rank 0, attention-TP records against the DP rank's first rank.
        for peer, attn in ((0, False), (rank - rank % attn_tp_size, True)):
            mine, theirs = _in_groups(trace, attn), _in_groups(traces[peer], attn)
            if mine == theirs:
                continue
            i = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            return (
                f"rank {peer} and rank {rank} differ at collective #{i} of their shared groups: "
                f"rank {peer}: {_at(theirs, i)}, rank {rank}: {_at(mine, i)}\n"
                f"  rank {peer} trace: {[str(r) for r in traces[peer]]}\n"
                f"  rank {rank} trace: {[str(r) for r in trace]}"
            )
    return None


def _in_groups(trace: Sequence[CollectiveRecord], attn_tp: bool) -> list[CollectiveRecord]:
    return [r for r in trace if (r.group == ATTN_TP) == attn_tp]


def _at(records: Sequence[CollectiveRecord], i: int) -> str:
    return str(records[i]) if i < len(records) else "(nothing)"
