"""Final projection to vocabulary logits, on the rows the batch asks for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from sglang.srt.batch.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.layers.linear import linear
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.sampling.sampler import token_logprobs

# Modes where every token row gets logits (no per-request "last token" pruning).
_ALL_ROWS_MODES = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE, ForwardMode.IDLE)


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # [rows, vocab] float32
    # Per capture_hidden_mode: None, the logits rows' hidden states, or all rows' (a fresh tensor).
    hidden_states: Optional[torch.Tensor] = None
    # For forward_batch.input_logprob_rows: the logprob of the token that follows each row [R],
    # and the rows' top logprobs ([R, K] values and ids; None when none are asked for).
    input_token_logprobs: Optional[torch.Tensor] = None
    input_top_logprobs: Optional[tuple[torch.Tensor, torch.Tensor]] = None


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(
        self, hidden_states: torch.Tensor, lm_head: VocabParallelEmbedding, forward_batch: ForwardBatch
    ) -> LogitsProcessorOutput:
        """hidden_states: [T, hidden] after the final norm."""
        if forward_batch.logits_indices is not None:
            rows = hidden_states[forward_batch.logits_indices]
        elif forward_batch.mode in _ALL_ROWS_MODES:
            rows = hidden_states
        else:
            rows = hidden_states[forward_batch.last_token_indices()]
        # The prompt-logprob rows share the GEMM (and its all-gather) with the rows above.
        extra = forward_batch.input_logprob_rows
        head_in = rows if extra is None else torch.cat([rows, hidden_states[extra]])
        # One rank: float32 straight from the GEMM (the Triton GEMV writes it without a cast kernel);
        # several: gathered in the weight's dtype, half the bytes.
        out_dtype = torch.float32 if lm_head.group.size == 1 else None
        logits = linear(head_in, lm_head.weight, getattr(lm_head, "bias", None), out_dtype)
        logits = lm_head.group.all_gather(logits, dim=-1)[:, : self.vocab_size].float()
        input_logprobs = input_tops = None
        if extra is not None:
            logits, input_logits = logits.split([rows.shape[0], extra.shape[0]])
            input_logprobs, input_tops = token_logprobs(
                input_logits, forward_batch.input_logprob_next_ids, forward_batch.input_top_logprobs_num
            )

        mode = forward_batch.capture_hidden_mode
        if mode == CaptureHiddenMode.FULL:
            hidden = hidden_states.clone()
        elif mode == CaptureHiddenMode.LAST:
            hidden = rows.clone() if rows is hidden_states else rows
        else:
            hidden = None
        return LogitsProcessorOutput(logits, hidden, input_logprobs, input_tops)
