"""What every model class shares: a decoder stack and an LM head over it.

`DecoderModel` is the embedding -> pre-norm decoder layers -> final norm stack, of which
a speculative draft (`DraftModel`) first fuses the embeddings with the target's hidden
states; `CausalLM` puts the LM head and the logits processor on any decoder `model` that maps
(input_ids, positions, forward_batch, input_embeds) to final-norm hidden states [T, hidden]
and holds its embedding as `model.embed_tokens`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.srt.batch.forward_batch_info import ForwardBatch
from sglang.srt.distributed.parallel_state import get_attn_tp
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, restricted_head


class DecoderModel(nn.Module):
    """Subclasses set embed_tokens, layers (PreNormDecoderLayer) and norm."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, hidden]."""
        embeds = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        hidden_states = self.first_layer_input(embeds, forward_batch)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        if residual is None:  # no layers
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def first_layer_input(self, embeds: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """The first layer's input [T, hidden] from the tokens' embeddings: the embeddings."""
        return embeds


class DraftModel(DecoderModel, ABC):
    """One EAGLE / MTP draft step over the draft's own decoder layer:

        h = fuse(embed(ids), target_hidden)  ->  decoder layer  ->  final norm

    target_hidden: the target's final-norm hidden states of the previous positions
    (forward_batch.spec_info.hidden_states).
    """

    @abstractmethod
    def fuse(self, embeds: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] decoder-layer input from the embeddings and target_hidden (both [T, hidden])."""

    def first_layer_input(self, embeds: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.fuse(embeds, forward_batch.spec_info.hidden_states.to(embeds.dtype))


class CausalLM(nn.Module):
    """`model` under an LM head sharded over attention TP, or tied to `model.embed_tokens`."""

    def __init__(self, config: PretrainedConfig, model: nn.Module, tie_word_embeddings: bool = False):
        super().__init__()
        self.config = config
        self.model = model
        self.tie_word_embeddings = tie_word_embeddings
        if tie_word_embeddings:
            self.lm_head = model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, group=get_attn_tp())
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: Optional[torch.Tensor] = None,
    ) -> LogitsProcessorOutput:
        hidden_states = self.model(input_ids, positions, forward_batch, input_embeds)
        return self.logits_processor(hidden_states, self.lm_head, forward_batch)

    def get_embed_and_head(self) -> tuple[nn.Parameter, nn.Parameter]:
        """The embedding and LM head parameters, for a draft model to share (no copy)."""
        return self.model.embed_tokens.weight, self.lm_head.weight

    def set_embed_and_head(self, embed: nn.Parameter, head: nn.Parameter) -> None:
        """Use the target's embedding and LM head parameters (same tensors, no copy)."""
        for module, param in ((self.model.embed_tokens, embed), (self.lm_head, head)):
            if param.shape != module.weight.shape:
                raise ValueError(f"shared weight shape {tuple(param.shape)} != {tuple(module.weight.shape)}")
            del module.weight
            module.weight = param

    def restrict_head(self, layout: torch.Tensor) -> None:
        """Project onto a vocabulary subset only (a shard_token_subset layout): logits column c
        is then token layout.flatten()[c]. The embedding keeps the whole vocabulary."""
        self.lm_head = restricted_head(self.lm_head, layout)
        self.logits_processor = LogitsProcessor(layout.numel())
