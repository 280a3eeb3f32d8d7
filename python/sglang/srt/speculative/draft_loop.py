"""The draft steps of one decode cycle as one unit: run eagerly, or captured as one CUDA graph.

The loop is a GraphProgram of the draft runner: it reads only its first step's batch (static
buffers under a graph) and derives every later step's batch on the device, so the whole loop,
and the verify tree built from its candidates, replays without the host.

First step's batch, per request with KV length L (topk input tokens: the guesses of the
latest draft extend, depth 1):
- positions L, seq_lens L + topk, a tree mask that shows each guess itself;
- out_cache_loc: the step's scratch slots (the dummy slot 0 for padded rows). The request's
  table row holds step t's scratch slots at columns L + t * topk .. L + (t + 1) * topk - 1;
- spec_info: the draft's last hidden state (per guess) and each guess's probability.
Step t (t >= 1) feeds the topk best children of step t - 1 at positions L + t; its tree mask
shows each input its ancestors among the inputs of steps 0..t (columns L .. L + (t + 1) * topk).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from sglang.srt.batch.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.cuda_graph_runner import PAD_KV_SLOT, ForwardFn
from sglang.srt.speculative.eagle_utils import build_draft_tree, chain_tree, select_step_inputs
from sglang.srt.speculative.spec_info import SpecInput, greedy_guess, top_guesses
from sglang.srt.utils.device_constants import DeviceConstants


@dataclass(frozen=True)
class DraftLoop:
    steps: int
    topk: int
    num_draft_tokens: int
    max_position: int  # positions past the context are never emitted; they are clamped
    constants: DeviceConstants = field(compare=False, repr=False)
    columns: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)  # see top_guesses

    def __call__(self, fb: ForwardBatch, forward: ForwardFn) -> tuple[torch.Tensor, ...]:
        """Runs steps - 1 draft forwards; returns the verify tree (DraftTree.as_tuple())."""
        if self.topk == 1:
            return self._chain(fb, forward)
        bs, k, constants = fb.batch_size, self.topk, self.constants
        scores, tokens = fb.spec_info.scores.view(bs, k), fb.input_ids.view(bs, k)
        cand_scores, cand_tokens = [scores], [tokens]
        cand_parents = [constants.full((bs, k), -1)]
        input_cand = constants.arange(k).expand(bs, k)  # candidate number of each input
        itself = constants.tiled_eye(bs, k).view(bs, k, k)
        ancestors, arange_bs = itself, constants.arange(bs).view(-1, 1)
        step = fb
        for t in range(self.steps - 1):
            out = forward(step)
            child_p, child_tok = top_guesses(out.next_token_logits, k, self.columns)
            child_scores = (scores.view(bs, k, 1) * child_p.view(bs, k, k)).flatten(1)
            child_tok = child_tok.view(bs, k * k)
            cand_scores.append(child_scores)
            cand_tokens.append(child_tok)
            cand_parents.append(input_cand.repeat_interleave(k, dim=1))
            if t == self.steps - 2:
                break
            scores, tokens, flat = select_step_inputs(child_scores, child_tok, k)
            parent_input = flat // k
            input_cand = k + t * k * k + flat
            hidden = out.hidden_states.unflatten(0, (bs, k))[arange_bs, parent_input].flatten(0, 1)
            ancestors = torch.cat([ancestors[arange_bs, parent_input], itself], dim=2)
            step = self._next_step(fb, t + 1, tokens, hidden, ancestors)
        tree = build_draft_tree(
            torch.cat(cand_scores, 1),
            torch.cat(cand_tokens, 1),
            torch.cat(cand_parents, 1),
            self.num_draft_tokens,
            self.steps,
        )
        return tree.as_tuple()

    def _chain(self, fb: ForwardBatch, forward: ForwardFn) -> tuple[torch.Tensor, ...]:
        """topk 1: each step feeds its one guess on, seeing every input before it; the tree is
        the chain of guesses (no ranking, so no scores)."""
        bs = fb.batch_size
        tokens, step = [fb.input_ids.view(bs, 1)], fb
        for t in range(self.steps - 1):
            out = forward(step)
            token = greedy_guess(out.next_token_logits, self.columns)
            tokens.append(token)
            if t < self.steps - 2:
                seen = self.constants.full((bs, 1, t + 2), True, torch.bool)
                step = self._next_step(fb, t + 1, token, out.hidden_states, seen)
        return chain_tree(torch.cat(tokens, 1), self.constants).as_tuple()

    def _next_step(
        self, first: ForwardBatch, t: int, tokens: torch.Tensor, hidden: torch.Tensor, ancestors: torch.Tensor
    ) -> ForwardBatch:
        """Step t's batch, derived from the first step's on the device."""
        k = self.topk
        out_cache_loc, positions, seq_lens = self._step_inputs(first, t)
        return replace(
            first,
            input_ids=tokens.flatten(),
            positions=positions,
            out_cache_loc=out_cache_loc,
            seq_lens=seq_lens,
            seq_lens_cpu=[s + t * k for s in first.seq_lens_cpu],
            custom_mask=ancestors.flatten(0, 1),
            spec_info=SpecInput(hidden),
        )

    def _step_inputs(self, first: ForwardBatch, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step t's (out_cache_loc, positions, seq_lens) on the device; on CUDA one launch."""
        k, table = self.topk, first.req_to_token_pool.req_to_token
        if table.is_cuda:
            from sglang.srt.kernels.spec_ops import draft_step_inputs  # triton ships with CUDA builds of torch

            return draft_step_inputs(
                table,
                first.req_pool_indices,
                first.seq_lens,
                first.positions,
                first.out_cache_loc,
                t,
                k,
                self.max_position,
                PAD_KV_SLOT,
            )
        # Request b's inputs j take table columns L_b + t*k + j (L_b = seq_lens - k), b-major.
        columns = (first.seq_lens + (t - 1) * k).view(-1, 1) + self.constants.arange(k)
        slots = table[first.req_pool_indices.view(-1, 1), columns].flatten()
        return (
            # A padded row writes only the dummy slot, whatever its table row holds.
            torch.where(first.out_cache_loc == PAD_KV_SLOT, PAD_KV_SLOT, slots),
            (first.positions + t).clamp(max=self.max_position),
            first.seq_lens + t * k,
        )
