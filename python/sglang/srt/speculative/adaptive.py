"""--speculative-adaptive: the tier (draft steps per cycle) each decode cycle runs at.

Figures. Each rank keeps a window of its latest verify cycles, at least `WINDOW_CYCLES` of
them and enough to hold `WINDOW_VERIFIES` request verifies (at batch 1 a window of 16 cycles
estimates a rate near 0.9 to about 0.08, too coarse to rank tiers a few percent apart), and
counts, over their requests, the trials of the first draft position and of the deeper ones apart. A draft
position is a trial when every draft before it was accepted; it is accepted or rejected (a
request whose chain stopped before its end rejected one draft; one that accepted its whole
chain rejected none). So first_accepted / first_trials estimates the chance that a cycle's
first draft is accepted, and deeper_accepted / deeper_trials the chance that a later one is,
given the drafts before it were, whatever tiers the window's cycles ran at. The two differ
(the first is usually the likelier): one rate pooled over the depths that the window's cycles
happened to reach would make longer chains look best after short cycles and shorter ones
after long cycles, and the tier would alternate. Under DP attention every rank puts its four
counts into the iteration's plan all-gather (LocalPlan; zeros while it has no running
requests), so every rank sees every rank's figures, and the decode batch of every rank.

Decision (`CostModel.decide`): with a1 the first position's rate and ad the deeper positions'
over the DP ranks, and b the largest DP rank's decode batch (the busiest rank sets the
iteration's time),

    tokens(s) = 1 + a1 (1 + ad + ... + ad^(s-1))           tokens per request of a cycle at s steps
    goodput(s) = tokens(s) / cost(s)

and the next cycle runs at the tier of the highest goodput, but leaves the current tier only
when that beats the current tier's goodput by `switch_gain` and the current tier has run
`min_dwell` cycles (hysteresis: no flapping between tiers of nearly equal goodput), and not
before the window holds `min_trials` first-position trials. A window with fewer than
`MIN_DEEPER_TRIALS` deeper trials (cycles at 1 step have none) takes ad from the latest
window that had them (`TierState.deeper_alpha`), or a1 when none has yet.

cost(s) is measured: the wall time of an iteration that ran a decode cycle and nothing else
(start to next start), after one that did the same at the same tier and bucket (with overlap
scheduling an iteration mostly waits for the previous one's cycle), a moving average per tier
and batch bucket (the power of two at or above b), kept in `CycleTimes`. A tier not yet
measured at the bucket is estimated from the nearest measured tier through the prior cost
1 + s * (draft_cost + verify_cost * b) plain steps (their ratio); with nothing measured at the
bucket the prior alone decides. Once the current tier is measured, a neighbouring tier (one
tier up or down) that is not, or whose measurement is older than `explore_every` decode
cycles, is run for `min_dwell` cycles to measure it: the prior only orders tiers until they
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
windows, and their decisions, are the same too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional, Protocol

from sglang.srt.distributed.scheduler_comm import GlobalPlan

WINDOW_CYCLES = 16
WINDOW_VERIFIES = 64
MIN_DEEPER_TRIALS = 8  # a window with fewer deeper trials keeps the latest deeper rate
ALPHA_ONE = 1 << 20  # alpha = 1 in the decision's fixed-point arithmetic
TIME_AVERAGE_SHIFT = 2  # a new cycle time weighs 1 / 4 in its moving average


def batch_bucket(batch: int) -> int:
    """The power of two at or above the batch: cycle times are kept per tier and bucket."""
    return 1 << max(batch - 1, 0).bit_length()


@dataclass(frozen=True)
class CycleTime:
    """The moving average of a tier's decode iterations at one batch bucket."""

    us: int  # wall time from an iteration's start to the next one's, microseconds
    cycle: int  # TierState.cycles when it was last measured


CycleTimes = Mapping[tuple[int, int], CycleTime]  # (steps, batch bucket) -> time


@dataclass(frozen=True)
class Trials:
    """Draft positions tried over a window, of the first position or of the deeper ones."""

    accepted: int = 0
    rejected: int = 0

    def __add__(self, other: Trials) -> Trials:
        return Trials(self.accepted + other.accepted, self.rejected + other.rejected)

    @property
    def count(self) -> int:
        return self.accepted + self.rejected

    def rate(self) -> int:
        """accepted / count in units of 1 / ALPHA_ONE (count > 0)."""
        return self.accepted * ALPHA_ONE // self.count


