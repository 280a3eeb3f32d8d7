"""Per-head views of attention projections."""

from __future__ import annotations

import torch


def as_heads(x: torch.Tensor, head_size: int) -> torch.Tensor:
    """[T, H*D] or [T, H, D] -> [T, H, D] (explicit sizes so that T may be 0)."""
    heads = x.shape[1] if x.dim() == 3 else x.shape[-1] // head_size
    return x.reshape(x.shape[0], heads, head_size)
