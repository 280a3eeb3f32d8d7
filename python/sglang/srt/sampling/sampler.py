"""Batched sampling on the logits' device: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

One host round-trip per step: the caller copies the sampled ids (and logprobs) back once.
Building a batch's parameters uploads nothing for an all-greedy batch without penalties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.transfer import to_device, upload

# The id reported for a row whose logits were not finite (--enable-nan-detection).
NAN_TOKEN_ID = -1


@dataclass
class SamplingBatchInfo:
    all_greedy: bool
    need_min_p: bool
    # Filters, on the device; None when all_greedy (argmax reads none of them).
    temperatures: Optional[torch.Tensor] = None  # [B, 1]
    top_ps: Optional[torch.Tensor] = None  # [B]
    top_ks: Optional[torch.Tensor] = None  # [B] (vocab size where disabled)
    min_ps: Optional[torch.Tensor] = None  # [B]
    # Penalties: None when no request in the batch uses them.
    frequency_penalties: Optional[torch.Tensor] = None  # [B, 1]
    presence_penalties: Optional[torch.Tensor] = None  # [B, 1]
    repetition_penalties: Optional[torch.Tensor] = None  # [B, 1]
    output_counts: Optional[torch.Tensor] = None  # [B, V] counts of generated tokens
    seen_mask: Optional[torch.Tensor] = None  # [B, V] prompt or output tokens
    generators: Optional[list[Optional[torch.Generator]]] = None
    # OpenAI logit_bias added to the logits: None when no request in the batch has one.
    logit_biases: Optional[torch.Tensor] = None  # [B, V]

    @classmethod
    def from_requests(
        cls,
        params: Sequence[SamplingParams],
        token_histories: Sequence[tuple[list[int], list[int]]],
        generators: Sequence[Optional[torch.Generator]],
        vocab_size: int,
        device: str,
    ) -> SamplingBatchInfo:
        """token_histories: (prompt ids, output ids) per request, read only when penalties are on.
        At most one upload per kind of tensor (filters, penalty values, penalty token ids)."""
        info = cls(
            all_greedy=all(p.is_greedy for p in params),
            need_min_p=any(p.min_p > 0 for p in params),
            generators=list(generators) if any(g is not None for g in generators) else None,
        )
        if not info.all_greedy:
            top_ks = [vocab_size if (p.top_k < 0 or p.top_k > vocab_size) else p.top_k for p in params]
            temps, top_ps, top_ks_f, min_ps = upload(
                [
                    [1.0 if p.is_greedy else p.temperature for p in params],
                    [p.top_p for p in params],
                    [1 if p.is_greedy else k for p, k in zip(params, top_ks)],  # exact in float32 (< 2**24)
                    [p.min_p for p in params],
                ],
                device,
                torch.float32,
            )
            info.temperatures, info.top_ps, info.min_ps = temps.view(-1, 1), top_ps, min_ps
            info.top_ks = top_ks_f.long()
        if any(p.has_penalties for p in params):
            info._init_penalties(params, token_histories, vocab_size, device)
        if any(p.logit_bias for p in params):
            info.logit_biases = _logit_biases(params, vocab_size, device)
        return info

    def _init_penalties(self, params, token_histories, vocab_size: int, device: str) -> None:
        bs = len(params)
        outputs = [torch.tensor(out, dtype=torch.int64) for _, out in token_histories]
        seen = [torch.tensor(prompt + out, dtype=torch.int64) for prompt, out in token_histories]
        rows = torch.arange(bs)
        out_rows = torch.repeat_interleave(rows, torch.tensor([len(t) for t in outputs], dtype=torch.int64))
        seen_rows = torch.repeat_interleave(rows, torch.tensor([len(t) for t in seen], dtype=torch.int64))
        host = torch.cat([out_rows, *outputs, seen_rows, *seen])
        n_out, n_seen = len(out_rows), len(seen_rows)
        out_r, out_ids, seen_r, seen_ids = to_device(host, device).split([n_out, n_out, n_seen, n_seen])
        self.output_counts = torch.zeros((bs, vocab_size), dtype=torch.float32, device=device)
        self.output_counts.index_put_((out_r, out_ids), torch.ones(n_out, device=device), accumulate=True)
        self.seen_mask = torch.zeros((bs, vocab_size), dtype=torch.bool, device=device)
        self.seen_mask[seen_r, seen_ids] = True
        values = [[p.frequency_penalty, p.presence_penalty, p.repetition_penalty] for p in params]
        freq, pres, rep = upload(list(zip(*values)), device, torch.float32)
        self.frequency_penalties, self.presence_penalties, self.repetition_penalties = (
            freq.view(-1, 1),
            pres.view(-1, 1),
            rep.view(-1, 1),
        )

    def count_more_outputs(self, counts: torch.Tensor) -> None:
        """Output tokens beyond each row's history ([B, V] counts; speculative verify: the
        tokens on a tree node's path) count for the penalties as generated ones."""
        self.output_counts = self.output_counts + counts
        self.seen_mask = self.seen_mask | (counts > 0)

    def apply_penalties(self, logits: torch.Tensor) -> torch.Tensor:
        """logit_bias, then the penalties."""
        if self.logit_biases is not None:
            logits = logits + self.logit_biases
        if self.output_counts is None:
            return logits
        logits = logits - self.frequency_penalties * self.output_counts
        logits = logits - self.presence_penalties * (self.output_counts > 0)
        rep = torch.where(self.seen_mask, self.repetition_penalties, torch.ones_like(logits))
        # A tiny repetition penalty (in float32 possibly 0) divides a positive logit to inf;
        # bounded here, the row stays finite through the temperature's division and softmax.
        return torch.where(logits > 0, logits / rep, logits * rep).clamp(-_PENALIZED_LOGIT_LIMIT, _PENALIZED_LOGIT_LIMIT)