def chain_trials(steps: int, accepted: int) -> tuple[Trials, Trials]:
    """(first position, deeper positions) trials of one request's chain of `steps` drafts of
    which it accepted `accepted`: the deeper positions are tried only after the first is accepted."""
    if accepted == 0:
        return Trials(0, 1), Trials()
    return Trials(1, 0), Trials(accepted - 1, int(accepted < steps))


@dataclass(frozen=True)
class RankFigures:
    """One DP rank's figures for the decision: its window's first-position and deeper trials,
    and the requests it decodes this iteration (0: it prefills or idles)."""

    first: Trials
    deeper: Trials
    decode_reqs: int


def figures_of_plan(plan: GlobalPlan) -> list[RankFigures]:
    """Every DP rank's figures from the iteration's plan (the same on every rank)."""
    return [
        RankFigures(
            Trials(p.spec_first_accepted, p.spec_first_rejected),
            Trials(p.spec_deeper_accepted, p.spec_deeper_rejected),
            0 if p.is_extend else p.num_reqs,
        )
        for p in plan.per_rank
    ]


def summed(trials: Sequence[Trials]) -> Trials:
    return sum(trials, Trials())


def deeper_alpha(figures: Sequence[RankFigures], latest: Optional[int]) -> Optional[int]:
    """The deeper positions' rate over the ranks' windows, or `latest` (the last window's that
    had MIN_DEEPER_TRIALS) when these have fewer."""
    deeper = summed([f.deeper for f in figures])
    return deeper.rate() if deeper.count >= MIN_DEEPER_TRIALS else latest


@dataclass(frozen=True)
class TierState:
    """What the decision remembers, the same on every rank."""

    steps: int  # the tier the latest decode cycle ran at (before the first: the starting tier)
    held: int = 0  # decode cycles run at it in a row
    cycles: int = 0  # decode cycles since startup
    deeper_alpha: Optional[int] = None  # the deeper rate of the latest window with enough trials


