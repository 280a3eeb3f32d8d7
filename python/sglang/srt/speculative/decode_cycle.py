"""One speculative decode cycle's device work: draft loop, target verify, draft extend.

A cycle starts from a *cycle batch*: per request its table row and the KV slots the cycle
may write (`SpecSizes.decode_kv_need_per_req` of them: the verify's nodes use the first
num_draft_tokens, the draft steps' scratch the first (steps - 1) * topk, in the same table
columns L, L + 1, ... after the request's KV length L). Everything else (L, the last token,
the draft's guesses and hidden state) comes from the request states on the device, so the
host uploads only rows and slots.

`DecodeCycle` is a program of the draft runner (GraphProgram): a greedy batch without
penalties runs it whole, eagerly or replayed as one CUDA graph, and the host launches one
graph per cycle. Other batches run the same steps (`run`) one sub-forward at a time, with
the host's acceptance between the verify and the draft extend (EAGLEWorker).

Padded requests of a graph (DP attention: idle ranks too) use the dummy table row and the
dummy KV slot; their KV length stays 0 (`finish` writes 0 for them), so every length they
give a sub-forward is that of a padded row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.batch.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.cuda_graph_runner import ForwardFn
from sglang.srt.speculative.draft_extend_program import DraftExtendProgram
from sglang.srt.speculative.draft_loop import DraftLoop
from sglang.srt.speculative.eagle_utils import DraftTree, VerifyOutcome, build_draft_tree, chain_tree
from sglang.srt.speculative.spec_info import RequestStates, SpecInput
from sglang.srt.speculative.spec_plan import SpecSizes, SubForward
from sglang.srt.speculative.verify_program import VerifyProgram

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

# Runs the program of one sub-forward on its batch (its graph, or its forwards eagerly).
SubForwardFn = Callable[[SubForward, ForwardBatch], tuple[torch.Tensor, ...]]
# Between verify and draft extend: (cycle, tree, node tokens, verify logits, verify hidden,
# greedy outcome) -> the outcome the cycle keeps.
AcceptFn = Callable[["CycleTensors", DraftTree, torch.Tensor, torch.Tensor, torch.Tensor, VerifyOutcome], VerifyOutcome]


@dataclass
class CycleTensors:
    """A cycle's per-request values: device tensors, and the host's KV lengths (upper bounds
    while an earlier cycle of the request is in flight: host_lens_exact False)."""

    rows: torch.Tensor  # [bs] table rows
    kv_len: torch.Tensor  # [bs] L
    roots: torch.Tensor  # [bs] the last tokens (verify tree roots)
    # The draft's guesses for the token after each root and its hidden state at the last position.
    draft_probs: torch.Tensor  # [bs, topk]
    draft_tokens: torch.Tensor  # [bs, topk]
    draft_hidden: torch.Tensor  # [bs, hidden]
    slots: torch.Tensor  # [bs, decode_kv_need_per_req]
    host_kv_len: list[int]
    host_lens_exact: bool
    dp_reqs: Optional[list[int]]  # DP attention: requests of every DP rank in this cycle

    @property
    def batch_size(self) -> int:
        return self.rows.shape[0]


@dataclass(frozen=True, eq=False)  # compared and hashed as an object: it holds state
class DecodeCycle:
    sizes: SpecSizes
    max_position: int  # positions past the context are never emitted; they are clamped
    # What the tiers' cycles share (left out of the repr, which a graph key carries and ranks
    # compare).
    states: RequestStates = field(repr=False)
    table: ReqToTokenPool = field(repr=False)
    target: ModelRunner = field(repr=False)
    # The programs of the tier's sub-forwards.
    draft_loop: Optional[DraftLoop]
    verify: VerifyProgram
    draft_extend: DraftExtendProgram

    # ------------------------------------------------------------------ the whole cycle
    def __call__(self, fb: ForwardBatch, forward: ForwardFn) -> tuple[torch.Tensor, ...]:
        """The greedy cycle of a cycle batch; returns (VerifyOutcome.host_reads,)."""
        programs = {
            SubForward.DRAFT_LOOP: self.draft_loop,
            SubForward.TARGET_VERIFY: self.verify,
            SubForward.DRAFT_EXTEND: self.draft_extend,
        }

        def sub_forward(kind: SubForward, batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
            runner = self.target if kind == SubForward.TARGET_VERIFY else None
            return programs[kind](batch, partial(forward, runner=runner))

        return (self.run(fb, sub_forward).host_reads,)

    def run(self, fb: ForwardBatch, sub_forward: SubForwardFn, accept: Optional[AcceptFn] = None) -> VerifyOutcome:
        """The cycle's steps; `accept` (if given) replaces the greedy outcome of the verify."""
        cycle = self.begin(fb)
        tree = self.draft(cycle, sub_forward)
        node_tokens = torch.cat([cycle.roots.view(-1, 1), tree.tokens], dim=1)
        outputs = sub_forward(SubForward.TARGET_VERIFY, self.verify_batch(cycle, tree, node_tokens))
        logits, hidden, outcome = VerifyProgram.split(outputs)
        if accept is not None:
            outcome = accept(cycle, tree, node_tokens, logits, hidden, outcome)
        self.finish(cycle, outcome, sub_forward)
        return outcome

    # ------------------------------------------------------------------ steps
    def begin(self, fb: ForwardBatch) -> CycleTensors:
        """The cycle's values from its batch and the request states (read before `finish`
        writes them); the slots go into each request's table row from its KV length L (the
        draft steps and the verify read them)."""
        bs = fb.batch_size
        rows, slots = fb.req_pool_indices, fb.out_cache_loc.view(bs, -1)
        kv_len, roots, probs, tokens, hidden = self.states.cycle_start(rows)
        self.table.write_rows_from(rows, kv_len, slots)
        tpr = self.sizes.tokens_per_req(SubForward.DECODE_CYCLE)
        dp_reqs = None if fb.global_num_tokens is None else [n // tpr for n in fb.global_num_tokens]
        return CycleTensors(rows, kv_len, roots, probs, tokens, hidden, slots, list(fb.seq_lens_cpu), fb.host_lens_exact, dp_reqs)

    def draft(self, cycle: CycleTensors, sub_forward: SubForwardFn) -> DraftTree:
        """The verify trees (without roots) from the draft loop, or from the kept guesses alone."""
        bs, k = cycle.batch_size, self.sizes.topk
        probs, tokens, hidden = cycle.draft_probs, cycle.draft_tokens, cycle.draft_hidden
        if self.sizes.steps == 1:
            if k == 1:  # the chain of the one guess (what build_draft_tree keeps of it, without launches)
                return chain_tree(tokens, self.table.constants)
            return build_draft_tree(probs, tokens, self.table.constants.full((bs, k), -1), self.sizes.num_draft_tokens, 1)
        fb = self._batch(
            cycle,
            SubForward.DRAFT_LOOP,
            ForwardMode.DRAFT_DECODE,
            input_ids=tokens.flatten(),
            positions=cycle.kv_len.clamp(max=self.max_position).view(-1, 1).expand(-1, k).flatten().contiguous(),
            out_cache_loc=cycle.slots[:, :k].flatten().contiguous(),  # the first step's scratch: columns L .. L + k - 1
            custom_mask=self.table.constants.tiled_eye(bs, k),
            capture_hidden_mode=CaptureHiddenMode.FULL,
            # Each guess's copy of the hidden state (hidden itself when topk = 1).
            spec_info=SpecInput(hidden.unsqueeze(1).expand(-1, k, -1).flatten(0, 1), probs.flatten()),
        )
        return DraftTree(*sub_forward(SubForward.DRAFT_LOOP, fb))

    def verify_batch(self, cycle: CycleTensors, tree: DraftTree, node_tokens: torch.Tensor) -> ForwardBatch:
        """The target forward over every request's tree (tree mask), node j at column L + j."""
        n = self.sizes.num_draft_tokens
        positions = (cycle.kv_len.view(-1, 1) + tree.depths).clamp(max=self.max_position)
        return self._batch(
            cycle,
            SubForward.TARGET_VERIFY,
            ForwardMode.TARGET_VERIFY,
            input_ids=node_tokens.flatten(),
            positions=positions.flatten(),
            out_cache_loc=cycle.slots[:, :n].flatten().contiguous(),
            custom_mask=tree.mask.flatten(0, 1),
            capture_hidden_mode=CaptureHiddenMode.FULL,
        )

    def finish(self, cycle: CycleTensors, outcome: VerifyOutcome, sub_forward: SubForwardFn) -> None:
        """Move the kept nodes' slots to positions L.. (positions past them, up to the draft
        extend's rows, get the dummy slot, which its pad rows write), let the draft catch up
        (position L + j consumes emitted token j with the target hidden state of its node;
        pads come after every real row, so no real row sees them), and store what the next
        cycle starts from."""
        width = self.sizes.draft_extend_rows
        self.table.write_rows_from(cycle.rows, cycle.kv_len, outcome.extend_slots)
        positions = (cycle.kv_len.view(-1, 1) + self.table.constants.arange(width)).clamp(max=self.max_position)
        fb = self._batch(
            cycle,
            SubForward.DRAFT_EXTEND,
            ForwardMode.DRAFT_EXTEND,
            input_ids=outcome.acceptance.emitted.flatten(),
            positions=positions.flatten(),
            out_cache_loc=outcome.extend_slots.flatten(),
            capture_hidden_mode=CaptureHiddenMode.LAST,
            logits_indices=outcome.extend_logits_rows,
            spec_info=SpecInput(outcome.extend_hidden),
        )
        probs, tokens, hidden = sub_forward(SubForward.DRAFT_EXTEND, fb)
        self.states.store_cycle_end(cycle.rows, probs, tokens, hidden, outcome.cursors)

    def _batch(self, cycle: CycleTensors, kind: SubForward, mode: ForwardMode, **fields) -> ForwardBatch:
        """A sub-forward's batch: kind's new tokens per request after each KV length L.
        Its index tensors are dense (Triton kernels read them as arrays)."""
        new, bs = self.sizes.tokens_per_req(kind), cycle.batch_size
        return ForwardBatch(
            mode=mode,
            batch_size=bs,
            req_pool_indices=cycle.rows,
            seq_lens=cycle.kv_len + new,
            extend_seq_lens=self.table.constants.full((bs,), new),
            seq_lens_cpu=[L + new for L in cycle.host_kv_len],
            extend_seq_lens_cpu=[new] * bs,
            host_lens_exact=cycle.host_lens_exact,
            global_num_tokens=None if cycle.dp_reqs is None else [r * new for r in cycle.dp_reqs],
            global_forward_mode=None if cycle.dp_reqs is None else mode,
            **fields,
        )


def cycle_batch(rows: torch.Tensor, slots: torch.Tensor, host_kv_len: list[int], host_lens_exact: bool) -> ForwardBatch:
    """The batch a cycle starts from: rows [bs] and slots [bs, decode_kv_need_per_req] on the
    device. It carries no tokens, positions or device lengths (the cycle reads those from the
    request states), only the host's KV lengths."""
    empty = rows[:0]
    return ForwardBatch(
        mode=ForwardMode.DECODE_CYCLE,
        batch_size=rows.shape[0],
        input_ids=empty,
        positions=empty,
        out_cache_loc=slots.flatten(),
        req_pool_indices=rows,
        seq_lens=empty,
        extend_seq_lens=empty,
        seq_lens_cpu=host_kv_len,
        extend_seq_lens_cpu=[slots.shape[1]] * rows.shape[0],
        host_lens_exact=host_lens_exact,
    )
