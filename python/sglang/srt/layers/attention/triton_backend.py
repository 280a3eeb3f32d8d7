"""Triton paged attention (CUDA): decode, extend with cached prefix, tree-masked verify.

`init_forward_metadata` builds, once per eager forward, the index arrays every layer's
kernels read, in one kernel launch (build_kv_metadata). The sizes it needs (batch size,
total KV tokens, longest query) come from the batch's host-side length lists, never from
device reads.

Under CUDA graphs, `init_forward_metadata_graph` runs *inside* the captured graph: it reads
only device tensors and writes the flattened KV indices into one max-size buffer allocated
by `init_cuda_graph_state`, so every replay rebuilds the metadata of the batch it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.batch.forward_batch_info import ForwardBatch
from sglang.srt.kernels.attention.common import build_kv_metadata, q_heads_view
from sglang.srt.kernels.attention.decode import MAX_KV_SPLITS, MIN_TOKENS_PER_SPLIT, decode_attention
from sglang.srt.kernels.attention.extend import extend_attention
from sglang.srt.layers.attention.base import AttentionBackend, load_kv
from sglang.srt.layers.radix_attention import RadixAttention


@dataclass
class TritonAttnMetadata:
    """Per-forward metadata shared by every layer (all tensors on the batch's device)."""

    kv_indptr: torch.Tensor  # [bs + 1] int32: request i's KV slots are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: torch.Tensor  # [>= sum(seq_lens)] int64: KV slot of each (request, position)
    max_extend_len: int  # longest query of the batch (host value; sizes the extend grid)
    use_decode_kernel: bool  # one query token per request and no custom mask
    num_kv_splits: Optional[torch.Tensor]  # [bs] int32, decode only: programs sharing one request's KV
    qo_indptr: Optional[torch.Tensor]  # [bs + 1] int32, extend only: same for its query rows in q


class TritonAttnBackend(AttentionBackend):
    def __init__(self) -> None:
        self.metadata: Optional[TritonAttnMetadata] = None
        # CUDA graphs: kv_indices of every captured batch (capacity = max bs x table row width).
        self.graph_kv_indices: Optional[torch.Tensor] = None

    def init_cuda_graph_state(self, max_bs: int, kv_indices_capacity: int, device: torch.device) -> None:
        self.graph_kv_indices = torch.zeros(kv_indices_capacity, dtype=torch.int64, device=device)

    def init_forward_metadata_graph(self, forward_batch: ForwardBatch, max_extend_len: int) -> None:
        """Static-shape metadata for a captured forward: every request has max_extend_len
        query tokens; no host length is read. Needs init_cuda_graph_state first."""
        fb = forward_batch
        use_decode = fb.custom_mask is None and max_extend_len == 1
        assert self.graph_kv_indices is not None, "init_cuda_graph_state first"
        # Every request's KV fits in one table row, so the capacity bounds sum(seq_lens).
        self.metadata = self._metadata(fb, self.graph_kv_indices, max_extend_len, use_decode)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        kv_indices = torch.empty(sum(fb.seq_lens_cpu), dtype=torch.int64, device=fb.seq_lens.device)
        use_decode = fb.custom_mask is None and all(e == 1 for e in fb.extend_seq_lens_cpu)
        self.metadata = self._metadata(fb, kv_indices, max(fb.extend_seq_lens_cpu, default=0), use_decode)

    @staticmethod
    def _metadata(fb: ForwardBatch, kv_indices: torch.Tensor, max_extend_len: int, use_decode: bool) -> TritonAttnMetadata:
        """One kernel launch fills kv_indices and the offsets (and splits) the chosen kernel
        reads. use_decode: one query token per request and no custom mask."""
        assert fb.req_to_token_pool is not None, "a forward batch of the model runner's pools"
        bs, device = fb.req_pool_indices.shape[0], fb.seq_lens.device
        kv_indptr = torch.empty(bs + 1, dtype=torch.int32, device=device)
        num_kv_splits = torch.empty(bs, dtype=torch.int32, device=device) if use_decode else None
        qo_indptr = None if use_decode else torch.empty(bs + 1, dtype=torch.int32, device=device)
        build_kv_metadata(
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            kv_indptr,
            kv_indices,
            split_tokens=MIN_TOKENS_PER_SPLIT,
            max_splits=MAX_KV_SPLITS,
            num_kv_splits=num_kv_splits,
            extend_seq_lens=fb.extend_seq_lens,
            qo_indptr=qo_indptr,
        )
        return TritonAttnMetadata(
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            max_extend_len=max_extend_len,
            use_decode_kernel=use_decode,
            num_kv_splits=num_kv_splits,
            qo_indptr=qo_indptr,
        )

    def _forward_metadata(self) -> TritonAttnMetadata:
        assert self.metadata is not None, "init_forward_metadata (or its graph variant) first"
        return self.metadata

    def attend(self, q: torch.Tensor, out: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch) -> None:
        meta = self._forward_metadata()
        q3 = q_heads_view(q, layer.tp_q_head_num, layer.head_dim)
        k_cache, v_cache = load_kv(layer, forward_batch)
        if meta.use_decode_kernel:
            assert meta.num_kv_splits is not None  # set with use_decode_kernel
            decode_attention(q3, k_cache, v_cache, out, meta.kv_indptr, meta.kv_indices, meta.num_kv_splits, layer.scaling)
        else:
            self.extend(q3, k_cache, v_cache, out, layer.scaling, forward_batch.custom_mask)

    def extend(
        self,
        q3: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        scaling: float,
        custom_mask: Optional[torch.Tensor],
        kv_splits: Optional[int] = None,
    ) -> None:
        """The extend kernel over this forward's metadata (q3: [T, H, Lk]; out: [T, H, Lv]);
        kv_splits: extend_attention's override (tests, benchmarks)."""
        meta = self._forward_metadata()
        assert meta.qo_indptr is not None  # set unless use_decode_kernel
        extend_attention(
            q3,
            k_cache,
            v_cache,
            out,
            meta.qo_indptr,
            meta.kv_indptr,
            meta.kv_indices,
            meta.max_extend_len,
            scaling,
            custom_mask,
            kv_splits=kv_splits,
        )
