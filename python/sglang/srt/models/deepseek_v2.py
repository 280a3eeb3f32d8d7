"""DeepSeek-V2 / V3: multi-head latent attention (MLA) and a MoE with shared experts.

MLA runs in the weight-absorbed form for every mode: the query's no-rope part is mapped
into the latent space (q_nope @ W_UK), attention runs over the cached latent ‖ k_rope
vectors (one KV "head" of kv_lora_rank + qk_rope_head_dim), and the latent output is
mapped back per head (o_latent @ W_UV^T) before o_proj. W_UK / W_UV are views of
kv_b_proj's weight, so there is no derived state to rebuild after loading.

Tensor parallelism: attention heads are split across the attention-TP group (q_b_proj /
q_proj / kv_b_proj column-parallel, o_proj row-parallel), as are the embedding and LM head;
the routed and shared experts (and dense MLPs) are split along their intermediate dimension
across the TP group, and the MoE's partial sums are all-reduced once per layer. The shared
experts are extra always-selected experts of the fused MoE (layers/moe/fused_moe.py): the
checkpoint's shared MLP is loaded into expert slots after the routed ones. Under DP
attention the MLP/MoE runs on every DP rank's rows at once (layers/dp_attention.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.srt.batch.forward_batch_info import ForwardBatch
from sglang.srt.distributed.parallel_state import get_attn_tp, tensor_model_parallel_all_reduce
from sglang.srt.kernels.moe.routing_config import RoutingConfig
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    linear,
    stack_rows,
)
from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import get_rope, get_rope_params, yarn_get_mscale
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.models.causal_lm import CausalLM, DecoderModel
from sglang.srt.models.decoder_layer import PreNormDecoderLayer
from sglang.srt.models.weight_loading import default_weight_loader

# HF dense-MLP names fused into gate_up_proj: (param fragment, checkpoint fragment, shard id).
_GATE_UP_MAPPING = ((".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1))
# A routed expert (mlp.experts.<id>.*) or the shared MLP (mlp.shared_experts.*) of a MoE layer.
_EXPERT_RE = re.compile(r"^(.*\.mlp)\.(?:experts\.(\d+)|shared_experts)\.(gate_proj|up_proj|down_proj)\.weight$")


def mla_softmax_scale(config: PretrainedConfig) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN scaling."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    _, scaling = get_rope_params(config)
    if scaling is not None and scaling.get("mscale_all_dim"):
        m = yarn_get_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale = scale * m * m
    return scale


def routing_config(config: PretrainedConfig) -> RoutingConfig:
    """Routing from the config; HF's DeepseekV3Config drops scoring_func/topk_method, so the
    model type supplies DeepSeek's defaults (V3: sigmoid + noaux_tc, V2: softmax + greedy)."""
    is_v3 = config.model_type == "deepseek_v3"
    return RoutingConfig(
        top_k=config.num_experts_per_tok,
        num_experts=config.n_routed_experts,
        scoring_func=getattr(config, "scoring_func", None) or ("sigmoid" if is_v3 else "softmax"),
        topk_method=getattr(config, "topk_method", None) or ("noaux_tc" if is_v3 else "greedy"),
        num_expert_group=getattr(config, "n_group", None),
        topk_group=getattr(config, "topk_group", None),
        renormalize=bool(getattr(config, "norm_topk_prob", False)),
        routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
        num_shared_experts=getattr(config, "n_shared_experts", None) or 0,
    )


def is_moe_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    return (
        getattr(config, "n_routed_experts", None) is not None
        and layer_idx >= (getattr(config, "first_k_dense_replace", 0) or 0)
        and layer_idx % (getattr(config, "moe_layer_freq", 1) or 1) == 0
    )


