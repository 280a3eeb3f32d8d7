"""YaRN rotary embedding as DeepSeek-V2/V3 configure it (mscale / mscale_all_dim).

cos/sin are computed from the positions on the fly (an outer product with inv_freq), so the
module has no maximum position and no per-device cache to keep in sync.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sglang.srt.layers.rotary_embedding import as_heads


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


class DeepseekScalingRotaryEmbedding(nn.Module):
    """Rotary embedding with DeepSeek's YaRN scaling.

    `max_position_embeddings` is the *original* (pre-scaling) context length, which sets the
    YaRN correction range. The rotation of the first `rotary_dim` channels of every head is
    multiplied by mscale(factor, mscale) / mscale(factor, mscale_all_dim) * attn_factor.
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
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        self.mscale = (
            yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor, mscale_all_dim) * attn_factor
        )
        inv_freq = yarn_inv_freq(
            rotary_dim, base, scaling_factor, max_position_embeddings, beta_fast, beta_slow, extrapolation_factor
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, rotary_dim // 2] float32 angles (integer positions promote to float32 in the product)."""
        return positions[:, None] * self.inv_freq.to(positions.device, torch.float32)[None, :]

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = self._freqs(positions)
        return freqs.cos() * self.mscale, freqs.sin() * self.mscale

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
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

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query/key: [T, heads * head_size] or [T, heads, head_size]; returns the same shapes."""
        return (self.forward_triton if query.is_cuda else self.forward_native)(positions, query, key)

    def forward_triton(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the angles in torch (accurate range reduction), then one kernel rotates q and k."""
        from sglang.srt.layers.fused_ops import rotary_embedding  # triton ships with CUDA builds of torch

        freqs = self._freqs(positions.flatten())
        return rotary_embedding(
            None, query, key, freqs.cos(), freqs.sin(), self.head_size, self.rotary_dim, self.is_neox_style, self.mscale
        )

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._cos_sin(positions.flatten())
        cos, sin = cos[:, None, :], sin[:, None, :]
        q = self._rotate(as_heads(query, self.head_size), cos, sin)
        k = self._rotate(as_heads(key, self.head_size), cos, sin)
        return q.view(query.shape), k.view(key.shape)
