"""The attention layer models call; it defers to the batch's attention backend."""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.batch.forward_batch_info import ForwardBatch
from sglang.srt.layers.deepseek_rotary import mla_rope_pack
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.rotary_embedding import RotaryEmbedding


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

    def forward_rope(
        self,
        rotary_emb: RotaryEmbedding,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """Attention of rotary(q) over rotary(k) and v (an MHA pool); shapes as forward's."""
        if rope_stores_kv(q):
            k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(self.layer_id)
            q = rotary_emb.forward_store_kv(positions, q, k, v, k_buf, v_buf, forward_batch.out_cache_loc)
            return self(q, None, None, forward_batch)
        q, k = rotary_emb(positions, q, k)
        return self(q, k, v, forward_batch)

    def forward_mla_rope(
        self,
        rotary_emb: RotaryEmbedding,
        positions: torch.Tensor,
        q_pe: torch.Tensor,
        k_pe: torch.Tensor,
        latent: torch.Tensor,
        latent_norm: RMSNorm,
        q_full: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """MLA attention (an MLA pool) -> [T, H * v_head_dim]. q_full [T, H, L + R] holds the
        absorbed q_nope in its first L (= v_head_dim) channels; rope(q_pe) fills the rest. The
        key is latent_norm(latent) ‖ rope(k_pe), the value its first L channels
        (deepseek_rotary.mla_rope_pack)."""
        if rope_stores_kv(q_full):
            kv_store = (forward_batch.token_to_kv_pool.get_kv_buffer(self.layer_id), forward_batch.out_cache_loc)
            mla_rope_pack(rotary_emb, positions, q_pe, k_pe, latent, q_full, kv_store, latent_norm)
            return self(q_full.flatten(1), None, None, forward_batch)
        k_full = mla_rope_pack(rotary_emb, positions, q_pe, k_pe, latent, q_full, latent_norm=latent_norm)
        return self(q_full.flatten(1), k_full, k_full[:, : self.v_head_dim], forward_batch)


def rope_stores_kv(q: torch.Tensor) -> bool:
    """Whether the rotary kernel stores the layer's K/V into the KV pool itself (CUDA): one
    launch where rotary and the backend's store take two; attention then gets k = v = None
    and reads them from the pool."""
    return q.is_cuda
