"""The attention layer models call; it defers to the batch's attention backend."""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.batch.forward_batch_info import ForwardBatch


class RadixAttention(nn.Module):
    """Paged attention over the KV pool for one layer.

    For MLA, num_kv_heads is 1, k is the latent ‖ rope vector that the pool stores and
    v is its first v_head_dim (= kv_lora_rank) channels.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        v_head_dim: int | None = None,
    ):
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """q: [T, H*D]; k, v: [T, Hkv*D] (or None to read only the cache). Returns [T, H*Dv]."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache)


def rope_stores_kv(q: torch.Tensor, forward_batch: ForwardBatch, pool_type: type) -> bool:
    """Whether a model's rotary kernel stores the layer's K/V into the KV pool itself (CUDA, a
    pool of pool_type), one launch where rotary and the backend's store take two; attention
    then gets k = v = None and reads them from the pool."""
    return q.is_cuda and isinstance(forward_batch.token_to_kv_pool, pool_type)
