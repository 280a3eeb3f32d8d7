"""--load-balance-method: the controller's choice of DP rank from fake load reports, the
entry rank's report of its outstanding work, and the balance figures of scheduler_balance.py."""

from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import pytest
import requests
import zmq

from sglang.srt.distributed.scheduler_comm import GlobalPlan, LocalPlan
from sglang.srt.managers.dp_load import LoadBalancer, LoadReporter, RankLoad
from sglang.srt.managers.dp_prefill_align import PrefillHold, prefill_allowed
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler_balance import IterationBalance
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.test.server_utils import kill_server, popen_launch_server


def test_round_robin_ignores_loads():
    lb = LoadBalancer("round_robin", 3)
    lb.on_report(RankLoad(0, 0, 50, 5000))
    assert [lb.choose(10) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_minimum_tokens_picks_least_outstanding_tokens():
    lb = LoadBalancer("minimum_tokens", 3)
    lb.on_report(RankLoad(0, 0, 1, 900))
    lb.on_report(RankLoad(1, 0, 5, 100))  # more requests, fewer tokens
    lb.on_report(RankLoad(2, 0, 2, 400))
    assert lb.choose(50) == 1


def test_shortest_queue_picks_fewest_requests():
    lb = LoadBalancer("shortest_queue", 3)
    lb.on_report(RankLoad(0, 0, 1, 900))
    lb.on_report(RankLoad(1, 0, 5, 100))
    lb.on_report(RankLoad(2, 0, 2, 400))
    assert lb.choose(50) == 0


def test_burst_between_reports_spreads_by_dispatched_work():
    """Without new reports the controller counts what it sent: one large request weighs as
    much as several small ones."""
    lb = LoadBalancer("minimum_tokens", 2)
    assert lb.choose(1000) == 0
    assert [lb.choose(100) for _ in range(5)] == [1] * 5
    assert lb.load_of(0) == (1, 1000) and lb.load_of(1) == (5, 500)
    # Rank 1 reports it took in 3 of its 5 and has 150 tokens left of them: 2 remain unreported.
    lb.on_report(RankLoad(1, 3, 3, 150))
    assert lb.load_of(1) == (5, 350)
    # A report that covers everything replaces the count; an older one is ignored.
    lb.on_report(RankLoad(1, 5, 0, 0))
    lb.on_report(RankLoad(1, 4, 9, 9999))
    assert lb.load_of(1) == (0, 0)


def test_client_chosen_rank_counts_as_dispatched():
    lb = LoadBalancer("minimum_tokens", 2)
    assert lb.choose(500, dp_rank=0) == 0
    assert lb.choose(10) == 1


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="--load-balance-method"):
        LoadBalancer("least_busy", 2)


def test_default_method_depends_on_dp_attention():
    assert (
        ServerArgs(model_path="m", device="cpu", tp_size=2, dp_size=2, enable_dp_attention=True).load_balance_method
        == "minimum_tokens"
    )
    assert ServerArgs(model_path="m", device="cpu", dp_size=2).load_balance_method == "round_robin"


def _req(prompt_len, kv_len, max_new, generated):
    return SimpleNamespace(
        origin_input_ids=[1] * prompt_len,
        kv_len=kv_len,
        output_ids=[2] * generated,
        sampling_params=SimpleNamespace(max_new_tokens=max_new),
    )


def test_reporter_sends_outstanding_work_only_when_it_changes(tmp_path):
    ctx = zmq.Context()
    name = f"ipc://{tmp_path}/load"
    pull = ctx.socket(zmq.PULL)
    pull.bind(name)
    reporter = LoadReporter(name, dp_rank=1, ctx=ctx)
    msg = TokenizedGenerateReqInput("r", None, [1, 2], SamplingParams(max_new_tokens=4))
    reporter.count_received([msg, object(), msg])
    # Queued (10 prompt tokens, 5 outputs), half prefilled, decoding (3 of 8 outputs left).
    reqs = [_req(10, 0, 5, 0), _req(10, 5, 5, 0), _req(10, 12, 8, 5)]
    reporter.report(reqs)
    reporter.report(reqs)
    assert pull.poll(1000)
    assert pull.recv_pyobj() == RankLoad(1, 2, 3, 15 + 10 + 3)
    assert not pull.poll(100)  # the unchanged load was not sent again
    reporter.report([])
    assert pull.poll(1000) and pull.recv_pyobj() == RankLoad(1, 2, 0, 0)
    ctx.destroy(linger=0)