_PENALIZED_LOGIT_LIMIT = 1e30  # times 1 / temperature (<= 1 / the greedy threshold) stays below float32's max


def _logit_biases(params: Sequence[SamplingParams], vocab_size: int, device: str) -> torch.Tensor:
    """[B, V] float32: each request's logit_bias at its token ids, 0 elsewhere (one upload)."""
    rows = [i for i, p in enumerate(params) for _ in (p.logit_bias or ())]
    ids = [t for p in params for t in (p.logit_bias or ())]
    values = [float(b) for p in params for b in (p.logit_bias or {}).values()]
    rows_f, ids_f, values_d = upload([rows, ids, values], device, torch.float32)  # ids exact in float32 (< 2**24)
    biases = torch.zeros((len(params), vocab_size), dtype=torch.float32, device=device)
    biases[rows_f.long(), ids_f.long()] = values_d
    return biases


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [B] int64
    logprobs: Optional[torch.Tensor] = None  # [B] logprob of the chosen token
    top_logprobs: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # ([B, K] values, [B, K] ids)


class Sampler:
    def __init__(self, detect_nan: bool = False):
        self.detect_nan = detect_nan

    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> SampleOutput:
        logits = info.apply_penalties(logits.float())
        bad_rows = None
        if self.detect_nan:
            # One device-side reduction, no sync: the flags reach the host inside the ids.
            bad_rows = ~torch.isfinite(logits).all(dim=-1)
            logits = logits.masked_fill(bad_rows.view(-1, 1), 0.0)  # keeps sampling valid; the row is discarded
        if info.all_greedy:
            next_ids = greedy_tokens(logits)
        else:
            probs = self.filtered_probs(logits, info)
            next_ids = self._draw(probs, info.generators)
        out = SampleOutput(next_ids)
        if return_logprob:
            out.logprobs, out.top_logprobs = token_logprobs(logits, next_ids, top_logprobs_num)
        if bad_rows is not None:
            out.next_token_ids = torch.where(bad_rows, NAN_TOKEN_ID, next_ids)
        return out

    @staticmethod
    def filtered_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Temperature-scaled probabilities after top-k, top-p and min-p (greedy rows: one-hot)."""
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        probs = _top_k_top_p(probs, info.top_ks, info.top_ps)
        if info.need_min_p:
            threshold = probs.max(dim=-1, keepdim=True).values * info.min_ps.view(-1, 1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs / probs.sum(dim=-1, keepdim=True)

    @staticmethod
    def _draw(probs: torch.Tensor, generators: Optional[list[Optional[torch.Generator]]]) -> torch.Tensor:
        if generators is None:
            return torch.multinomial(probs, 1).squeeze(1)
        # Seeded rows draw from their own generator so results do not depend on the batch.
        out = torch.multinomial(probs, 1).squeeze(1)
        for i, g in enumerate(generators):
            if g is not None:
                out[i] = torch.multinomial(probs[i], 1, generator=g)[0]
        return out


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """Logprob of token_ids[i] under logits row i ([R]), and the rows' top_n logprobs
    ([R, top_n] values and ids; None when top_n is 0)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).squeeze(1)
    return chosen, (tuple(torch.topk(logprobs, top_n, dim=-1)) if top_n > 0 else None)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1): first maximum, NaN counted as the maximum (a NaN row is
    only reported as NAN_TOKEN_ID under detect_nan, which zeroes it first)."""
    if not logits.is_cuda:
        return torch.argmax(logits, dim=-1)
    from sglang.srt.kernels.step_ops import argmax  # triton ships with CUDA builds of torch

    return argmax(logits)  # one or two short launches where torch's single-block reduction takes 27 us


def _top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).view(1, -1)
    drop = ranks >= top_ks.view(-1, 1)
    # Keep the smallest prefix whose mass reaches top_p (always at least the first token).
    cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= cum_before > top_ps.view(-1, 1)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs)
