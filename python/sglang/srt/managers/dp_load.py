"""Load-based dispatch of requests to DP ranks (--load-balance-method).

Each DP rank's entry rank pushes a `RankLoad` to the DataParallelController whenever its load
changes (at most once per scheduler iteration). A report says how many generate requests the
rank had taken in when it was made, so the controller adds exactly the requests it dispatched
after that (a burst arriving between two reports spreads instead of piling onto one rank).

Methods (SGLang's names):
- round_robin: ranks in turn, no reports;
- shortest_queue: fewest outstanding requests (queued, prefilling or decoding);
- minimum_tokens: fewest outstanding tokens, a request counting the prompt tokens it has not
  prefilled plus the output tokens it may still generate (max_new_tokens).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

import zmq

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.server_args import LOAD_BALANCE_METHODS


@dataclass(frozen=True)
class RankLoad:
    dp_rank: int
    num_received: int  # generate requests this DP rank took in from the controller so far
    num_reqs: int  # outstanding requests
    num_tokens: int  # outstanding tokens (see the module docstring)


def request_tokens(prompt_len: int, kv_len: int, max_new_tokens: int, num_generated: int) -> int:
    """Tokens a request still costs: prompt tokens without KV plus output tokens it may generate."""
    return max(prompt_len - kv_len, 0) + max(max_new_tokens - num_generated, 0)


def new_request_tokens(msg: TokenizedGenerateReqInput) -> int:
    return request_tokens(len(msg.input_ids), 0, msg.sampling_params.max_new_tokens, 0)


class LoadReporter:
    """Entry-rank side: counts the generate requests taken in and pushes the load when it changed."""

    def __init__(self, ipc_name: str, dp_rank: int, ctx: zmq.Context):
        self.dp_rank = dp_rank
        self.num_received = 0
        self.last: Optional[RankLoad] = None
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.connect(ipc_name)

    def count_received(self, msgs: Iterable[Any]) -> None:
        self.num_received += sum(isinstance(m, TokenizedGenerateReqInput) for m in msgs)

    def report(self, reqs: Iterable[Any]) -> None:
        """`reqs`: every request the rank holds (objects of schedule_batch.Req)."""
        reqs = list(reqs)
        tokens = sum(
            request_tokens(len(r.origin_input_ids), r.kv_len, r.sampling_params.max_new_tokens, len(r.output_ids)) for r in reqs
        )
        load = RankLoad(self.dp_rank, self.num_received, len(reqs), tokens)
        if load == self.last:
            return
        try:  # never stall the scheduler on the controller; the next change reports again
            self.socket.send_pyobj(load, zmq.NOBLOCK)
            self.last = load
        except zmq.Again:
            pass


class LoadBalancer:
    """Controller side: the DP rank for each new request, from the latest reports plus the
    requests dispatched since each report."""

    def __init__(self, method: str, dp_size: int):
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"--load-balance-method must be one of {LOAD_BALANCE_METHODS}, got {method!r}")
        self.method = method
        self.round_robin = itertools.cycle(range(dp_size))
        self.reported = [RankLoad(r, 0, 0, 0) for r in range(dp_size)]
        # Per rank: token cost of each request dispatched but not yet covered by a report, oldest first.
        self.unreported: list[deque[int]] = [deque() for _ in range(dp_size)]

    def on_report(self, load: RankLoad) -> None:
        if load.num_received < self.reported[load.dp_rank].num_received:
            return  # reports travel in order on one socket; an older one changes nothing
        covered = load.num_received - self.reported[load.dp_rank].num_received
        pending = self.unreported[load.dp_rank]
        for _ in range(min(covered, len(pending))):
            pending.popleft()
        self.reported[load.dp_rank] = load

    def load_of(self, rank: int) -> tuple[int, int]:
        """(outstanding requests, outstanding tokens) as the controller sees them now."""
        pending = self.unreported[rank]
        return self.reported[rank].num_reqs + len(pending), self.reported[rank].num_tokens + sum(pending)

    def choose(self, tokens: int, dp_rank: Optional[int] = None) -> int:
        """The rank for a request costing `tokens` (`dp_rank`: the client's own choice), recorded as dispatched."""
        if dp_rank is None:
            dp_rank = self._pick()
        if self.method != "round_robin":  # round-robin ranks send no reports
            self.unreported[dp_rank].append(tokens)
        return dp_rank

    def _pick(self) -> int:
        if self.method == "round_robin":
            return next(self.round_robin)
        ranks = range(len(self.reported))
        if self.method == "shortest_queue":
            return min(ranks, key=lambda r: (self.load_of(r)[0], self.load_of(r)[1], r))
        return min(ranks, key=lambda r: (self.load_of(r)[1], self.load_of(r)[0], r))
