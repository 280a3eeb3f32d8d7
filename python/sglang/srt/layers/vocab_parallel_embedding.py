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
