"""EAGLE / NextN speculative decoding worker (DESIGN.md §7).

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
Every size is known on the host before the cycle starts, so a greedy cycle reads the device
once, after its last forward is queued (the emitted tokens and the nodes kept); the rejected
nodes' slots are freed then.
Under DP attention every rank runs the same sub-forward sequence with the same per-rank rows,
derived from the iteration's plan all-gather (spec_plan.py); a rank without work in a phase
runs zero-row (IDLE) sub-forwards. Hidden states handed from one sub-forward to the next are
fresh tensors, never views of the gathered buffer (which the next collective overwrites).
The draft model shares the target's request->token table and slot allocator, with its own
KV pool: draft position j holds the draft's KV for token j+1 at the target's slot of position j.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.scheduler_comm import GlobalPlan
from sglang.srt.layers.sampler import NAN_TOKEN_ID, Sampler, SamplingBatchInfo, greedy_tokens
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.tp_worker import GenerationResult, LaunchedStep, TpModelWorker
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.draft_loop import DraftLoop
from sglang.srt.speculative.eagle_utils import (
    Acceptance,
    DraftTree,
    VerifyOutcome,
    build_draft_tree,
    greedy_accept,
    non_finite_requests,
    verify_outcome,
    walk_tree,
)
from sglang.srt.speculative.spec_info import RequestStates, SpecInput, top_guesses
from sglang.srt.speculative.spec_plan import SpecIterationPlan, SpecSizes, SubForward
from sglang.srt.speculative.verify_program import VerifyProgram
from sglang.srt.utils.device_constants import DeviceConstants
from sglang.srt.utils.transfer import HostCopy, to_device, to_host, upload

logger = logging.getLogger(__name__)

NEXTN_ARCHITECTURE = "DeepseekV3ForCausalLMNextN"
_TARGET_SUB_FORWARDS = (SubForward.TARGET_EXTEND, SubForward.TARGET_VERIFY)
# Under DP attention, the mode every rank (idle ones too) names a sub-forward by when choosing
# its CUDA graph; the draft extend after a prefill has varying lengths and stays eager.
_GLOBAL_MODE = {
    SubForward.TARGET_EXTEND: ForwardMode.EXTEND,
    SubForward.DRAFT_EXTEND_PREFILL: ForwardMode.EXTEND,
    SubForward.DRAFT_LOOP: ForwardMode.DRAFT_DECODE,
    SubForward.TARGET_VERIFY: ForwardMode.TARGET_VERIFY,
    SubForward.DRAFT_EXTEND: ForwardMode.DRAFT_EXTEND,
}


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
class Lengths:
    """seq_lens and extend_seq_lens of one sub-forward, on the device and on the host."""

    seq: torch.Tensor
    ext: torch.Tensor
    seq_cpu: list[int]
    ext_cpu: list[int]


@dataclass
class CycleInputs:
    """A decode cycle's per-request values on the device, gathered from the request states
    (so a cycle can be queued before the previous one's lengths reach the host). Every length
    of every sub-forward follows from the KV lengths L. The host lengths are exact when every
    request's previous cycle has reached the host, else upper bounds (docs/architecture.md)."""

    rows: torch.Tensor  # [bs] request->token table rows
    kv_len: torch.Tensor  # [bs] L
    roots: torch.Tensor  # [bs] the last tokens (verify tree roots)
    draft_positions: torch.Tensor  # [bs * topk] L (clamped): the draft loop's first step
    extend_positions: torch.Tensor  # [bs * (steps + 1)] L + j (clamped): the draft extend
    draft_loop: Lengths  # topk new tokens per request (the loop's first step)
    verify: Lengths  # num_draft_tokens
    extend: Lengths  # steps + 1
    host_lens_exact: bool

    @classmethod
    def gather(
        cls, reqs: list[Req], states: RequestStates, sizes: SpecSizes, max_position: int, constants: DeviceConstants
    ) -> "CycleInputs":
        (rows,) = upload([[r.req_pool_idx for r in reqs]], constants.device)
        bs, width = len(reqs), sizes.draft_extend_rows
        kv_len, roots = states.cursors[rows].unbind(1)
        # A request whose previous cycle is in flight gained 1 .. steps + 1 KV positions in it.
        host_kv = [r.kv_len + width * r.in_flight for r in reqs]
        exact = not any(r.in_flight for r in reqs)
        lengths = [
            Lengths(kv_len + new, constants.full((bs,), new), [L + new for L in host_kv], [new] * bs)
            for new in (sizes.topk, sizes.num_draft_tokens, width)
        ]
        extend_positions = (kv_len.view(-1, 1) + constants.arange(width)).clamp(max=max_position)  # [bs, width]
        return cls(
            rows,
            kv_len,
            roots,
            extend_positions[:, 0].repeat_interleave(sizes.topk),
            extend_positions.flatten(),
            *lengths,
            exact,
        )


@dataclass
class LaunchedCycle:
    """A decode cycle queued on the device (scheduler.LaunchedStep's interface): its tokens and
    its KV positions reach the host in resolve(), which also frees the verify slots not kept."""

    reqs: list[Req]
    slots: torch.Tensor  # [bs, n] the verify's slots (host)
    reads: HostCopy  # accept lengths, emitted tokens, kept nodes, then the optional reads
    finish: Callable[[list[Req], torch.Tensor, list], GenerationResult]
    kv_known_at_launch = False

    @property
    def sampled_rows(self) -> list[int]:
        return list(range(len(self.reqs)))

    def future_tokens(self) -> None:
        """The next cycle reads its roots from the request states, not from the scheduler."""
        return None

    def resolve(self) -> GenerationResult:
        return self.finish(self.reqs, self.slots, self.reads.tensors())


class EAGLEWorker:
    def __init__(self, server_args: ServerArgs, target_worker: TpModelWorker, gpu_id: int, tp_rank: int):
        self.target = target_worker
        self.kv = target_worker.kv
        self.device = target_worker.device
        self.steps = server_args.speculative_num_steps
        self.topk = server_args.speculative_eagle_topk
        self.num_draft = server_args.speculative_num_draft_tokens
        self.detect_nan = server_args.enable_nan_detection
        self.sizes = SpecSizes.from_server_args(server_args)
        target_runner = target_worker.runner
        self.hidden_size = target_runner.model_config.hidden_size
        # Positions past the context are never emitted (the request stops first); clamp them.
        self.max_position = target_runner.model_config.context_len - 1
        self.draft_loop = (
            DraftLoop(self.steps, self.topk, self.num_draft, self.max_position) if self.steps > 1 else None
        )
        self.draft_runner = ModelRunner(
            draft_model_config(server_args),
            server_args,
            gpu_id,
            tp_rank,
            server_args.tp_size,
            req_to_token_pool=target_runner.req_to_token_pool,
            token_allocator=target_runner.token_allocator,
            gathered_buffer=target_runner.gathered_buffer,
            is_draft=True,
            embed_and_head=target_runner.model.get_embed_and_head(),
            draft_loop=self.draft_loop,
        )
        self.states = RequestStates(
            target_runner.req_to_token_pool.size, self.topk, self.hidden_size, self.draft_runner.dtype, self.device
        )
        self.constants = target_runner.req_to_token_pool.constants  # one cache of device constants per table
        # The sub-forwards that run as one program (its graph, or its forwards eagerly).
        self.programs = {
            SubForward.TARGET_VERIFY: self.sizes.verify_program(),
            SubForward.DRAFT_EXTEND: self.sizes.draft_extend_program(),
        }
        if self.draft_loop is not None:
            self.programs[SubForward.DRAFT_LOOP] = self.draft_loop
        # Sub-forwards of the latest iteration: (kind, rows of every DP rank, local rows).
        self.trace: list[tuple[str, Optional[tuple[int, ...]], int]] = []
        logger.info(
            "Speculative decoding: %s, steps %d, topk %d, draft tokens %d",
            server_args.speculative_algorithm, self.steps, self.topk, self.num_draft,
        )

    # ------------------------------------------------------------------ worker interface
    def decode_kv_need_per_req(self) -> int:
        return self.sizes.decode_kv_need_per_req

    def max_tokens_per_step(self) -> int:
        return self.sizes.draft_extend_rows  # accepted drafts + the bonus token

    def add_request(self, req: Req) -> None:
        self.target.add_request(req)

    def remove_request(self, req: Req) -> None:
        self.target.remove_request(req)

    def launch(self, batch: ScheduleBatch, plan: Optional[GlobalPlan] = None) -> Union[LaunchedStep, LaunchedCycle]:
        """Queues this iteration's phases (DP attention: those of every DP rank, from `plan`);
        the batch's own phase does real work, the others run zero-row sub-forwards. A prefill
        has its tokens at once; a decode cycle's tokens wait in the returned LaunchedCycle."""
        if plan is None:
            it = SpecIterationPlan.local(batch.mode, len(batch.input_ids), len(batch.reqs), self.sizes)
        else:
            it = SpecIterationPlan.from_global(plan, self.sizes)
        self.trace = []
        step: Union[LaunchedStep, LaunchedCycle] = LaunchedStep(GenerationResult([], []))
        if batch.mode == ForwardMode.EXTEND:
            step = LaunchedStep(self.forward_extend(batch, it))
        else:
            self._idle(it, it.extend_phase())
        if batch.mode == ForwardMode.DECODE:
            step = self.launch_decode(batch, it)
        else:
            self._idle(it, it.decode_phase())
        return step

    def planned_sub_forwards(self, plan: GlobalPlan) -> list[tuple[str, tuple[int, ...]]]:
        """(kind, rows of every DP rank) of each sub-forward an iteration with this plan runs."""
        it = SpecIterationPlan.from_global(plan, self.sizes)
        return [(kind.value, it.rows(kind)) for kind in it.sub_forwards()]

    def _forward(self, runner: ModelRunner, fb: ForwardBatch, kind: SubForward, it: SpecIterationPlan):
        """Every sub-forward goes through here: sets its DP sizes and records it."""
        fb.global_num_tokens = it.global_num_tokens(kind)
        if fb.global_num_tokens is not None:
            fb.global_forward_mode = _GLOBAL_MODE[kind]
        buffer = runner.gathered_buffer
        if fb.spec_info is not None and buffer is not None and fb.num_tokens:
            # Invariant: a hidden state handed to the draft is never a view of the gathered buffer.
            assert fb.spec_info.hidden_states.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
        rows = tuple(fb.global_num_tokens) if fb.global_num_tokens is not None else None
        self.trace.append((kind.value, rows, fb.num_tokens))
        program = self.programs.get(kind)
        if program is not None:
            return runner.run_program(fb, program)
        return runner.forward(fb)

    def _idle(self, it: SpecIterationPlan, kinds: list[SubForward]) -> None:
        """Zero-row sub-forwards: this rank has no work in the phase but joins its collectives
        (and, with CUDA graphs, replays the same graph as the busy ranks: a masked sub-forward
        carries a zero-row mask of the busy ranks' tree width)."""
        for kind in kinds:
            target, loop = kind in _TARGET_SUB_FORWARDS, kind == SubForward.DRAFT_LOOP
            tree_cols = {SubForward.TARGET_VERIFY: self.num_draft, SubForward.DRAFT_LOOP: self.topk}.get(kind, 0)
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
                capture_hidden_mode=CaptureHiddenMode.FULL if kind in self.programs else CaptureHiddenMode.NULL,
            )
            self._forward(runner, fb, kind, it)

    # ------------------------------------------------------------------ prefill
    def forward_extend(self, batch: ScheduleBatch, it: SpecIterationPlan) -> GenerationResult:
        fb = batch.to_forward_batch(self.device)
        fb.capture_hidden_mode = CaptureHiddenMode.FULL
        out = self._forward(self.target.runner, fb, SubForward.TARGET_EXTEND, it)
        ready = [i for i, r in enumerate(batch.reqs) if r.kv_len + batch.extend_lens[i] == r.seq_len]
        result = GenerationResult([[] for _ in batch.reqs], list(batch.extend_lens))
        sampled = self.target.sample_rows(batch.reqs, ready, out, result) if ready else None
        # Draft sees every chunk: ids shifted left by one, then the next token (prompt or sampled).
        ids: list[int] = []
        for i, req in enumerate(batch.reqs):
            start, end = batch.prefix_lens[i], batch.seq_lens[i]
            nxt = req.all_ids[end] if end < req.seq_len else result.next_token_ids[i][0]
            ids += req.all_ids[start + 1 : end] + [nxt]
        draft_fb = replace(
            fb,
            mode=ForwardMode.DRAFT_EXTEND,
            input_ids=upload([ids], self.device)[0],
            capture_hidden_mode=CaptureHiddenMode.LAST,
            spec_info=SpecInput(out.hidden_states),
        )
        draft_out = self._forward(self.draft_runner, draft_fb, SubForward.DRAFT_EXTEND_PREFILL, it)
        if ready:  # their first decode cycle starts from the whole sequence's KV and the sampled token
            reqs = [batch.reqs[i] for i in ready]
            req_rows, kv_lens, out_rows = upload([[r.req_pool_idx for r in reqs], [r.seq_len for r in reqs], ready], self.device)
            self.states.kv_lens.index_copy_(0, req_rows, kv_lens)
            self.states.last_tokens.index_copy_(0, req_rows, sampled.next_token_ids)
            logits, hidden = draft_out.next_token_logits, draft_out.hidden_states
            if len(ready) < logits.shape[0]:  # else the rows are all rows, in order
                logits, hidden = logits[out_rows], hidden[out_rows]
            self.states.store_draft(req_rows, *top_guesses(logits, self.topk), hidden)
        return result

    # ------------------------------------------------------------------ decode cycle
    def launch_decode(self, batch: ScheduleBatch, it: SpecIterationPlan) -> LaunchedCycle:
        reqs = batch.reqs
        cycle = CycleInputs.gather(reqs, self.states, self.sizes, self.max_position, self.constants)
        tree = self.draft(reqs, cycle, it)
        node_tokens = torch.cat([cycle.roots.view(-1, 1), tree.tokens], dim=1)
        slots, dev_slots, (logits, hidden, outcome) = self.verify(reqs, cycle, tree, node_tokens, it)
        if not _greedy_without_penalties(reqs):  # else the verify program's own outcome holds
            logits, acceptance = self.accept(reqs, tree, node_tokens, logits)
            outcome = verify_outcome(acceptance, cycle.kv_len, dev_slots, hidden)
        # Everything the host needs from this cycle, read once after the last forward is queued.
        reads = [outcome.host_reads]
        if self.detect_nan:
            reads.append(non_finite_requests(logits, len(reqs)))
        if any(r.return_logprob for r in reqs):
            reads += self._logprobs(reqs, logits, outcome.acceptance)
        self.draft_extend(cycle, outcome, it)
        self.states.cursors.index_copy_(0, cycle.rows, outcome.cursors)
        return LaunchedCycle(reqs, slots, HostCopy(*reads), self._result)

    def accept(
        self, reqs: list[Req], tree: DraftTree, node_tokens: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, Acceptance]:
        """The verify logits after penalties and what they accept (greedy, or sampled)."""
        info = SamplingBatchInfo.from_requests(  # penalties see the tokens generated before this cycle
            [r.sampling_params for r in reqs for _ in range(self.num_draft)],
            [(r.origin_input_ids, r.output_ids) for r in reqs for _ in range(self.num_draft)],
            [None] * (len(reqs) * self.num_draft),
            logits.shape[-1],
            self.device,
        )
        logits = info.apply_penalties(logits)
        if info.all_greedy:
            target_tokens = greedy_tokens(logits).view(len(reqs), self.num_draft)
            return logits, greedy_accept(tree, node_tokens, target_tokens, self.sizes.draft_extend_rows)
        return logits, self.sample_accept(reqs, tree, node_tokens, logits, info)

    @staticmethod
    def _batch(mode: ForwardMode, cycle: CycleInputs, lengths: Lengths, **fields) -> ForwardBatch:
        return ForwardBatch(
            mode=mode, batch_size=len(lengths.seq_cpu), req_pool_indices=cycle.rows, seq_lens=lengths.seq,
            extend_seq_lens=lengths.ext, seq_lens_cpu=lengths.seq_cpu, extend_seq_lens_cpu=lengths.ext_cpu,
            host_lens_exact=cycle.host_lens_exact, **fields,
        )

    def _place_after_kv(self, cycle: CycleInputs, slots: torch.Tensor) -> torch.Tensor:
        """slots [bs, w] (device) into each request's table row from its KV length L; returns slots."""
        self.kv.req_to_token_pool.write_rows_from(cycle.rows, cycle.kv_len, slots)
        return slots

    def draft(self, reqs: list[Req], cycle: CycleInputs, it: SpecIterationPlan) -> DraftTree:
        """The verify trees (without roots) from the draft loop, or from the kept guesses alone."""
        bs, k = len(reqs), self.topk
        probs, tokens, hidden = self.states.draft_guesses(cycle.rows)
        if self.steps == 1:
            return build_draft_tree(probs, tokens, self.constants.full((bs, k), -1), self.num_draft, 1)
        # Scratch slots: step t's inputs of request b at row positions L + t*k + j.
        width = (self.steps - 1) * k
        scratch_host = self.kv.alloc(bs * width)
        scratch = self._place_after_kv(cycle, to_device(scratch_host, self.device).view(bs, width))
        fb = self._batch(
            ForwardMode.DRAFT_DECODE, cycle, cycle.draft_loop,
            input_ids=tokens.flatten(),
            positions=cycle.draft_positions,
            out_cache_loc=scratch[:, :k].flatten(),
            custom_mask=self.constants.tiled_eye(bs, k),
            capture_hidden_mode=CaptureHiddenMode.FULL,
            # Each guess's copy of the hidden state (hidden itself when topk = 1).
            spec_info=SpecInput(hidden.unsqueeze(1).expand(-1, k, -1).flatten(0, 1), probs.flatten()),
        )
        tree = DraftTree(*self._forward(self.draft_runner, fb, SubForward.DRAFT_LOOP, it))
        self.kv.allocator.free(scratch_host)
        return tree

    def verify(
        self, reqs: list[Req], cycle: CycleInputs, tree: DraftTree, node_tokens: torch.Tensor, it: SpecIterationPlan
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, VerifyOutcome]]:
        """Target forward over every request's tree; returns its slots [bs, n] on the host and
        on the device, and its logits, hidden states and greedy outcome (VerifyProgram)."""
        n = self.num_draft
        slots = self.kv.alloc(len(reqs) * n)
        dev_slots = self._place_after_kv(cycle, to_device(slots, self.device).view(len(reqs), n))
        positions = (cycle.kv_len.view(-1, 1) + tree.depths).clamp(max=self.max_position)
        fb = self._batch(
            ForwardMode.TARGET_VERIFY, cycle, cycle.verify,
            input_ids=node_tokens.flatten(),
            positions=positions.flatten(),
            out_cache_loc=dev_slots.flatten(),
            custom_mask=tree.mask.flatten(0, 1),
            capture_hidden_mode=CaptureHiddenMode.FULL,
        )
        out = self._forward(self.target.runner, fb, SubForward.TARGET_VERIFY, it)
        return slots.view(len(reqs), n), dev_slots, VerifyProgram.split(out)

    def sample_accept(
        self, reqs: list[Req], tree: DraftTree, node_tokens: torch.Tensor, logits: torch.Tensor, info: SamplingBatchInfo
    ) -> Acceptance:
        """Lossless tree sampling, walked on the host (two reads of the device)."""
        bs, n, width = len(reqs), self.num_draft, self.sizes.draft_extend_rows
        probs = Sampler.filtered_probs(logits, info)
        parent_rows = torch.arange(bs, device=self.device).view(-1, 1) * n + tree.parents
        child_prob = probs[parent_rows.flatten(), node_tokens.flatten()].view(bs, n)
        child_prob, uniforms, parents, tokens = to_host(child_prob, self._uniforms(reqs, n), tree.parents, node_tokens)
        walks = [walk_tree(parents[b], child_prob[b], uniforms[b]) for b in range(bs)]
        paths = [w[0] for w in walks]
        finals = [b * n + (p[-1] if p else 0) for b, p in enumerate(paths)]
        rejected = [(b, tokens[b][c]) for b, (_, cands) in enumerate(walks) for c in cands]
        finals_t, rej_rows, rej_toks = upload([finals, [b for b, _ in rejected], [t for _, t in rejected]], self.device)
        residual = probs[finals_t]  # a copy
        residual[rej_rows, rej_toks] = 0.0
        residual /= residual.sum(dim=-1, keepdim=True)
        generators = [self.target.generators.get(r.rid) for r in reqs]
        (bonus,) = to_host(Sampler._draw(residual, generators if any(generators) else None))
        nodes, emitted = [], []
        for b, path in enumerate(paths):
            pad = width - len(path) - 1
            nodes.append([0] + path + [path[-1] if path else 0] * pad)
            emitted.append([tokens[b][c] for c in path] + [bonus[b]] + [0] * pad)
        accept_len, nodes_t, emitted_t = upload([[len(p) for p in paths], sum(nodes, []), sum(emitted, [])], self.device)
        return Acceptance(accept_len, nodes_t.view(bs, width), emitted_t.view(bs, width))

    def _uniforms(self, reqs: list[Req], n: int) -> torch.Tensor:
        u = torch.rand((len(reqs), n), device=self.device)
        for b, req in enumerate(reqs):
            gen = self.target.generators.get(req.rid)
            if gen is not None:
                u[b] = torch.rand(n, generator=gen, device=self.device)
        return u

    def _logprobs(self, reqs: list[Req], logits: torch.Tensor, acceptance: Acceptance) -> list[torch.Tensor]:
        """Logprob of each emitted token (padding columns too) under the target logits (after
        penalties) of its node, and the top logprobs when asked for: [bs * width (, top_n)]."""
        rows = torch.arange(len(reqs), device=self.device).view(-1, 1) * self.num_draft + acceptance.nodes
        logprobs = torch.log_softmax(logits[rows.flatten()], dim=-1)
        chosen = logprobs.gather(1, acceptance.emitted.view(-1, 1)).squeeze(1)
        top_n = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        return [chosen, *torch.topk(logprobs, top_n, dim=-1)] if top_n else [chosen]

    def draft_extend(self, cycle: CycleInputs, outcome: VerifyOutcome, it: SpecIterationPlan) -> None:
        """Move the kept nodes' slots to positions L.. (positions past them, up to the draft
        extend's rows, get the dummy slot, which its pad rows write), then let the draft catch
        up: position L + j consumes emitted token j with the target hidden state of its node.
        Pads come after every real row, so no real row sees them (causally)."""
        kept = self._place_after_kv(cycle, outcome.extend_slots)
        fb = self._batch(
            ForwardMode.DRAFT_EXTEND, cycle, cycle.extend,
            input_ids=outcome.acceptance.emitted.flatten(),
            positions=cycle.extend_positions,
            out_cache_loc=kept.flatten(),
            capture_hidden_mode=CaptureHiddenMode.LAST,
            logits_indices=outcome.extend_logits_rows,
            spec_info=SpecInput(outcome.extend_hidden),
        )
        self.states.store_draft(cycle.rows, *self._forward(self.draft_runner, fb, SubForward.DRAFT_EXTEND, it))

    def _result(self, reqs: list[Req], slots: torch.Tensor, reads: tuple[torch.Tensor, ...]) -> GenerationResult:
        """The cycle's tokens per request from what it read (host tensors); frees the nodes not
        kept (all of a request that finished while the cycle was in flight: its tokens are dropped)."""
        host_reads, *rest = reads
        rest = [t.tolist() for t in rest]
        width = self.sizes.draft_extend_rows
        rows = host_reads.tolist()  # per request: accept_len, nodes, emitted (VerifyOutcome.host_reads)
        accept_len, emitted = [row[0] for row in rows], [row[1 + width :] for row in rows]
        self.kv.allocator.free(slots[~self._kept_nodes(reqs, host_reads[:, 1 : 1 + width])])
        result = GenerationResult(
            next_token_ids=[emitted[b][: a + 1] for b, a in enumerate(accept_len)],
            kv_written=[a + 1 for a in accept_len],
            accepted_draft_tokens=list(accept_len),
        )
        if self.detect_nan:
            non_finite, *rest = rest
            for b, bad in enumerate(non_finite):
                if bad:  # --enable-nan-detection: the scheduler turns it into an error finish
                    result.next_token_ids[b] = [NAN_TOKEN_ID]
        if rest:
            self._fill_logprobs(reqs, accept_len, emitted, rest, result)
        return result

    def _kept_nodes(self, reqs: list[Req], nodes: torch.Tensor) -> torch.Tensor:
        """[bs, n] bool (host): the verify nodes whose slots a request keeps. nodes [bs, width]
        repeats the last kept node past accept_len; a finished request keeps none."""
        keep = torch.zeros((len(reqs), self.num_draft), dtype=torch.bool).scatter_(1, nodes, True)
        finished = [b for b, r in enumerate(reqs) if r.finished]
        if finished:
            keep[finished] = False
        return keep

    def _fill_logprobs(
        self, reqs: list[Req], accept_len: list[int], emitted: list[list[int]], reads: list, result: GenerationResult
    ) -> None:
        chosen, *tops = reads
        width = self.sizes.draft_extend_rows
        result.logprobs, result.top_logprobs = [], []
        for b, req in enumerate(reqs):
            rows = range(b * width, b * width + accept_len[b] + 1)
            result.logprobs.append([(chosen[i], emitted[b][j]) for j, i in enumerate(rows)])
            k = req.top_logprobs_num
            result.top_logprobs.append([list(zip(tops[0][i][:k], tops[1][i][:k])) for i in rows] if tops and k else [])


def _greedy_without_penalties(reqs: list[Req]) -> bool:
    """Whether the verify's argmax decides the cycle (VerifyProgram's greedy outcome holds)."""
    return all(r.sampling_params.is_greedy and not r.sampling_params.has_penalties for r in reqs)
