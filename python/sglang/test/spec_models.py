"""Draft checkpoints for speculative-decoding tests.

- make_eagle_head: a random EAGLE head (LlamaForCausalLMEagle format, see models/llama_eagle.py)
  for a tiny Llama target.
- make_perfect_llama_pair / make_perfect_deepseek_v3: a target whose next token depends on the
  current token alone, and a draft that reproduces it exactly: one decoder
  layer with a zero attention output projection, embedding rows of +-1 entries (RMS exactly
  1, so an RMSNorm with unit weight and a negligible eps is the identity on them), and a draft
  that feeds the embedding through [I | 0] into a copy of the target's layer, norm and head.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from sglang.test.tiny_deepseek import make_tiny_deepseek_v3
from sglang.test.tiny_models import make_tiny_llama

EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle"
_EXACT_EPS = 1e-12  # 1 + eps == 1 in float32


def _read_all(model_dir: str) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), framework="pt") as f:
                state.update({k: f.get_tensor(k) for k in f.keys()})
    return state


def _write_head(target_dir: str, out_dir: str, weights: dict[str, torch.Tensor]) -> str:
    """An EAGLE head directory: the target's config as a one-layer LlamaForCausalLMEagle."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(target_dir, "config.json")) as f:
        config = json.load(f)
    config.update(architectures=[EAGLE_ARCHITECTURE], num_hidden_layers=1)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def _random_layer(target_dir: str, seed: int) -> dict[str, torch.Tensor]:
    """HF-named weights of a random one-layer Llama of the target's shape (layers.0.*, norm)."""
    config = LlamaConfig.from_pretrained(target_dir)
    config.num_hidden_layers = 1
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith(("model.layers.0.", "model.norm.")):
            if name.endswith("norm.weight"):
                tensor = 1.0 + 0.2 * torch.randn(tensor.shape, generator=gen)
            state[name.removeprefix("model.")] = tensor
    return state


def make_eagle_head(target_dir: str, out_dir: str, seed: int = 1) -> str:
    """Random EAGLE head for the Llama checkpoint in target_dir (no embedding / LM head stored)."""
    config = LlamaConfig.from_pretrained(target_dir)
    hidden = config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    weights = _random_layer(target_dir, seed)
    weights["fc.weight"] = config.initializer_range * torch.randn(hidden, 2 * hidden, generator=gen)
    weights["fc.bias"] = config.initializer_range * torch.randn(hidden, generator=gen)
    return _write_head(target_dir, out_dir, weights)


def _sign_rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (rows, cols), generator=gen).float() * 2 - 1


def make_perfect_llama_pair(out_dir: str, seed: int = 0) -> tuple[str, str]:
    """(target dir, EAGLE head dir) where the head predicts exactly the target's next token."""
    target_dir = make_tiny_llama(os.path.join(out_dir, "target"), seed=seed, num_hidden_layers=1, rms_norm_eps=_EXACT_EPS)
    state = _read_all(target_dir)
    state["model.embed_tokens.weight"] = _sign_rows(*state["model.embed_tokens.weight"].shape, seed)
    state["model.layers.0.self_attn.o_proj.weight"].zero_()
    save_file(state, os.path.join(target_dir, "model.safetensors"), metadata={"format": "pt"})
    hidden = state["model.norm.weight"].shape[0]
    head = {k.removeprefix("model."): v.clone() for k, v in state.items() if k.startswith(("model.layers.0.", "model.norm."))}
    head["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    head["fc.bias"] = torch.zeros(hidden)
    return target_dir, _write_head(target_dir, os.path.join(out_dir, "head"), head)


def make_perfect_deepseek_v3(out_dir: str, seed: int = 0, draft_noise: float = 0.0) -> str:
    """One-layer (MoE) DeepSeek-V3 whose in-checkpoint MTP layer predicts exactly its next token;
    with draft_noise > 0, Gaussian noise of that scale on the MTP layer's input projection makes
    the draft agree with the target on part of the tokens only (partial acceptance)."""
    make_tiny_deepseek_v3(
        out_dir, seed=seed, with_mtp=False, num_hidden_layers=1, first_k_dense_replace=0, rms_norm_eps=_EXACT_EPS
    )
    path = os.path.join(out_dir, "model.safetensors")
    state = _read_all(out_dir)
    embed = state["model.embed_tokens.weight"]
    state["model.embed_tokens.weight"] = embed = _sign_rows(*embed.shape, seed)
    state["model.layers.0.self_attn.o_proj.weight"].zero_()
    hidden = embed.shape[1]
    mtp = "model.layers.1."
    for name in [n for n in state if n.startswith("model.layers.0.")]:
        state[mtp + name.removeprefix("model.layers.0.")] = state[name].clone()
    state[mtp + "enorm.weight"] = torch.ones(hidden)
    state[mtp + "hnorm.weight"] = torch.ones(hidden)
    noise = draft_noise * torch.randn((hidden, hidden), generator=torch.Generator().manual_seed(seed + 1))
    state[mtp + "eh_proj.weight"] = torch.cat([torch.eye(hidden) + noise, torch.zeros(hidden, hidden)], dim=1)
    state[mtp + "shared_head.norm.weight"] = state["model.norm.weight"].clone()
    state[mtp + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    state[mtp + "embed_tokens.weight"] = embed.clone()
    save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})
    return out_dir
