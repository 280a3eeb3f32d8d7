"""Which waiting requests join the next prefill, and how many tokens each extends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from sglang.srt.batch.schedule_batch import Req


def order_waiting(waiting: list[Req], policy: str, prefix_len: Callable[[Req], int]) -> list[Req]:
    """fcfs: arrival order. lpm: longest cached prefix first (ties by arrival)."""
    if policy == "lpm":
        return sorted(waiting, key=lambda r: (-prefix_len(r), r.arrival_time))
    return sorted(waiting, key=lambda r: r.arrival_time)


class PrefillAdder:
    """Packs requests into one extend batch under a token budget and a KV budget.

    Invariant: at most one request in the batch is partially prefilled (the chunked one),
    and it is the last one added.
    """

    def __init__(self, token_budget: int, chunk_size: Optional[int], free_kv_tokens: int, free_req_slots: int):
        self.token_budget = token_budget
        self.chunk_size = chunk_size  # None: never split a prompt
        self.free_kv_tokens = free_kv_tokens
        self.free_req_slots = free_req_slots
        self.reqs: list[Req] = []
        self.chunked_req: Optional[Req] = None

    @property
    def num_tokens(self) -> int:
        return sum(r.extend_len for r in self.reqs)

    def try_add(self, req: Req, already_has_slot: bool = False, reserve_decode: int = 0) -> bool:
        """Add req extending as much of its remaining prompt as fits. False: batch is full.

        reserve_decode: KV tokens kept free so that running requests can keep decoding.
        """
        if self.chunked_req is not None:
            return False
        if not already_has_slot and self.free_req_slots == 0:
            return False
        remaining = req.pending_extend
        # A matched prefix gets locked when the request joins, so it stops counting as evictable.
        locked = 0 if already_has_slot else req.cached_tokens
        room = min(self.token_budget - self.num_tokens, self.free_kv_tokens - reserve_decode - locked)
        if self.chunk_size is not None:
            room = min(room, self.chunk_size - self.num_tokens)
        if room <= 0:
            return False
        if self.chunk_size is None and remaining > room:
            # Unchunked: a prompt above the token budget may still run alone if the KV fits.
            if self.reqs or remaining > self.free_kv_tokens - reserve_decode - locked:
                return False
            room = remaining
        req.extend_len = min(remaining, room)
        if req.extend_len < remaining:
            self.chunked_req = req
        self.reqs.append(req)
        self.free_kv_tokens -= req.extend_len + locked
        if not already_has_slot:
            self.free_req_slots -= 1
        return True
