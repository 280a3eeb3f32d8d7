"""Run a model on hand-built ForwardBatches (no scheduler or model runner).

Owns a request->token table, a slot allocator and a KV pool sized for a few short
requests, and drives EXTEND (optionally chunked, prefix already cached) and DECODE
batches over several requests of different lengths. Under DP attention it also owns the
gathered buffer, and greedy_generate_lockstep keeps the DP ranks in step (IDLE forwards
on a rank without work), agreeing on per-rank token counts with one CPU all-gather a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from sglang.srt.batch.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import (
    get_attn_dp_size,
    get_attn_tp_size,
    get_cpu_group,
    get_tp_size,
    is_dp_attention_enabled,
)
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.dp_attention import gathered_buffer_rows
from sglang.srt.mem_cache.memory_pool import (
    KVPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)


@dataclass
class HarnessRequest:
    row: int  # request->token table row
    tokens: list[int]  # every token so far (prompt + generated)
    cached: int = 0  # tokens whose KV is in the pool
    slots: list[torch.Tensor] = field(default_factory=list)


def make_kv_pool(model_config: ModelConfig, size: int, device: str) -> KVPool:
    if model_config.is_mla:
        return MLATokenToKVPool(
            size,
            model_config.dtype,
            model_config.kv_lora_rank,
            model_config.qk_rope_head_dim,
            model_config.num_hidden_layers,
            device,
        )
    return MHATokenToKVPool(
        size,
        model_config.dtype,
        model_config.get_num_kv_heads(get_attn_tp_size()),
        model_config.head_dim,
        model_config.num_hidden_layers,
        device,
    )


class ModelHarness:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        device: str = "cpu",
        max_requests: int = 8,
        max_context_len: int = 256,
        kv_pool: Optional[KVPool] = None,
    ):
        self.model, self.device = model, device
        size = max_requests * max_context_len
        self.req_to_token_pool = ReqToTokenPool(max_requests, max_context_len, device)
        self.allocator = TokenToKVPoolAllocator(size)
        self.kv_pool = kv_pool or make_kv_pool(model_config, size, device)
        self.attn_backend = TorchNativeAttnBackend()
        self.gathered_buffer: Optional[torch.Tensor] = None
        if is_dp_attention_enabled():
            rows = gathered_buffer_rows(max_requests, 1, size, get_attn_dp_size())
            self.gathered_buffer = torch.empty(rows, model_config.hidden_size, dtype=model_config.dtype, device=device)

    # ---- public API -------------------------------------------------------------------

    def run_prefill(self, prompts: list[list[int]], chunk_size: Optional[int] = None) -> list[torch.Tensor]:
        """Logits [len(prompt), vocab] of every prompt position, optionally in chunks of chunk_size."""
        reqs = self.start_requests(prompts)
        per_req: list[list[torch.Tensor]] = [[] for _ in reqs]
        try:
            while any(r.cached < len(r.tokens) for r in reqs):
                active = [i for i, r in enumerate(reqs) if r.cached < len(r.tokens)]
                lens = [self._chunk_len(reqs[i], chunk_size) for i in active]
                out = self.forward_extend([reqs[i] for i in active], lens, all_logits=True)
                for i, part in zip(active, out.next_token_logits.split(lens)):
                    per_req[i].append(part)
        finally:
            self.finish_requests(reqs)
        return [torch.cat(parts) for parts in per_req]

    def greedy_generate(self, prompts: list[list[int]], max_new_tokens: int, chunk_size: Optional[int] = None) -> list[list[int]]:
        """Greedy continuation of each prompt: (chunked) EXTEND batches, then DECODE batches."""
        reqs = self.start_requests(prompts)
        try:
            last_logits: dict[int, torch.Tensor] = {}
            while any(r.cached < len(r.tokens) for r in reqs):
                active = [i for i, r in enumerate(reqs) if r.cached < len(r.tokens)]
                lens = [self._chunk_len(reqs[i], chunk_size) for i in active]
                out = self.forward_extend([reqs[i] for i in active], lens)
                for i, logits in zip(active, out.next_token_logits):
                    last_logits[i] = logits
            for i, r in enumerate(reqs):
                r.tokens.append(int(last_logits[i].argmax()))
            for _ in range(max_new_tokens - 1):
                out = self.forward_decode(reqs)
                for r, logits in zip(reqs, out.next_token_logits):
                    r.tokens.append(int(logits.argmax()))
            return [r.tokens[len(p) :] for r, p in zip(reqs, prompts)]
        finally:
            self.finish_requests(reqs)

    def greedy_generate_lockstep(
        self,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        chunk_size: Optional[int] = None,
        start_step: int = 0,
    ) -> list[torch.Tensor]:
        """Greedy generation, one forward per step on every rank until no DP rank has work.

        This rank's requests arrive at step start_step; request i stops after
        max_new_tokens[i] tokens. A step extends every request with prompt left (chunked),
        else decodes the unfinished ones, else is IDLE. Returns, per request, the logits
        [max_new_tokens[i], vocab] its tokens were chosen from (argmax).
        """
        reqs: list[HarnessRequest] = []
        picked: list[list[torch.Tensor]] = [[] for _ in prompts]
        step = 0
        try:
            while True:
                if step == start_step:
                    reqs = self.start_requests(prompts)
                extend = [i for i, r in enumerate(reqs) if r.cached < len(prompts[i])]
                decode = [i for i, r in enumerate(reqs) if 0 < len(r.tokens) - len(prompts[i]) < max_new_tokens[i]]
                active = extend or decode
                lens = [self._chunk_len(reqs[i], chunk_size) for i in extend] if extend else [1] * len(decode)
                global_num_tokens, any_busy = self._agree(sum(lens), step < start_step or bool(active))
                if not any_busy:
                    return [torch.stack(p) for p in picked]
                step += 1
                if not active:
                    self.forward_idle(global_num_tokens)
                    continue
                batch = [reqs[i] for i in active]
                if extend:
                    out = self.forward_extend(batch, lens, global_num_tokens=global_num_tokens)
                else:
                    out = self.forward_decode(batch, global_num_tokens=global_num_tokens)
                for i, logits in zip(active, out.next_token_logits):
                    if reqs[i].cached >= len(prompts[i]):  # prompt done: this row picks a token
                        picked[i].append(logits)
                        reqs[i].tokens.append(int(logits.argmax()))
        finally:
            self.finish_requests(reqs)

    def _agree(self, num_tokens: int, busy: bool) -> tuple[Optional[list[int]], bool]:
        """(tokens of each DP rank, whether any rank is busy); one CPU all-gather under DP attention."""
        if not is_dp_attention_enabled():
            return None, busy
        mine = torch.tensor([num_tokens, int(busy)], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(get_tp_size())]
        dist.all_gather(parts, mine, group=get_cpu_group())
        return [int(p[0]) for p in parts[:: get_attn_tp_size()]], any(int(p[1]) for p in parts)

    # ---- batches ----------------------------------------------------------------------

    def forward_extend(
        self,
        reqs: list[HarnessRequest],
        lens: list[int],
        all_logits: bool = False,
        capture=CaptureHiddenMode.NULL,
        global_num_tokens: Optional[list[int]] = None,
    ):
        """Extend each request by its next lens[i] uncached tokens (its cached prefix stays)."""
        ids: list[int] = []
        positions: list[int] = []
        for r, n in zip(reqs, lens):
            ids += r.tokens[r.cached : r.cached + n]
            positions += range(r.cached, r.cached + n)
        fb = self._batch(ForwardMode.EXTEND, reqs, ids, positions, lens, capture)
        if all_logits:
            fb.logits_indices = torch.arange(len(ids), device=self.device)
        return self._run(fb, global_num_tokens)

    def forward_decode(
        self,
        reqs: list[HarnessRequest],
        capture=CaptureHiddenMode.NULL,
        global_num_tokens: Optional[list[int]] = None,
    ):
        """One new token per request: the last token of each, whose KV is not cached yet."""
        ids = [r.tokens[-1] for r in reqs]
        positions = [len(r.tokens) - 1 for r in reqs]
        fb = self._batch(ForwardMode.DECODE, reqs, ids, positions, [1] * len(reqs), capture)
        return self._run(fb, global_num_tokens)

    def forward_idle(self, global_num_tokens: list[int]):
        """A forward with no local rows, so this rank joins the other DP ranks' collectives."""
        return self._run(self._batch(ForwardMode.IDLE, [], [], [], [], CaptureHiddenMode.NULL), global_num_tokens)

    def _batch(self, mode, reqs, ids, positions, lens, capture) -> ForwardBatch:
        out_loc = []
        for r, n in zip(reqs, lens):
            slots = self.allocator.alloc(n)
            assert slots is not None, "harness KV pool is full"
            self.req_to_token_pool.write(r.row, r.cached, slots)
            r.slots.append(slots)
            out_loc.append(slots)
            r.cached += n
        dev = self.device
        seq_lens = [r.cached for r in reqs]
        return ForwardBatch(
            mode=mode,
            batch_size=len(reqs),
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            out_cache_loc=torch.cat(out_loc).to(dev) if out_loc else torch.empty(0, dtype=torch.int64, device=dev),
            req_pool_indices=torch.tensor([r.row for r in reqs], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            extend_seq_lens=torch.tensor(lens, dtype=torch.int64, device=dev),
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=list(lens),
            capture_hidden_mode=capture,
        )

    def _run(self, fb: ForwardBatch, global_num_tokens: Optional[list[int]] = None):
        if is_dp_attention_enabled() != (global_num_tokens is not None):
            raise ValueError("global_num_tokens is required under DP attention and only then")
        fb.global_num_tokens, fb.gathered_buffer = global_num_tokens, self.gathered_buffer
        fb.attn_backend = self.attn_backend
        fb.req_to_token_pool = self.req_to_token_pool
        fb.token_to_kv_pool = self.kv_pool
        self.attn_backend.init_forward_metadata(fb)
        with torch.no_grad():
            return self.model.forward(fb.input_ids, fb.positions, fb)

    # ---- request bookkeeping ------------------------------------------------------------

    @staticmethod
    def _chunk_len(r: HarnessRequest, chunk_size: Optional[int]) -> int:
        remaining = len(r.tokens) - r.cached
        return remaining if chunk_size is None else min(chunk_size, remaining)

    def start_requests(self, prompts: list[list[int]]) -> list[HarnessRequest]:
        reqs = []
        for p in prompts:
            row = self.req_to_token_pool.alloc()
            assert row is not None, "harness request table is full"
            reqs.append(HarnessRequest(row=row, tokens=list(p)))
        return reqs

    def finish_requests(self, reqs: list[HarnessRequest]) -> None:
        for r in reqs:
            for s in r.slots:
                self.allocator.free(s)
            self.req_to_token_pool.free(r.row)
