"""Requests as the scheduler tracks them, and the batches it runs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from sglang.srt.batch.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.mem_cache.memory_pool import TableWrite
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.transfer import upload

_NO_SLOTS = torch.empty(0, dtype=torch.int64)


@dataclass
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # With return_logprob: the prompt position from which input logprobs are returned, in
    # [0, prompt length), or -1 for the last prompt token only (output logprobs alone).
    logprob_start_len: int = -1
    output_ids: list[int] = field(default_factory=list)
    finished_reason: Optional[dict[str, Any]] = None
    # Memory: row in the request->token table and how many tokens have KV in the pool.
    req_pool_idx: Optional[int] = None
    kv_len: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    last_node: Any = None  # radix node locked by this request
    prefix_slots: Optional[torch.Tensor] = None  # matched cached prefix, before it is claimed
    cache_prefix_len: int = 0  # tokens of this request owned by the radix tree
    # Token budget of the current extend chunk (set by the policy).
    extend_len: int = 0
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    # (logprob, token id) of prompt tokens input_logprob_start + 1 .. in order, and their top logprobs.
    input_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    spec_verify_ct: int = 0
    streamed_len: int = 0  # output ids already sent to the detokenizer
    # Tokens sampled on the device whose values have not reached output_ids yet (overlap
    # scheduling: at most one). Their KV is written by the forward that feeds them.
    in_flight: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    to_abort: bool = False

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def full_len(self) -> int:
        """seq_len counting the tokens still in flight."""
        return self.seq_len + self.in_flight

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def pending_input_logprobs(self) -> range:
        """Prompt positions whose logits the input logprobs still need: from logprob_start_len
        up to the last prompt position, whose logits sample the first output token instead
        (position p's logits give the logprob of token p + 1)."""
        if not self.return_logprob:
            return range(0)
        return range(self.input_logprob_start + len(self.input_token_logprobs), len(self.origin_input_ids) - 1)

    @property
    def input_logprob_start(self) -> int:
        """The first prompt position of the input logprobs (logprob_start_len, -1 resolved)."""
        return len(self.origin_input_ids) - 1 if self.logprob_start_len == -1 else self.logprob_start_len

    @property
    def pending_extend(self) -> int:
        """Tokens still to extend before sampling (a matched prefix counts as done)."""
        done = self.kv_len if self.req_pool_idx is not None else self.cached_tokens
        return self.seq_len - done

    def check_finished(self, eos_ids: set[int], context_len: int, tail_text: Optional[str]) -> None:
        """Set finished_reason after output_ids grew; tail_text is the decoded end of the output."""
        if self.finished_reason is not None:
            return
        params = self.sampling_params
        n_out = len(self.output_ids)
        if n_out >= params.max_new_tokens:
            self.finished_reason = {"type": "length", "length": params.max_new_tokens}
            return
        if len(self.origin_input_ids) + n_out >= context_len:  # seq_len
            self.finished_reason = {"type": "length", "length": n_out}
            return
        if n_out <= params.min_new_tokens:
            return
        last = self.output_ids[-1]
        if last in params.stop_token_ids or (not params.ignore_eos and last in eos_ids):
            self.finished_reason = {"type": "stop", "matched": last}
            return
        if tail_text is not None:
            for stop in params.stop:
                if stop in tail_text:
                    self.finished_reason = {"type": "stop", "matched": stop}
                    return


@dataclass
class FutureTokens:
    """The tokens of the step in flight, still on the device: ids[index[rid]] is request
    rid's newest token, which its next decode step feeds."""

    ids: torch.Tensor
    index: dict[str, int]


@dataclass
class ScheduleBatch:
    """Requests that run one forward together, with the KV slots their new tokens use."""

    mode: ForwardMode
    reqs: list[Req]
    input_ids: list[int]
    positions: list[int]
    # The new tokens' KV slots on the device (decode: set by to_forward_batch from kv_write).
    out_cache_loc: Optional[torch.Tensor]
    seq_lens: list[int]
    extend_lens: list[int]
    prefix_lens: list[int] = field(default_factory=list)
    # DP attention: tokens of every DP rank in this forward (from the iteration's all-gather).
    global_num_tokens: Optional[list[int]] = None
    # DP attention: DECODE when no DP rank extends this iteration (decode graphs may replay).
    global_forward_mode: Optional[ForwardMode] = None
    global_num_reqs: Optional[list[int]] = None  # see ForwardBatch.global_num_reqs
    # Decode (or a mixed extend's decode rows) under overlap scheduling: input_ids[future_dst[j]]
    # = future.ids[future_src[j]], filled on the device (the host list holds placeholders
    # there); when both are every row in order, the device input ids are a view of future.ids.
    future: Optional[FutureTokens] = None
    future_dst: list[int] = field(default_factory=list)
    future_src: list[int] = field(default_factory=list)
    # Decode: the new tokens' slots and table entries, still on the host (uploaded with the batch).
    kv_write: Optional[TableWrite] = None
    # Extend: the rows whose logits give prompt logprobs (Req.pending_input_logprobs within the
    # chunk), how many of them each request has, and the token that follows each row.
    input_logprob_rows: list[int] = field(default_factory=list)
    input_logprob_counts: list[int] = field(default_factory=list)
    input_logprob_next_ids: list[int] = field(default_factory=list)
    # Extend with --enable-mixed-chunk: the first rows are running requests extending by their
    # newest token (their decode step), the rest prefill.
    mixed_decode_rows: int = 0
    # Extend under speculation with --enable-mixed-chunk: the running requests' decode batch,
    # whose cycle is queued in the same iteration right after the prefill (None: no cycle).
    alongside_decode: Optional[ScheduleBatch] = None

    @property
    def decode_part(self) -> Optional[ScheduleBatch]:
        """The batch whose requests take a decode step (or speculative cycle) of their own this
        iteration: this one when it decodes, a prefill's alongside_decode, else None."""
        return self if self.mode == ForwardMode.DECODE else self.alongside_decode

    @classmethod
    def idle(cls) -> ScheduleBatch:
        """No local requests; still runs the forward so that every collective is issued."""
        return cls(ForwardMode.IDLE, [], [], [], torch.empty(0, dtype=torch.int64), [], [])

    @classmethod
    def for_extend(
        cls, reqs: list[Req], out_cache_loc: torch.Tensor, future: Optional[FutureTokens] = None, mixed_decode_rows: int = 0
    ) -> ScheduleBatch:
        """Each req extends all_ids[kv_len : kv_len + extend_len] (a retracted request re-extends
        its output too); the first mixed_decode_rows reqs are running requests extending by
        their newest token, which, when still in flight, is taken from `future` on the device."""
        input_ids, positions, seq_lens, extend_lens, prefix_lens = [], [], [], [], []
        logprob_rows, logprob_counts, logprob_next_ids = [], [], []
        future_dst, future_src = [], []
        for r in reqs:
            start, end = r.kv_len, r.kv_len + r.extend_len
            pending = r.pending_input_logprobs
            wanted = range(max(start, pending.start), min(end, pending.stop))
            logprob_rows += (len(input_ids) + p - start for p in wanted)
            logprob_counts.append(len(wanted))
            logprob_next_ids += r.origin_input_ids[wanted.start + 1 : wanted.stop + 1]
            ids = r.all_ids[start:end]
            if len(ids) < end - start:  # the newest token is in flight: its value comes from the step before
                assert future is not None and r.in_flight and end == r.full_len, "a token in flight, but no step holds it"
                future_dst.append(len(input_ids) + len(ids))
                future_src.append(future.index[r.rid])
                ids.append(0)
            input_ids += ids
            positions += range(start, end)
            seq_lens.append(end)
            extend_lens.append(r.extend_len)
            prefix_lens.append(start)
        batch = cls(ForwardMode.EXTEND, reqs, input_ids, positions, out_cache_loc, seq_lens, extend_lens, prefix_lens)
        batch.input_logprob_rows, batch.input_logprob_counts = logprob_rows, logprob_counts
        batch.input_logprob_next_ids = logprob_next_ids
        batch.mixed_decode_rows = mixed_decode_rows
        if future_dst:
            batch.future, batch.future_dst, batch.future_src = future, future_dst, future_src
        return batch

    @classmethod
    def for_decode(cls, reqs: list[Req], future: Optional[FutureTokens] = None) -> ScheduleBatch:
        """Each req feeds its newest token, whose KV is not in the pool yet; a token still in
        flight is taken from `future` on the device."""
        input_ids = [0 if r.in_flight else r.output_ids[-1] for r in reqs]
        seq_lens = [r.full_len for r in reqs]
        positions = [n - 1 for n in seq_lens]
        batch = cls(ForwardMode.DECODE, reqs, input_ids, positions, None, seq_lens, [1] * len(reqs), positions)
        # A speculative worker reads its inputs from its own request states (future None).
        batch.future_dst = [i for i, r in enumerate(reqs) if r.in_flight]
        if batch.future_dst and future is not None:
            batch.future = future
            batch.future_src = [future.index[reqs[i].rid] for i in batch.future_dst]
        return batch

    def to_forward_batch(self, device: str) -> ForwardBatch:
        """The batch's host lists, and its new slots with their table entries (kv_write), reach
        the device through one upload."""
        assert self.future is not None or not self.future_dst, "a token in flight, but no step in flight holds it"
        pending = self.kv_write
        (
            input_ids,
            positions,
            req_pool_indices,
            seq_lens,
            extend_seq_lens,
            dst,
            src,
            logprob_rows,
            logprob_next_ids,
            index,
            slots,
        ) = upload(
            [
                self.input_ids,
                self.positions,
                [r.req_pool_idx for r in self.reqs],
                self.seq_lens,
                self.extend_lens,
                self.future_dst,
                self.future_src,
                self.input_logprob_rows,
                self.input_logprob_next_ids,
                [] if pending is None else pending.index,
            ],
            device,
            tensors=[_NO_SLOTS if pending is None else pending.slots],
        )
        if pending is not None:
            pending.pool.write_at(index, slots)
            self.out_cache_loc, self.kv_write = slots, None
        else:  # assigned before (extend: already on the device) or none (an idle batch)
            self.out_cache_loc = self.out_cache_loc.to(device)
        if self.future is not None:
            rows = list(range(len(self.reqs)))
            if self.future_dst == rows and self.future_src == rows:  # each row's token: the step's same row
                input_ids = self.future.ids[: len(rows)]
            else:
                input_ids.index_copy_(0, dst, self.future.ids.index_select(0, src))
        return ForwardBatch(
            mode=self.mode,
            batch_size=len(self.reqs),
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            extend_seq_lens=extend_seq_lens,
            seq_lens_cpu=list(self.seq_lens),
            extend_seq_lens_cpu=list(self.extend_lens),
            global_num_tokens=self.global_num_tokens,
            global_forward_mode=self.global_forward_mode,
            global_num_reqs=self.global_num_reqs,
            input_logprob_rows=logprob_rows if self.input_logprob_rows else None,
            input_logprob_next_ids=logprob_next_ids,
            input_top_logprobs_num=self.input_top_logprobs_num,
        )

    @property
    def input_top_logprobs_num(self) -> int:
        """Top logprobs per prompt-logprob row: the most any request with such rows asks for."""
        counts = self.input_logprob_counts
        return max((r.top_logprobs_num for r, n in zip(self.reqs, counts) if n), default=0)
