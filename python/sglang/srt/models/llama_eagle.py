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

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.srt.distributed.parallel_state import get_attn_tp
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.models.causal_lm import CausalLM, DraftModel
from sglang.srt.models.llama import STACKED_PARAMS_MAPPING, LlamaDecoderLayer
from sglang.srt.models.weight_loading import load_weights_into


class LlamaEagleModel(DraftModel):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        hidden = config.hidden_size
        # Sharded like the target's (over attention TP), so that set_embed_and_head shares it.
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, group=get_attn_tp())
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=True)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, 0)])
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)

    def fuse(self, embeds: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([embeds, target_hidden], dim=-1))


class LlamaForCausalLMEagle(CausalLM):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config, LlamaEagleModel(config))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The head's weights are required; a stored embedding / LM head is optional."""

        def named_as_here() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("model.")
                yield (name if name == "lm_head.weight" else f"model.{name}"), tensor

        load_weights_into(
            self,
            named_as_here(),
            STACKED_PARAMS_MAPPING,
            skip_substrings=("rotary_emb.inv_freq",),
            optional=("model.embed_tokens.weight", "lm_head.weight"),
        )


EntryClass = LlamaForCausalLMEagle
