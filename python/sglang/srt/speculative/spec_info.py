"""What the speculative worker hands to a draft model and keeps between decode cycles."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SpecInput:
    """ForwardBatch.spec_info of a draft forward.

    hidden_states[t] is the hidden state paired with input token t: the target's final-norm
    hidden state of the previous position (draft extend), or the draft's own output hidden
    state of the parent token (draft steps).
    """

    hidden_states: torch.Tensor  # [num_tokens, hidden]


@dataclass
class DraftState:
    """Per request, after its latest draft extend: the draft's guesses for the next token.

    Invariant: the draft KV covers the same positions as the target KV (0 .. kv_len-1), draft
    position j having consumed token j+1; topk_* come from the draft's last position.
    """

    topk_p: torch.Tensor  # [topk] draft probabilities of the candidates
    topk_index: torch.Tensor  # [topk] candidate token ids
    hidden: torch.Tensor  # [hidden] draft output hidden state at the last position
