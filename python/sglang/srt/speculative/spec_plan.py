"""Which speculative sub-forwards run in one scheduler iteration, and their token counts.

Under DP attention every sub-forward gathers rows from all DP ranks before the MLP/MoE, so
every rank must run the same sequence of sub-forwards with the same per-rank row counts.
Both follow from the iteration's one plan all-gather (GlobalPlan), on every rank alike:

  extend phase (if any DP rank prefills):   target extend, draft extend   (1 row per token)
  decode phase (if any DP rank decodes):    draft loop: steps - 1 forwards (topk per request each)
                                            target verify                 (num_draft_tokens per request)
                                            draft extend                  (steps + 1 per request)

A rank takes part in a phase it has no work for with zero-row (IDLE) sub-forwards. The draft
extend after verify is padded to steps + 1 rows per request (accepted + 1 are real), so its
size is known before acceptance and no extra agreement step is needed. With
--speculative-adaptive, `steps` is the iteration's tier, decided from the same all-gather by
every rank alike (speculative/adaptive.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from sglang.srt.distributed.scheduler_comm import GlobalPlan


class SubForward(enum.Enum):
    TARGET_EXTEND = "target_extend"
    DRAFT_EXTEND_PREFILL = "draft_extend_prefill"
    DRAFT_LOOP = "draft_loop"  # steps - 1 draft forwards of the same rows
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    # The three above as one program (decode_cycle.py); its batch carries each request's
    # table row and the cycle's KV slots.
    DECODE_CYCLE = "decode_cycle"


@dataclass(frozen=True)
class SpecSizes:
    steps: int
    topk: int
    num_draft_tokens: int

    @classmethod
    def tiers(cls, args) -> tuple[SpecSizes, ...]:
        """The sizes of every tier, ascending by steps: the configured sizes alone, or with
        --speculative-adaptive one chain per tier (num_draft_tokens = steps + 1). The last tier
        is the largest in every size: it sizes the buffers, the request->token table and the
        KV slots the scheduler keeps free."""
        if not args.speculative_adaptive:
            return (cls(args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens),)
        return tuple(cls(steps, 1, steps + 1) for steps in args.speculative_tiers)

    @property
    def draft_extend_rows(self) -> int:
        """Rows per request of the draft extend after verify (padded: accepted + 1 <= steps + 1)."""
        return self.steps + 1

    @property
    def decode_kv_need_per_req(self) -> int:
        """KV slots a decode cycle takes per request: the draft steps' scratch slots and the
        verify's are the first of the same slots (the draft's KV at a scratch slot is dead
        before the verify or the draft extend writes there)."""
        return max((self.steps - 1) * self.topk, self.num_draft_tokens)

    def tokens_per_req(self, kind: SubForward) -> int:
        """Rows per request of a decode-phase sub-forward (of each forward of the draft loop;
        the cycle batch: its KV slots)."""
        return {
            SubForward.DRAFT_LOOP: self.topk,
            SubForward.TARGET_VERIFY: self.num_draft_tokens,
            SubForward.DRAFT_EXTEND: self.draft_extend_rows,
            SubForward.DECODE_CYCLE: self.decode_kv_need_per_req,
        }[kind]

    @property
    def tree_row_width(self) -> int:
        """Request->token table columns a cycle uses past a request's KV."""
        return max(self.decode_kv_need_per_req, self.draft_extend_rows)


@dataclass(frozen=True)
class SpecIterationPlan:
    """extend_tokens[d]: tokens DP rank d prefills (None: no extend phase this iteration);
    decode_reqs[d]: requests DP rank d decodes (None: no decode phase). One entry per DP rank
    under DP attention, else a single entry (this rank's own batch). Same on every rank.
    extend_reqs: under DP attention, the requests each DP rank prefills, when every rank's
    prefill may replay a graph (None: no extend phase, or a rank computes prompt logprobs)."""

    sizes: SpecSizes
    extend_tokens: Optional[tuple[int, ...]]
    decode_reqs: Optional[tuple[int, ...]]
    dp_attention: bool
    extend_reqs: Optional[tuple[int, ...]] = None

    @classmethod
    def from_global(cls, plan: GlobalPlan, sizes: SpecSizes) -> SpecIterationPlan:
        extend = tuple(p.num_tokens if p.is_extend else 0 for p in plan.per_rank)
        decode = tuple(p.decode_reqs for p in plan.per_rank)
        graph_reqs = plan.prefill_graph_reqs if any(extend) else None
        extend_reqs = None if graph_reqs is None else tuple(n if p.is_extend else 0 for n, p in zip(graph_reqs, plan.per_rank))
        return cls(sizes, extend if any(extend) else None, decode if any(decode) else None, True, extend_reqs)

    @classmethod
    def local(cls, extend_tokens: int, decode_reqs: int, sizes: SpecSizes) -> SpecIterationPlan:
        """One DP group: the phases of this rank's own work (tokens it prefills, requests it
        decodes; 0: no such phase), no gathering."""
        return cls(sizes, (extend_tokens,) if extend_tokens else None, (decode_reqs,) if decode_reqs else None, False)

    def rows(self, kind: SubForward) -> tuple[int, ...]:
        """Rows each DP rank feeds the model in one sub-forward of this kind (in each forward
        of the draft loop)."""
        if kind in (SubForward.TARGET_EXTEND, SubForward.DRAFT_EXTEND_PREFILL):
            assert self.extend_tokens is not None
            return self.extend_tokens
        assert self.decode_reqs is not None
        return tuple(n * self.sizes.tokens_per_req(kind) for n in self.decode_reqs)

    def global_num_tokens(self, kind: SubForward) -> Optional[list[int]]:
        """ForwardBatch.global_num_tokens of a sub-forward (None without DP attention)."""
        return list(self.rows(kind)) if self.dp_attention else None

    def global_num_reqs(self, kind: SubForward) -> Optional[list[int]]:
        """ForwardBatch.global_num_reqs of a sub-forward (None outside the extend phase and
        without DP attention)."""
        if kind in (SubForward.TARGET_EXTEND, SubForward.DRAFT_EXTEND_PREFILL) and self.extend_reqs is not None:
            return list(self.extend_reqs)
        return None

    def extend_phase(self) -> list[SubForward]:
        if self.extend_tokens is None:
            return []
        return [SubForward.TARGET_EXTEND, SubForward.DRAFT_EXTEND_PREFILL]

    def decode_phase(self) -> list[SubForward]:
        if self.decode_reqs is None:
            return []
        loop = [SubForward.DRAFT_LOOP] if self.sizes.steps > 1 else []
        return loop + [SubForward.TARGET_VERIFY, SubForward.DRAFT_EXTEND]

    def sub_forwards(self) -> list[SubForward]:
        """The sequence every rank runs this iteration, in order."""
        return self.extend_phase() + self.decode_phase()