def test_balance_ratio_and_stalls():
    b = IterationBalance()
    b.observe(4, [4, 4], has_running=True, decoded=True)
    b.observe(0, [0, 8], has_running=True, decoded=False)  # the other rank prefills; this one waits
    b.observe(0, [0, 0], has_running=False, decoded=False)  # all idle: not an iteration
    state = b.internal_state()
    assert state["balance_ratio"] == pytest.approx((4 + 4) / (4 + 8))
    assert state["tokens_per_iteration"] == 2.0
    assert state["stalled_iteration_fraction"] == 0.5
    assert state["running_iterations"] == 2 and state["stalled_iterations"] == 1
    text = b.log_text()
    assert "tok/iter: 2.0, balance: 0.67, stalled: 0.50" in text
    # The log line covers the iterations since the previous one; the totals stay.
    b.observe(3, None, has_running=True, decoded=True)  # without DP attention: no ratio
    assert b.log_text() == "tok/iter: 3.0, stalled: 0.00, "
    assert b.internal_state()["tokens_per_iteration"] == pytest.approx(7 / 3)


def _new_seqs_per_rank(log: str) -> dict[int, int]:
    """Requests each DP rank prefilled, from its `[... DPd TPt] Prefill batch. #new-seq: n` lines."""
    counts = {0: 0, 1: 0}
    for rank, n in re.findall(r"DP(\d) TP\d\] Prefill batch\. #new-seq: (\d+)", log):
        counts[int(rank)] += int(n)
    return counts


@pytest.mark.parametrize("method, expected", [("minimum_tokens", {0: 1, 1: 3}), ("round_robin", {0: 2, 1: 2})])
def test_tp2_dp2_requests_follow_the_load(tiny_llama_dir, method, expected):
    """A long request keeps DP rank 0 busy; the short ones that follow go to rank 1 by load
    (round-robin alternates regardless). The balance figures reach /get_server_info."""
    args = ["--device", "cpu", "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]
    server = popen_launch_server(tiny_llama_dir, args + ["--load-balance-method", method, "--skip-server-warmup"])
    try:
        url = server.base_url
        generate = lambda prompt, max_new: _generate(url, prompt, max_new)
        long = _start_long_request(url, 400)
        shorts = [threading.Thread(target=generate, args=([10 + i, 11, 12], 4)) for i in range(3)]
        for t in shorts:
            t.start()
        for t in shorts + [long]:
            t.join(300)
        log = server.log_tail(200000)
        assert _new_seqs_per_rank(log) == expected
        line = r"DP0 TP0\] Decode batch\..*tok/iter: \d+\.\d, balance: \d\.\d\d, stalled: \d\.\d\d, "
        assert re.search(line + r"host us/iter: launch \d+, wait \d+, process \d+, schedule \d+, gen throughput", log)
        states = _internal_states(url)
        for s in states:
            assert 0 < s["balance_ratio"] <= 1
            assert s["tokens_per_iteration"] > 0
            assert 0 <= s["stalled_iteration_fraction"] <= 1
        assert states[0]["balance_ratio"] == states[1]["balance_ratio"]  # both read the same plans
    finally:
        kill_server(server)


def _generate(url: str, prompt: list[int], max_new: int) -> dict:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    return requests.post(f"{url}/generate", json=body, timeout=300).json()


def _start_long_request(url: str, max_new: int) -> threading.Thread:
    """A request of max_new tokens on a thread, returned once a DP rank runs it."""
    long = threading.Thread(target=_generate, args=(url, [5, 6, 7, 8], max_new))
    long.start()
    deadline = time.monotonic() + 60
    while sum(s["num_running_reqs"] for s in _internal_states(url)) == 0:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.05)
    return long


