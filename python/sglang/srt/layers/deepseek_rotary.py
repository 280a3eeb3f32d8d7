"""The MLA step of DeepSeek-V2/V3 that writes the rotated rope channels into the buffers
attention reads (one kernel on CUDA)."""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.rotary_embedding import DeepseekScalingRotaryEmbedding, RotaryEmbedding


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
        from sglang.srt.kernels.mla import mla_rope_pack_triton  # triton ships with CUDA builds of torch

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
