"""Prefill (extend) batches over a ModelRunner's pools, built by hand: whole prompts, prompts
whose prefix another request's KV already holds (a radix-cache hit), and prompt chunks; and a
set of prefill cases over them (token ids below 100, for any tiny model's vocabulary)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang.srt.batch.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner


@dataclass
class PrefillRequest:
    row: int  # request->token table row
    tokens: list[int]  # the whole prompt
    slots: list[int] = field(default_factory=list)  # KV slot of each cached token

    @property
    def cached(self) -> int:
        return len(self.slots)


class PrefillBatches:
    """Requests on a runner's request->token table and KV slots (never freed)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def request(self, tokens: list[int], prefix_of: Optional[PrefillRequest] = None, prefix_len: int = 0) -> PrefillRequest:
        """A new request; with prefix_of, its first prefix_len tokens (the same as prefix_of's)
        are cached in prefix_of's KV slots."""
        row = self.runner.req_to_token_pool.alloc()
        assert row is not None, "request table full"
        req = PrefillRequest(row, list(tokens))
        if prefix_of is not None:
            assert tokens[:prefix_len] == prefix_of.tokens[:prefix_len] and prefix_len <= prefix_of.cached
            self._cache(req, prefix_of.slots[:prefix_len])
        return req

    def extend(self, reqs: list[PrefillRequest], lens: Optional[list[int]] = None) -> ForwardBatch:
        """The EXTEND batch of each request's next lens[i] uncached tokens (default: all the
        rest), their KV slots allocated and written into the table."""
        lens = [len(r.tokens) - r.cached for r in reqs] if lens is None else lens
        ids, positions, new_slots = [], [], []
        for r, n in zip(reqs, lens):
            ids += r.tokens[r.cached : r.cached + n]
            positions += range(r.cached, r.cached + n)
            slots = self.runner.token_allocator.alloc(n)
            assert slots is not None, "KV pool full"
            self._cache(r, slots.tolist())
            new_slots += slots.tolist()
        seq_lens = [r.cached for r in reqs]
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.runner.device)
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            batch_size=len(reqs),
            input_ids=t(ids),
            positions=t(positions),
            out_cache_loc=t(new_slots),
            req_pool_indices=t([r.row for r in reqs]),
            seq_lens=t(seq_lens),
            extend_seq_lens=t(lens),
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=list(lens),
        )

    def _cache(self, req: PrefillRequest, slots: list[int]) -> None:
        """Append KV slots to req's cached tokens (and to its table row)."""
        table = self.runner.req_to_token_pool
        table.write(req.row, req.cached, torch.tensor(slots, dtype=torch.int64, device=table.req_to_token.device))
        req.slots += slots


PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8, 1, 4, 6, 2, 9, 12], [11, 4, 6, 1, 9, 2, 10, 7, 7, 3, 15, 8, 2]]
LONG_PROMPT = [(7 * i) % 90 + 3 for i in range(100)]  # longer than one 64-row query block
PREFILL_CASES = ("one prompt", "several prompts", "cached prefix", "chunked prefill", "full bucket", "long prompt")


def case_batches(runner: ModelRunner, case: str) -> list[ForwardBatch]:
    """The batches of a prefill case (PREFILL_CASES), in order: all but the last fill the
    prefix KV that the last one reads, and run first."""
    batches = PrefillBatches(runner)
    if case == "one prompt":  # 11 tokens
        return [batches.extend([batches.request(PROMPTS[2][:11])])]
    if case == "several prompts":  # 5 + 9 + 13 tokens
        return [batches.extend([batches.request(p) for p in PROMPTS])]
    if case == "cached prefix":  # 5 new tokens after 8 of another request's KV, beside a fresh 6-token prompt
        first = batches.request(PROMPTS[2])
        warm = batches.extend([first])
        second = batches.request(PROMPTS[2][:8] + [20, 21, 22, 23, 24], prefix_of=first, prefix_len=8)
        return [warm, batches.extend([second, batches.request(PROMPTS[1][:6])])]
    if case == "chunked prefill":  # the second chunk (8 tokens) of a 20-token prompt
        req = batches.request(PROMPTS[2] + PROMPTS[1][:7])
        return [batches.extend([req], [12]), batches.extend([req])]
    if case == "full bucket":  # 4 requests of 4 tokens
        return [batches.extend([batches.request(p[:4]) for p in (*PROMPTS, [30, 31, 32, 33])])]
    if case == "long prompt":  # 100 + 5 tokens
        return [batches.extend([batches.request(LONG_PROMPT), batches.request(PROMPTS[0])])]
    raise ValueError(f"unknown prefill case {case!r}")
