"""--speculative-token-map: the vocabulary subset a draft guesses among (the frequent tokens of
FR-Spec). The draft's LM head keeps only those rows, so each draft step reads a fraction of
the head; the target still verifies over the whole vocabulary, so outputs do not change, and a
token outside the subset is never guessed (it ends the accepted run where it appears)."""

from __future__ import annotations

import os
from typing import Optional

import torch

from sglang.srt.layers.vocab_parallel_embedding import shard_token_subset

FLAG = "--speculative-token-map"


def load_token_map(path: str, vocab_size: int, topk: int) -> torch.Tensor:
    """The token ids saved at `path` (torch.save of a 1-D integer tensor or list), int64 on the
    CPU; ValueError naming the flag when the file is missing or holds anything else."""
    if not os.path.isfile(path):
        raise ValueError(f"{FLAG} {path}: no such file")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        ids = torch.as_tensor(loaded)
    except Exception as e:  # any unreadable or non-tensor content is the user's file's fault
        raise ValueError(f"{FLAG} {path}: not a saved tensor or list of token ids ({e})") from e
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{FLAG} {path}: expected a 1-D list of integer token ids, got {ids.dtype} of shape {tuple(ids.shape)}")
    ids = ids.to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):  # an empty map fails below
        raise ValueError(f"{FLAG} {path}: token ids must be in [0, {vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{FLAG} {path}: token ids repeat")
    if ids.numel() < topk:
        raise ValueError(f"{FLAG} {path}: {ids.numel()} tokens, fewer than --speculative-eagle-topk {topk}")
    return ids


def draft_head_vocab(
    path: Optional[str], vocab_size: int, topk: int, attn_tp_size: int, device: str
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(the layout the draft runner restricts its head to, the token of each draft logits
    column on `device`), or (None, None) without a token map."""
    if path is None:
        return None, None
    layout = shard_token_subset(load_token_map(path, vocab_size, topk), vocab_size, attn_tp_size)
    return layout, layout.flatten().clamp(min=0).to(device)
