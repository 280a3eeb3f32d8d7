"""Rotary position embeddings (RoPE): plain, linear-scaled and Llama 3.1 scaled.

A module keeps one float32 cos|sin table [max_position, rotary_dim] (first half cos,
second half sin); `get_rope` shares one module per distinct configuration and device,
so every layer of a model reads the same table. Subclasses change the table by
overriding `_compute_inv_freq` / `_compute_cos_sin_cache`.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    mscale = 1.0  # what the Triton paths multiply cos and sin by (YaRN subclasses set their own)

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool = True,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        self.dtype = dtype
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache(), persistent=False)

    def _compute_inv_freq(self) -> torch.Tensor:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        return 1.0 / (self.base**exponents)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq()
        t = torch.arange(self.max_position_embeddings, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: [T, H*D] or [T, H, D]; returns rotated copies with the input shapes."""
        return (self.forward_triton if q.is_cuda else self.forward_native)(positions, q, k)

    def forward_triton(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel; rotates in float32 where forward_native rounds cos/sin and products to q's dtype."""
        from sglang.srt.layers.fused_ops import rotary_embedding  # triton ships with CUDA builds of torch

        cos, sin = self.cos_sin_cache.chunk(2, dim=-1)
        return rotary_embedding(positions, q, k, cos, sin, self.head_size, self.rotary_dim, self.is_neox_style)

    def forward_store_kv(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        loc: torch.Tensor,
    ) -> torch.Tensor:
        """forward_triton's q; its k, and v, written to k_buf[loc] and v_buf[loc] (one layer of
        a KV pool) in the same launch. CUDA only."""
        from sglang.srt.layers.fused_ops import rotary_embedding_store_kv  # triton ships with CUDA builds of torch

        cos, sin = self.cos_sin_cache.chunk(2, dim=-1)
        return rotary_embedding_store_kv(
            positions.flatten(), q, k, v, cos, sin, self.head_size, self.rotary_dim, self.is_neox_style,
            k_buf, v_buf, loc, self.mscale,
        )

    def forward_native(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = as_heads(x, self.head_size)
        cos = cos[:, None, :].to(x.dtype)
        sin = sin[:, None, :].to(x.dtype)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:  # GPT-J style: rotate interleaved pairs
            x1, x2 = rot[..., ::2], rot[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1).reshape(shape)


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """Positions divided by `scaling_factor`."""

    def __init__(self, head_size, rotary_dim, max_position_embeddings, base, is_neox_style, scaling_factor: float, dtype=None):
        self.scaling_factor = scaling_factor
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_inv_freq(self) -> torch.Tensor:
        return super()._compute_inv_freq() / self.scaling_factor


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama 3.1 frequency scaling: low frequencies divided by `factor`, a smooth blend between."""

    def __init__(
        self,
        head_size,
        rotary_dim,
        max_position_embeddings,
        base,
        is_neox_style,
        factor: float,
        low_freq_factor: float,
        high_freq_factor: float,
        original_max_position_embeddings: int,
        dtype=None,
    ):
        self.factor = factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.original_max_position = original_max_position_embeddings
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_inv_freq(self) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq()
        low_wavelen = self.original_max_position / self.low_freq_factor
        high_wavelen = self.original_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        return torch.where(
            wavelen < high_wavelen, inv_freq, torch.where(wavelen > low_wavelen, inv_freq / self.factor, blended)
        )


def get_rope_params(config: Any) -> tuple[float, Optional[dict]]:
    """(rope base, rope scaling dict or None) from an HF config, transformers 4.x or 5.x style."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type"))
    return float(base), (None if rope_type in (None, "default") else dict(params))


_ROPE_CACHE: dict[tuple, nn.Module] = {}


def as_heads(x: torch.Tensor, head_size: int) -> torch.Tensor:
    """[T, H*D] or [T, H, D] -> [T, H, D] (explicit sizes so that T may be 0)."""
    heads = x.shape[1] if x.dim() == 3 else x.shape[-1] // head_size
    return x.reshape(x.shape[0], heads, head_size)


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: Optional[dict] = None,
    is_neox_style: bool = True,
    dtype: Optional[torch.dtype] = None,
) -> nn.Module:
    """A shared rotary module for this configuration on the current default device."""
    scaling_key = tuple(sorted((k, str(v)) for k, v in (rope_scaling or {}).items()))
    key = (head_size, rotary_dim, max_position, base, scaling_key, is_neox_style, dtype, str(torch.get_default_device()))
    if key not in _ROPE_CACHE:
        _ROPE_CACHE[key] = _build_rope(head_size, rotary_dim, max_position, base, rope_scaling, is_neox_style, dtype)
    return _ROPE_CACHE[key]


def _build_rope(head_size, rotary_dim, max_position, base, rope_scaling, is_neox_style, dtype) -> nn.Module:
    if rope_scaling is None:
        return RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style, dtype)
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type == "linear":
        return LinearScalingRotaryEmbedding(
            head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling["factor"], dtype
        )
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(
            head_size,
            rotary_dim,
            max_position,
            base,
            is_neox_style,
            rope_scaling["factor"],
            rope_scaling["low_freq_factor"],
            rope_scaling["high_freq_factor"],
            rope_scaling["original_max_position_embeddings"],
            dtype,
        )
    if rope_type in ("yarn", "deepseek_yarn"):
        from sglang.srt.layers.deepseek_rotary import DeepseekScalingRotaryEmbedding

        extra_keys = ("extrapolation_factor", "attn_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
        return DeepseekScalingRotaryEmbedding(
            head_size,
            rotary_dim,
            rope_scaling["original_max_position_embeddings"],
            base,
            is_neox_style,
            rope_scaling["factor"],
            dtype,
            **{k: rope_scaling[k] for k in extra_keys if k in rope_scaling},
        )
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: none, linear, llama3, yarn, deepseek_yarn)")
