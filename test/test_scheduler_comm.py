"""Scheduler-side collectives: the per-iteration plan all-gather and --debug-collectives."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.distributed.collective_trace import CollectiveRecorder
from sglang.srt.distributed.parallel_state import (
    get_attn_tp,
    get_tp,
    initialize_model_parallel,
    record_graph_replay,
    set_collective_recorder,
)
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


def _traces(rank: int, world: int) -> None:
    recorder = CollectiveRecorder()
    set_collective_recorder(recorder)
    try:
        initialize_model_parallel(4, rank, dp_size=2, enable_dp_attention=True)
        comm = SchedulerComm(tp_size=4, tp_rank=rank, attn_tp_size=2, dp_attention=True)
        # Each DP rank's attention-TP group moves its own rows; the TP group the same for all.
        get_attn_tp().all_reduce(torch.ones(3 + rank // 2, 4))
        get_tp().all_gather(torch.ones(2, 4), dim=0)
        comm.check_collective_traces(recorder.take())
        # Rank 3 reshapes its rows wrongly: the same bytes move (gloo does not notice), the shapes differ.
        get_tp().all_reduce(torch.ones((6, 4) if rank == 3 else (4, 6)))
        if rank == 1:
            record_graph_replay("GraphKey(DECODE, 4, 1)")  # rank 1 alone replays a graph after it
        with pytest.raises(CollectiveMismatch) as err:
            comm.check_collective_traces(recorder.take())
    finally:
        set_collective_recorder(None)
    message = str(err.value)
    # The first difference in rank order: rank 1's replay, which rank 0 lacks (before rank 3's shape).
    assert "rank 0 and rank 1 differ at collective #1" in message
    assert "rank 0: (nothing), rank 1: graph GraphKey(DECODE, 4, 1)" in message
    assert "rank 0 trace: ['tp.all_reduce[4, 6] float32']" in message
    assert "rank 1 trace: ['tp.all_reduce[4, 6] float32', 'graph GraphKey(DECODE, 4, 1)']" in message


def test_debug_collectives_compares_what_each_rank_moved():
    spawn_gloo(_traces, 4)


def _reshaped(rank: int, world: int) -> None:
    recorder = CollectiveRecorder()
    set_collective_recorder(recorder)
    try:
        initialize_model_parallel(2, rank)
        comm = SchedulerComm(tp_size=2, tp_rank=rank, attn_tp_size=2, dp_attention=False)
        get_tp().all_reduce(torch.ones(2, 8))
        get_tp().all_reduce(torch.ones((4, 4) if rank else (2, 8)))
        with pytest.raises(CollectiveMismatch) as err:
            comm.check_collective_traces(recorder.take())
    finally:
        set_collective_recorder(None)
    message = str(err.value)
    assert (
        "differ at collective #1" in message
        and "rank 0: tp.all_reduce[2, 8] float32, rank 1: tp.all_reduce[4, 4] float32" in message
    )
    assert "rank 1 trace: ['tp.all_reduce[2, 8] float32', 'tp.all_reduce[4, 4] float32']" in message


def test_debug_collectives_reports_a_reshaped_collective_with_both_traces():
    spawn_gloo(_reshaped, 2)
