"""EAGLE / NextN speculative decoding worker.

Plugs in where the scheduler would use a TpModelWorker. Per decode cycle, for every request
with seq_len L (target and draft KV at positions 0..L-2, last token x_{L-1} not written):
  1. draft loop: the topk guesses kept from the previous draft extend are depth 1; steps - 1
     draft forwards (topk tokens per request each, tree mask) add depths 2..steps, and the
     verify tree (the root x_{L-1} plus the num_draft_tokens - 1 best candidates) is built
     on the device; with CUDA graphs the whole loop is one graph (draft_loop.py);
  2. verify: the target runs the tree (tree mask), positions L-1 + depth;
  3. accept: greedy on the device (inside the verify program, verify_program.py), or lossless
     sampling walked on the host; accepted tokens plus one bonus are emitted;
  4. the accepted nodes' KV slots move to positions L-1.. (on the device) and the draft
     extends on the emitted tokens with the target hidden states of the nodes before them,
     padded to steps + 1 rows per request (pads write the dummy KV slot 0; logits are taken
     at each request's last real row).
The cycle's device work is speculative/decode_cycle.py. Its KV slots (the verify's and the
draft steps' scratch, one allocation) and table rows are all the host uploads: every length
follows from the KV lengths in the request states. A greedy batch without penalties runs the
cycle as one program (with CUDA graphs: one graph launch per cycle) and reads the device once,
after it is queued (the emitted tokens and the nodes kept); the rejected nodes' slots are
freed then. Other batches run it sub-forward by sub-forward and accept on the host.
A cycle runs at the tier (draft steps) the scheduler chose for the iteration (spec_tier.py);
one cycle's tier may differ from the one still in flight, which keeps its own sizes
(LaunchedCycle.sizes).
Under DP attention every rank runs the same sub-forward sequence with the same per-rank rows,
derived from the iteration's plan all-gather (spec_plan.py); a rank without work in a phase
runs zero-row (IDLE) sub-forwards. Hidden states handed from one sub-forward to the next are
fresh tensors, never views of the gathered buffer (which the next collective overwrites).
The draft model shares the target's request->token table and slot allocator, with its own
KV pool: draft position j holds the draft's KV for token j+1 at the target's slot of position j.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Optional, Union

import torch

from sglang.srt.batch.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.batch.schedule_batch import Req, ScheduleBatch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import get_attn_tp_group, get_attn_tp_size
from sglang.srt.distributed.scheduler_comm import GlobalPlan
from sglang.srt.model_executor.cuda_graph_runner import CapturedMode, ModeKey
from sglang.srt.model_executor.model_runner import ModelRunner, RunnerShapes
from sglang.srt.model_executor.tp_worker import GenerationResult, InputLogprobs, LaunchedStep, TpModelWorker
from sglang.srt.sampling.sampler import NAN_TOKEN_ID, Sampler, SamplingBatchInfo, greedy_tokens, token_logprobs
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.decode_cycle import CycleTensors, cycle_batch
from sglang.srt.speculative.eagle_utils import (
    Acceptance,
    DraftTree,
    VerifyOutcome,
    agree_on_acceptance,
    greedy_accept,
    non_finite_requests,
    path_token_counts,
    sample_acceptance,
    verify_outcome,
)
from sglang.srt.speculative.spec_info import RequestStates, SpecInput, top_guesses
from sglang.srt.speculative.spec_plan import SpecIterationPlan, SpecSizes, SubForward
from sglang.srt.speculative.spec_tier import SpecTier, draft_prefill_graph_mode, runner_shapes, target_graph_modes
from sglang.srt.speculative.token_map import draft_head_vocab
from sglang.srt.utils.transfer import HostCopy, upload

logger = logging.getLogger(__name__)

NEXTN_ARCHITECTURE = "DeepseekV3ForCausalLMNextN"
_TARGET_SUB_FORWARDS = (SubForward.TARGET_EXTEND, SubForward.TARGET_VERIFY)
# Under DP attention, the mode every rank (idle ones too) names a sub-forward by when choosing
# its CUDA graph (the prefill phase's: the target's and the draft's prefill graphs).
_GLOBAL_MODE = {
    SubForward.TARGET_EXTEND: ForwardMode.EXTEND,
    SubForward.DRAFT_EXTEND_PREFILL: ForwardMode.DRAFT_EXTEND,
    SubForward.DRAFT_LOOP: ForwardMode.DRAFT_DECODE,
    SubForward.TARGET_VERIFY: ForwardMode.TARGET_VERIFY,
    SubForward.DRAFT_EXTEND: ForwardMode.DRAFT_EXTEND,
    SubForward.DECODE_CYCLE: ForwardMode.DECODE_CYCLE,
}


def target_runner_setup(server_args: ServerArgs) -> tuple[RunnerShapes, dict[ModeKey, CapturedMode]]:
    """The shapes and CUDA graph modes of the target's runner (made before this worker)."""
    tiers = SpecSizes.tiers(server_args)
    return runner_shapes(tiers[-1]), target_graph_modes(tiers)


