"""Rotary position embeddings (RoPE): plain, linear-scaled, Llama 3.1 scaled, and YaRN as
DeepSeek-V2/V3 configure it (mscale / mscale_all_dim).

A module keeps one float32 cos|sin table [max_position, rotary_dim] (first half cos,
second half sin); `get_rope` shares one module per distinct configuration and device,
so every layer of a model reads the same table. Subclasses change the table by
overriding `_compute_inv_freq` / `_compute_cos_sin_cache`.

The YaRN table covers the scaled context (original max position x factor, as SGLang / vLLM
size it); it is unscaled and mscale multiplies at rotation time. Its rows are
float(position) * inv_freq exactly as an on-the-fly outer product computes them, so a lookup
changes no value; positions must lie inside the table.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.utils.heads import as_heads


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

    def forward_triton(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel; rotates in float32 where forward_native rounds cos/sin and products to q's dtype."""
        from sglang.srt.kernels.elementwise import rotary_embedding  # triton ships with CUDA builds of torch

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
        from sglang.srt.kernels.elementwise import rotary_embedding_store_kv  # triton ships with CUDA builds of torch

        cos, sin = self.cos_sin_cache.chunk(2, dim=-1)
        return rotary_embedding_store_kv(
            positions.flatten(),
            q,
            k,
            v,
            cos,
            sin,
            self.head_size,
            self.rotary_dim,
            self.is_neox_style,
            k_buf,
            v_buf,
            loc,
            self.mscale,
        )

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        return torch.where(wavelen < high_wavelen, inv_freq, torch.where(wavelen > low_wavelen, inv_freq / self.factor, blended))


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN magnitude correction; the softmax scale of MLA is multiplied by its square."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(num_rotations: float, dim: int, base: float, max_position: int) -> float:
    return (dim * math.log(max_position / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_inv_freq(
    rotary_dim: int,
    base: float,
    scaling_factor: float,
    original_max_position: int,
    beta_fast: float,
    beta_slow: float,
    extrapolation_factor: float = 1.0,
) -> torch.Tensor:
    """Inverse frequencies blended between extrapolation (high freq) and interpolation (low freq)."""
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (scaling_factor * pos_freqs)
    low = max(math.floor(_correction_dim(beta_fast, rotary_dim, base, original_max_position)), 0)
    high = min(math.ceil(_correction_dim(beta_slow, rotary_dim, base, original_max_position)), rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = (1 - ramp) * extrapolation_factor
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


class DeepseekScalingRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding with DeepSeek's YaRN scaling.

    `max_position_embeddings` is the *original* (pre-scaling) context length, which sets the
    YaRN correction range; the table covers that times `scaling_factor` positions. The rotation
    of the first `rotary_dim` channels of every head is multiplied by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) * attn_factor.
    is_neox_style=False rotates interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek does.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        scaling_factor: float,
        dtype: torch.dtype | None = None,
        *,
        extrapolation_factor: float = 1.0,
        attn_factor: float = 1.0,
        beta_fast: float = 32,
        beta_slow: float = 1,
        mscale: float = 1.0,
        mscale_all_dim: float = 0.0,
    ):
        self.scaling_factor = scaling_factor
        self.original_max_position = max_position_embeddings
        self.extrapolation_factor = extrapolation_factor
        self.beta_fast, self.beta_slow = beta_fast, beta_slow
        self.mscale = yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor, mscale_all_dim) * attn_factor
        table_len = int(max_position_embeddings * scaling_factor)
        super().__init__(head_size, rotary_dim, table_len, base, is_neox_style, dtype)

    def _compute_inv_freq(self) -> torch.Tensor:
        return yarn_inv_freq(
            self.rotary_dim,
            self.base,
            self.scaling_factor,
            self.original_max_position,
            self.beta_fast,
            self.beta_slow,
            self.extrapolation_factor,
        )

    def forward_triton(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel: table rows by position, times mscale, rotate q and k in float32."""
        from sglang.srt.kernels.elementwise import rotary_embedding  # triton ships with CUDA builds of torch

        cos, sin = self.cos_sin_cache.chunk(2, dim=-1)
        return rotary_embedding(
            positions.flatten(), query, key, cos, sin, self.head_size, self.rotary_dim, self.is_neox_style, self.mscale
        )

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates in float32 and rounds once (RotaryEmbedding rounds cos/sin to the input dtype)."""
        cos, sin = (self.cos_sin_cache.index_select(0, positions.flatten()) * self.mscale)[:, None, :].chunk(2, dim=-1)
        q = self._rotate_float32(as_heads(query, self.head_size), cos, sin)
        k = self._rotate_float32(as_heads(key, self.head_size), cos, sin)
        return q.view(query.shape), k.view(key.shape)

    def _rotate_float32(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, head_size]; cos/sin: [T, 1, rotary_dim // 2]
        rot = x[..., : self.rotary_dim].float()
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        if self.rotary_dim == self.head_size:
            return out.to(x.dtype)
        return torch.cat((out.to(x.dtype), x[..., self.rotary_dim :]), dim=-1)


def get_rope_params(config: Any) -> tuple[float, Optional[dict]]:
    """(rope base, rope scaling dict or None) from an HF config, transformers 4.x or 5.x style."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type"))
    return float(base), (None if rope_type in (None, "default") else dict(params))


_ROPE_CACHE: dict[tuple, nn.Module] = {}


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