class TierPolicy(Protocol):
    def decide(self, state: TierState, figures: Sequence[RankFigures], times: CycleTimes) -> int:
        """The steps of the next decode cycle: a pure function of its arguments."""


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
    min_trials: int = 8
    explore_every: int = 2048

    @staticmethod
    def tokens(steps: int, first: int, deeper: int) -> int:
        """Expected tokens per request of a cycle at `steps`, in 1 / ALPHA_ONE, with first and
        deeper the draft positions' acceptance rates in the same unit."""
        tokens, power = ALPHA_ONE, first
        for _ in range(steps):
            tokens += power
            power = power * deeper // ALPHA_ONE
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
        """A neighbour of the measured current tier whose time at this bucket is missing or
        older than explore_every cycles (the lower first), or None."""
        bucket = batch_bucket(batch)
        if (state.steps, bucket) not in times:
            return None
        i = self.tiers.index(state.steps)
        for steps in self.tiers[max(i - 1, 0) : i + 2]:
            time = times.get((steps, bucket))
            if time is None or state.cycles - time.cycle > self.explore_every:
                return steps
        return None

    def decide(self, state: TierState, figures: Sequence[RankFigures], times: CycleTimes) -> int:
        first = summed([f.first for f in figures])
        if first.count < self.min_trials or state.held < self.min_dwell:
            return state.steps
        batch = max(f.decode_reqs for f in figures)
        unmeasured = self.to_measure(state, batch, times)
        if unmeasured is not None:
            return unmeasured
        costs = self.costs(batch, times)
        first_alpha = first.rate()
        deeper = deeper_alpha(figures, state.deeper_alpha)
        tokens = {s: self.tokens(s, first_alpha, first_alpha if deeper is None else deeper) for s in self.tiers}
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

    def decide(self, state: TierState, figures: Sequence[RankFigures], times: CycleTimes) -> int:
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
    """One rank's side: its window of verify cycles (the figures it contributes), the tier
    state and the cycle times (advanced by `next_tier`, on every rank with the same figures
    and times) and tier usage."""

    def __init__(
        self, start: int, policy: TierPolicy, window_cycles: int = WINDOW_CYCLES, window_verifies: int = WINDOW_VERIFIES
    ):
        self.start, self.policy = start, policy
        self.window_cycles, self.window_verifies = window_cycles, window_verifies
        # Per verify cycle with requests: (first position, deeper positions) trials; a
        # request's verify is one first-position trial.
        self.window: deque[tuple[Trials, Trials]] = deque()
        self.state = TierState(start)
        self.times: dict[tuple[int, int], CycleTime] = {}
        # (steps, batch bucket) of the latest iteration when it ran a decode cycle and nothing else.
        self.last_key: Optional[tuple[int, int]] = None
        # The key the next agreed time counts for: the latest iteration's, when the one before
        # it had the same key (see next_tier).
        self.timed: Optional[tuple[int, int]] = None
        self.total, self.since_log = TierCounts(), TierCounts()

    @classmethod
    def from_server_args(cls, args) -> AdaptiveTiers:
        pairs = args.speculative_adaptive_schedule_pairs
        policy: TierPolicy = FixedSchedule(tuple(pairs)) if pairs else CostModel(args.speculative_tiers)
        return cls(args.speculative_num_steps, policy)

    def reset(self) -> None:
        """Back to the starting tier with an empty window, no times and no usage (after a startup check)."""
        self.window.clear()
        self.state = TierState(self.start)
        self.times.clear()
        self.last_key = self.timed = None
        self.total, self.since_log = TierCounts(), TierCounts()

    # ------------------------------------------------------------------ figures
    def observe(self, steps: int, accepted: Sequence[int]) -> None:
        """A verify cycle's outcome on this rank: the tier it ran at, drafts accepted per request."""
        chains = [chain_trials(steps, a) for a in accepted]
        if chains:
            self.window.append((summed([f for f, _ in chains]), summed([d for _, d in chains])))
        verifies = sum(first.count for first, _ in self.window)
        while len(self.window) > self.window_cycles and verifies - self.window[0][0].count >= self.window_verifies:
            verifies -= self.window.popleft()[0].count
        for counts in (self.total, self.since_log):
            counts.add(steps, accepted)

    def window_figures(self) -> tuple[Trials, Trials]:
        """(first position, deeper positions) trials over the window."""
        return summed([f for f, _ in self.window]), summed([d for _, d in self.window])

    def local_figures(self, decode_reqs: int) -> list[RankFigures]:
        """The figures of one DP group deciding alone (no DP attention)."""
        return [RankFigures(*self.window_figures(), decode_reqs)]

    # ------------------------------------------------------------------ decision
    def preview(self, figures: Sequence[RankFigures]) -> int:
        """The tier the next decode cycle runs at with these figures (nothing changes)."""
        if not any(f.decode_reqs for f in figures):
            return self.state.steps
        return self.policy.decide(self.state, figures, self.times)

    def next_tier(self, figures: Sequence[RankFigures], cycle_us: int = 0, decode_only: bool = True) -> int:
        """The tier of this iteration's decode cycle, which every rank runs (idle ranks with
        zero rows), and the state after it; an iteration without decode cycles keeps the state.
        cycle_us: the agreed wall time of the previous iteration (0: not measured), which counts
        when that iteration ran a decode cycle and nothing else; decode_only: whether this one does."""
        if self.timed is not None and cycle_us > 0:
            self._record_time(*self.timed, cycle_us)
        steps = self.preview(figures)
        key = None
        if any(f.decode_reqs for f in figures):
            held = self.state.held + 1 if steps == self.state.steps else 1
            self.state = TierState(steps, held, self.state.cycles + 1, deeper_alpha(figures, self.state.deeper_alpha))
            if decode_only:
                key = (steps, batch_bucket(max(f.decode_reqs for f in figures)))
        # With overlap scheduling an iteration mostly waits for the cycle launched by the one
        # before it, so its time counts only when both ran at the same tier and bucket.
        self.timed = key if key is not None and key == self.last_key else None
        self.last_key = key
        return steps

    def _record_time(self, steps: int, bucket: int, us: int) -> None:
        old = self.times.get((steps, bucket))
        average = us if old is None else old.us + ((us - old.us) >> TIME_AVERAGE_SHIFT)
        self.times[steps, bucket] = CycleTime(average, self.state.cycles)

    # ------------------------------------------------------------------ reports
    def log_text(self) -> str:
        """The decode log line's part: cycles per tier since the previous line."""
        counts, self.since_log = self.since_log, TierCounts()
        return "tier cycles: " + " ".join(f"{s}:{n}" for s, n in sorted(counts.cycles.items())) + ", "

    def internal_state(self) -> dict:
        """Since startup (JSON keys: the tiers' steps as strings; cycle times "steps/bucket")."""
        return {
            "spec_tier": self.state.steps,
            "spec_tier_cycles": {str(s): n for s, n in sorted(self.total.cycles.items())},
            "spec_tier_accept_length": {str(s): a for s, a in self.total.accept_lengths().items()},
            "spec_tier_cycle_us": {f"{s}/{b}": t.us for (s, b), t in sorted(self.times.items())},
        }
