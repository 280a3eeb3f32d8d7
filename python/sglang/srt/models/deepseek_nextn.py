"""DeepSeek-V3 multi-token-prediction (MTP / NextN) layer as a draft model.

    h = eh_proj(enorm(embed(ids)) ‖ hnorm(target_hidden))  ->  one DeepSeek decoder layer
      -> shared_head.norm  ->  LM head

`target_hidden` is the target model's final-norm hidden state of the previous position
([num_tokens, hidden], from forward_batch.spec_info.hidden_states). The decoder layer is
layer 0 of the draft's own KV pool and is an MoE layer whenever the config has routed
experts (as in every DeepSeek-V3 checkpoint). The embedding and LM head can be replaced by
the target's parameters with set_embed_and_head (shared, not copied).

Checkpoints: the MTP weights live at `model.layers.{config.num_hidden_layers}.*`, both in a
target checkpoint (index = number of target layers) and in a checkpoint written by
`python -m sglang.tools.export_nextn` (num_hidden_layers = 1, weights at model.layers.1.*).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.srt.distributed.parallel_state import get_attn_tp
from sglang.srt.layers.layernorm import RMSNorm, rms_norm_pair
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.models.causal_lm import CausalLM, DraftModel
from sglang.srt.models.deepseek_v2 import DeepseekV2DecoderLayer, load_deepseek_weights

# Checkpoint names inside the MTP layer prefix -> this module's names (the rest is the decoder layer).
_MTP_RENAMES = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "shared_head.head.weight": "lm_head.weight",
    "shared_head.norm.weight": "model.shared_head.norm.weight",
    "enorm.weight": "model.enorm.weight",
    "hnorm.weight": "model.hnorm.weight",
    "eh_proj.weight": "model.eh_proj.weight",
}


def nextn_layer_prefix(config: PretrainedConfig) -> str:
    """Checkpoint prefix of the MTP layer's weights."""
    return f"model.layers.{config.num_hidden_layers}."


class SharedHead(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepseekModelNextN(DraftModel):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        hidden = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, group=get_attn_tp())
        self.enorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden)
        moe = getattr(config, "n_routed_experts", None) is not None
        self.decoder = DeepseekV2DecoderLayer(config, attn_layer_id=0, moe=moe)
        self.shared_head = SharedHead(config)

    def fuse(self, embeds: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(rms_norm_pair(self.enorm, embeds, self.hnorm, target_hidden))

    @property
    def layers(self) -> tuple[DeepseekV2DecoderLayer]:
        """The decoder stack DecoderModel runs (checkpoint names: decoder.*, shared_head.norm)."""
        return (self.decoder,)

    @property
    def norm(self) -> RMSNorm:
        return self.shared_head.norm


class DeepseekV3ForCausalLMNextN(CausalLM):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config, DeepseekModelNextN(config))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads the MTP layer's tensors; every other tensor of the checkpoint is skipped."""
        prefix = nextn_layer_prefix(self.config)
        layer_re = re.compile(re.escape(prefix) + r"(.*)$")

        def rename(name: str) -> Optional[str]:
            m = layer_re.match(name)
            if m is None:
                return None
            rest = m.group(1)
            return _MTP_RENAMES.get(rest, f"model.decoder.{rest}")

        load_deepseek_weights(self, weights, rename)


EntryClass = DeepseekV3ForCausalLMNextN
