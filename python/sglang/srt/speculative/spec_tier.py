"""One speculative tier: the sizes of its cycles and the programs that run them.

Without --speculative-adaptive a worker has one tier (the configured sizes); with it, one per
--speculative-adaptive-steps entry (topk 1 chains, num_draft_tokens = steps + 1). Tiers share
everything a request carries from one cycle to the next (speculative/spec_info.RequestStates:
KV length, last token, the draft's guess and hidden state; the draft KV, which always covers
the target KV's positions), so consecutive cycles may belong to any tiers. Only a cycle's own
work differs: its KV slots per request, its sub-forwards' rows, its draft loop and its graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.batch.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.model_executor.cuda_graph_runner import CapturedMode, GraphProgram, ModeKey
from sglang.srt.model_executor.model_runner import RunnerShapes
from sglang.srt.model_executor.prefill_graphs import SERVER_PREFILL_BUCKETS
from sglang.srt.speculative.decode_cycle import DecodeCycle
from sglang.srt.speculative.draft_extend_program import DraftExtendProgram
from sglang.srt.speculative.draft_loop import DraftLoop
from sglang.srt.speculative.spec_info import SpecInput
from sglang.srt.speculative.spec_plan import SpecSizes, SubForward
from sglang.srt.speculative.verify_program import VerifyProgram


@dataclass(frozen=True)
class SpecTier:
    sizes: SpecSizes
    draft_loop: Optional[DraftLoop]  # None at 1 step: the verify checks the draft extend's guess alone
    cycle: DecodeCycle
    # The sub-forwards that run as one program (the tier's graph, or its forwards eagerly).
    programs: dict[SubForward, GraphProgram]

    @classmethod
    def build(cls, sizes: SpecSizes, max_position: int, columns: Optional[torch.Tensor], **cycle_parts) -> SpecTier:
        """columns: the token of each draft logits column (spec_info.top_guesses); cycle_parts:
        what DecodeCycle shares across tiers (request states, table, target runner)."""
        constants = cycle_parts["table"].constants
        loop = (
            DraftLoop(sizes.steps, sizes.topk, sizes.num_draft_tokens, max_position, constants, columns)
            if sizes.steps > 1
            else None
        )
        verify, draft_extend = verify_program(sizes), DraftExtendProgram(sizes.topk, sizes.draft_extend_rows, columns)
        cycle = DecodeCycle(sizes, max_position, draft_loop=loop, verify=verify, draft_extend=draft_extend, **cycle_parts)
        programs: dict[SubForward, GraphProgram] = {
            SubForward.TARGET_VERIFY: verify,
            SubForward.DRAFT_EXTEND: draft_extend,
            SubForward.DECODE_CYCLE: cycle,
        }
        if loop is not None:
            programs[SubForward.DRAFT_LOOP] = loop
        return cls(sizes, loop, cycle, programs)

    def draft_graph_modes(self, hidden_size: int, dtype: torch.dtype) -> dict[ModeKey, CapturedMode]:
        """What the draft runner's CUDA graphs capture of this tier (its group: the tier's
        steps): the draft extend after verify, the whole draft loop (its first step's batch:
        topk tokens per request, a topk-wide tree mask) and the whole greedy cycle (its batch's
        table rows and KV slots). A cycle consumes every output before the next cycle replays
        the graph: no output copies."""
        sizes, group = self.sizes, self.sizes.steps
        modes = {
            ModeKey(ForwardMode.DRAFT_EXTEND, self.programs[SubForward.DRAFT_EXTEND]): CapturedMode(
                sizes.draft_extend_rows,
                capture_hidden=CaptureHiddenMode.LAST,
                logits_at_rows=True,
                spec_info=SpecInput.layout(hidden_size, dtype, scores=False),
                outputs_as_views=True,
                group=group,
            )
        }
        if self.draft_loop is not None:
            modes[ModeKey(ForwardMode.DRAFT_DECODE, self.draft_loop)] = CapturedMode(
                sizes.topk,
                (sizes.topk,),
                CaptureHiddenMode.FULL,
                spec_info=SpecInput.layout(hidden_size, dtype, scores=True),
                outputs_as_views=True,
                group=group,
            )
        modes[ModeKey(ForwardMode.DECODE_CYCLE, self.cycle)] = CapturedMode(
            sizes.decode_kv_need_per_req, slots_only=True, outputs_as_views=True, group=group
        )
        return modes


def verify_program(sizes: SpecSizes) -> VerifyProgram:
    return VerifyProgram(sizes.num_draft_tokens, sizes.draft_extend_rows, chain=sizes.topk == 1)


def target_graph_modes(tiers: tuple[SpecSizes, ...]) -> dict[ModeKey, CapturedMode]:
    """What the target runner's CUDA graphs capture: per tier (its group: the tier's steps),
    the verify with its greedy acceptance; and the prefill, keeping every token's hidden state
    for the draft (at the server's prefill buckets)."""
    modes = {
        ModeKey(ForwardMode.TARGET_VERIFY, verify_program(sizes)): CapturedMode(
            sizes.num_draft_tokens,
            (sizes.num_draft_tokens,),
            CaptureHiddenMode.FULL,
            outputs_as_views=True,
            group=sizes.steps,
        )
        for sizes in tiers
    }
    modes[ModeKey(ForwardMode.EXTEND)] = CapturedMode(
        0, capture_hidden=CaptureHiddenMode.FULL, ragged=SERVER_PREFILL_BUCKETS, per_token_outputs=(1,)
    )
    return modes


def draft_prefill_graph_mode(hidden_size: int, dtype: torch.dtype) -> dict[ModeKey, CapturedMode]:
    """The draft's extend over a prefill's tokens (the target's hidden states in; the last
    row's logits and hidden state out), captured at the server's prefill buckets."""
    mode = CapturedMode(
        0,
        capture_hidden=CaptureHiddenMode.LAST,
        spec_info=SpecInput.layout(hidden_size, dtype, scores=False),
        ragged=SERVER_PREFILL_BUCKETS,
    )
    return {ModeKey(ForwardMode.DRAFT_EXTEND): mode}


def runner_shapes(largest: SpecSizes) -> RunnerShapes:
    """The target's and the draft's runner shapes, from the largest tier: a cycle's largest
    sub-forward per request (draft steps, verify, draft extend), its tree past a request's KV,
    and the draft's KV pool (NextN layer or EAGLE head: one decoder layer) on the target's slots."""
    tokens_per_request = max(largest.num_draft_tokens, largest.topk, largest.draft_extend_rows)
    return RunnerShapes(tokens_per_request, largest.tree_row_width, kv_layers_sharing_slots=1)
