"""Token embedding and LM head sharded over the vocabulary.

The vocabulary is padded up to a multiple of the group size; rank r owns rows
[r * V_local, (r + 1) * V_local). Padded rows are zero and sliced off the logits.
Models shard both over the attention-TP group: under DP attention each DP rank embeds and
projects its own rows, so neither needs a cross-DP collective (and tied weights still work).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.parallel_state import ParallelGroup, get_tp


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, group: Optional[ParallelGroup] = None):
        super().__init__()
        self.group = group or get_tp()
        self.tp_size, self.tp_rank = self.group.size, self.group.rank
        self.org_vocab_size = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if loaded_weight.shape[0] != self.org_vocab_size or loaded_weight.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"shape mismatch loading embedding: expected ({self.org_vocab_size}, {param.shape[1]}), "
                f"got {tuple(loaded_weight.shape)}"
            )
        rows = loaded_weight[self.vocab_start_index : self.vocab_end_index]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        ids = torch.where(local, input_ids - self.vocab_start_index, torch.zeros_like(input_ids))
        out = F.embedding(ids, self.weight) * local.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection; used through LogitsProcessor, never called directly."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, group: Optional[ParallelGroup] = None):
        super().__init__(num_embeddings, embedding_dim, group)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.num_embeddings_per_partition), requires_grad=False)
            self.bias.weight_loader = self._bias_loader
        else:
            self.register_parameter("bias", None)

    def _bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        rows = loaded_weight[self.vocab_start_index : self.vocab_end_index]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor")


def shard_token_subset(token_ids: torch.Tensor, vocab_size: int, tp_size: int) -> torch.Tensor:
    """A vocabulary subset laid out as a head restricted to it is sharded: [tp_size, width], row
    r the subset's tokens that rank r's vocabulary shard holds (in the given order), padded with
    -1 to the fullest rank's count. Logits column r * width + j of that head is token out[r, j]."""
    owner = token_ids // -(-vocab_size // tp_size)
    width = int(torch.bincount(owner, minlength=tp_size).max())
    layout = torch.full((tp_size, width), -1, dtype=torch.int64)
    for rank in range(tp_size):
        ids = token_ids[owner == rank]
        layout[rank, : ids.numel()] = ids
    return layout


def restricted_head(head: VocabParallelEmbedding, layout: torch.Tensor) -> ParallelLMHead:
    """A copy of `head` (an LM head or a tied embedding) keeping the rows of a shard_token_subset
    layout; its padding columns get logit -inf (bias), so no greedy or top-k pick lands there."""
    rows = layout[head.tp_rank]
    real = rows >= 0
    local = (rows - head.vocab_start_index).clamp(min=0).to(head.weight.device)
    restricted = ParallelLMHead(layout.numel(), head.weight.shape[1], bias=False, group=head.group)
    restricted.weight = nn.Parameter(head.weight.data[local], requires_grad=False)
    old_bias = getattr(head, "bias", None)
    if old_bias is not None or not bool(real.all()):
        bias = torch.where(real.to(head.weight.device), 0.0, float("-inf")).to(head.weight.dtype)
        restricted.bias = nn.Parameter(bias if old_bias is None else bias + old_bias.data[local], requires_grad=False)
    return restricted
