"""What one scheduled step gives each of its requests: the result every worker returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class GenerationResult:
    # New tokens per request (empty for a request whose prompt is still being chunked).
    next_token_ids: list[list[int]]
    # KV positions written per request by this step (the scheduler adds them to kv_len).
    kv_written: list[int]
    # Per request, per new token: (logprob, token id) and top logprobs, when asked for.
    logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    top_logprobs: list[list[list[tuple[float, int]]]] = field(default_factory=list)
    # Draft tokens accepted this step per request, and the draft steps of the cycle's tier
    # (speculative workers only).
    accepted_draft_tokens: Optional[list[int]] = None
    draft_steps: Optional[int] = None
    # Extend: per request, (logprob, token id) and top logprobs of the prompt tokens whose
    # logprobs this chunk computed (ScheduleBatch.input_logprob_rows), when any were asked for.
    input_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_top_logprobs: list[list[list[tuple[float, int]]]] = field(default_factory=list)
