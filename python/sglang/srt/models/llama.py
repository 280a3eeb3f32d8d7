"""Llama-family decoder (Llama 2/3/3.1, SmolLM2) on RadixAttention.

Qwen2 differs only by biases on q/k/v; LlamaForCausalLM.qkv_bias selects it.
Attention, the embedding and the LM head shard over the attention-TP group, the MLP over
the TP group (the same group unless DP attention is on).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.srt.batch.forward_batch_info import ForwardBatch
from sglang.srt.distributed.parallel_state import get_attn_tp
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import get_rope, get_rope_params
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.models.causal_lm import CausalLM, DecoderModel
from sglang.srt.models.decoder_layer import PreNormDecoderLayer
from sglang.srt.models.weight_loading import load_weights_into

# HF checkpoint names fused into our stacked parameters: (param, checkpoint, shard id).
STACKED_PARAMS_MAPPING = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, qkv_bias: bool):
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        attention_bias = bool(getattr(config, "attention_bias", False))  # Llama: biases on q, k, v and o
        group = get_attn_tp()
        self.qkv_proj = QKVParallelLinear(
            hidden, head_dim, total_heads, total_kv_heads, bias=qkv_bias or attention_bias, group=group
        )
        self.o_proj = RowParallelLinear(total_heads * head_dim, hidden, bias=attention_bias, group=group)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        base, scaling = get_rope_params(config)
        self.rotary_emb = get_rope(head_dim, head_dim, config.max_position_embeddings, base, scaling)
        self.attn = RadixAttention(self.qkv_proj.num_heads, head_dim, head_dim**-0.5, self.qkv_proj.num_kv_heads, layer_id)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn.forward_rope(self.rotary_emb, positions, q, k, v, forward_batch))


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, layer_id: int, qkv_bias: bool = False):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, qkv_bias)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, bias=getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class LlamaModel(DecoderModel):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool = False):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group=get_attn_tp())
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, qkv_bias) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    qkv_bias = False

    def __init__(self, config: PretrainedConfig):
        tied = bool(getattr(config, "tie_word_embeddings", False))
        super().__init__(config, LlamaModel(config, qkv_bias=self.qkv_bias), tie_word_embeddings=tied)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights_into(
            self,
            weights,
            STACKED_PARAMS_MAPPING,
            skip_prefixes=("lm_head.",) if self.tie_word_embeddings else (),
            skip_substrings=("rotary_emb.inv_freq",),
        )


EntryClass = LlamaForCausalLM