class DeepseekV2MLP(nn.Module):
    """SiLU-gated MLP of the dense layers."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class MoEGate(nn.Module):
    """Router logits in float32; V3 adds a per-expert bias used only for expert choice.
    The weight is kept in float32 (cast once at load, not at every forward); on CUDA the
    input is cast in registers (router_logits), not copied."""

    def __init__(self, config: PretrainedConfig, with_correction_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(config.n_routed_experts, config.hidden_size, dtype=torch.float32), requires_grad=False
        )
        if with_correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(config.n_routed_experts, dtype=torch.float32), requires_grad=False
            )
        else:
            self.register_parameter("e_score_correction_bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from sglang.srt.kernels.moe.routing import router_logits  # triton ships with CUDA builds of torch

            return router_logits(x, self.weight)
        return torch.nn.functional.linear(x.float(), self.weight)


class DeepseekV2MoE(nn.Module):
    """Router and experts; the experts hold the shared MLP too (n_shared_experts slots)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        routing = routing_config(config)
        self.gate = MoEGate(config, with_correction_bias=routing.topk_method == "noaux_tc")
        self.experts = FusedMoE(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, routing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._experts(x, self.gate(x))

    def forward_after_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(norm(x + residual)), x + residual); on CUDA the add, the norm and the
        router's logits share one launch (routing.add_rms_norm_router_logits)."""
        if not x.is_cuda:
            normed, s = norm(x, residual)
            return self(normed), s
        from sglang.srt.kernels.moe.routing import add_rms_norm_router_logits  # triton ships with CUDA builds of torch

        normed, s, logits = add_rms_norm_router_logits(x, residual, norm.weight, norm.variance_epsilon, self.gate.weight)
        return self._experts(normed, logits), s

    def _experts(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, router_logits, self.gate.e_score_correction_bias)  # routed + shared
        return tensor_model_parallel_all_reduce(out)


def head_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out[t, h] = a[t, h] @ b[h] for a [T, H, K], b [H, K, N] and out [T, H, N] (views of
    any strides); out is written in place, so it may be a channel slice of a wider tensor."""
    if a.is_cuda:  # triton ships with CUDA builds of torch
        from sglang.srt.kernels.mla import HEAD_MATMUL_MAX_TOKENS, head_matmul_triton

        if a.shape[0] <= HEAD_MATMUL_MAX_TOKENS:
            return head_matmul_triton(a, b, out)
    torch.bmm(a.transpose(0, 1), b, out=out.transpose(0, 1))


class DeepseekV2Attention(nn.Module):
    """MLA in the weight-absorbed form over the latent KV cache (layer `attn_layer_id` of the pool).

    q_proj (or q_a_proj) and kv_a_proj_with_mqa keep their names and loaders, but their
    weights are row views of q_kv_a_weight: one GEMM computes both (stack_rows).
    """

    def __init__(self, config: PretrainedConfig, attn_layer_id: int):
        super().__init__()
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        total_heads = config.num_attention_heads
        group = get_attn_tp()
        if total_heads % group.size:
            raise ValueError(f"num_attention_heads {total_heads} is not divisible by attention tp size {group.size}")
        self.num_heads = total_heads // group.size
        hidden = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * qk_head_dim, group=group)
        else:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * qk_head_dim, group=group)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, total_heads * (self.qk_nope_head_dim + self.v_head_dim), group=group
        )
        self.o_proj = RowParallelLinear(total_heads * self.v_head_dim, hidden, bias=bias, group=group)
        q_in = self.q_a_proj if self.q_lora_rank else self.q_proj
        self.q_in_size = q_in.weight.shape[0]
        self.q_kv_a_weight, self.q_kv_a_bias = stack_rows([q_in, self.kv_a_proj_with_mqa])
        base, scaling = get_rope_params(config)
        self.rotary_emb = get_rope(
            self.qk_rope_head_dim,
            self.qk_rope_head_dim,
            config.max_position_embeddings,
            base,
            scaling,
            is_neox_style=False,  # DeepSeek rotates interleaved pairs
        )
        self.attn = RadixAttention(
            self.num_heads,
            self.kv_lora_rank + self.qk_rope_head_dim,
            mla_softmax_scale(config),
            num_kv_heads=1,
            layer_id=attn_layer_id,
            v_head_dim=self.kv_lora_rank,
        )

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of kv_b_proj: W_UK [H, nope, L] and W_UV [H, v, L]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q_in, latent, k_pe = linear(hidden_states, self.q_kv_a_weight, self.q_kv_a_bias).split(
            [self.q_in_size, self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        q = self.q_b_proj(self.q_a_layernorm(q_in)) if self.q_lora_rank else q_in
        q = q.view(num_tokens, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)  # no -1: T may be 0
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        w_uk, w_uv = self._absorbed_weights()
        # q = (q_nope @ W_UK) ‖ rope(q_pe): the matmul and the rope step write their own channels;
        # the rope step norms the raw latent (kv_a_layernorm) on its way to k.
        q_full = q.new_empty((num_tokens, self.num_heads, self.kv_lora_rank + self.qk_rope_head_dim))
        head_matmul(q_nope, w_uk, q_full[..., : self.kv_lora_rank])
        o_latent = self.attn.forward_mla_rope(
            self.rotary_emb, positions, q_pe, k_pe, latent, self.kv_a_layernorm, q_full, forward_batch
        )
        o_latent = o_latent.view(num_tokens, self.num_heads, self.kv_lora_rank)
        o = o_latent.new_empty((num_tokens, self.num_heads, self.v_head_dim))
        head_matmul(o_latent, w_uv.transpose(1, 2), o)  # [T, H, v]
        return self.o_proj(o.flatten(1))


class DeepseekV2DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, attn_layer_id: int, moe: bool):
        super().__init__()
        self.self_attn = DeepseekV2Attention(config, attn_layer_id)
        self.mlp = DeepseekV2MoE(config) if moe else DeepseekV2MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def mlp_after_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A MoE norms its own rows (the router's launch adds and norms them), unless DP
        # attention gathers the normed rows of every rank first.
        if isinstance(self.mlp, DeepseekV2MoE) and forward_batch.global_num_tokens is None:
            return self.mlp.forward_after_add_norm(attn_out, residual, self.post_attention_layernorm)
        return super().mlp_after_attention(attn_out, residual, forward_batch)


class DeepseekV2Model(DecoderModel):
    """Its final-norm hidden states are also what the NextN draft consumes."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group=get_attn_tp())
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(config, i, is_moe_layer(config, i)) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


