"""--speculative-accept-check: the startup self-check of speculative decoding."""

from __future__ import annotations

import logging
from typing import Optional

import pytest
import torch
import torch.multiprocessing as mp

from sglang.srt.managers import accept_check
from sglang.srt.managers.accept_check import AcceptCheckFailed, PassResult, judge
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.test.inprocess_scheduler import greedy, start_scheduler

CHAIN = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}


def _args(target: str) -> ServerArgs:
    return ServerArgs(
        model_path=target, device="cpu", dtype="float32", speculative_algorithm="NEXTN", speculative_accept_check=True, **CHAIN
    )


def test_perfect_draft_logs_every_draft_accepted_and_serves_after(perfect_deepseek_v3_dir, caplog):
    caplog.set_level(logging.INFO, logger=accept_check.__name__)
    scheduler = start_scheduler(_args(perfect_deepseek_v3_dir))
    lines = [r.getMessage() for r in caplog.records if r.name == accept_check.__name__]
    assert lines == ["Speculative accept check: DP0 eager: accept length 4.00, outputs match the non-speculative path"]
    # Serving starts from an empty pool and zero statistics, then works as without the check.
    assert scheduler.free_kv_tokens() == scheduler.allocator.size
    assert scheduler.avg_spec_accept_length() == 0.0
    assert len(greedy(scheduler, [[5, 6, 7]], [9])[0]) == 9
    assert scheduler.avg_spec_accept_length() == CHAIN["speculative_num_steps"] + 1


def test_outputs_that_differ_fail_startup_loudly(perfect_deepseek_v3_dir, monkeypatch):
    """The speculative pass's outputs are forced to differ from the plain pass's in one token."""
    run_pass, calls = accept_check._run_pass, []

    def spec_pass_off_by_one(scheduler, prompts):
        outputs = run_pass(scheduler, prompts)
        calls.append(outputs)
        if len(calls) > 1:  # the first pass is the plain reference
            outputs[1][-1] += 1
        return outputs

    monkeypatch.setattr(accept_check, "_run_pass", spec_pass_off_by_one)
    with pytest.raises(
        AcceptCheckFailed, match="--speculative-accept-check failed: DP0 eager: accept length 4.00, outputs DIFFER FROM"
    ):
        start_scheduler(_args(perfect_deepseek_v3_dir))


def test_judge_names_a_mismatch_and_a_rank_that_trails():
    ok = [PassResult(0, "graphs", 3.7, True), PassResult(1, "graphs", 3.5, True), PassResult(0, "eager", 3.7, True)]
    assert judge(ok) is None
    # DP1 with graphs falls from 3.69 to 2.12 (the upstream report); DP0 eager differs.
    bad = [PassResult(0, "graphs", 3.69, True), PassResult(1, "graphs", 2.12, True), PassResult(0, "eager", 3.69, False)]
    problem = judge(bad)
    assert "DP0 eager: accept length 3.69, outputs DIFFER FROM the non-speculative path" in problem
    assert "DP1 graphs: accept length 2.12 is more than 0.5 below the best rank's 3.69" in problem
    assert "DP0 graphs" not in problem


def test_the_flag_needs_speculation():
    with pytest.raises(ValueError, match="--speculative-accept-check needs --speculative-algorithm"):
        ServerArgs(model_path="m", device="cpu", speculative_accept_check=True)


def _dp_rank_main(rank: int, server_args: ServerArgs, port_args: PortArgs, rank_1_accept: Optional[float], results) -> None:
    torch.set_num_threads(1)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger(accept_check.__name__).addHandler(handler)
    logging.getLogger(accept_check.__name__).setLevel(logging.INFO)
    if rank == 1 and rank_1_accept is not None:  # this rank's accept length is forced
        Scheduler.avg_spec_accept_length = lambda self: rank_1_accept
    try:
        start_scheduler(server_args, rank, port_args)
        results[rank] = ("started", lines)
    except AcceptCheckFailed as e:
        results[rank] = ("failed", str(e))


def _run_dp_ranks(target: str, rank_1_accept: Optional[float] = None) -> dict:
    server_args = ServerArgs(
        model_path=target, device="cpu", dtype="float32", tp_size=2, dp_size=2, enable_dp_attention=True,
        chunked_prefill_size=8, max_running_requests=4, debug_collectives=True,
        speculative_algorithm="NEXTN", speculative_accept_check=True, **CHAIN,
    )  # fmt: skip
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_dp_rank_main, args=(server_args, PortArgs.init_new(server_args), rank_1_accept, results), nprocs=2)
    return dict(results)


@pytest.mark.timeout(300)
def test_every_dp_rank_is_checked_under_dp_attention(perfect_deepseek_v3_dir):
    results = _run_dp_ranks(perfect_deepseek_v3_dir)
    assert results[0] == (
        "started",
        [
            "Speculative accept check: DP0 eager: accept length 4.00, outputs match the non-speculative path",
            "Speculative accept check: DP1 eager: accept length 4.00, outputs match the non-speculative path",
        ],
    )
    assert results[1] == ("started", [])  # rank 0 logs for every DP rank


@pytest.mark.timeout(300)
def test_a_dp_rank_that_trails_fails_startup_on_every_rank(perfect_deepseek_v3_dir):
    results = _run_dp_ranks(perfect_deepseek_v3_dir, rank_1_accept=2.5)
    message = "--speculative-accept-check failed: DP1 eager: accept length 2.50 is more than 0.5 below the best rank's 4.00"
    assert results == {0: ("failed", message), 1: ("failed", message)}


def test_adaptive_tiers_pass_the_check_and_start_afresh(perfect_deepseek_v3_dir, caplog):
    """--speculative-adaptive with tiers forced to change: the check's passes (the plain one
    included, which has no verify cycles) leave serving at the starting tier with no usage."""
    caplog.set_level(logging.INFO, logger=accept_check.__name__)
    args = ServerArgs(
        model_path=perfect_deepseek_v3_dir,
        device="cpu",
        dtype="float32",
        speculative_algorithm="NEXTN",
        speculative_accept_check=True,
        speculative_adaptive=True,
        speculative_adaptive_schedule="5:1,1:2",
    )
    scheduler = start_scheduler(args)
    lines = [r.getMessage() for r in caplog.records if r.name == accept_check.__name__]
    assert len(lines) == 1 and lines[0].endswith("outputs match the non-speculative path"), lines
    state = scheduler.internal_state()
    assert state["spec_tier"] == 5 and state["spec_tier_cycles"] == {} and scheduler.adaptive.state.cycles == 0