def _internal_states(url: str) -> list[dict]:
    return requests.get(f"{url}/get_server_info", timeout=30).json()["internal_states"]


def _plan(*ranks: tuple[int, int, int, int]) -> GlobalPlan:
    """A previous iteration's plan from (num_reqs, is_extend, has_work, prefill_wait) per rank."""
    return GlobalPlan(tuple(LocalPlan(num_tokens=n, num_reqs=n, is_extend=e, has_work=w, prefill_wait=p) for n, e, w, p in ranks))


def test_prefill_alignment_rule():
    decoding, waiting = (4, 0, 1, 0), (0, 0, 1, 1)
    assert prefill_allowed(None, 4)  # the first iteration
    assert prefill_allowed(_plan(decoding, waiting), 0)  # alignment off
    assert not prefill_allowed(_plan(decoding, waiting), 4)  # rank 1 holds while rank 0 decodes
    assert prefill_allowed(_plan(decoding, (0, 0, 1, 4)), 4)  # ... for at most 4 iterations
    assert prefill_allowed(_plan((4, 0, 1, 2), waiting), 4)  # both want to prefill
    assert prefill_allowed(_plan(decoding, waiting, (0, 0, 0, 0)), 4) is False  # an idle rank does not count
    assert prefill_allowed(_plan((0, 0, 0, 0), waiting), 4)  # nobody decodes: nothing to delay
    assert prefill_allowed(_plan((3, 1, 1, 4), waiting), 4)  # rank 0's chunked prompt goes on


def test_two_ranks_prefill_together():
    """Rank 1 holds its request until rank 0 also has one, then both prefill in one iteration;
    alone, rank 1 waits exactly align_iters iterations."""
    align = 3
    holds = [PrefillHold(align), PrefillHold(align)]
    previous = _plan((4, 0, 1, 0), (4, 0, 1, 0))
    waiting = [False, True]
    arrivals = {2: 0}  # rank 0 gets a request in iteration 2
    prefilled_at: dict[int, int] = {}
    for it in range(6):
        if it in arrivals:
            waiting[arrivals[it]] = True
        allowed = prefill_allowed(previous, align)
        ranks = []
        for r in range(2):
            prefills = allowed and waiting[r]
            if prefills:
                prefilled_at[r], waiting[r] = it, False
            wait = holds[r].report(wants_prefill=waiting[r], prefilled=prefills, continues_chunk=False)
            ranks.append((4, int(prefills), 1, wait))
        previous = _plan(*ranks)
    assert prefilled_at == {0: 3, 1: 3}
    alone = PrefillHold(align)
    previous = _plan((4, 0, 1, 0), (4, 0, 1, 0))
    for it in range(10):
        if prefill_allowed(previous, align):
            break
        previous = _plan((4, 0, 1, 0), (4, 0, 1, alone.report(wants_prefill=True, prefilled=False, continues_chunk=False)))
    assert it == align and alone.total_held_iters == align


def test_tp2_dp2_prefill_waits_for_alignment(tiny_llama_dir):
    """A request reaching DP rank 1 while rank 0 decodes a long one is held
    --dp-prefill-align-iters iterations, then served with the right tokens."""
    args = ["--device", "cpu", "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--skip-server-warmup"]
    server = popen_launch_server(tiny_llama_dir, args + ["--load-balance-method", "round_robin", "--dp-prefill-align-iters", "6"])
    try:
        url = server.base_url
        generate = lambda prompt, max_new: _generate(url, prompt, max_new)["output_ids"]
        long = _start_long_request(url, 300)
        held = generate([10, 11, 12], 5)  # round robin: DP rank 1
        waits = [s["prefill_wait_iterations"] for s in _internal_states(url)]
        long.join(300)
        assert waits == [0, 6]  # per DP rank
        assert held == generate([10, 11, 12], 5)  # alone: prefilled at once, the same tokens
    finally:
        kill_server(server)


def test_prefill_align_iters_must_not_be_negative():
    with pytest.raises(ValueError, match="--dp-prefill-align-iters"):
        ServerArgs(model_path="m", device="cpu", dp_prefill_align_iters=-1)
