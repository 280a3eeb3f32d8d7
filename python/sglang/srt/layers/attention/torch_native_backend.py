"""Plain-PyTorch paged attention (CPU and GPU): the reference every kernel is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang.srt.batch.forward_batch_info import ForwardBatch
from sglang.srt.layers.attention.base import AttentionBackend, load_kv
from sglang.srt.layers.radix_attention import RadixAttention


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self) -> None:
        self.lengths: list[tuple[int, int]] = []  # (query, KV) length of each request

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        if fb.host_lens_exact:
            self.lengths = list(zip(fb.extend_seq_lens_cpu, fb.seq_lens_cpu))
        else:  # upper bounds on the host: this reference backend reads the exact ones
            self.lengths = list(zip(fb.extend_seq_lens.tolist(), fb.seq_lens.tolist()))

    def attend(self, q: torch.Tensor, out: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch) -> None:
        q = q.view(q.shape[0], layer.tp_q_head_num, layer.head_dim)
        k_cache, v_cache = load_kv(layer, forward_batch)
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        start = 0
        for i, (ext, seq) in enumerate(self.lengths):
            if ext == 0:
                continue
            slots = req_to_token[forward_batch.req_pool_indices[i], :seq]
            mask = self._mask(forward_batch, start, ext, seq, q.device)
            out[start : start + ext] = self._attend(q[start : start + ext], k_cache[slots], v_cache[slots], mask, layer)
            start += ext

    @staticmethod
    def _mask(fb: ForwardBatch, row: int, ext: int, seq: int, device) -> torch.Tensor:
        """[ext, seq] visibility of the request whose query rows start at `row`."""
        if fb.custom_mask is not None:
            tree = fb.custom_mask[row : row + ext]
            return torch.cat([torch.ones((ext, seq - tree.shape[1]), dtype=torch.bool, device=device), tree], dim=1)
        prefix = seq - ext
        cols = torch.arange(seq, device=device)
        rows = torch.arange(ext, device=device) + prefix
        return cols[None, :] <= rows[:, None]

    @staticmethod
    def _attend(q, k, v, mask, layer: RadixAttention) -> torch.Tensor:
        # q: [e, H, D], k: [s, Hkv, D], v: [s, Hkv, Dv] -> [e, H, Dv]
        group = layer.tp_q_head_num // layer.tp_k_head_num
        k = k.to(q.dtype).repeat_interleave(group, dim=1) if group > 1 else k.to(q.dtype)
        v = v.to(q.dtype).repeat_interleave(group, dim=1) if group > 1 else v.to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=layer.scaling
        )
        return o.transpose(0, 1)
