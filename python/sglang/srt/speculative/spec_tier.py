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

from sglang.srt.model_executor.cuda_graph_runner import GraphProgram
from sglang.srt.speculative.decode_cycle import DecodeCycle
from sglang.srt.speculative.draft_loop import DraftLoop
from sglang.srt.speculative.spec_plan import SpecSizes, SubForward


@dataclass(frozen=True)
class SpecTier:
    sizes: SpecSizes
    draft_loop: Optional[DraftLoop]  # None at 1 step: the verify checks the draft extend's guess alone
    cycle: DecodeCycle
    # The sub-forwards that run as one program (the tier's graph, or its forwards eagerly).
    programs: dict[SubForward, GraphProgram]

    @classmethod
    def build(cls, sizes: SpecSizes, max_position: int, **cycle_parts) -> "SpecTier":
        """cycle_parts: what DecodeCycle shares across tiers (request states, table, target runner)."""
        loop = DraftLoop(sizes.steps, sizes.topk, sizes.num_draft_tokens, max_position) if sizes.steps > 1 else None
        cycle = DecodeCycle(sizes, max_position, draft_loop=loop, **cycle_parts)
        programs: dict[SubForward, GraphProgram] = {
            SubForward.TARGET_VERIFY: sizes.verify_program(),
            SubForward.DRAFT_EXTEND: sizes.draft_extend_program(),
            SubForward.DECODE_CYCLE: cycle,
        }
        if loop is not None:
            programs[SubForward.DRAFT_LOOP] = loop
        return cls(sizes, loop, cycle, programs)

    @property
    def graph_programs(self) -> tuple[Optional[GraphProgram], GraphProgram]:
        """(draft loop, decode cycle): what the draft runner's graphs of this tier capture."""
        return self.draft_loop, self.cycle
