"""Scheduler-side collectives: the per-iteration plan all-gather and --debug-collectives."""

from __future__ import annotations

import pytest

from sglang.srt.distributed.scheduler_comm import CollectiveMismatch, LocalPlan, SchedulerComm
from sglang.test.dist_utils import spawn_gloo


def _plan_gather(rank: int, world: int) -> None:
    comm = SchedulerComm(tp_size=4, tp_rank=rank, attn_tp_size=2, dp_attention=True)
    dp_rank = rank // 2
    # Each DP rank's attention-TP ranks see the same batch; DP rank 1 is idle.
    local = LocalPlan(num_tokens=5, num_reqs=2, is_extend=1, has_work=1) if dp_rank == 0 else LocalPlan()
    plan = comm.gather_plan(local)
    assert plan.global_num_tokens == [5, 0]
    assert plan.any_extend and not plan.all_idle and plan.any_work
    # A rank waiting for its step in flight schedules nothing, but the ranks are not idle.
    waiting = comm.gather_plan(LocalPlan(has_work=1) if dp_rank == 1 else LocalPlan())
    assert waiting.all_idle and waiting.any_work
    assert comm.num_plan_gathers == 2
    msgs = comm.broadcast_requests(["req-a", "req-b"] if comm.is_entry_rank else [])
    assert msgs == ["req-a", "req-b"]


def test_plan_all_gather_and_request_broadcast():
    spawn_gloo(_plan_gather, 4)


def _mismatch(rank: int, world: int) -> None:
    comm = SchedulerComm(tp_size=2, tp_rank=rank, attn_tp_size=1, dp_attention=True)
    comm.check_agreement({"global_num_tokens": [3, 1]}, {"mode": 2})  # agreement passes
    with pytest.raises(CollectiveMismatch) as err:
        comm.check_agreement({"global_num_tokens": [3, 1 + rank]}, {"mode": 2})
    message = str(err.value)
    assert "rank 0" in message and "rank 1" in message and "[3, 2]" in message


def test_debug_collectives_reports_a_per_rank_diff():
    spawn_gloo(_mismatch, 2)
