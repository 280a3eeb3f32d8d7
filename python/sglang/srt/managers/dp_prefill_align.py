"""Prefill alignment under DP attention (--dp-prefill-align-iters N).

An iteration in which any DP rank prefills costs every rank: the others join the prefill's
collectives with zero rows, and their decode runs in that extend iteration (without the
decode graphs) or after it. Prefills that start in the same iteration share that cost, so a
rank with waiting requests may hold them for up to N iterations while its peers decode, until
its peers want to prefill too.

The decision for iteration t is a pure function of the plan of iteration t - 1, which every
rank holds alike, so all ranks open a prefill iteration together. In the plan each rank
reports `prefill_wait`: 0 when it has nothing to prefill, else the iterations it has held its
waiting requests so far (at least 1), or N when it will prefill regardless (a chunked prompt
goes on). Prefills are allowed when
- the previous plan ran no decode batch anywhere (nothing to delay: idle or prefilling ranks),
- every rank that holds requests wants to prefill, or
- some rank has held its requests N iterations (the bound on the added time to first token).
"""

from __future__ import annotations

from typing import Optional

from sglang.srt.distributed.scheduler_comm import GlobalPlan


def prefill_allowed(previous: Optional[GlobalPlan], align_iters: int) -> bool:
    """Whether the ranks may start prefills this iteration (the same answer on every rank)."""
    if align_iters == 0 or previous is None:
        return True
    ranks = previous.per_rank
    if not any(p.num_reqs and not p.is_extend for p in ranks):
        return True
    if all(p.prefill_wait > 0 for p in ranks if p.has_work):
        return True
    return any(p.prefill_wait >= align_iters for p in ranks)


class PrefillHold:
    """One rank's count of the iterations it has held waiting requests."""

    def __init__(self, align_iters: int):
        self.align_iters = align_iters
        self.held_iters = 0  # of the requests waiting now
        self.total_held_iters = 0  # since startup (internal state)

    def report(self, wants_prefill: bool, prefilled: bool, continues_chunk: bool) -> int:
        """This iteration's prefill_wait for the plan, after the rank chose its batch."""
        if continues_chunk:
            self.held_iters = 0
            return self.align_iters
        if prefilled or not wants_prefill:
            self.held_iters = 0
            return 0
        self.held_iters += 1
        self.total_held_iters += 1
        return self.held_iters