def draft_model_config(server_args: ServerArgs) -> ModelConfig:
    """NEXTN reads the MTP layer from a target or extracted checkpoint; EAGLE reads the head's config."""
    architectures = [NEXTN_ARCHITECTURE] if server_args.speculative_algorithm == "NEXTN" else None
    return ModelConfig(
        server_args.speculative_draft_model_path,
        context_length=server_args.context_length,
        dtype=server_args.dtype,
        device=server_args.device,
        trust_remote_code=server_args.trust_remote_code,
        architectures=architectures,
    )


@dataclass
class LaunchedCycle:
    """A decode cycle queued on the device (tp_worker.LaunchedStep's interface): its tokens and
    its KV positions reach the host in resolve(), which also frees the verify slots not kept."""

    reqs: list[Req]
    sizes: SpecSizes  # the cycle's tier
    slots: torch.Tensor  # [bs, cycle slots] the cycle's slots (host), the verify's first
    reads: HostCopy  # accept lengths, emitted tokens, kept nodes, then the optional reads
    finish: Callable[[SpecSizes, list[Req], torch.Tensor, list], GenerationResult]
    kv_known_at_launch = False

    @property
    def sampled_rows(self) -> list[int]:
        return list(range(len(self.reqs)))

    def future_tokens(self) -> None:
        """The next cycle reads its roots from the request states, not from the scheduler."""
        return None

    def resolve(self) -> GenerationResult:
        return self.finish(self.sizes, self.reqs, self.slots, self.reads.tensors())


@dataclass
class LaunchedMixed:
    """A prefill and the running requests' decode cycle queued in one iteration
    (--enable-mixed-chunk): the scheduler processes each with its own batch."""

    prefill: LaunchedStep
    cycle: LaunchedCycle

    def future_tokens(self) -> None:
        """The next cycle reads its roots from the request states, not from the scheduler."""
        return None


