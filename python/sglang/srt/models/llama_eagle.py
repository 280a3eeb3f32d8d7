"""EAGLE draft head for Llama-family targets.

    h = fc(embed(ids) ‖ target_hidden)  ->  one Llama decoder layer  ->  norm  ->  LM head

`target_hidden` is the target's final-norm hidden state of the previous position, read from
forward_batch.spec_info.hidden_states. The embedding and LM head are the target's
(set_embed_and_head shares the tensors); the decoder layer is layer 0 of the draft's KV pool.

Checkpoint format (a directory, loaded like any model):
- config.json: a LlamaConfig of the target's shape with architectures
  ["LlamaForCausalLMEagle"] and num_hidden_layers = 1;
- weights (safetensors or .bin), names with or without a leading "model.":
  fc.weight [hidden, 2*hidden], fc.bias [hidden], layers.0.* (an HF Llama
  decoder layer: self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, input_layernorm,
  post_attention_layernorm), norm.weight; embed_tokens.weight and lm_head.weight are
  optional and replaced by the target's when the draft is attached.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.srt.batch.forward_batch_info import ForwardBatch
from sglang.srt.distributed.parallel_state import get_attn_tp
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.models.llama import STACKED_PARAMS_MAPPING, LlamaDecoderLayer
from sglang.srt.models.weight_loading import load_weights_into


class LlamaEagleModel(nn.Module):
    """The head's own weights (everything except the shared embedding and LM head)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        hidden = config.hidden_size
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=True)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, 0)])
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        target_hidden = forward_batch.spec_info.hidden_states.to(embeds.dtype)
        hidden = self.fc(torch.cat([embeds, target_hidden], dim=-1))
        hidden, residual = self.layers[0](positions, hidden, forward_batch, None)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLMEagle(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.config = config
        self.model = LlamaEagleModel(config)
        # Sharded like the target's (over attention TP), so that set_embed_and_head shares them.
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group=get_attn_tp())
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
        embeds = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        hidden = self.model(embeds, positions, forward_batch)
        return self.logits_processor(hidden, self.lm_head, forward_batch)

    def get_embed_and_head(self) -> tuple[nn.Parameter, nn.Parameter]:
        return self.embed_tokens.weight, self.lm_head.weight

    def set_embed_and_head(self, embed: nn.Parameter, head: nn.Parameter) -> None:
        """Use the target's embedding and LM head parameters (same tensors, no copy)."""
        for module, param in ((self.embed_tokens, embed), (self.lm_head, head)):
            if param.shape != module.weight.shape:
                raise ValueError(f"shared weight shape {tuple(param.shape)} != {tuple(module.weight.shape)}")
            del module.weight
            module.weight = param

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The head's weights are required; a stored embedding / LM head is optional."""
        shared = {"embed_tokens.weight": self.embed_tokens, "lm_head.weight": self.lm_head}

        def own() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name in shared:
                    shared[name].weight_loader(shared[name].weight, tensor)
                elif "rotary_emb.inv_freq" not in name:
                    yield name, tensor

        load_weights_into(self.model, own(), STACKED_PARAMS_MAPPING)


EntryClass = LlamaForCausalLMEagle
