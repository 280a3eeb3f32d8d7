"""Random paged-attention batches (one-layer KV pool, scattered slots) for kernel tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.batch.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool


@dataclass(frozen=True)
class AttnShape:
    """Per-rank attention geometry; MLA has one latent KV head with k = latent ‖ rope, v = latent."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    mla: bool = False

    def layer(self) -> RadixAttention:
        return RadixAttention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id=0, v_head_dim=self.v_head_dim
        )


def tree_mask(ext: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """ext x cols mask over a request's last `cols` KV columns (cols >= ext): the prefix columns
    among them visible; each new token sees itself and random earlier new tokens."""
    mask = torch.ones(ext, cols, dtype=torch.bool)
    new = torch.rand(ext, ext, generator=gen) < 0.5
    mask[:, cols - ext :] = new.tril(-1) | torch.eye(ext, dtype=torch.bool)
    return mask


def make_attention_batch(
    shape: AttnShape,
    ext_lens: list[int],
    prefix_lens: list[int],
    dtype: torch.dtype,
    device: str,
    tree: bool = False,
    seed: int = 0,
) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch whose cached prefixes hold random KV at scattered slots, plus this forward's q, k, v.

    Slots are a random permutation of the pool, so every request's KV crosses block
    boundaries; request rows of the request->token table are shuffled as well.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, ext_lens)]
    pool_size = sum(seq_lens) + 37
    if shape.mla:
        rope = shape.head_dim - shape.v_head_dim
        pool = MLATokenToKVPool(pool_size, dtype, shape.v_head_dim, rope, 1, device)
        pool.kv_buffer[0].copy_(torch.randn(pool.kv_buffer[0].shape, generator=gen))
    else:
        pool = MHATokenToKVPool(pool_size, dtype, shape.num_kv_heads, shape.head_dim, 1, device, shape.v_head_dim)
        pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=gen))
        pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=gen))
    bs = len(ext_lens)
    req_pool = ReqToTokenPool(bs + 3, max(seq_lens, default=1) + 4, device)
    rows = torch.randperm(bs + 3, generator=gen)[:bs]
    slots = torch.randperm(pool_size, generator=gen) + 1  # slot 0 is the dummy slot
    out_loc, used = [], 0
    for row, seq, ext in zip(rows.tolist(), seq_lens, ext_lens):
        mine = slots[used : used + seq]
        used += seq
        req_pool.write(row, 0, mine.to(device))
        out_loc.append(mine[seq - ext :])
    num_tokens = sum(ext_lens)
    as_dev = lambda x: torch.tensor(x, dtype=torch.int64, device=device)
    mask: Optional[torch.Tensor] = None
    if tree:
        cols = max(ext_lens, default=0)  # every request's tree covers its last `cols` columns
        mask = torch.cat([tree_mask(e, cols, gen) for e in ext_lens] + [torch.zeros(0, cols, dtype=torch.bool)])
        mask = mask.to(device)
    fb = ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY if tree else ForwardMode.EXTEND,
        batch_size=bs,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        out_cache_loc=torch.cat(out_loc + [torch.zeros(0, dtype=torch.int64)]).to(device),
        req_pool_indices=rows.to(device),
        seq_lens=as_dev(seq_lens),
        extend_seq_lens=as_dev(ext_lens),
        seq_lens_cpu=seq_lens,
        extend_seq_lens_cpu=list(ext_lens),
        custom_mask=mask,
        req_to_token_pool=req_pool,
        token_to_kv_pool=pool,
    )
    rand = lambda *s: torch.randn(*s, generator=gen).to(device, dtype)
    q = rand(num_tokens, shape.num_heads * shape.head_dim)
    k = rand(num_tokens, shape.num_kv_heads * shape.head_dim)
    v = k[:, : shape.v_head_dim] if shape.mla else rand(num_tokens, shape.num_kv_heads * shape.v_head_dim)
    return fb, q, k, v
