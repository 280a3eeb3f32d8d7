"""Where a scheduler iteration's wall time goes, on the host, split into four phases:
- launch: handing the batch to the model runner (the forward's and the sampler's launches);
- wait: blocked until a launched step's tokens reach the host (the device was still busy);
- process: handing the tokens to their requests, finishing and streaming them;
- schedule: the rest (receiving requests, choosing the next batch, the DP plan all-gather).
Only busy iterations count (one that launched a batch or processed a step), so an idle
server's polling does not dilute the figures. With overlap, a large `wait` means the device
is the limit; a small one with a long iteration means the host is.
Summed since the last decode log line, reported there as microseconds per busy iteration.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields


@dataclass
class PhaseTotals:
    launch: float = 0.0
    wait: float = 0.0
    process: float = 0.0
    schedule: float = 0.0


class IterationPhases:
    def __init__(self) -> None:
        self.window = PhaseTotals()
        self.iterations = 0
        self._measured = 0.0  # seconds the current iteration's measured phases took
        self._busy = False  # whether it launched or processed a step

    def begin(self) -> None:
        self._measured, self._busy = 0.0, False

    def add(self, phase: str, seconds: float) -> None:
        setattr(self.window, phase, getattr(self.window, phase) + seconds)
        self._measured += seconds
        self._busy = True

    def end(self, started: float) -> None:
        """Close the iteration that began at `started` (time.perf_counter); its schedule phase
        is what the other three did not take. It counts when it launched or processed a step."""
        if self._busy:
            self.window.schedule += max(0.0, time.perf_counter() - started - self._measured)
            self.iterations += 1

    def per_iteration_us(self) -> dict[str, float]:
        n = max(self.iterations, 1)
        return {f.name: getattr(self.window, f.name) * 1e6 / n for f in fields(PhaseTotals)}

    def take_log_text(self) -> str:
        """The window's figures for the decode log line; the window starts again."""
        if not self.iterations:
            return ""
        us = self.per_iteration_us()
        text = "host us/iter: " + ", ".join(f"{name} {value:.0f}" for name, value in us.items()) + ", "
        self.window, self.iterations = PhaseTotals(), 0
        return text
