"""YaRN rotary embedding as DeepSeek-V2/V3 configure it (mscale / mscale_all_dim), and the
MLA step that writes the rotated rope channels into the buffers attention reads.

Like every RotaryEmbedding, the module keeps one float32 cos|sin table, here over the scaled
context (original max position x factor, as SGLang / vLLM size it); the table is unscaled and
mscale multiplies at rotation time. Rows are float(position) * inv_freq exactly as an on-the-fly
outer product computes them, so a lookup changes no value; positions must lie inside the table.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, as_heads


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
        self.mscale = (
            yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor, mscale_all_dim) * attn_factor
        )
        table_len = int(max_position_embeddings * scaling_factor)
        super().__init__(head_size, rotary_dim, table_len, base, is_neox_style, dtype)

    def _compute_inv_freq(self) -> torch.Tensor:
        return yarn_inv_freq(
            self.rotary_dim, self.base, self.scaling_factor, self.original_max_position,
            self.beta_fast, self.beta_slow, self.extrapolation_factor,
        )

    def forward_triton(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel: table rows by position, times mscale, rotate q and k in float32."""
        from sglang.srt.layers.fused_ops import rotary_embedding  # triton ships with CUDA builds of torch

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


def mla_rope_pack(
    rope: RotaryEmbedding,
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    latent: torch.Tensor,
    q_out: torch.Tensor,
    kv_store: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    latent_norm: Optional[RMSNorm] = None,
) -> Optional[torch.Tensor]:
    """MLA's attention inputs from one rope step.

    q_pe [T, H, R], k_pe [T, R] (column slices are fine), latent [T, L], q_out [T, H, L + R]
    whose first L channels the caller fills. Writes rope(q_pe) into q_out[..., L:] and
    returns k = latent ‖ rope(k_pe) [T, L + R], what the MLA pool stores. On CUDA one kernel
    (same values as the rope module's forward_triton); otherwise the module's forward_native.

    kv_store = (one layer's MLA pool buffer [slots, 1, L + R], loc [T]): k is stored into the
    buffer's rows loc instead, cast to its dtype (as the pool's set_kv_buffer stores it), and
    None is returned; on CUDA in the same launch. latent_norm (kv_a_layernorm) norms the
    latent first, on CUDA in the same launch too.
    """
    latent_dim, rot = latent.shape[-1], q_pe.shape[-1]
    assert rope.rotary_dim == rope.head_size == rot and q_out.shape[-1] == latent_dim + rot
    if q_pe.is_cuda:
        from sglang.srt.layers.mla_triton import mla_rope_pack_triton  # triton ships with CUDA builds of torch

        scale = rope.mscale if isinstance(rope, DeepseekScalingRotaryEmbedding) else 1.0
        norm = None if latent_norm is None else (latent_norm.weight, latent_norm.variance_epsilon)
        return mla_rope_pack_triton(
            positions, q_pe, k_pe, latent, q_out, rope.cos_sin_cache, scale, rope.is_neox_style, kv_store, norm
        )
    if latent_norm is not None:
        latent = latent_norm.forward_native(latent)
    q_rot, k_rot = rope.forward_native(positions, q_pe, k_pe.unsqueeze(1))
    q_out[..., latent_dim:] = q_rot
    k = torch.cat([latent, k_rot.squeeze(1)], dim=-1)
    if kv_store is None:
        return k
    kv_buffer, loc = kv_store
    kv_buffer[loc] = k.to(kv_buffer.dtype).unsqueeze(1)
    return None
