"""The model facts the engine needs, read from an HF config (directory or GGUF)."""

from __future__ import annotations

import json
from typing import Any, Optional, Union

import torch

from sglang.srt.utils.hf_transformers_utils import get_config, resolve_model_path

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """'auto' is bfloat16 on CUDA and float32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _causal_lm_architecture(model_type: str) -> str:
    """transformers' causal-LM class name for a model_type (e.g. llama -> LlamaForCausalLM)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"config has no architectures and model_type {model_type!r} has no causal-LM class")
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


class ModelConfig:
    def __init__(
        self,
        model_path: str,
        context_length: Optional[int] = None,
        dtype: str = "auto",
        device: str = "cpu",
        trust_remote_code: bool = False,
        model_override_args: Optional[Union[dict[str, Any], str]] = None,
        architectures: Optional[list[str]] = None,
    ):
        self.model_path = resolve_model_path(model_path)
        self.hf_config = get_config(self.model_path, trust_remote_code)
        overrides: dict[str, Any] = (
            json.loads(model_override_args) if isinstance(model_override_args, str) else model_override_args or {}
        )
        for key, value in overrides.items():
            setattr(self.hf_config, key, value)
        if architectures is not None:
            self.hf_config.architectures = list(architectures)
        if not getattr(self.hf_config, "architectures", None):  # GGUF configs carry only model_type
            self.hf_config.architectures = [_causal_lm_architecture(self.hf_config.model_type)]
        self.architectures: list[str] = list(self.hf_config.architectures or [])
        self.dtype = resolve_dtype(dtype, device)

        cfg = self.hf_config
        derived_context = getattr(cfg, "max_position_embeddings", None) or 2048
        if context_length is not None and context_length > derived_context:
            raise ValueError(f"--context-length {context_length} exceeds the model's max_position_embeddings {derived_context}")
        self.context_len: int = context_length or derived_context
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size
        self.num_hidden_layers: int = cfg.num_hidden_layers
        self.num_attention_heads: int = cfg.num_attention_heads
        self.num_key_value_heads: int = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

        # MLA (DeepSeek-V2/V3): the KV cache holds one latent of kv_lora_rank + qk_rope_head_dim per token.
        self.is_mla: bool = getattr(cfg, "kv_lora_rank", None) is not None
        if self.is_mla:
            self.kv_lora_rank: int = cfg.kv_lora_rank
            self.qk_rope_head_dim: int = cfg.qk_rope_head_dim
            self.qk_nope_head_dim: int = cfg.qk_nope_head_dim
            self.v_head_dim: int = cfg.v_head_dim
            self.head_dim: int = self.qk_nope_head_dim + self.qk_rope_head_dim  # query/key head dim
        else:
            self.head_dim = getattr(cfg, "head_dim", None) or self.hidden_size // self.num_attention_heads

    def get_num_kv_heads(self, tp_size: int) -> int:
        """KV heads held by one tensor-parallel rank (KV heads are replicated when tp_size exceeds them)."""
        return max(1, self.num_key_value_heads // tp_size)

    def __repr__(self) -> str:
        return (
            f"ModelConfig(path={self.model_path!r}, architectures={self.architectures}, dtype={self.dtype}, "
            f"context_len={self.context_len}, layers={self.num_hidden_layers}, mla={self.is_mla})"
        )
