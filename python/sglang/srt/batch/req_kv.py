"""KV slot bookkeeping per request, shared by the scheduler and the model workers.

Invariant: for a request with a row, req_to_token[row, :req.kv_len] are slots whose KV is
written; slots [0, cache_prefix_len) belong to the prefix cache, the rest to the request.

The table lives on the device. Reading a request's slots back (to cache or free them when it
ends or is cut short) would wait for the step in flight, which overlap scheduling has already
queued, and leave the device idle until the host launches the next one. So those reads are
queued without waiting (`pending_reads`) and completed later by `complete_reads`, once the
steps queued before them have been waited for anyway: until then the slots stay taken and the
row stays out of the free list.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Optional

import torch

from sglang.srt.batch.schedule_batch import Req
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool, TableWrite, TokenToKVPoolAllocator
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.utils.transfer import HostCopy


class ReqKVManager:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        tree_cache: Optional[RadixCache],
    ):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        # Table spans on their way to the host, each with what is done with it there.
        self.pending_reads: list[tuple[HostCopy, Callable[[torch.Tensor], None]]] = []

    def free_kv_tokens(self) -> int:
        evictable = self.tree_cache.evictable_size if self.tree_cache else 0
        return self.allocator.available_size() + evictable

    def alloc(self, n: int) -> torch.Tensor:
        """n free slots (host), evicting cached prefixes if needed."""
        short = n - self.allocator.available_size()
        if short > 0 and self.tree_cache is not None:
            self.tree_cache.evict(short)
        slots = self.allocator.alloc(n)
        if slots is None:
            raise RuntimeError(f"KV cache exhausted: need {n} slots, {self.allocator.available_size()} free")
        return slots

    def assign(self, reqs: list[Req], counts: list[int]) -> torch.Tensor:
        """Slots for each request's next counts[i] positions (from kv_len), written into its
        row; returned on the table's device."""
        return self.write_after_kv(reqs, counts, self.alloc(sum(counts)))

    def assign_next_on_upload(self, reqs: list[Req]) -> TableWrite:
        """A slot for each request's next position (its kv_len), its table entry left to the
        upload of the batch that uses it."""
        width = self.req_to_token_pool.max_context_len
        index = [r.req_pool_idx * width + r.kv_len for r in reqs]
        return TableWrite(self.req_to_token_pool, index, self.alloc(len(reqs)))

    def write_after_kv(self, reqs: list[Req], counts: list[int], slots: torch.Tensor) -> torch.Tensor:
        """Host slots, the next counts[i] of them into request i's row from its kv_len (one
        upload); returns them on the table's device."""
        rows, starts = [r.req_pool_idx for r in reqs], [r.kv_len for r in reqs]
        return self.req_to_token_pool.write_spans(rows, starts, counts, slots)

    def slots_of(self, req: Req, start: int, end: int) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, start:end]

    def truncate(self, req: Req, new_kv_len: int) -> None:
        """Free the request-owned slots past new_kv_len (tokens dropped after a stop), once
        read back (complete_reads)."""
        if new_kv_len < req.kv_len:
            self._read_later(self.slots_of(req, max(new_kv_len, req.cache_prefix_len), req.kv_len), self.allocator.free)
            req.kv_len = new_kv_len

    def claim(self, req: Req) -> None:
        """Give a waiting request a row and lock its matched prefix (set by match_prefix)."""
        req.req_pool_idx = self.req_to_token_pool.alloc()
        if self.tree_cache is not None and req.prefix_slots is not None:
            self.tree_cache.inc_lock_ref(req.last_node)
            self.req_to_token_pool.write_spans([req.req_pool_idx], [0], [len(req.prefix_slots)], req.prefix_slots)
            req.kv_len = req.cache_prefix_len = len(req.prefix_slots)
        req.prefix_slots = None

    def match_prefix(self, req: Req) -> None:
        """Look up a waiting request's cached prefix: at least one token stays to extend, and
        every prompt position whose logits its input logprobs still need."""
        if self.tree_cache is None:
            return
        limit = len(req.all_ids) - 1
        pending = req.pending_input_logprobs
        if pending:
            limit = min(limit, pending.start)
        slots, node = self.tree_cache.match_prefix(req.all_ids[:limit])
        req.cached_tokens, req.last_node, req.prefix_slots = len(slots), node, slots

    def release(self, req: Req) -> None:
        """Return a finished/aborted/retracted request's KV to the prefix cache or the allocator,
        and its row to the table, once its slots are read back (complete_reads); the request
        holds neither from now on."""
        if req.req_pool_idx is None:
            return
        done = partial(self._release_slots, req.req_pool_idx, req.all_ids[: req.kv_len], req.cache_prefix_len, req.last_node)
        self._read_later(self.slots_of(req, 0, req.kv_len), done)
        req.req_pool_idx, req.last_node = None, None

    def _release_slots(self, row: int, ids: list[int], cache_prefix_len: int, last_node: Any, slots: torch.Tensor) -> None:
        if self.tree_cache is not None:
            cached = self.tree_cache.insert(ids, slots)
            self.allocator.free(slots[cache_prefix_len:cached])
            if last_node is not None:
                self.tree_cache.dec_lock_ref(last_node)
        else:
            self.allocator.free(slots)
        self.req_to_token_pool.free(row)

    def _read_later(self, device_slots: torch.Tensor, then: Callable[[torch.Tensor], None]) -> None:
        self.pending_reads.append((HostCopy(device_slots), then))

    def complete_reads(self) -> None:
        """Finish the releases and truncations queued so far. Their copies wait for every step
        queued before them: call this once those steps were waited for (after resolving the
        step in flight, before anything of this iteration is released), or with none in flight."""
        pending, self.pending_reads = self.pending_reads, []
        for copy, then in pending:
            then(copy.tensors()[0])
