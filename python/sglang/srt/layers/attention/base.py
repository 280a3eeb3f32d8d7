"""Interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang.srt.batch.forward_batch_info import ForwardBatch
    from sglang.srt.layers.radix_attention import RadixAttention


class AttentionBackend(ABC):
    """Reads query lengths, KV lengths and an optional custom mask; nothing else."""

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:  # noqa: B027  (optional hook)
        """Build backend-private metadata once per forward, before the layers run."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """q: [T, H*D]; k, v: [T, Hkv*D], saved into the pool first, or None when the pool
        holds them already. Returns [T, H*Dv]."""
        if k is not None and save_kv_cache:
            save_kv(layer, forward_batch, k, v)
        num_tokens = q.shape[0]
        out = q.new_empty((num_tokens, layer.tp_q_head_num, layer.v_head_dim))
        if num_tokens:
            self.attend(q, out, layer, forward_batch)
        return out.view(num_tokens, layer.tp_q_head_num * layer.v_head_dim)

    @abstractmethod
    def attend(self, q: torch.Tensor, out: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch) -> None:
        """out [T, H, Dv] = attention of q [T, H*D] (T > 0) over the layer's pool."""


def save_kv(layer: RadixAttention, forward_batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write this forward's K/V (or MLA latent) into the pool at out_cache_loc."""
    pool = forward_batch.token_to_kv_pool
    loc = forward_batch.out_cache_loc
    if hasattr(pool, "kv_buffer"):  # MLA: v is a view of the latent part of k
        pool.set_kv_buffer(layer.layer_id, loc, k)
    else:
        pool.set_kv_buffer(
            layer.layer_id,
            loc,
            k.view(-1, layer.tp_k_head_num, layer.head_dim),
            v.view(-1, layer.tp_k_head_num, layer.v_head_dim),
        )


def load_kv(layer: RadixAttention, forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole K and V buffers of this layer: [slots, Hkv, D] and [slots, Hkv, Dv]."""
    pool = forward_batch.token_to_kv_pool
    if hasattr(pool, "kv_buffer"):
        kv = pool.get_kv_buffer(layer.layer_id)
        return kv, kv[..., : layer.v_head_dim]
    return pool.get_kv_buffer(layer.layer_id)
