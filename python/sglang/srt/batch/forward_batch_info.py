"""The small batch description that a forward pass reads.

Models only see tensors; the attention backend is the one component that reads the
per-request query/KV lengths and the optional custom (tree) mask. Nothing here says
"draft" or "verify" to the layers: the mode only decides how the batch was built and
which hidden states the caller keeps.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import KVPool, ReqToTokenPool


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill / chunked prefill, with an optional cached prefix
    DECODE = 2  # one new token per request
    TARGET_VERIFY = 3  # num_draft_tokens per request, tree mask
    DRAFT_DECODE = 4  # topk tokens per request, one draft step
    DRAFT_EXTEND = 5  # draft model catching up on accepted tokens
    IDLE = 6  # no local rows; still runs every collective under DP attention
    # A speculative decode cycle's batch: table rows and KV slots only, which a program turns
    # into the cycle's sub-forwards (never a model forward itself).
    DECODE_CYCLE = 7

    def is_extend_like(self) -> bool:
        """Modes whose queries attend causally to their own new tokens."""
        return self in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND, ForwardMode.TARGET_VERIFY)

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE


class LayerAttention(Protocol):
    """What a batch's attention backend does for one attention layer (every
    layers/attention backend implements it)."""

    def forward(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: Any,  # the calling layers.radix_attention.RadixAttention
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Attention of q over the layer's KV, after storing k and v (unless None) at out_cache_loc."""


class CaptureHiddenMode(enum.IntEnum):
    NULL = 0  # keep no hidden states
    LAST = 1  # keep the last token's hidden state per request
    FULL = 2  # keep every token's hidden state (speculative decoding)


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64 KV slot written by each token
    req_pool_indices: torch.Tensor  # [bs] int64 rows of the request->token table
    seq_lens: torch.Tensor  # [bs] int64 KV length after this forward (prefix + new)
    extend_seq_lens: torch.Tensor  # [bs] int64 new (query) tokens per request
    # Host copies of the lengths, filled when the batch is built (never read back from device).
    # A batch queued before an earlier step's lengths reached the host (overlapped speculative
    # cycles) has upper bounds of the KV lengths here (host_lens_exact False): enough to size
    # buffers; a backend that needs exact host lengths reads seq_lens then.
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    host_lens_exact: bool = True
    # Tree mask, bool [num_tokens, tree_cols]: query token t sees every KV column of its
    # request before the last tree_cols, and the last tree_cols where its row is set
    # (tree_cols, the same for every request, is at most every seq_len).
    # None means causal over the new tokens with full visibility of the prefix.
    custom_mask: Optional[torch.Tensor] = None
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    # Logits are computed for these token rows only (None: last token of each request).
    logits_indices: Optional[torch.Tensor] = None
    # EXTEND: token rows whose next-token logprobs are asked for (prompt logprobs), the token
    # that follows each row, and how many top logprobs per row (0: none). Computed apart from
    # the rows above; None: no row.
    input_logprob_rows: Optional[torch.Tensor] = None
    input_logprob_next_ids: Optional[torch.Tensor] = None
    input_top_logprobs_num: int = 0
    # Speculative decoding input (draft hidden states etc.), owned by speculative/.
    spec_info: Any = None
    # DP attention: tokens each DP rank contributes to this forward (same on every rank),
    # and this rank's gathered buffer (allocated once; sliced per forward, never kept).
    global_num_tokens: Optional[list[int]] = None
    # DP attention: DECODE when every DP rank decodes or idles (then all ranks replay the same
    # padded decode graph, idle ones included), EXTEND when any rank extends.
    global_forward_mode: Optional[ForwardMode] = None
    # DP attention, an EXTEND iteration: requests of every DP rank, from which every rank
    # chooses the same prefill graph; None: every rank's prefill runs eagerly (a rank computes
    # prompt logprobs, which no graph holds).
    global_num_reqs: Optional[list[int]] = None
    gathered_buffer: Optional[torch.Tensor] = None
    # Set by the model runner before the forward.
    attn_backend: Optional[LayerAttention] = None
    req_to_token_pool: Optional[ReqToTokenPool] = None
    token_to_kv_pool: Optional[KVPool] = None

    @property
    def num_tokens(self) -> int:
        """Every token writes one KV slot (a padded one the dummy slot)."""
        return int(self.out_cache_loc.shape[0])

    def last_token_indices(self) -> torch.Tensor:
        """Row of each request's last new token in the flattened token dimension."""
        return torch.cumsum(self.extend_seq_lens, 0) - 1