class EAGLEWorker:
    def __init__(self, server_args: ServerArgs, target_worker: TpModelWorker, gpu_id: int, tp_rank: int):
        self.target = target_worker
        self.kv = target_worker.kv
        self.device = target_worker.device
        self.detect_nan = server_args.enable_nan_detection
        tiers = SpecSizes.tiers(server_args)
        # The largest tier: the KV slots per request the scheduler keeps free for any cycle.
        self.sizes = tiers[-1]
        self.topk = self.sizes.topk  # the same in every tier
        target_runner = target_worker.runner
        self.hidden_size = target_runner.model_config.hidden_size
        # Positions past the context are never emitted (the request stops first); clamp them.
        self.max_position = target_runner.model_config.context_len - 1
        draft_config = draft_model_config(server_args)
        head_vocab, self.draft_columns = draft_head_vocab(
            server_args.speculative_token_map, draft_config.vocab_size, self.topk, server_args.attn_tp_size, self.device
        )
        table = target_runner.req_to_token_pool
        self.states = RequestStates(table.req_to_token.shape[0], self.topk, self.hidden_size, draft_config.dtype, self.device)
        # Made before the draft runner, whose CUDA graphs capture their programs.
        self.tiers = {
            sizes.steps: SpecTier.build(
                sizes, self.max_position, self.draft_columns, states=self.states, table=table, target=target_runner
            )
            for sizes in tiers
        }
        # The tier of the latest decode cycle launched: a request's cycle in flight is that one.
        self.launched_sizes = self.sizes
        graph_modes = draft_prefill_graph_mode(draft_config.hidden_size, draft_config.dtype)
        for tier in self.tiers.values():
            graph_modes.update(tier.draft_graph_modes(draft_config.hidden_size, draft_config.dtype))
        # The draft shares the target's slots, gathered buffer, IPC buffers, embedding and LM head.
        self.draft_runner = ModelRunner(
            draft_config,
            server_args,
            gpu_id,
            tp_rank,
            server_args.tp_size,
            req_to_token_pool=target_runner.req_to_token_pool,
            token_allocator=target_runner.token_allocator,
            gathered_buffer=target_runner.gathered_buffer,
            embed_and_head=target_runner.model.get_embed_and_head(),
            head_vocab=head_vocab,
            shapes=target_runner.shapes,
            graph_modes=graph_modes,
            open_ipc_collectives=False,
        )
        # Sub-forwards of the latest iteration: (kind, rows of every DP rank, local rows).
        self.trace: list[tuple[str, Optional[tuple[int, ...]], int]] = []
        logger.info(
            "Speculative decoding: %s, steps %d, topk %d, draft tokens %d%s%s",
            server_args.speculative_algorithm,
            server_args.speculative_num_steps,
            self.topk,
            server_args.speculative_num_draft_tokens,
            f", adaptive over the tiers of {sorted(self.tiers)} steps" if len(self.tiers) > 1 else "",
            f", draft head over {int((head_vocab >= 0).sum())} tokens" if head_vocab is not None else "",
        )

    # ------------------------------------------------------------------ worker interface
    def decode_kv_need_per_req(self) -> int:
        """KV slots per request that any tier's cycle may take (the scheduler keeps them free
        before the iteration's tier is known)."""
        return self.sizes.decode_kv_need_per_req

    def max_tokens_per_step(self) -> int:
        """Most tokens a request's cycle in flight brings: accepted drafts + the bonus token."""
        return self.launched_sizes.draft_extend_rows

    def add_request(self, req: Req) -> None:
        self.target.add_request(req)

    def remove_request(self, req: Req) -> None:
        self.target.remove_request(req)

    def launch(
        self, batch: ScheduleBatch, plan: Optional[GlobalPlan] = None, steps: Optional[int] = None
    ) -> Union[LaunchedStep, LaunchedCycle, LaunchedMixed]:
        """Queues this iteration's phases (DP attention: those of every DP rank, from `plan`) at
        the tier of `steps` (default: the largest; every rank passes the same); the batch's own
        phases do real work, the others run zero-row sub-forwards. A prefill has its tokens at
        once; a decode cycle's tokens wait in the returned LaunchedCycle; a prefill with its
        running requests' cycle (batch.alongside_decode) returns both as a LaunchedMixed."""
        tier = self.tier(steps)
        extend = batch if batch.mode == ForwardMode.EXTEND else None
        decode = batch.decode_part
        if plan is None:
            extend_tokens = len(batch.input_ids) if extend is not None else 0
            it = SpecIterationPlan.local(extend_tokens, len(decode.reqs) if decode is not None else 0, tier.sizes)
        else:
            it = SpecIterationPlan.from_global(plan, tier.sizes)
        self.trace = []
        prefill = cycle = None
        if extend is not None:
            prefill = self.forward_extend(extend, it)
        else:
            self._idle(it, it.extend_phase())
        if decode is not None:
            cycle = self.launch_decode(decode, it)
        else:
            self._idle(it, it.decode_phase())
        if prefill is not None and cycle is not None:
            return LaunchedMixed(prefill, cycle)
        return prefill or cycle or LaunchedStep(GenerationResult([], []))

    def tier(self, steps: Optional[int] = None) -> SpecTier:
        """The tier of `steps` draft steps (default: the largest)."""
        return self.tiers[self.sizes.steps if steps is None else steps]

    def planned_sub_forwards(self, plan: GlobalPlan, steps: Optional[int] = None) -> list[tuple[str, tuple[int, ...]]]:
        """(kind, rows of every DP rank) of each sub-forward an iteration with this plan runs (at
        the tier of `steps`)."""
        it = SpecIterationPlan.from_global(plan, self.tier(steps).sizes)
        return [(kind.value, it.rows(kind)) for kind in it.sub_forwards()]

    def _forward(self, runner: ModelRunner, fb: ForwardBatch, kind: SubForward, it: SpecIterationPlan):
        """Every sub-forward goes through here: sets its DP sizes, runs it by its tier's program
        (if any), and records it."""
        fb.global_num_tokens = it.global_num_tokens(kind)
        if fb.global_num_tokens is not None:
            fb.global_forward_mode = _GLOBAL_MODE[kind]
            fb.global_num_reqs = it.global_num_reqs(kind)
        buffer = runner.gathered_buffer
        if fb.spec_info is not None and buffer is not None and fb.num_tokens:
            # Invariant: a hidden state handed to the draft is never a view of the gathered buffer.
            assert fb.spec_info.hidden_states.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
        if kind == SubForward.DECODE_CYCLE:  # its sub-forwards run inside the one program
            for sub in it.decode_phase():
                dp_rows = it.global_num_tokens(sub)
                self.trace.append((sub.value, dp_rows and tuple(dp_rows), fb.batch_size * it.sizes.tokens_per_req(sub)))
        else:
            self.trace.append((kind.value, fb.global_num_tokens and tuple(fb.global_num_tokens), fb.num_tokens))
        program = self.tiers[it.sizes.steps].programs.get(kind)
        if program is not None:
            return runner.run_program(fb, program)
        return runner.forward(fb)

    def _idle(self, it: SpecIterationPlan, kinds: list[SubForward]) -> None:
        """Zero-row sub-forwards: this rank has no work in the phase but joins its collectives
        (and, with CUDA graphs, replays the same graph as the busy ranks: a masked sub-forward
        carries a zero-row mask of the busy ranks' tree width)."""
        programs = self.tiers[it.sizes.steps].programs
        for kind in kinds:
            target, loop = kind in _TARGET_SUB_FORWARDS, kind == SubForward.DRAFT_LOOP
            tree_cols = {SubForward.TARGET_VERIFY: it.sizes.num_draft_tokens, SubForward.DRAFT_LOOP: self.topk}.get(kind, 0)
            runner = self.target.runner if target else self.draft_runner
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            hidden = torch.empty((0, self.hidden_size), dtype=runner.dtype, device=self.device)
            scores = torch.empty(0, dtype=torch.float32, device=self.device)
            fb = ForwardBatch(
                mode=ForwardMode.IDLE,
                batch_size=0,
                input_ids=empty,
                positions=empty,
                out_cache_loc=empty,
                req_pool_indices=empty,
                seq_lens=empty,
                extend_seq_lens=empty,
                custom_mask=torch.zeros((0, tree_cols), dtype=torch.bool, device=self.device) if tree_cols else None,
                spec_info=None if target else SpecInput(hidden, scores if loop else None),
                # The programs return it (the loop feeds it on, the verify hands it on, the draft extend keeps it).
                capture_hidden_mode=CaptureHiddenMode.FULL if kind in programs else CaptureHiddenMode.NULL,
            )
            self._forward(runner, fb, kind, it)

    # ------------------------------------------------------------------ prefill
    def forward_extend(self, batch: ScheduleBatch, it: SpecIterationPlan) -> LaunchedStep:
        """Queues the target's prefill, its sampling and the draft's extend; nothing waits for
        the device (the sampled tokens reach the draft on the device, the host in resolve())."""
        fb = batch.to_forward_batch(self.device)
        fb.capture_hidden_mode = CaptureHiddenMode.FULL
        out = self._forward(self.target.runner, fb, SubForward.TARGET_EXTEND, it)
        ready = [i for i, r in enumerate(batch.reqs) if r.kv_len + batch.extend_lens[i] == r.seq_len]
        result = GenerationResult([[] for _ in batch.reqs], list(batch.extend_lens))
        input_logprobs = InputLogprobs.launch(batch, out)  # the prompt's logprobs are the target's
        sampled = self.target.launch_sampling(batch.reqs, ready, out) if ready else None
        # Draft sees every chunk: ids shifted left by one, then the next token: the prompt's, or
        # for a request whose prompt ends here the sampled one, put in its place on the device.
        # A NaN_TOKEN_ID (--enable-nan-detection: non-finite logits) is no embedding row: the
        # draft reads token 0 in its place; the scheduler finishes that request with its error.
        ids: list[int] = []
        sampled_at: list[int] = []  # the rows of ids that take the sampled tokens, in `ready` order
        ready_rows = set(ready)
        for i, req in enumerate(batch.reqs):
            start, end = batch.prefix_lens[i], batch.seq_lens[i]
            ids += req.all_ids[start + 1 : end]
            if i in ready_rows:
                sampled_at.append(len(ids))
            ids.append(0 if i in ready_rows else req.all_ids[end])
        draft_ids, sampled_rows = upload([ids, sampled_at], self.device)
        if sampled is not None:
            draft_ids.index_copy_(0, sampled_rows, sampled.out.next_token_ids.clamp(min=0))
        draft_fb = replace(
            fb,
            mode=ForwardMode.DRAFT_EXTEND,
            input_ids=draft_ids,
            capture_hidden_mode=CaptureHiddenMode.LAST,
            spec_info=SpecInput(out.hidden_states),
            input_logprob_rows=None,
        )
        draft_out = self._forward(self.draft_runner, draft_fb, SubForward.DRAFT_EXTEND_PREFILL, it)
        if ready:  # their first decode cycle starts from the whole sequence's KV and the sampled token
            reqs = [batch.reqs[i] for i in ready]
            req_rows, kv_lens, out_rows = upload([[r.req_pool_idx for r in reqs], [r.seq_len for r in reqs], ready], self.device)
            self.states.kv_lens.index_copy_(0, req_rows, kv_lens)
            self.states.last_tokens.index_copy_(0, req_rows, sampled.out.next_token_ids.clamp(min=0))
            logits, hidden = draft_out.next_token_logits, draft_out.hidden_states
            if len(ready) < logits.shape[0]:  # else the rows are all rows, in order
                logits, hidden = logits[out_rows], hidden[out_rows]
            self.states.store_draft(req_rows, *top_guesses(logits, self.topk, self.draft_columns), hidden)
        return LaunchedStep(result, sampled, input_logprobs)

    # ------------------------------------------------------------------ decode cycle
    def launch_decode(self, batch: ScheduleBatch, it: SpecIterationPlan) -> LaunchedCycle:
        """The cycle's slots come from the host (one allocation, one upload with the table
        rows); a greedy batch without penalties or per-token reads runs the whole cycle as
        one program (one graph), any other runs it sub-forward by sub-forward, accepting
        between verify and draft extend."""
        reqs, sizes = batch.reqs, it.sizes
        bs, width = len(reqs), sizes.tokens_per_req(SubForward.DECODE_CYCLE)
        slots = self.kv.alloc(bs * width)
        rows, dev_slots = upload([[r.req_pool_idx for r in reqs]], self.device, tensors=[slots])
        # A request whose previous cycle is in flight gained 1 .. steps + 1 KV positions in it,
        # at that cycle's tier.
        host_kv = [r.kv_len + self.launched_sizes.draft_extend_rows * r.in_flight for r in reqs]
        self.launched_sizes = sizes
        fb = cycle_batch(rows, dev_slots.view(bs, width), host_kv, not any(r.in_flight for r in reqs))
        if self._whole_cycle(reqs):
            reads = list(self._forward(self.draft_runner, fb, SubForward.DECODE_CYCLE, it))
        else:
            reads = []
            accept = partial(self._accept_on_host, sizes, reqs, reads)
            self.tiers[sizes.steps].cycle.run(fb, partial(self._sub_forward, it), accept)
        return LaunchedCycle(reqs, sizes, slots.view(bs, width), HostCopy(*reads), self._result)

    def _whole_cycle(self, reqs: list[Req]) -> bool:
        """Whether the verify's argmax decides the cycle and the host reads only its outcome."""
        return self.target.takes_argmax_only(reqs)

    def _sub_forward(self, it: SpecIterationPlan, kind: SubForward, fb: ForwardBatch) -> tuple[torch.Tensor, ...]:
        runner = self.target.runner if kind in _TARGET_SUB_FORWARDS else self.draft_runner
        return self._forward(runner, fb, kind, it)

    def _accept_on_host(
        self,
        sizes: SpecSizes,
        reqs: list[Req],
        reads: list[torch.Tensor],
        cycle: CycleTensors,
        tree: DraftTree,
        node_tokens: torch.Tensor,
        logits: torch.Tensor,
        hidden: torch.Tensor,
        outcome: VerifyOutcome,
    ) -> VerifyOutcome:
        """The outcome of a batch that samples or has penalties (from the verify logits; the
        greedy outcome otherwise), and what the host reads of the cycle into `reads`."""
        non_finite = non_finite_requests(logits, len(reqs)) if self.detect_nan else None
        if not _greedy_without_penalties(reqs):
            logits, acceptance = self.accept(sizes, reqs, tree, node_tokens, logits, non_finite)
            outcome = verify_outcome(acceptance, cycle.kv_len, cycle.slots[:, : sizes.num_draft_tokens], hidden)
        reads.append(outcome.host_reads)
        if non_finite is not None:
            reads.append(non_finite)
        if any(r.return_logprob for r in reqs):
            reads += self._logprobs(sizes, reqs, logits, outcome.acceptance)
        return outcome

    def accept(
        self,
        sizes: SpecSizes,
        reqs: list[Req],
        tree: DraftTree,
        node_tokens: torch.Tensor,
        logits: torch.Tensor,
        non_finite: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Acceptance]:
        """The verify logits after penalties and what they accept (greedy, or sampled), for a
        cycle of the tier of `sizes`. non_finite [bs]: requests whose logits are zeroed first
        (their outcome is discarded), so that sampling stays valid."""
        n = sizes.num_draft_tokens
        if non_finite is not None:
            logits = logits.masked_fill(non_finite.repeat_interleave(n).view(-1, 1), 0.0)
        info = SamplingBatchInfo.from_requests(  # one row per tree node
            [r.sampling_params for r in reqs for _ in range(n)],
            [(r.origin_input_ids, r.output_ids) for r in reqs for _ in range(n)],
            [None] * (len(reqs) * n),
            logits.shape[-1],
            self.device,
        )
        if info.output_counts is not None:  # a node's penalties see the tokens before the cycle and on its path
            info.count_more_outputs(path_token_counts(tree, logits.shape[-1]))
        logits = info.apply_penalties(logits)
        if info.all_greedy:
            target_tokens = greedy_tokens(logits).view(len(reqs), n)
            return logits, greedy_accept(tree, node_tokens, target_tokens, sizes.draft_extend_rows)
        return logits, self.sample_accept(sizes, reqs, tree, node_tokens, logits, info)

    def sample_accept(
        self,
        sizes: SpecSizes,
        reqs: list[Req],
        tree: DraftTree,
        node_tokens: torch.Tensor,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
    ) -> Acceptance:
        """Lossless tree sampling, walked on the host (two reads of the device)."""
        generators = [self.target.generators.get(r.rid) for r in reqs]
        draw = partial(Sampler._draw, generators=generators if any(generators) else None)
        probs = Sampler.filtered_probs(logits, info)
        uniforms = self._uniforms(reqs, sizes.num_draft_tokens)
        acceptance = sample_acceptance(probs, tree, node_tokens, uniforms, draw, sizes.draft_extend_rows)
        group = get_attn_tp_group()
        if group is None or get_attn_tp_size() == 1:
            return acceptance
        # Attention-TP ranks hold the same requests: they keep attention-TP rank 0's outcome.
        return agree_on_acceptance(acceptance, group, torch.distributed.get_global_rank(group, 0))

    def _uniforms(self, reqs: list[Req], n: int) -> torch.Tensor:
        u = torch.rand((len(reqs), n), device=self.device)
        for b, req in enumerate(reqs):
            gen = self.target.generators.get(req.rid)
            if gen is not None:
                u[b] = torch.rand(n, generator=gen, device=self.device)
        return u

    def _logprobs(self, sizes: SpecSizes, reqs: list[Req], logits: torch.Tensor, acceptance: Acceptance) -> list[torch.Tensor]:
        """Logprob of each emitted token (padding columns too) under the target logits (after
        penalties) of its node, and the top logprobs when asked for: [bs * width (, top_n)]."""
        rows = torch.arange(len(reqs), device=self.device).view(-1, 1) * sizes.num_draft_tokens + acceptance.nodes
        top_n = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        chosen, tops = token_logprobs(logits[rows.flatten()], acceptance.emitted.view(-1), top_n)
        return [chosen, *(tops or ())]

    def _result(
        self, sizes: SpecSizes, reqs: list[Req], slots: torch.Tensor, reads: tuple[torch.Tensor, ...]
    ) -> GenerationResult:
        """The tokens per request of a cycle of the tier of `sizes`, from what it read (host
        tensors); frees the nodes not kept (all of a request that finished while the cycle was
        in flight: its tokens are dropped)."""
        host_reads, *rest = reads
        rest = [t.tolist() for t in rest]
        width = sizes.draft_extend_rows
        rows = host_reads.tolist()  # per request: accept_len, nodes, emitted (VerifyOutcome.host_reads)
        accept_len, emitted = [row[0] for row in rows], [row[1 + width :] for row in rows]
        self.kv.allocator.free(slots[~self._kept_nodes(sizes, reqs, host_reads[:, 1 : 1 + width])])
        result = GenerationResult(
            next_token_ids=[emitted[b][: a + 1] for b, a in enumerate(accept_len)],
            kv_written=[a + 1 for a in accept_len],
            accepted_draft_tokens=list(accept_len),
            draft_steps=sizes.steps,
        )
        if self.detect_nan:
            non_finite, *rest = rest
            for b, bad in enumerate(non_finite):
                if bad:  # --enable-nan-detection: the scheduler turns it into an error finish
                    result.next_token_ids[b] = [NAN_TOKEN_ID]
        if rest:
            self._fill_logprobs(width, reqs, accept_len, emitted, rest, result)
        return result

    def _kept_nodes(self, sizes: SpecSizes, reqs: list[Req], nodes: torch.Tensor) -> torch.Tensor:
        """[bs, cycle slots] bool (host): the cycle's slots a request keeps. nodes [bs, width]
        repeats the last kept node past accept_len; a finished request keeps none."""
        keep = torch.zeros((len(reqs), sizes.decode_kv_need_per_req), dtype=torch.bool).scatter_(1, nodes, True)
        finished = [b for b, r in enumerate(reqs) if r.finished]
        if finished:
            keep[finished] = False
        return keep

    def _fill_logprobs(
        self,
        width: int,
        reqs: list[Req],
        accept_len: list[int],
        emitted: list[list[int]],
        reads: list,
        result: GenerationResult,
    ) -> None:
        """width: the cycle's emitted tokens per request (steps + 1, padding included)."""
        chosen, *tops = reads
        result.logprobs, result.top_logprobs = [], []
        for b, req in enumerate(reqs):
            rows = range(b * width, b * width + accept_len[b] + 1)
            result.logprobs.append([(chosen[i], emitted[b][j]) for j, i in enumerate(rows)])
            k = req.top_logprobs_num
            result.top_logprobs.append([list(zip(tops[0][i][:k], tops[1][i][:k])) for i in rows] if tops and k else [])


def _greedy_without_penalties(reqs: list[Req]) -> bool:
    """Whether the verify's argmax decides the cycle (VerifyProgram's greedy outcome holds)."""
    return all(r.sampling_params.is_greedy and not r.sampling_params.adjusts_logits for r in reqs)
