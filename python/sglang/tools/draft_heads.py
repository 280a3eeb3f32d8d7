"""Trainable draft heads (DeepSeek MTP layer, Llama EAGLE head) built from transformers' layers,
and the loss that trains them to draft for a target.

Both heads compute, for position j of a sequence,

    d_j = norm(decoder_layer(proj(embed(x_{j+1}) ‖ h_j)))

where h_j is the target's final-norm hidden state at j; the target's LM head on d_j predicts
x_{j+2}. This is exactly what the engine's DeepseekV3ForCausalLMNextN / LlamaForCausalLMEagle
compute (models/deepseek_nextn.py, models/llama_eagle.py), and during speculative decoding
a later draft step feeds d_j back in place of h_{j+1}, so the loss can unroll that too.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV3Config, LlamaConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding


def _sdpa(config):
    """A copy whose attention is SDPA: with no mask it is causal (a bare layer has no default)."""
    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    return config


class DraftHead(nn.Module):
    """Shared forward; subclasses set in_embed_norm, in_hidden_norm, proj, layer, norm, rotary."""

    in_embed_norm: nn.Module
    in_hidden_norm: nn.Module
    proj: nn.Linear
    layer: nn.Module
    norm: nn.Module
    rotary: nn.Module

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds, hidden: [B, T, H] (embedding of x_{j+1}, target hidden at j) -> d: [B, T, H]."""
        x = self.proj(torch.cat([self.in_embed_norm(embeds), self.in_hidden_norm(hidden.to(embeds.dtype))], dim=-1))
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        x = self.layer(x, attention_mask=None, position_ids=positions, position_embeddings=self.rotary(x, positions))
        return self.norm(x)


class MTPHead(DraftHead):
    """DeepSeek-V3 MTP layer: enorm, hnorm, eh_proj (no bias), decoder layer N, shared_head.norm."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        config = _sdpa(config)
        hidden = config.hidden_size
        self.in_embed_norm = DeepseekV3RMSNorm(hidden, config.rms_norm_eps)
        self.in_hidden_norm = DeepseekV3RMSNorm(hidden, config.rms_norm_eps)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        # Layer index N: an MoE layer whenever the model has MoE layers past first_k_dense_replace.
        self.layer = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.norm = DeepseekV3RMSNorm(hidden, config.rms_norm_eps)
        self.rotary = DeepseekV3RotaryEmbedding(config)

    def checkpoint_extras(self) -> dict[str, torch.Tensor]:
        """The MTP tensors outside the decoder layer, named as under model.layers.{N}."""
        return {
            "enorm.weight": self.in_embed_norm.weight,
            "hnorm.weight": self.in_hidden_norm.weight,
            "eh_proj.weight": self.proj.weight,
            "shared_head.norm.weight": self.norm.weight,
        }


class EagleHead(DraftHead):
    """EAGLE head in the LlamaForCausalLMEagle layout: fc (with bias), layers.0, norm; no input norms."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        config = _sdpa(config)
        hidden = config.hidden_size
        self.in_embed_norm = nn.Identity()
        self.in_hidden_norm = nn.Identity()
        self.proj = nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.norm = LlamaRMSNorm(hidden, config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Every tensor of the head under its checkpoint name (models/llama_eagle.py)."""
        state = {f"layers.0.{k}": v for k, v in self.layer.state_dict().items()}
        state.update({"fc.weight": self.proj.weight, "fc.bias": self.proj.bias, "norm.weight": self.norm.weight})
        return state


def draft_loss(
    head: DraftHead,
    embed: nn.Module,
    lm_head: nn.Module,
    ids: torch.Tensor,
    hidden: torch.Tensor,
    target_logits: Optional[torch.Tensor] = None,
    unroll: int = 1,
    hidden_weight: float = 0.0,
) -> tuple[torch.Tensor, list[float]]:
    """Loss of `head` drafting x_{j+2} for ids [B, T] from the target's hidden [B, T, H].

    With target_logits [B, T, V] the draft is distilled (KL to the target's next-token
    distribution at j+1); without, it is trained on the text (cross-entropy to x_{j+2}).
    Pass k > 1 feeds d_{j-1} of pass k-1 in place of h_j, as later draft steps do.
    hidden_weight adds a smooth-L1 pull of d_j towards h_{j+1}.
    Returns the mean loss over passes and each pass's top-1 agreement with its labels.
    """
    embeds = embed(ids[:, 1:])
    h_in = hidden[:, :-1]
    if target_logits is not None:
        teacher = F.softmax(target_logits[:, 1:-1].float(), dim=-1)
        labels = target_logits[:, 1:-1].argmax(-1)
    else:
        teacher, labels = None, ids[:, 2:]
    losses, accuracies = [], []
    for _ in range(unroll):
        d = head(embeds, h_in)
        logits = lm_head(d[:, :-1]).float()
        if teacher is not None:
            loss = F.kl_div(F.log_softmax(logits, -1), teacher, reduction="none").sum(-1).mean()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if hidden_weight:
            loss = loss + hidden_weight * F.smooth_l1_loss(d[:, :-1].float(), hidden[:, 1:-1].float().detach())
        losses.append(loss)
        accuracies.append(float((logits.argmax(-1) == labels).float().mean()))
        h_in = torch.cat([hidden[:, :1], d[:, :-1]], dim=1)
    return torch.stack(losses).mean(), accuracies
