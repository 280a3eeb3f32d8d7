"""The target's verify forward and the greedy acceptance of its trees as one unit: run
eagerly, or captured as one CUDA graph (so a greedy cycle's acceptance costs no host launches).

The program reads only the verify batch (static buffers under a graph): node tokens, KV
slots and the tree mask, from which it recovers the trees (DraftTree.from_mask; with topk 1
every tree is a chain and needs no recovering). Its greedy outcome is computed for every
batch; the worker uses it only when the batch is greedy without penalties, and otherwise
accepts from the returned logits itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.batch.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.cuda_graph_runner import ForwardFn
from sglang.srt.sampling.sampler import greedy_tokens
from sglang.srt.speculative.eagle_utils import (
    DraftTree,
    VerifyOutcome,
    chain_verify_outcome,
    greedy_accept,
    verify_outcome,
)


@dataclass(frozen=True)
class VerifyProgram:
    num_draft_tokens: int
    width: int  # the draft extend's rows per request (steps + 1)
    chain: bool = False  # topk 1: every tree is a chain, accepted in closed form

    def __call__(self, fb: ForwardBatch, forward: ForwardFn) -> tuple[torch.Tensor, ...]:
        """Returns (logits [bs * n, vocab], hidden [bs * n, hidden], *VerifyOutcome.as_tuple())."""
        out = forward(fb)
        bs, n = fb.batch_size, self.num_draft_tokens
        tokens = fb.input_ids.view(bs, n)
        target_tokens = greedy_tokens(out.next_token_logits).view(bs, n)
        kv_len, slots = fb.seq_lens - n, fb.out_cache_loc.view(bs, n)
        if self.chain:
            outcome = chain_verify_outcome(tokens, target_tokens, kv_len, slots, out.hidden_states, self.width)
        else:
            tree = DraftTree.from_mask(tokens, fb.custom_mask.view(bs, n, n))
            acceptance = greedy_accept(tree, tokens, target_tokens, self.width)
            outcome = verify_outcome(acceptance, kv_len, slots, out.hidden_states)
        return (out.next_token_logits, out.hidden_states, *outcome.as_tuple())

    @staticmethod
    def split(outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, VerifyOutcome]:
        """(logits, hidden, greedy outcome) of the program's outputs."""
        logits, hidden, *outcome = outputs
        return logits, hidden, VerifyOutcome.from_tuple(tuple(outcome))
