"""What the speculative worker hands to a draft model and keeps between decode cycles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.mem_cache.memory_pool import DUMMY_REQ_ROW
from sglang.srt.model_executor.cuda_graph_runner import SpecInfoLayout
from sglang.srt.sampling.sampler import greedy_tokens


def top_guesses(logits: torch.Tensor, topk: int, columns: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, tokens) [rows, topk] of the draft's topk most likely next tokens, from its
    logits [rows, columns]: the scores are their probabilities, which rank a tree's nodes.
    columns: the token of each logits column when the draft's head covers a vocabulary subset
    (--speculative-token-map), None when column c is token c.

    One guess is the greedy argmax with score 1: a chain is never ranked, so no softmax runs
    (on CUDA the argmax is one or two short launches; softmax and a max reduction took about
    15 us at 32 rows, torch.topk is a radix select of a dozen kernels)."""
    if topk == 1:
        return logits.new_ones((logits.shape[0], 1), dtype=torch.float32), greedy_guess(logits, columns)
    scores, tokens = torch.topk(torch.softmax(logits, dim=-1), topk, dim=-1)
    return scores, tokens if columns is None else columns[tokens]


def greedy_guess(logits: torch.Tensor, columns: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The tokens [rows, 1] of top_guesses(logits, 1, columns), without the scores."""
    tokens = greedy_tokens(logits).view(-1, 1)
    return tokens if columns is None else columns[tokens]


@dataclass
class SpecInput:
    """ForwardBatch.spec_info of a draft forward.

    hidden_states[t] is the hidden state paired with input token t: the target's final-norm
    hidden state of the previous position (draft extend), or the draft's own output hidden
    state of the parent token (draft steps).
    """

    hidden_states: torch.Tensor  # [num_tokens, hidden]
    scores: Optional[torch.Tensor] = None  # [num_tokens] float32 cumulative draft score (draft loop)

    @staticmethod
    def layout(hidden_size: int, dtype: torch.dtype, scores: bool) -> SpecInfoLayout:
        """How a CUDA graph's batches carry it: hidden states, and the scores when `scores`."""
        fields = (("hidden_states", (hidden_size,), dtype),) + ((("scores", (), torch.float32),) if scores else ())
        return SpecInfoLayout(fields, SpecInput)


class RequestStates:
    """Per request->token table row, what the request's next decode cycle starts from, on the
    device (a batch gathers its rows with one index, and a cycle updates them without the
    host): its KV length L, its last token (not in the KV yet), and the draft's top-k guesses
    for the token after it with the draft's hidden state at the last position.

    Invariant: the draft KV covers the same positions as the target KV (0 .. L-1), draft
    position j having consumed token j+1; the guesses come from the draft's last position."""

    def __init__(self, rows: int, topk: int, hidden_size: int, dtype: torch.dtype, device: str):
        # (L, last token) per row: a batch reads both with one index and a cycle writes both with one copy.
        self.cursors = torch.zeros((rows, 2), dtype=torch.int64, device=device)
        self.kv_lens, self.last_tokens = self.cursors.unbind(1)
        self.probs = torch.zeros((rows, topk), dtype=torch.float32, device=device)
        self.tokens = torch.zeros((rows, topk), dtype=torch.int64, device=device)
        self.hidden = torch.zeros((rows, hidden_size), dtype=dtype, device=device)

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cursors, probs, tokens, hidden): the order of spec_ops' state kernels."""
        return self.cursors, self.probs, self.tokens, self.hidden

    def store_draft(self, rows: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """The draft's guesses (top_guesses) and hidden states at each row's last position."""
        self.probs.index_copy_(0, rows, probs)
        self.tokens.index_copy_(0, rows, tokens)
        self.hidden.index_copy_(0, rows, hidden.to(self.hidden.dtype))

    def cycle_start(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kv_len [bs], last tokens [bs], probs [bs, topk], tokens [bs, topk], hidden [bs, hidden])
        of the given rows: fresh tensors (kv_len and the last tokens are the columns of one
        [bs, 2]). On CUDA one launch."""
        if not self.cursors.is_cuda:
            gathered = tuple(t[rows] for t in self.buffers)
        else:
            from sglang.srt.kernels.spec_ops import gather_states  # triton ships with CUDA builds of torch

            gathered = gather_states(self.buffers, rows)
        cursors, probs, tokens, hidden = gathered
        return cursors[:, 0], cursors[:, 1], probs, tokens, hidden

    def store_cycle_end(
        self, rows: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, cursors: torch.Tensor
    ) -> None:
        """What a decode cycle leaves for the next: store_draft's guesses and hidden states, and
        the cursors [bs, 2], except that the dummy row's become (0, 0) (a padded request's KV
        length stays 0). Rows other than the dummy row are distinct. On CUDA one launch."""
        if not self.cursors.is_cuda:
            self.store_draft(rows, probs, tokens, hidden)
            self.cursors.index_copy_(0, rows, cursors * (rows != DUMMY_REQ_ROW).view(-1, 1))
            return
        from sglang.srt.kernels.spec_ops import store_states  # triton ships with CUDA builds of torch

        store_states(self.buffers, rows, (cursors, probs, tokens, hidden), DUMMY_REQ_ROW)
