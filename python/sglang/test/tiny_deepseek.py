"""Tiny random DeepSeek-V2 / V3 checkpoints for tests, saved by transformers' save_pretrained.

Norm weights, V3's e_score_correction_bias and all linear weights are randomized (HF's
init leaves norms at one and the bias at zero, which would hide bugs). The V3 generator
can append a random MTP (NextN) layer at `model.layers.{num_hidden_layers}.*` in the same
safetensors file, the way real DeepSeek-V3 checkpoints store it: enorm, hnorm, eh_proj,
one MoE decoder layer, shared_head.norm, plus shared_head.head and embed_tokens (copies
of the target's lm_head and embedding, as in the real checkpoints).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from sglang.test.tiny_models import make_tiny_tokenizer

VOCAB_SIZE = 256
_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=24,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    tie_word_embeddings=False,
)
# DeepSeek-style YaRN: original context 128 (x4 = max_position_embeddings), distinct mscale / mscale_all_dim.
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


def tiny_v2_config(**overrides: Any) -> DeepseekV2Config:
    """No q_lora_rank, softmax routing over group-limited experts, 2 shared experts."""
    kwargs = dict(
        _COMMON,
        q_lora_rank=None,
        n_shared_experts=2,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kwargs.update(overrides)
    return DeepseekV2Config(**kwargs)


def tiny_v3_config(yarn: bool = False, **overrides: Any) -> DeepseekV3Config:
    """q_lora_rank set, sigmoid + noaux_tc routing over 4 groups, 1 shared expert."""
    kwargs = dict(
        _COMMON,
        q_lora_rank=48,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters=dict(YARN_ROPE) if yarn else {"rope_type": "default", "rope_theta": 10000.0},
    )
    kwargs.update(overrides)
    return DeepseekV3Config(**kwargs)


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("norm.weight"):
            tensor.copy_(1.0 + 0.2 * torch.randn(tensor.shape, generator=gen))
        elif name.endswith("e_score_correction_bias"):
            tensor.copy_(0.3 * torch.randn(tensor.shape, generator=gen))


def _token_fields(out_dir: str) -> dict[str, int]:
    """Write the tiny tokenizer; the config's vocab and special ids follow it."""
    tok = make_tiny_tokenizer(out_dir, VOCAB_SIZE)
    return dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def _save(model_cls: type, config: Any, out_dir: str, seed: int) -> str:
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _randomize(model, seed)
    model.save_pretrained(out_dir)
    return out_dir


def make_tiny_deepseek_v2(out_dir: str, seed: int = 0, **overrides: Any) -> str:
    config = tiny_v2_config(**{**_token_fields(out_dir), **overrides})
    return _save(DeepseekV2ForCausalLM, config, out_dir, seed)


def make_tiny_deepseek_v3(out_dir: str, seed: int = 0, yarn: bool = False, with_mtp: bool = True, **overrides: Any) -> str:
    """With with_mtp, the checkpoint also holds the MTP layer (see append_mtp_layer)."""
    config = tiny_v3_config(yarn=yarn, **{**_token_fields(out_dir), **overrides})
    _save(DeepseekV3ForCausalLM, config, out_dir, seed)
    if with_mtp:
        append_mtp_layer(out_dir, seed + 1)
    return out_dir


@torch.no_grad()
def append_mtp_layer(model_dir: str, seed: int) -> None:
    """Add a random MTP layer at index num_hidden_layers to `model_dir`/model.safetensors.

    Its decoder layer is layer N of a random (N+1)-layer model of the same config (an MoE
    layer when the config has routed experts past first_k_dense_replace), saved by HF so
    the names and expert layout are exactly HF's.
    """
    path = os.path.join(model_dir, "model.safetensors")
    config = DeepseekV3Config.from_pretrained(model_dir)
    n = config.num_hidden_layers
    with safe_open(path, framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    torch.manual_seed(seed)
    bigger = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict({**config.to_dict(), "num_hidden_layers": n + 1}))
    _randomize(bigger, seed)
    with tempfile.TemporaryDirectory() as tmp:
        bigger.save_pretrained(tmp)
        with safe_open(os.path.join(tmp, "model.safetensors"), framework="pt") as f:
            prefix = f"model.layers.{n}."
            state.update({k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})
    gen = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    mtp = f"model.layers.{n}."
    state[mtp + "enorm.weight"] = 1.0 + 0.2 * torch.randn(hidden, generator=gen)
    state[mtp + "hnorm.weight"] = 1.0 + 0.2 * torch.randn(hidden, generator=gen)
    state[mtp + "eh_proj.weight"] = config.initializer_range * torch.randn(hidden, 2 * hidden, generator=gen)
    state[mtp + "shared_head.norm.weight"] = 1.0 + 0.2 * torch.randn(hidden, generator=gen)
    state[mtp + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    state[mtp + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    save_file({k: v.contiguous() for k, v in state.items()}, path, metadata=metadata)
