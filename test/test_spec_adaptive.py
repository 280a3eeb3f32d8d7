"""--speculative-adaptive (CPU, float32, tiny DeepSeek-V3 checkpoints with an MTP layer).

- The decision (speculative/adaptive.py): deterministic, the same on every rank's view of the
  plan all-gather whatever each rank's own figures, hysteresis (no flapping near a boundary,
  a minimum dwell), the forced schedule counting decode cycles only.
- One rank, tiers forced to change every few cycles (through the lowest, 1 step, and back),
  overlapped: greedy tokens equal the non-speculative run (a draft that agrees with the
  target on part of the tokens, so acceptance varies within each tier; the whole-cycle path
  and the sub-forward path with logprobs), and after the tier changes the target and draft
  KV of a request equal those of a fresh prefill of the same tokens (the draft KV is
  refreshed by the draft extend at every tier, the lowest included).
- An exact draft accepts steps + 1 in every cycle of every tier, also right after coming back
  from the lowest tier: the accept length of a run that never left the tier.
- `--tp-size 2 --dp-size 2 --enable-dp-attention` over HTTP (round robin, --debug-collectives,
  forced tiers): greedy tokens equal the reference; tier usage in /get_server_info, /metrics and
  the decode log line. With the decision itself (no forced schedule), two in-process ranks take
  the same tier at every iteration and switch tiers: DP attention ranks (whose acceptance differs)
  from the plan, TP ranks of one DP group from their own reports.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Optional, Union

import pytest
import requests
import torch
import torch.multiprocessing as mp
from prometheus_client.parser import text_string_to_metric_families

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import initialize_model_parallel
from sglang.srt.distributed.scheduler_comm import GlobalPlan, LocalPlan
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.model_loader import get_model
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.speculative.adaptive import (
    ALPHA_ONE,
    MIN_POSITION_TRIALS,
    POSITION_MEMORY,
    RECORD_ONE,
    STALE_FADE,
    TIME_SAMPLES,
    AdaptiveTiers,
    CostModel,
    CycleTime,
    FixedSchedule,
    PositionRecord,
    RankFigures,
    TierState,
    Trials,
    chain_trials,
    figures_of_plan,
)
from sglang.test.inprocess_scheduler import greedy, start_scheduler
from sglang.test.model_harness import ModelHarness
from sglang.test.server_utils import kill_server, popen_launch_server

TIERS = (1, 3, 5)
# Tier changes every two or three cycles, through the lowest tier and back.
SCHEDULE = "3:2,1:2,5:3,1:3"
PROMPTS = [[5, 17, 42, 99, 7, 3, 150, 11, 12, 13, 14, 15, 16], [8, 9, 10], [100, 101, 102, 103, 104, 105, 106], [60, 61]]
MAX_NEW = [31, 17, 24, 9]  # requests end at different cycles (and tiers)


# ---- the decision (pure) -------------------------------------------------------------------


def _trials(alpha: float, count: int) -> Trials:
    accepted = round(alpha * count)
    return Trials(accepted, count - accepted)


def _report(rates: Union[float, tuple[float, ...]], batch: int, trials: int = 1000) -> list[RankFigures]:
    """One rank's report: `trials` trials of every position (of the largest tier's five) at
    these rates (one rate: every position's)."""
    rates = rates if isinstance(rates, tuple) else (rates,) * max(TIERS)
    return [RankFigures(tuple(_trials(r, trials) for r in rates), batch)]


def _state(steps: int, rates: Union[float, tuple[float, ...]], held: int = 100, cycles: int = 0, trials: int = 1000):
    """A tier state whose records hold `trials` trials of every position at these rates."""
    return TierState(steps, held, cycles).with_trials(_report(rates, 1, trials))


NO_TRIALS = (Trials(),) * max(TIERS)


def test_cost_model_picks_long_chains_for_good_drafts_and_small_batches():
    model = CostModel(TIERS)
    assert model.decide(_state(3, 0.3), 1, {}) == 1  # poor draft: the shortest chain
    assert model.decide(_state(3, 0.95), 1, {}) == 5  # good draft, small batch: the longest
    # With nothing measured the prior decides; the trained small DeepSeek's acceptance (0.71):
    # 3 steps at batch 1, 1 step at batch 32.
    assert model.decide(_state(3, 0.71), 1, {}) == 3
    assert model.decide(_state(3, 0.71), 32, {}) == 1
    # Fewer steps as the batch grows, never more.
    for alpha in (0.5, 0.71, 0.8, 0.9):
        picks = [model.decide(_state(s, alpha), b, {}) for s in TIERS for b in (1, 4, 16, 64)]
        for s in range(len(TIERS)):
            by_batch = picks[4 * s : 4 * s + 4]
            assert by_batch == sorted(by_batch, reverse=True), (alpha, by_batch)


def test_cost_model_hysteresis():
    model = CostModel(TIERS)
    # Near the 1 / 3 boundary (alpha 0.71, batch 20) each tier keeps itself: switching would gain < 5%.
    assert model.decide(_state(1, 0.71), 20, {}) == 1
    assert model.decide(_state(3, 0.71), 20, {}) == 3
    # Acceptance wobbling around the boundary does not make the tier flap.
    rng = random.Random(0)
    tiers = AdaptiveTiers(3, model)
    chosen = [tiers.next_tier(_report(0.71 + rng.uniform(-0.01, 0.01), 20)) for _ in range(400)]
    assert chosen == [3] * 400
    # A clear change switches, but only after the tier has run min_dwell cycles.
    assert model.decide(_state(3, 0.2, held=model.min_dwell - 1), 1, {}) == 3
    assert model.decide(_state(3, 0.2, held=model.min_dwell), 1, {}) == 1
    # No decision before the first position's record holds min_trials trials.
    assert model.decide(_state(3, 0.0, trials=model.min_trials - 1), 1, {}) == 3
    assert model.decide(TierState(3, held=100), 1, {}) == 3


def test_each_positions_rate_decides_and_is_kept():
    """The first draft accepted 90% of the time, later ones 30%: one step (one rate of 90%
    would pick five). Reports without trials of later positions (cycles at one step) keep most
    of their records; a position with too few trials on record takes the rate of the one before it."""
    model = CostModel(TIERS)
    assert model.decide(_state(3, (0.9, 0.3, 0.3, 0.3, 0.3)), 1, {}) == 1
    assert model.decide(_state(3, 0.9), 1, {}) == 5
    first_only = [RankFigures((_trials(0.9, 100), *NO_TRIALS[1:]), 1)]
    kept = _state(1, (0.9, 0.3, 0.3, 0.3, 0.3)).with_trials(first_only)
    # The positions not reached lose weight with the first position's trials, STALE_FADE times slower.
    faded = 1000 * RECORD_ONE * POSITION_MEMORY * STALE_FADE // (POSITION_MEMORY * STALE_FADE + 100)
    assert [r.trials for r in kept.records[1:]] == [faded] * 4
    assert model.decide(kept, 1, {}) == 1
    assert model.decide(TierState(1, held=100).with_trials(first_only), 1, {}) == 5
    # Positions 2 and 3 are accepted often, 4 and 5 rarely: 3 steps (one rate over the later
    # positions, 0.55, would pick 1 step; the 0.8 of positions 2 and 3 alone, 5 steps).
    assert model.decide(_state(3, (0.9, 0.8, 0.8, 0.3, 0.3)), 1, {}) == 3
    tiers = AdaptiveTiers(3, model)
    tiers.next_tier(_report((0.9, 0.8, 0.8, 0.3, 0.3), 1))
    assert tiers.internal_state()["spec_position_accept_rate"] == [0.9, 0.8, 0.8, 0.3, 0.3]


def test_position_records_weigh_recent_trials():
    """Each new trial weighs as much as the POSITION_MEMORY before it: a rate that changes is
    followed within a few hundred trials whatever the batch, and a position below
    MIN_POSITION_TRIALS on record takes the rate of the one before it."""
    record = PositionRecord()
    for _ in range(40):
        record = record.add(_trials(0.9, 10))
    assert abs(record.rate() / ALPHA_ONE - 0.9) < 0.01
    for _ in range(60):
        record = record.add(_trials(0.5, 10))
    assert abs(record.rate() / ALPHA_ONE - 0.5) < 0.02
    one_by_one = PositionRecord()
    for i in range(600):
        one_by_one = one_by_one.add(Trials(1, 0) if i < 300 or i % 2 else Trials(0, 1))
    assert abs(one_by_one.rate() / ALPHA_ONE - 0.5) < 0.05
    assert PositionRecord().add(Trials(1, MIN_POSITION_TRIALS - 2)).rate() is None
    state = TierState(3).with_trials([RankFigures((_trials(0.8, 100), Trials(1, 2), *NO_TRIALS[2:]), 1)])
    assert state.rates() == [_trials(0.8, 100).accepted * ALPHA_ONE // 100] * 5


RatesAt = Callable[[int, int], tuple[float, ...]]  # (cycle, tokens so far) -> position rates


def _served(steps: Optional[int], rates_at: RatesAt, cost_us: dict[int, int], seed: int = 0):
    """Tokens per ms of one request stream over 20,000 cycles, position d of a chain accepted
    with probability rates_at(cycle, tokens so far)[d - 1] given the ones before it were, at a
    fixed tier (`steps`) or adaptive, and the cycles run at each tier."""
    rng = random.Random(seed)
    tiers = AdaptiveTiers(5, CostModel(TIERS))
    tokens = us = 0
    previous = None
    usage = dict.fromkeys(TIERS, 0)
    for i in range(20_000):
        rates = rates_at(i, tokens)
        tier = steps or tiers.next_tier(tiers.local_figures(1), cost_us[previous] if previous else 0)
        accepted = 0
        while accepted < tier and rng.random() < rates[accepted]:
            accepted += 1
        tiers.observe(tier, [accepted])
        tokens, us, previous = tokens + accepted + 1, us + cost_us[tier], tier
        usage[tier] += 1
    return 1000 * tokens / us, usage


@pytest.mark.parametrize(
    "rates, cost_us",
    [
        # 3 steps: 2.24 tokens per ms against 1.90 (1 step) and 2.11 (5 steps). One rate pooled
        # over the positions is the first's 90% after cycles at 1 step, which picks 5 steps.
        ((0.9, 0.5, 0.5, 0.5, 0.5), {1: 1000, 3: 1150, 5: 1300}),
        # 3 steps: 2.65 tokens per ms against 1.90 and 2.44 (positions 4 and 5 rarely accepted).
        ((0.9, 0.75, 0.7, 0.4, 0.3), {1: 1000, 3: 1150, 5: 1350}),
        # 3 steps: 1.78 against 1.60 and 1.66 (a poorer draft).
        ((0.6, 0.5, 0.5, 0.5, 0.5), {1: 1000, 3: 1150, 5: 1300}),
    ],
)
def test_a_draft_settles_on_its_best_tier(rates, cost_us):
    """At rates that do not change the decision runs mostly at the tier of the most tokens per
    unit of time (its records, a few dozen trials each, now and then rank a neighbour a few
    percent apart above it) and serves at least 0.97x the best fixed tier."""
    best_fixed = max(_served(steps, lambda i, tokens: rates, cost_us)[0] for steps in TIERS)
    for seed in range(3):
        served, usage = _served(None, lambda i, tokens: rates, cost_us, seed)
        assert max(usage, key=usage.get) == 3 and served >= 0.97 * best_fixed, (seed, served / best_fixed, usage)


def test_a_draft_whose_acceptance_changes_is_followed():
    """Stretches of 1,000 cycles (a few long requests) alternately easy for the draft (3 or 5
    steps pay) and hard (its second position is accepted 25% of the time: 1 step pays). The
    adaptive server does better than any fixed tier: at 1 step the records of positions it
    does not reach fade, so it tries longer chains again once the stretch turns easy (kept as
    they were, they held it at 1 step for 2,048 cycles)."""
    regimes = [(0.8, 0.75, 0.7, 0.7, 0.7), (0.55, 0.25, 0.4, 0.5, 0.5)]
    cost_us = {1: 731, 3: 917, 5: 1039}

    def rates_at(cycle: int, tokens: int) -> tuple[float, ...]:
        return regimes[cycle // 1000 % 2]

    best_fixed = max(_served(steps, rates_at, cost_us)[0] for steps in TIERS)
    assert _served(None, rates_at, cost_us)[0] >= best_fixed


def test_requests_that_differ_for_the_draft_at_batch_1():
    """One request at a time, 256 tokens each, of three kinds as the trained small DeepSeek's
    held-out prompts at concurrency 1 showed them (40-cycle stretches at 3 steps emitting from
    1.0 to 3.6 tokens a cycle): a quarter the draft continues verbatim, a quarter it hardly
    gets, the rest between. The next request is unrelated to the one before, so records that
    follow about one request serve at least 0.99x the best fixed tier (records of the latest
    128 trials, which span a request or two, 0.976x to 0.994x at these seeds)."""
    cost_us = {1: 726, 3: 933, 5: 1157}  # the tiers' cycles at batch 1 on one H100
    for seed in range(4):
        rng = random.Random(100 + seed)
        kinds = [rng.random() for _ in range(400)]
        between = [rng.random() for _ in range(400)]

        def rates_at(cycle: int, tokens: int) -> tuple[float, ...]:
            kind, q = kinds[tokens // 256], between[tokens // 256]
            if kind < 0.25:
                return (0.95,) * 5
            if kind < 0.5:
                return (0.25, 0.4, 0.5, 0.6, 0.6)
            return (0.5 + 0.3 * q, 0.6 + 0.2 * q, 0.7 + 0.2 * q, 0.8, 0.8)

        best_fixed = max(_served(steps, rates_at, cost_us, seed)[0] for steps in TIERS)
        served, usage = _served(None, rates_at, cost_us, seed)
        assert served >= 0.99 * best_fixed, (seed, served / best_fixed, usage)


def test_trials_are_counted_per_position_and_reported_once():
    """Position d of a chain is tried when the d - 1 before it were accepted. A request that
    accepted its whole chain rejected nothing, any other one draft. A report carries the trials
    since the previous one."""
    n, a, r = Trials(), Trials(1, 0), Trials(0, 1)
    assert chain_trials(3, 0, 5) == (r, n, n, n, n)
    assert chain_trials(3, 1, 5) == (a, r, n, n, n)
    assert chain_trials(3, 3, 5) == (a, a, a, n, n)
    assert chain_trials(1, 1, 5) == (a, n, n, n, n)
    tiers = AdaptiveTiers(3, CostModel(TIERS))
    tiers.observe(3, [3, 0, 2])
    tiers.observe(5, [])  # no requests: no trials
    assert tiers.plan_trials() == (2, 1, 2, 0, 1, 1, 0, 0, 0, 0)
    assert tiers.plan_trials() == (0,) * 10
    tiers.observe(1, [1, 1])
    tiers.observe(5, [0])
    assert tiers.local_figures(4) == [RankFigures((Trials(2, 1), n, n, n, n), 4)]
    assert tiers.total.accept_lengths() == {1: 2.0, 3: 8 / 3, 5: 1.0}
    assert tiers.internal_state()["spec_position_accept_rate"] == []  # no report absorbed yet
    assert tiers.internal_state()["spec_tier_cycles"] == {"1": 1, "3": 1, "5": 2}
    # Reports count once, also those of an iteration without a batch on any rank.
    tiers.next_tier(_report(0.5, 0, trials=10))
    tiers.absorb(_report(0.5, 0, trials=10))
    assert tiers.state.records[0].trials == 10 * RECORD_ONE * POSITION_MEMORY // (POSITION_MEMORY + 10) + 10 * RECORD_ONE


def test_log_line_shows_usage_rates_and_times():
    """The decode log line's part: cycles per tier since the previous line, each position's
    rate on record (- below MIN_POSITION_TRIALS) and the cycle times at the latest bucket."""
    tiers = AdaptiveTiers(3, CostModel(TIERS))
    assert tiers.log_text() == "tier cycles: , position rates: -, cycle us at batch <= 1: -, "
    accepted = Trials(3 * MIN_POSITION_TRIALS, MIN_POSITION_TRIALS)
    tiers.next_tier([RankFigures((accepted, Trials(1, 1), *NO_TRIALS[2:]), 20)])
    for us in (900, 1000, 1100):  # the third iteration's time counts (with the fourth)
        tiers.next_tier(_report(0.5, 20, trials=0), us)
    tiers.times[1, 1] = CycleTime((700,), 0)  # another bucket's time is left out
    assert tiers.log_text() == "tier cycles: , position rates: 0.75 - - - -, cycle us at batch <= 32: 3:1100, "
    tiers.observe(3, [1, 2])
    assert tiers.log_text().startswith("tier cycles: 3:1, ")
    assert tiers.log_text().startswith("tier cycles: , ")


def test_measured_cycle_times_decide_over_the_prior():
    """Where tiers are measured at the batch's bucket their times decide: at batch 32, where the
    prior picks 1 step, a 3-step cycle measured at 1.3x a 1-step one wins; at batch 1, where
    the prior picks 3, dear draft positions make 1 step win. A tier not measured is scaled
    from the nearest measured one by the prior's ratio."""
    model = CostModel(TIERS)
    cheap_drafts = {(1, 32): CycleTime((1000,), 0), (3, 32): CycleTime((1300,), 0), (5, 32): CycleTime((1700,), 0)}
    assert model.decide(_state(1, 0.71, cycles=10), 32, cheap_drafts) == 3
    dear_drafts = {(1, 1): CycleTime((1000,), 0), (3, 1): CycleTime((2000,), 0), (5, 1): CycleTime((3000,), 0)}
    assert model.decide(_state(3, 0.71, cycles=10), 1, dear_drafts) == 1
    # Another bucket's times do not count: batch 8 falls back to the prior.
    assert model.costs(8, cheap_drafts) == {s: model.prior_cost(s, 8) for s in TIERS}
    only_three = {(3, 32): CycleTime((1300,), 0)}
    assert model.costs(32, only_three) == {
        1: 1300 * model.prior_cost(1, 32) // model.prior_cost(3, 32),
        3: 1300,
        5: 1300 * model.prior_cost(5, 32) // model.prior_cost(3, 32),
    }


def test_neighbouring_tiers_are_measured_then_remeasured():
    """Once the current tier is measured at the bucket, an unmeasured neighbour (the lower
    first) runs to be measured; then the times decide; a neighbour's time older than
    explore_every cycles is measured again. Nothing is explored before the current tier's own
    time exists, nor before the dwell."""
    model = CostModel(TIERS)
    times = {(3, 32): CycleTime((1300,), 50)}
    assert model.decide(_state(3, 0.71, held=100, cycles=60), 32, times) == 1
    assert model.decide(_state(3, 0.71, held=model.min_dwell - 1, cycles=60), 32, times) == 3
    # From the unmeasured 5 nothing is explored: tier 3's time scaled by the prior decides (1 step).
    assert model.decide(_state(5, 0.71, held=100, cycles=60), 32, times) == 1
    times[1, 32] = CycleTime((1000,), 70)
    assert model.decide(_state(1, 0.71, held=model.min_dwell, cycles=70), 32, times) == 3
    assert model.decide(_state(3, 0.71, held=model.min_dwell, cycles=80), 32, times) == 5  # 5 next
    times[5, 32] = CycleTime((1700,), 90)
    assert model.decide(_state(5, 0.71, held=model.min_dwell, cycles=90), 32, times) == 3
    assert model.decide(_state(3, 0.71, held=100, cycles=100), 32, times) == 3
    later = 70 + model.explore_every + 1  # tier 1's time is stale, tier 5's not yet
    times[3, 32] = CycleTime((1300,), later)
    assert model.decide(_state(3, 0.71, held=100, cycles=later), 32, times) == 1


def test_a_neighbour_timed_out_of_order_is_measured_again():
    """A neighbour whose time contradicts the current tier's (fewer steps yet dearer, or more
    yet cheaper) was timed in another state of the machine: it is measured again once older
    than recheck_after cycles, long before explore_every; times in order are kept."""
    model = CostModel(TIERS)
    fresh = model.recheck_after + 10
    stale_three = {(3, 32): CycleTime((2500,), 0), (5, 32): CycleTime((2200,), fresh)}
    assert model.decide(_state(5, 0.71, held=100, cycles=fresh), 32, stale_three) == 3
    assert model.to_measure(_state(5, 0.71, held=100, cycles=model.recheck_after), 32, stale_three) is None
    stale_one = {(1, 32): CycleTime((1900,), 0), (3, 32): CycleTime((1800,), fresh), (5, 32): CycleTime((2600,), fresh)}
    assert model.to_measure(_state(3, 0.71, held=100, cycles=fresh), 32, stale_one) == 1
    in_order = {(1, 32): CycleTime((1500,), 0), (3, 32): CycleTime((1800,), fresh), (5, 32): CycleTime((2600,), 0)}
    assert model.to_measure(_state(3, 0.71, held=100, cycles=fresh), 32, in_order) is None


def test_cycle_times_count_decode_only_iterations():
    """An iteration's time arrives with the next one and counts for its tier and bucket only
    when it and the two before it ran a decode cycle and nothing else at that tier and bucket."""
    tiers = AdaptiveTiers(3, CostModel(TIERS))
    figures = _report(0.71, 20)  # bucket 32
    tiers.next_tier(figures)
    tiers.next_tier(figures)
    assert tiers.timed is None  # one iteration before it
    tiers.next_tier(figures)
    assert tiers.timed == (3, 32)
    tiers.next_tier(figures, cycle_us=1200)
    assert tiers.times == {(3, 32): CycleTime((1200,), 3)}
    tiers.next_tier(figures, cycle_us=2000, decode_only=False)  # this one also prefills
    assert tiers.times[3, 32].samples == (1200, 2000)
    tiers.next_tier(figures, cycle_us=9999)  # the prefilling iteration's time: not counted
    assert tiers.times[3, 32].samples == (1200, 2000) and tiers.timed is None  # nor this one's
    tiers.next_tier(figures, cycle_us=8888)
    assert tiers.timed is None  # nor the next: its GPU cycle ran right after the prefill
    tiers.next_tier(figures, cycle_us=7777)
    tiers.next_tier([RankFigures(NO_TRIALS, 0)], cycle_us=1100)  # counted; no decode cycle now
    assert tiers.times[3, 32].samples == (1200, 2000, 1100) and tiers.timed is None
    tiers.next_tier(figures, cycle_us=5000)  # after an iteration without decode cycles: nothing
    assert tiers.times[3, 32].us == 1100
    assert tiers.internal_state()["spec_tier_cycle_us"] == {"3/32": 1100}
    tiers.reset()
    assert tiers.times == {} and tiers.timed is None and tiers.last_key is None and tiers.key_run == 0


def test_cycle_times_skip_the_first_iterations_of_a_tier():
    """Three cycles at 3 steps, three at 5, again: only the third iteration of each run counts,
    for its own tier (the first mostly waits for the other tier's cycle, the second for one
    that ran right after it)."""
    tiers = AdaptiveTiers(3, FixedSchedule(((3, 3), (5, 3))))
    figures = _report(0.71, 20)
    counted = []
    for i in range(12):
        tiers.next_tier(figures, cycle_us=1000 + i)
        counted.append(tiers.timed)
    assert counted == [None, None, (3, 32), None, None, (5, 32)] * 2
    tiers.next_tier(figures, cycle_us=2000)
    # Times of iterations 2 and 8 (3 steps: 1003, 1009), 5 and 11 (5 steps: 1006, 2000).
    assert tiers.times == {(3, 32): CycleTime((1003, 1009), 9), (5, 32): CycleTime((1006, 2000), 12)}
    assert (tiers.times[3, 32].us, tiers.times[5, 32].us) == (1003, 1006)


def test_slow_iterations_do_not_move_the_cycle_time():
    """The lower quartile of the latest TIME_SAMPLES: iterations that ran long (a garbage
    collection, a kernel's first use, requests finishing), even half of them, leave the tier's
    time near its own work's; the oldest samples go."""
    tiers = AdaptiveTiers(3, FixedSchedule(((3, 1),)))
    figures = _report(0.71, 1)
    for us in [0, 0, 0, 1000, 50_000, 1010, 2400, 990, 2600, 1005, 2500]:
        tiers.next_tier(figures, cycle_us=us)
    assert tiers.times[3, 1].samples == (1000, 50_000, 1010, 2400, 990, 2600, 1005, 2500)
    assert tiers.times[3, 1].us == 1000
    for _ in range(TIME_SAMPLES + 1):  # a time counts with the next iteration: the last one waits
        tiers.next_tier(figures, cycle_us=1100)
    assert tiers.times[3, 1].samples == (1100,) * TIME_SAMPLES


def _gathered(locals_: list[LocalPlan]) -> GlobalPlan:
    """What SchedulerComm.gather_plan returns: every rank's packed ints, unpacked."""
    return GlobalPlan(tuple(LocalPlan.unpack(torch.tensor(p.pack(), dtype=torch.int64).tolist()) for p in locals_))


def _chain(steps: int, skill: float, rng: random.Random) -> int:
    """Drafts a chain of `steps` accepts when each is accepted with probability `skill`."""
    accepted = 0
    while accepted < steps and rng.random() < skill:
        accepted += 1
    return accepted


def test_every_rank_decides_alike_from_the_plan():
    """Four DP ranks, each with its own acceptance, batches coming and going, prefills mixed
    in: every rank takes the same decision every iteration from the gathered plan, although a
    rank deciding from its own reports alone would often have decided otherwise."""
    rng = random.Random(1)
    ranks = [AdaptiveTiers(5, CostModel(TIERS, min_dwell=3)) for _ in range(4)]
    solos = [AdaptiveTiers(5, CostModel(TIERS, min_dwell=3)) for _ in range(4)]
    skill = [0.2, 0.6, 0.8, 0.95]  # each rank's draft acceptance
    decisions, alone_differs = [], 0
    for _ in range(300):
        locals_ = []
        for r, tiers in enumerate(ranks):
            batch = rng.choice([0, 0, 1, 3, 8, 30])
            extend = rng.random() < 0.1
            locals_.append(
                LocalPlan(
                    num_tokens=batch * 2,
                    num_reqs=batch,
                    is_extend=int(extend),
                    has_work=1,
                    spec_trials=tiers.plan_trials(),
                    spec_cycle_us=rng.randint(500, 3000) if tiers.timed else 0,  # each rank's own clock
                )
            )
        plan = _gathered(locals_)
        figures = figures_of_plan(plan)
        cycle_us = max(p.spec_cycle_us for p in plan.per_rank)
        alone = [solo.next_tier([f], cycle_us, decode_only=not plan.any_extend) for solo, f in zip(solos, figures)]
        chosen = [t.next_tier(figures, cycle_us, decode_only=not plan.any_extend) for t in ranks]
        assert len(set(chosen)) == 1, chosen
        assert len({t.state for t in ranks}) == 1 and all(t.times == ranks[0].times for t in ranks)
        alone_differs += any(a != chosen[0] for a, f in zip(alone, figures) if f.decode_reqs)
        decisions.append(chosen[0])
        for r, tiers in enumerate(ranks):  # each rank's cycle outcome: its own acceptance
            if figures[r].decode_reqs:
                tiers.observe(chosen[0], [_chain(chosen[0], skill[r], rng) for _ in range(figures[r].decode_reqs)])
    assert len(set(decisions)) > 1 and alone_differs > 0 and ranks[0].times


def test_fixed_schedule_counts_decode_cycles_only():
    tiers = AdaptiveTiers(3, FixedSchedule(((3, 2), (1, 1))))
    idle = [RankFigures(NO_TRIALS, 0)]
    busy = [RankFigures(NO_TRIALS, 2)]
    steps = [tiers.next_tier(figures) for figures in [busy, idle, busy, busy, idle, busy, busy, busy]]
    # Two cycles at 3, one at 1, again; an iteration without decode keeps the tier and the count.
    assert steps == [3, 3, 3, 1, 1, 3, 3, 1]
    assert tiers.state.cycles == 6


# ---- one rank --------------------------------------------------------------------------------


def _reference(path: str, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    """Single-rank, non-speculative greedy tokens."""
    initialize_model_parallel(1, 0)
    config = ModelConfig(path, dtype="float32", device="cpu")
    harness = ModelHarness(get_model(config, "auto", "cpu"), config, max_context_len=128)
    outs = harness.greedy_generate(prompts, max(max_new))
    return [out[:n] for out, n in zip(outs, max_new)]


def _adaptive_args(path: str, start: int = 3, **extra) -> ServerArgs:
    return ServerArgs(
        model_path=path,
        device="cpu",
        dtype="float32",
        speculative_algorithm="NEXTN",
        speculative_adaptive=True,
        speculative_adaptive_steps=",".join(map(str, TIERS)),
        speculative_num_steps=start,
        max_running_requests=8,
        **extra,
    )


def _record_cycles(scheduler) -> list[tuple[int, list[int]]]:
    """Every verify cycle this rank processes: (its tier's steps, drafts accepted per request)."""
    cycles: list[tuple[int, list[int]]] = []
    observe = scheduler.adaptive.observe

    def recorded(steps: int, accepted: list[int]) -> None:
        cycles.append((steps, list(accepted)))
        observe(steps, accepted)

    scheduler.adaptive.observe = recorded
    return cycles


def _draft_and_target_kv(scheduler, req, length: int) -> list[torch.Tensor]:
    """The request's KV at positions 0 .. length-1, every target layer and the draft's."""
    slots = scheduler.req_to_token_pool.req_to_token[req.req_pool_idx, :length]
    pools = [scheduler.runner.kv_pool, scheduler.spec_worker.draft_runner.kv_pool]
    return [layer[slots] for pool in pools for layer in pool.kv_buffer]


def test_forced_tier_changes_keep_tokens_and_kv(partial_deepseek_v3_dir):
    reference = _reference(partial_deepseek_v3_dir, PROMPTS, MAX_NEW)
    scheduler = start_scheduler(
        _adaptive_args(partial_deepseek_v3_dir, speculative_adaptive_schedule=SCHEDULE, disable_radix_cache=True)
    )
    cycles = _record_cycles(scheduler)
    assert greedy(scheduler, PROMPTS, MAX_NEW) == reference
    tiers = [steps for steps, _ in cycles]
    assert set(tiers) == set(TIERS) and any(a == 1 and b > 1 for a, b in zip(tiers, tiers[1:]))
    accepted = {a for _, acc in cycles for a in acc}
    assert 0 in accepted and len(accepted) > 2  # partial acceptance within the tiers
    # The sub-forward path (logprobs: acceptance on the host) at every tier too.
    assert greedy(scheduler, PROMPTS, MAX_NEW, return_logprob=True) == reference
    # Sampling with penalties (the tree walk on the host, sequential scheduling) runs at every tier.
    sampled = greedy(scheduler, PROMPTS, MAX_NEW, temperature=0.8, frequency_penalty=0.5)
    assert [len(ids) for ids in sampled] == MAX_NEW
    assert scheduler.free_kv_tokens() == scheduler.allocator.size

    # Mid-generation, after cycles at every tier: the request's target and draft KV equal a
    # fresh prefill's of the same tokens.
    params = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    scheduler.handle_message(TokenizedGenerateReqInput("long", None, PROMPTS[0], params))
    end = scheduler.adaptive.state.cycles + 12  # past one whole period of the schedule
    while scheduler.adaptive.state.cycles < end:
        scheduler.run_iteration()
    scheduler.finish_in_flight()
    (req,) = scheduler.running
    length = req.kv_len
    decoded = _draft_and_target_kv(scheduler, req, length)
    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    scheduler.handle_message(TokenizedGenerateReqInput("fresh", None, req.all_ids[: length + 1], params))
    scheduler.run_iteration()  # the fresh request's prefill alone
    scheduler.finish_in_flight()
    fresh = next(r for r in scheduler.running if r.rid == "fresh")
    for got, want in zip(decoded, _draft_and_target_kv(scheduler, fresh, length)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_exact_draft_accepts_every_draft_at_every_tier(perfect_deepseek_v3_dir):
    """Right after the lowest tier, a tier accepts steps + 1 again: what a run that never left
    it accepts (the exact draft's guesses and hidden states survive the tier changes)."""
    target = perfect_deepseek_v3_dir
    # Short stays: the exact draft's long cycles end the requests within a few periods.
    scheduler = start_scheduler(_adaptive_args(target, speculative_adaptive_schedule="3:1,1:2,5:1,1:1"))
    cycles = _record_cycles(scheduler)
    assert greedy(scheduler, PROMPTS, MAX_NEW) == _reference(target, PROMPTS, MAX_NEW)
    assert all(accepted == [steps] * len(accepted) for steps, accepted in cycles), cycles
    tiers = [steps for steps, _ in cycles]
    assert sum(a == 1 and b > 1 for a, b in zip(tiers, tiers[1:])) >= 2  # came back up from the lowest tier
    assert scheduler.internal_state()["spec_tier_accept_length"] == {"1": 2.0, "3": 4.0, "5": 6.0}


# ---- DP attention ----------------------------------------------------------------------------


def test_dp_attention_http_forced_tiers(tiny_deepseek_v3_dir):
    reference = _reference(tiny_deepseek_v3_dir, PROMPTS, MAX_NEW)
    args = ["--device", "cpu", "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--speculative-algo", "NEXTN"]
    args += ["--speculative-adaptive", "--speculative-adaptive-steps", "1,3,5", "--speculative-num-steps", "3"]
    args += ["--speculative-adaptive-schedule", SCHEDULE, "--load-balance-method", "round_robin"]
    args += ["--debug-collectives", "--decode-log-interval", "1", "--enable-metrics", "--chunked-prefill-size", "8"]
    server = popen_launch_server(tiny_deepseek_v3_dir, args)
    try:
        body = {
            "input_ids": PROMPTS,
            "sampling_params": [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in MAX_NEW],
        }
        outs = requests.post(f"{server.base_url}/generate", json=body, timeout=300).json()
        assert [o["output_ids"] for o in outs] == reference
        states = requests.get(f"{server.base_url}/get_server_info", timeout=30).json()["internal_states"]
        assert [s["dp_rank"] for s in states] == [0, 1]
        for s in states:  # both ranks decoded at every tier
            assert set(s["spec_tier_cycles"]) == {"1", "3", "5"} and s["spec_tier"] in TIERS
            assert s["available_kv_tokens"] == s["max_total_num_tokens"]
        metrics = requests.get(f"{server.base_url}/metrics", timeout=30).text
        tier_cycles = {
            (s.labels["dp_rank"], s.labels["steps"]): s.value
            for family in text_string_to_metric_families(metrics)
            for s in family.samples
            if s.name == "sglang:spec_tier_cycles"
        }
        assert {key: int(n) for key, n in tier_cycles.items()} == {
            (str(s["dp_rank"]), steps): n for s in states for steps, n in s["spec_tier_cycles"].items()
        }
        log = server.log_tail(400000)
        for rank in (0, 1):
            assert re.search(rf"DP{rank} TP{rank}\] Decode batch\. .*accept len: \d+\.\d\d, tier cycles: (\d:\d+ ?)+,", log), rank
    finally:
        kill_server(server)


def _decide_main(rank: int, server_args: ServerArgs, port_args: PortArgs, prompts: list, max_new: list, results) -> None:
    """A rank's greedy tokens and the tier of each of its iterations. Under DP attention the
    ranks get different requests (rank 1's end sooner: it idles while rank 0 decodes); TP
    ranks of one DP group get the same."""
    torch.set_num_threads(1)
    scheduler = start_scheduler(server_args, rank, port_args)
    scheduler.adaptive.policy = CostModel(TIERS, min_dwell=2, min_trials=8)  # moves within a short run
    tiers: list[int] = []
    next_tier = scheduler.adaptive.next_tier

    def recorded(*args, **kwargs):
        tiers.append(next_tier(*args, **kwargs))
        return tiers[-1]

    scheduler.adaptive.next_tier = recorded
    mine = slice(2 * rank, 2 * rank + 2) if server_args.enable_dp_attention else slice(None)
    results[rank] = (greedy(scheduler, prompts[mine], max_new[mine]), tiers, dict(scheduler.adaptive.times))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel", ["dp_attention", "tp"])
def test_ranks_decide_alike(partial_deepseek_v3_dir, parallel):
    """The decision itself (its dwell shortened so that it moves within a short run), from the
    largest tier: under DP attention from both ranks' figures in the plan, under TP alone from
    each rank's own reports (the same requests, the same acceptance). Both ranks take the same
    tier at every iteration (--debug-collectives also compares what their collectives moved),
    it moves, and the tokens equal the reference."""
    dp = dict(dp_size=2, enable_dp_attention=True) if parallel == "dp_attention" else {}
    server_args = _adaptive_args(partial_deepseek_v3_dir, start=5, tp_size=2, debug_collectives=True, **dp)
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_decide_main, args=(server_args, PortArgs.init_new(server_args), PROMPTS, MAX_NEW, results), nprocs=2)
    reference = _reference(partial_deepseek_v3_dir, PROMPTS, MAX_NEW)
    assert results[0][0] + results[1][0] == reference if dp else results[0][0] == results[1][0] == reference
    assert results[0][1] == results[1][1]
    assert results[0][1][0] == 5 and len(set(results[0][1])) > 1
    # The measured cycle times are agreed: the same on both ranks (each rank's clock differs).
    assert results[0][2] == results[1][2] and results[0][2]