def load_deepseek_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rename) -> None:
    """Load HF-named tensors into `model`.

    `rename(name)` maps a checkpoint name to this model's parameter name, or None to skip it.
    Routed and shared experts' tensors go into the stacked expert weights; gate/up
    projections of dense MLPs into gate_up_proj. Raises on an unknown tensor or an unloaded
    parameter.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None:
            continue
        expert = _EXPERT_RE.match(name)
        if expert:
            mlp, expert_id, shard = expert.groups()
            moe: FusedMoE = model.get_submodule(f"{mlp}.experts")
            moe.weight_loader(shard, None if expert_id is None else int(expert_id), tensor)
            loaded.update((f"{mlp}.experts.w13_weight", f"{mlp}.experts.w2_weight"))
            continue
        shard_id = None
        for param_frag, ckpt_frag, sid in _GATE_UP_MAPPING:
            if ckpt_frag in name:
                name, shard_id = name.replace(ckpt_frag, param_frag), sid
                break
        if name not in params:
            raise KeyError(f"checkpoint tensor {ckpt_name!r} has no matching model parameter {name!r}")
        param = params[name]
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            default_weight_loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing parameters: {missing[:10]}{' ...' if len(missing) > 10 else ''}")


class DeepseekV2ForCausalLM(CausalLM):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config, DeepseekV2Model(config))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names; the MTP layer (index num_hidden_layers and above) belongs to the draft."""
        num_layers = self.config.num_hidden_layers

        def rename(name: str) -> Optional[str]:
            layer = re.match(r"model\.layers\.(\d+)\.", name)
            if (layer and int(layer.group(1)) >= num_layers) or "rotary_emb.inv_freq" in name:
                return None
            return name

        load_deepseek_weights(self, weights, rename)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass


EntryClass = [DeepseekV2ForCausalLM, DeepseekV3ForCausalLM]
