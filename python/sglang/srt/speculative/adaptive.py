"""--speculative-adaptive: the tier (draft steps per cycle) each decode cycle runs at.

Figures. A draft position d (1 to the largest tier's steps) is a trial of a request's verify
when the d - 1 drafts before it were accepted; it is accepted or rejected (a request whose
chain stopped before its end rejected one draft; one that accepted its whole chain rejected
none). Each rank counts the trials of each position in the verify cycles it processes and
reports the counts since its previous report once per iteration; under DP attention in the
iteration's plan all-gather (LocalPlan.spec_trials), so every rank sees every rank's counts
and the decode batch of every rank. The tier state keeps per position a record of its trials
(`PositionRecord`): each new trial weighs as much as the `POSITION_MEMORY` trials before it
together, so the record follows the latest few dozen trials of that position, however many
cycles they took. At batch 1 that is the current request: requests differ far more than a
record of a few dozen trials errs (a prompt the draft continues verbatim accepts every draft,
the next one hardly any), and the next request is unrelated to the one before, so a record
spanning several requests follows neither; at batch 32 it is the latest cycle or two, the
mean of every running request. A position that no cycle reaches (cycles at 1 step try only
the first) keeps its record but lets it fade `STALE_FADE` times slower, by the first
position's trials: kept as it was, a record taken on a stretch hard for the draft would hold
the tier low after the stretch ends; faded below `MIN_POSITION_TRIALS` it gives way to the
rate of the position before it, and the longer chains are tried again. a_d, position d's
accepted / trials, is the chance that a cycle's d-th draft is accepted given the ones before
it were, whatever tiers the cycles ran at. The positions differ (the first is usually the
likeliest): one rate pooled over the positions that recent cycles happened to reach would
make longer chains look best after short cycles and shorter ones after long cycles, and the
tier would alternate.

Decision (`CostModel.decide`): with b the largest DP rank's decode batch (the busiest rank sets
the iteration's time),

    tokens(s) = 1 + a_1 + a_1 a_2 + ... + a_1 a_2 ... a_s  tokens per request of a cycle at s steps
    goodput(s) = tokens(s) / cost(s)

and the next cycle runs at the tier of the highest goodput, but leaves the current tier only
when that beats the current tier's goodput by `switch_gain` and the current tier has run
`min_dwell` cycles (hysteresis: no flapping between tiers of nearly equal goodput), and not
before the first position's record holds `min_trials` trials. A position whose record holds
fewer than `MIN_POSITION_TRIALS` trials takes the rate of the position before it.

cost(s) is measured: the wall time of an iteration that ran a decode cycle and nothing else
(start to next start), after two that did the same at the same tier and bucket (with overlap
scheduling an iteration mostly waits for the previous one's cycle, which the GPU ran after
the one before it: a prefill's or another tier's work still queued would count), the lower
quartile of the latest `TIME_SAMPLES` per tier and batch bucket (the power of two at or above
b), kept in `CycleTimes`. A low quantile, because what an iteration adds to a cycle's time
only lengthens it (a garbage collection, a first use of a kernel, requests that finish or
join, a prefill's work still on the GPU) and comes at any tier, while a tier's own work sets
its shortest times: at concurrency 32 on the GPU, with a prefill every few cycles, more than
half of a tier's samples ran long at times, enough to move a median by half. A tier not yet
measured at the bucket is estimated from the nearest measured tier through the prior cost
1 + s * (draft_cost + verify_cost * b) plain steps (their ratio); with nothing measured at the
bucket the prior alone decides. Once the current tier is measured, a neighbouring tier (one
tier up or down) that is not, or whose measurement is older than `explore_every` decode
cycles, or older than `recheck_after` and out of order against the current tier's (more steps
yet cheaper, or fewer yet dearer: timed in another state of the machine), is run for
`min_dwell` cycles to measure it: the prior only orders tiers until they
are measured, so a machine or a model where it is wrong (prefills that are cheap or dear, a
dense or a MoE target) still ends at its best tier.

Why every rank decides alike: the decision is a pure function of the tier state (the same on
every rank: it starts the same and changes only by this function of agreed figures) and of
integers that are the same on every rank (the all-gathered plan), computed in integer
arithmetic, so no CPU or rounding difference can split the ranks. Cycle times are such
integers too: under DP attention each rank puts the time of its previous iteration in the
plan and every rank takes the largest; within a DP group the entry rank sends its time with
the requests it broadcasts to its attention-TP peers. Ranks of one DP group without DP
attention (TP only) hold the same batch and get the same accept lengths (the logits are
gathered before the argmax; sampled acceptance is agreed from attention-TP rank 0), so their
reports, and their decisions, are the same too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Optional, Protocol

from sglang.srt.distributed.scheduler_comm import GlobalPlan

POSITION_MEMORY = 64  # a position's new trial weighs 1 / (POSITION_MEMORY + 1) of its record
RECORD_ONE = 1 << 8  # one trial in a PositionRecord's fixed-point counts
STALE_FADE = 4  # see PositionRecord.fade
MIN_POSITION_TRIALS = 32  # a position with fewer trials on record takes the rate of the one before
ALPHA_ONE = 1 << 20  # alpha = 1 in the decision's fixed-point arithmetic
TIME_SAMPLES = 8  # the cycle times a tier's lower quartile at a bucket is taken over


def batch_bucket(batch: int) -> int:
    """The power of two at or above the batch: cycle times are kept per tier and bucket."""
    return 1 << max(batch - 1, 0).bit_length()


@dataclass(frozen=True)
class CycleTime:
    """The latest wall times of a tier's decode iterations at one batch bucket."""

    samples: tuple[int, ...]  # from an iteration's start to the next one's (us), the oldest first
    cycle: int  # TierState.cycles when it was last measured

    @property
    def us(self) -> int:
        """The lower quartile (of 8 samples the second shortest; of up to 4, the shortest)."""
        ordered = sorted(self.samples)
        return ordered[(len(ordered) - 1) // 4]


CycleTimes = Mapping[tuple[int, int], CycleTime]  # (steps, batch bucket) -> time


@dataclass(frozen=True)
class Trials:
    """The trials of one draft position: counts, added as they come."""

    accepted: int = 0
    rejected: int = 0

    def __add__(self, other: Trials) -> Trials:
        return Trials(self.accepted + other.accepted, self.rejected + other.rejected)

    @property
    def count(self) -> int:
        return self.accepted + self.rejected


DepthTrials = tuple[Trials, ...]  # per draft position, the first (depth 1) first


def chain_trials(steps: int, accepted: int, depths: int) -> DepthTrials:
    """The trials of one request's chain of `steps` drafts of which it accepted `accepted`, per
    position up to `depths`: position d is tried when the d - 1 before it were accepted."""
    return tuple(
        Trials(int(accepted >= d), int(accepted == d - 1)) if d <= steps and accepted >= d - 1 else Trials()
        for d in range(1, depths + 1)
    )


def summed(rows: Sequence[DepthTrials], depths: int) -> DepthTrials:
    """Position by position sums (an empty sequence: no trials at any of `depths` positions)."""
    return tuple(sum((row[d] for row in rows), Trials()) for d in range(depths))


@dataclass(frozen=True)
class PositionRecord:
    """One position's trials so far, older ones fading: fixed-point counts (RECORD_ONE a trial)."""

    accepted: int = 0
    trials: int = 0

    def add(self, new: Trials) -> PositionRecord:
        """With `new` trials: the old counts keep POSITION_MEMORY / (POSITION_MEMORY + n) of
        their weight (n: the new trials), so each trial weighs as much as the memory before it."""
        if not new.count:
            return self
        kept, total = POSITION_MEMORY, POSITION_MEMORY + new.count
        return PositionRecord(
            self.accepted * kept // total + new.accepted * RECORD_ONE, self.trials * kept // total + new.count * RECORD_ONE
        )

    def fade(self, first_trials: int) -> PositionRecord:
        """A position that cycles did not reach while the first position had `first_trials`
        trials: its counts lose weight STALE_FADE times slower than by trials of its own."""
        kept = POSITION_MEMORY * STALE_FADE
        return PositionRecord(self.accepted * kept // (kept + first_trials), self.trials * kept // (kept + first_trials))

    def rate(self, min_trials: int = MIN_POSITION_TRIALS) -> Optional[int]:
        """accepted / trials in units of 1 / ALPHA_ONE, or None below min_trials trials (at least 1)."""
        return self.accepted * ALPHA_ONE // self.trials if self.trials >= max(min_trials, 1) * RECORD_ONE else None


@dataclass(frozen=True)
class RankFigures:
    """One DP rank's report: the trials per draft position of the verify cycles it processed
    since its previous report, and the requests it decodes this iteration (0: it prefills or idles)."""

    trials: DepthTrials
    decode_reqs: int


def figures_of_plan(plan: GlobalPlan) -> list[RankFigures]:
    """Every DP rank's report from the iteration's plan (the same on every rank)."""
    return [
        RankFigures(
            tuple(Trials(*p.spec_trials[i : i + 2]) for i in range(0, len(p.spec_trials), 2)),
            p.decode_reqs,
        )
        for p in plan.per_rank
    ]


@dataclass(frozen=True)
class TierState:
    """What the decision remembers, the same on every rank."""

    steps: int  # the tier the latest decode cycle ran at (before the first: the starting tier)
    held: int = 0  # decode cycles run at it in a row
    cycles: int = 0  # decode cycles since startup
    records: tuple[PositionRecord, ...] = ()  # per draft position (none yet: empty)

    def with_trials(self, figures: Sequence[RankFigures]) -> TierState:
        """The state with every rank's reported trials added to the records."""
        if not figures or not figures[0].trials:
            return self
        new = summed([f.trials for f in figures], len(figures[0].trials))
        records = self.records or (PositionRecord(),) * len(new)
        first = new[0].count
        return replace(self, records=tuple(r.add(t) if t.count else r.fade(first) for r, t in zip(records, new)))

    def rates(self) -> list[int]:
        """Per position its rate; a later one with too few trials takes the one before it's.
        The first position's record holds trials: the decision waits for min_trials of them."""
        first = self.records[0].rate(min_trials=1)
        assert first is not None, "no trial of the first position on record"
        rates = [first]
        for record in self.records[1:]:
            rate = record.rate()
            rates.append(rates[-1] if rate is None else rate)
        return rates


class TierPolicy(Protocol):
    @property
    def depths(self) -> int:
        """The draft positions the figures cover: the largest tier's steps."""

    def decide(self, state: TierState, batch: int, times: CycleTimes) -> int:
        """The steps of the next decode cycle (b: the largest DP rank's decode batch, at least
        1): a pure function of its arguments."""


@dataclass(frozen=True)
class CostModel:
    """The goodput rule above, in integers: alpha in units of 1 / ALPHA_ONE. The prior costs are
    in percent of a plain decode step of the target, fitted to the trained small DeepSeek-V3 on
    one H200 with eager prefills (docs/benchmarks.md, "speculation pays at concurrency 32"):
    one more draft position costs 17% of a plain step plus 1% per request."""

    tiers: tuple[int, ...]
    draft_cost_pct: int = 17
    verify_cost_pct_per_req: int = 1
    switch_gain_pct: int = 5
    min_dwell: int = 8
    min_trials: int = MIN_POSITION_TRIALS
    explore_every: int = 2048
    recheck_after: int = 64

    @property
    def depths(self) -> int:
        return max(self.tiers)

    @staticmethod
    def tokens(steps: int, rates: Sequence[int]) -> int:
        """Expected tokens per request of a cycle at `steps`, in 1 / ALPHA_ONE, with rates[d]
        the acceptance rate of position d + 1 given the ones before it were accepted."""
        tokens = power = ALPHA_ONE
        for rate in rates[:steps]:
            power = power * rate // ALPHA_ONE
            tokens += power
        return tokens

    def prior_cost(self, steps: int, batch: int) -> int:
        """A cycle's cost in percent of a plain decode step, before any is measured."""
        return 100 + steps * (self.draft_cost_pct + self.verify_cost_pct_per_req * batch)

    def costs(self, batch: int, times: CycleTimes) -> dict[int, int]:
        """Every tier's cost at this batch, in one unit: measured microseconds (an unmeasured
        tier scaled from the nearest measured one by the prior's ratio), or the prior's percent
        when no tier is measured at the batch's bucket."""
        bucket = batch_bucket(batch)
        prior = {s: self.prior_cost(s, batch) for s in self.tiers}
        measured = {s: times[s, bucket].us for s in self.tiers if (s, bucket) in times}
        if not measured:
            return prior
        costs = {}
        for i, steps in enumerate(self.tiers):
            nearest = min(measured, key=lambda s: (abs(self.tiers.index(s) - i), s))
            costs[steps] = measured[steps] if steps in measured else measured[nearest] * prior[steps] // prior[nearest]
        return costs

    def to_measure(self, state: TierState, batch: int, times: CycleTimes) -> Optional[int]:
        """A neighbour of the measured current tier whose time at this bucket is missing, older
        than explore_every cycles, or older than recheck_after cycles and out of order against
        the current tier's (more steps yet cheaper, or fewer yet dearer: a cycle of more steps
        does strictly more work, so one of the two was timed in another state of the machine,
        and the current one is fresh); the lower first; or None."""
        bucket = batch_bucket(batch)
        current = times.get((state.steps, bucket))
        if current is None:
            return None
        i = self.tiers.index(state.steps)
        for steps in self.tiers[max(i - 1, 0) : i + 2]:
            time = times.get((steps, bucket))
            if time is None or state.cycles - time.cycle > self.explore_every:
                return steps
            out_of_order = (steps - state.steps) * (time.us - current.us) < 0
            if out_of_order and state.cycles - time.cycle > self.recheck_after:
                return steps
        return None

    def decide(self, state: TierState, batch: int, times: CycleTimes) -> int:
        if not state.records or state.records[0].trials < self.min_trials * RECORD_ONE or state.held < self.min_dwell:
            return state.steps
        unmeasured = self.to_measure(state, batch, times)
        if unmeasured is not None:
            return unmeasured
        costs = self.costs(batch, times)
        rates = state.rates()
        tokens = {s: self.tokens(s, rates) for s in self.tiers}
        best = state.steps
        for steps in self.tiers:  # a tie keeps the tier found first (the current one)
            if tokens[steps] * costs[best] > tokens[best] * costs[steps]:
                best = steps
        current = state.steps
        if 100 * tokens[best] * costs[current] >= (100 + self.switch_gain_pct) * tokens[current] * costs[best]:
            return best
        return current


@dataclass(frozen=True)
class FixedSchedule:
    """--speculative-adaptive-schedule (testing): (steps, cycles) pairs, repeated, by the count
    of decode cycles alone."""

    pairs: tuple[tuple[int, int], ...]

    @property
    def depths(self) -> int:
        return max(steps for steps, _ in self.pairs)

    def decide(self, state: TierState, batch: int, times: CycleTimes) -> int:
        position = state.cycles % sum(cycles for _, cycles in self.pairs)
        for steps, cycles in self.pairs:
            if position < cycles:
                return steps
            position -= cycles
        raise AssertionError("unreachable: position < the schedule's length")


@dataclass
class TierCounts:
    """Per tier: decode cycles, request-cycles (verifies) and tokens they emitted."""

    cycles: dict[int, int] = field(default_factory=dict)
    verifies: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)

    def add(self, steps: int, accepted: Sequence[int]) -> None:
        self.cycles[steps] = self.cycles.get(steps, 0) + 1
        self.verifies[steps] = self.verifies.get(steps, 0) + len(accepted)
        self.tokens[steps] = self.tokens.get(steps, 0) + sum(accepted) + len(accepted)

    def accept_lengths(self) -> dict[int, float]:
        return {s: self.tokens[s] / self.verifies[s] for s in sorted(self.verifies) if self.verifies[s]}


class AdaptiveTiers:
    """One rank's side: the trials it has not reported yet, the tier state and the cycle times
    (advanced by `next_tier`, on every rank with the same reports and times) and tier usage."""

    def __init__(self, start: int, policy: TierPolicy):
        self.start, self.policy = start, policy
        self.depths = policy.depths
        self.unreported = summed([], self.depths)
        self.state = TierState(start)
        self.times: dict[tuple[int, int], CycleTime] = {}
        # (steps, batch bucket) of the latest iteration when it ran a decode cycle and nothing
        # else, and how many iterations in a row ended with it.
        self.last_key: Optional[tuple[int, int]] = None
        self.key_run = 0
        self.bucket = 1  # the batch bucket of the latest decode cycle
        self.total, self.since_log = TierCounts(), TierCounts()

    @classmethod
    def from_server_args(cls, args) -> AdaptiveTiers:
        pairs = args.speculative_adaptive_schedule_pairs
        policy: TierPolicy = FixedSchedule(tuple(pairs)) if pairs else CostModel(args.speculative_tiers)
        return cls(args.speculative_num_steps, policy)

    def reset(self) -> None:
        """Back to the starting tier with no trials, no times and no usage (after a startup check)."""
        self.unreported = summed([], self.depths)
        self.state = TierState(self.start)
        self.times.clear()
        self.last_key = None
        self.key_run = 0
        self.bucket = 1
        self.total, self.since_log = TierCounts(), TierCounts()

    # ------------------------------------------------------------------ figures
    def observe(self, steps: int, accepted: Sequence[int]) -> None:
        """A verify cycle's outcome on this rank: the tier it ran at, drafts accepted per request."""
        chains = [chain_trials(steps, a, self.depths) for a in accepted]
        self.unreported = summed([self.unreported, *chains], self.depths)
        for counts in (self.total, self.since_log):
            counts.add(steps, accepted)

    def take_report(self) -> DepthTrials:
        """The trials observed since the previous report, which this one carries."""
        report, self.unreported = self.unreported, summed([], self.depths)
        return report

    def plan_trials(self) -> tuple[int, ...]:
        """LocalPlan.spec_trials: this rank's report, accepted and rejected of each position in turn."""
        return tuple(n for t in self.take_report() for n in (t.accepted, t.rejected))

    def local_figures(self, decode_reqs: int) -> list[RankFigures]:
        """The report of one DP group deciding alone (no DP attention)."""
        return [RankFigures(self.take_report(), decode_reqs)]

    # ------------------------------------------------------------------ decision
    def preview(self, figures: Sequence[RankFigures]) -> int:
        """The tier the next decode cycle runs at with these reports (nothing changes)."""
        return self._decide(self.state.with_trials(figures), figures)

    def _decide(self, state: TierState, figures: Sequence[RankFigures]) -> int:
        """The policy's tier from `state` (the reports already in it); without decode cycles the tier stays."""
        batch = max((f.decode_reqs for f in figures), default=0)
        return self.policy.decide(state, batch, self.times) if batch else state.steps

    def absorb(self, figures: Sequence[RankFigures]) -> None:
        """Reports of an iteration in which no rank runs a batch: their trials count all the same."""
        self.state = self.state.with_trials(figures)

    def next_tier(self, figures: Sequence[RankFigures], cycle_us: int = 0, decode_only: bool = True) -> int:
        """The tier of this iteration's decode cycle, which every rank runs (idle ranks with
        zero rows), and the state after it; an iteration without decode cycles keeps the tier.
        cycle_us: the agreed wall time of the previous iteration (0: not measured), which counts
        when that iteration ran a decode cycle and nothing else; decode_only: whether this one does."""
        if self.timed is not None and cycle_us > 0:
            self._record_time(*self.timed, cycle_us)
        state = self.state.with_trials(figures)
        steps = self._decide(state, figures)
        key = None
        batch = max((f.decode_reqs for f in figures), default=0)
        if batch:
            self.bucket = batch_bucket(batch)
            held = state.held + 1 if steps == state.steps else 1
            state = replace(state, steps=steps, held=held, cycles=state.cycles + 1)
            if decode_only:
                key = (steps, batch_bucket(batch))
        self.state = state
        self.key_run = self.key_run + 1 if key is not None and key == self.last_key else int(key is not None)
        self.last_key = key
        return steps

    @property
    def timed(self) -> Optional[tuple[int, int]]:
        """The key the next agreed time counts for: the latest iteration's, when the two before
        it had the same key. With overlap scheduling an iteration mostly waits for the cycle
        launched by the one before it, which the GPU ran after the one before that."""
        return self.last_key if self.key_run >= 3 else None

    def _record_time(self, steps: int, bucket: int, us: int) -> None:
        old = self.times.get((steps, bucket))
        samples = (() if old is None else old.samples[1 - TIME_SAMPLES :]) + (us,)
        self.times[steps, bucket] = CycleTime(samples, self.state.cycles)

    # ------------------------------------------------------------------ reports
    def log_text(self) -> str:
        """The decode log line's part: cycles per tier since the previous line, and what the
        decision weighs: each draft position's rate (- while it has too few trials) and the
        measured cycle times (us) of the tiers at the latest cycle's batch bucket."""
        counts, self.since_log = self.since_log, TierCounts()
        rates = " ".join("-" if r is None else f"{r:.2f}" for r in self.position_rates())
        times = " ".join(f"{s}:{t.us}" for (s, b), t in sorted(self.times.items()) if b == self.bucket)
        return (
            "tier cycles: "
            + " ".join(f"{s}:{n}" for s, n in sorted(counts.cycles.items()))
            + f", position rates: {rates or '-'}, cycle us at batch <= {self.bucket}: {times or '-'}, "
        )

    def position_rates(self) -> list[Optional[float]]:
        """Per draft position the rate on record (None: too few trials)."""
        return [None if (rate := r.rate()) is None else rate / ALPHA_ONE for r in self.state.records]

    def internal_state(self) -> dict:
        """Since startup (JSON keys: the tiers' steps as strings; cycle times "steps/bucket")."""
        return {
            "spec_tier": self.state.steps,
            "spec_tier_cycles": {str(s): n for s, n in sorted(self.total.cycles.items())},
            "spec_tier_accept_length": {str(s): a for s, a in self.total.accept_lengths().items()},
            "spec_tier_cycle_us": {f"{s}/{b}": t.us for (s, b), t in sorted(self.times.items())},
            # Per draft position: accepted / tried given the ones before it were accepted (None: too few trials).
            "spec_position_accept_rate": [None if r is None else round(r, 4) for r in self.position_rates()],
        }
