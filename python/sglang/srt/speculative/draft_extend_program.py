"""The draft extend after verify and the draft's next guesses as one unit: run eagerly, or
captured as one CUDA graph (so the guesses' softmax and top-k cost no host launches)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang.srt.batch.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.cuda_graph_runner import ForwardFn
from sglang.srt.speculative.spec_info import top_guesses


@dataclass(frozen=True)
class DraftExtendProgram:
    topk: int
    rows_per_req: int  # the batch's rows per request (steps + 1): each tier captures its own graphs
    columns: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)  # see top_guesses

    def __call__(self, fb: ForwardBatch, forward: ForwardFn) -> tuple[torch.Tensor, ...]:
        """Returns (probs [bs, topk], tokens [bs, topk], hidden [bs, hidden]) at each request's
        last real row (the batch's logits rows)."""
        out = forward(fb)
        probs, tokens = top_guesses(out.next_token_logits, self.topk, self.columns)
        return probs, tokens, out.hidden_states
