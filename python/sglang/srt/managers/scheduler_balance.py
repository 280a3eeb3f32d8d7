"""How evenly the DP ranks are kept busy, as one scheduler rank sees it.

Per iteration in which some rank runs a batch:
- tokens per iteration: the rows this rank fed the model;
- balance ratio (DP attention only, where every rank learns every DP rank's rows from the
  plan all-gather): sum over iterations of the mean rows per rank over sum of the largest
  rank's rows, i.e. the share of the ranks' paid-for capacity that did work (1.0 = even);
- stalled fraction: among iterations in which this rank holds running requests, those in
  which it ran no decode batch (none of its running requests got a token).
Kept since startup (internal state, /metrics) and since the last decode log line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class BalanceWindow:
    iterations: int = 0  # iterations in which some rank ran a batch
    tokens: int = 0  # this rank's rows over those iterations
    mean_rows: float = 0.0  # sum over iterations of the mean rows per DP rank
    max_rows: int = 0  # sum over iterations of the largest DP rank's rows
    running_iterations: int = 0  # iterations in which this rank held running requests
    stalled_iterations: int = 0  # ... and ran no decode batch

    def add(self, own_rows: int, all_rows: Optional[list[int]], has_running: bool, stalled: bool) -> None:
        busy = max(all_rows) > 0 if all_rows is not None else own_rows > 0
        if busy:
            self.iterations += 1
            self.tokens += own_rows
            if all_rows is not None:
                self.mean_rows += sum(all_rows) / len(all_rows)
                self.max_rows += max(all_rows)
        self.running_iterations += has_running
        self.stalled_iterations += stalled

    @property
    def tokens_per_iteration(self) -> float:
        return self.tokens / self.iterations if self.iterations else 0.0

    @property
    def balance_ratio(self) -> Optional[float]:
        """None without DP attention or before any rank ran a batch."""
        return self.mean_rows / self.max_rows if self.max_rows else None

    @property
    def stalled_fraction(self) -> float:
        return self.stalled_iterations / self.running_iterations if self.running_iterations else 0.0


class IterationBalance:
    def __init__(self) -> None:
        self.total = BalanceWindow()
        self.since_log = BalanceWindow()

    def observe(self, own_rows: int, all_rows: Optional[list[int]], has_running: bool, decoded: bool) -> None:
        """One iteration: this rank's rows, every DP rank's rows (DP attention; else None),
        whether this rank held running requests and whether it ran a decode batch."""
        stalled = has_running and not decoded
        for window in (self.total, self.since_log):
            window.add(own_rows, all_rows, has_running, stalled)

    def log_text(self) -> str:
        """The decode log line's part, for the iterations since the previous line."""
        w, self.since_log = self.since_log, BalanceWindow()
        ratio = "" if w.balance_ratio is None else f"balance: {w.balance_ratio:.2f}, "
        return f"tok/iter: {w.tokens_per_iteration:.1f}, {ratio}stalled: {w.stalled_fraction:.2f}, "

    def internal_state(self) -> dict:
        return {
            "tokens_per_iteration": self.total.tokens_per_iteration,
            "balance_ratio": self.total.balance_ratio,
            "stalled_iteration_fraction": self.total.stalled_fraction,
            # The fraction's counts, which a benchmark differences over one pass.
            "running_iterations": self.total.running_iterations,
            "stalled_iterations": self.total.stalled_iterations,
        }
