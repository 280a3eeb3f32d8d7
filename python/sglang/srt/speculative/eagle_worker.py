"""EAGLE / NextN speculative decoding worker (DESIGN.md §7).

Plugs in where the scheduler would use a TpModelWorker. Per decode cycle, for every request
with seq_len L (target and draft KV at positions 0..L-2, last token x_{L-1} not written):
  1. draft: the topk guesses kept from the previous draft extend are depth 1; steps - 1 draft
     forwards (topk tokens per request each, tree mask) add depths 2..steps;
  2. verify: the target runs the root x_{L-1} plus the num_draft_tokens - 1 best candidates
     (tree mask), positions L-1 + depth;
  3. accept: walk the tree (greedy or lossless sampling), emit accepted tokens + one bonus;
     move the accepted nodes' KV slots to positions L-1.. and free the rest;
  4. draft extend on the emitted tokens with the target hidden states of the nodes before them,
     padded to steps + 1 rows per request (pads write the dummy KV slot 0; logits are taken at
     each request's last real row).
Under DP attention every rank runs the same sub-forward sequence with the same per-rank rows,
derived from the iteration's plan all-gather (spec_plan.py); a rank without work in a phase
runs zero-row (IDLE) sub-forwards. Hidden states handed from one sub-forward to the next are
fresh tensors, never views of the gathered buffer (which the next collective overwrites).
The draft model shares the target's request->token table and slot allocator, with its own
KV pool: draft position j holds the draft's KV for token j+1 at the target's slot of position j.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Optional

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.scheduler_comm import GlobalPlan
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.sampler import NAN_TOKEN_ID, Sampler, SamplingBatchInfo
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.tp_worker import GenerationResult, TpModelWorker
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.eagle_utils import VerifyTree, build_verify_tree, select_step_inputs, walk_tree
from sglang.srt.speculative.spec_info import DraftState, SpecInput
from sglang.srt.speculative.spec_plan import SpecIterationPlan, SpecSizes, SubForward

logger = logging.getLogger(__name__)

NEXTN_ARCHITECTURE = "DeepseekV3ForCausalLMNextN"
_TARGET_SUB_FORWARDS = (SubForward.TARGET_EXTEND, SubForward.TARGET_VERIFY)
# Under DP attention, the mode every rank (idle ones too) names a sub-forward by when choosing
# its CUDA graph; the draft extend after a prefill has varying lengths and stays eager.
_GLOBAL_MODE = {
    SubForward.TARGET_EXTEND: ForwardMode.EXTEND,
    SubForward.DRAFT_EXTEND_PREFILL: ForwardMode.EXTEND,
    SubForward.DRAFT_STEP: ForwardMode.DRAFT_DECODE,
    SubForward.TARGET_VERIFY: ForwardMode.TARGET_VERIFY,
    SubForward.DRAFT_EXTEND: ForwardMode.DRAFT_EXTEND,
}
_DUMMY_SLOT = 0  # TokenToKVPoolAllocator never hands out slot 0


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
        self.req_to_token_pool = target_runner.req_to_token_pool
        self.draft_runner = ModelRunner(
            draft_model_config(server_args),
            server_args,
            gpu_id,
            tp_rank,
            server_args.tp_size,
            req_to_token_pool=self.req_to_token_pool,
            token_allocator=target_runner.token_allocator,
            gathered_buffer=target_runner.gathered_buffer,
            is_draft=True,
            embed_and_head=target_runner.model.get_embed_and_head(),
        )
        # Positions past the context are never emitted (the request stops first); clamp them.
        self.max_position = target_runner.model_config.context_len - 1
        self.states: dict[str, DraftState] = {}
        # Sub-forwards of the latest iteration: (kind, rows of every DP rank, local rows).
        self.trace: list[tuple[str, Optional[tuple[int, ...]], int]] = []
        logger.info(
            "Speculative decoding: %s, steps %d, topk %d, draft tokens %d",
            server_args.speculative_algorithm, self.steps, self.topk, self.num_draft,
        )

    # ------------------------------------------------------------------ worker interface
    def decode_kv_need_per_req(self) -> int:
        return self.sizes.decode_kv_need_per_req

    def add_request(self, req: Req) -> None:
        self.target.add_request(req)

    def remove_request(self, req: Req) -> None:
        self.target.remove_request(req)
        self.states.pop(req.rid, None)

    def forward_batch_generation(self, batch: ScheduleBatch, plan: Optional[GlobalPlan] = None) -> GenerationResult:
        """Runs this iteration's phases (DP attention: those of every DP rank, from `plan`);
        the batch's own phase does real work, the others run zero-row sub-forwards."""
        if plan is None:
            it = SpecIterationPlan.local(batch.mode, len(batch.input_ids), len(batch.reqs), self.sizes)
        else:
            it = SpecIterationPlan.from_global(plan, self.sizes)
        self.trace = []
        result = GenerationResult([], [])
        if batch.mode == ForwardMode.EXTEND:
            result = self.forward_extend(batch, it)
        else:
            self._idle(it, it.extend_phase())
        if batch.mode == ForwardMode.DECODE:
            result = self.forward_decode(batch, it)
        else:
            self._idle(it, it.decode_phase())
        return result

    def planned_sub_forwards(self, plan: GlobalPlan) -> list[tuple[str, tuple[int, ...]]]:
        """(kind, rows of every DP rank) of each sub-forward an iteration with this plan runs."""
        it = SpecIterationPlan.from_global(plan, self.sizes)
        return [(kind.value, it.rows(kind)) for kind in it.sub_forwards()]

    def _forward(self, runner: ModelRunner, fb: ForwardBatch, kind: SubForward, it: SpecIterationPlan) -> LogitsProcessorOutput:
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
        return runner.forward(fb)

    def _idle(self, it: SpecIterationPlan, kinds: list[SubForward]) -> None:
        """Zero-row sub-forwards: this rank has no work in the phase but joins its collectives
        (and, with CUDA graphs, replays the same graph as the busy ranks: a masked sub-forward
        carries a zero-row mask of the busy ranks' tree width)."""
        draft_steps = 0
        for kind in kinds:
            target = kind in _TARGET_SUB_FORWARDS
            tree_cols = 0
            if kind == SubForward.TARGET_VERIFY:
                tree_cols = self.num_draft
            elif kind == SubForward.DRAFT_STEP:
                draft_steps += 1
                tree_cols = draft_steps * self.topk
            runner = self.target.runner if target else self.draft_runner
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            hidden = torch.empty((0, self.hidden_size), dtype=runner.dtype, device=self.device)
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
                spec_info=None if target else SpecInput(hidden),
            )
            self._forward(runner, fb, kind, it)

    # ------------------------------------------------------------------ prefill
    def forward_extend(self, batch: ScheduleBatch, it: SpecIterationPlan) -> GenerationResult:
        fb = batch.to_forward_batch(self.device)
        fb.capture_hidden_mode = CaptureHiddenMode.FULL
        out = self._forward(self.target.runner, fb, SubForward.TARGET_EXTEND, it)
        ready = [i for i, r in enumerate(batch.reqs) if r.kv_len + batch.extend_lens[i] == r.seq_len]
        result = GenerationResult([[] for _ in batch.reqs], list(batch.extend_lens))
        if ready:
            self.target.sample_rows(batch.reqs, ready, out, result)
        # Draft sees every chunk: ids shifted left by one, then the next token (prompt or sampled).
        ids: list[int] = []
        for i, req in enumerate(batch.reqs):
            start, end = batch.prefix_lens[i], batch.seq_lens[i]
            nxt = req.all_ids[end] if end < req.seq_len else result.next_token_ids[i][0]
            ids += req.all_ids[start + 1 : end] + [nxt]
        draft_fb = replace(
            fb,
            mode=ForwardMode.DRAFT_EXTEND,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self.device),
            capture_hidden_mode=CaptureHiddenMode.LAST,
            spec_info=SpecInput(out.hidden_states),
        )
        draft_out = self._forward(self.draft_runner, draft_fb, SubForward.DRAFT_EXTEND_PREFILL, it)
        self._store_states([batch.reqs[i] for i in ready], draft_out, ready)
        return result

    def _store_states(self, reqs: list[Req], out: LogitsProcessorOutput, rows: list[int]) -> None:
        """Keep the draft's top-k guesses and hidden state at each request's last position."""
        if not reqs:
            return
        rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
        probs = torch.softmax(out.next_token_logits[rows_t], dim=-1)
        topk_p, topk_index = torch.topk(probs, self.topk, dim=-1)
        hidden = out.hidden_states[rows_t]
        for j, req in enumerate(reqs):
            self.states[req.rid] = DraftState(topk_p[j], topk_index[j], hidden[j])

    # ------------------------------------------------------------------ decode cycle
    def forward_decode(self, batch: ScheduleBatch, it: SpecIterationPlan) -> GenerationResult:
        reqs = batch.reqs
        states = [self.states[r.rid] for r in reqs]
        cand_scores, cand_tokens, cand_parents = self.draft(reqs, states, it)
        root = torch.tensor(batch.input_ids, dtype=torch.int64, device=self.device)
        tree = build_verify_tree(root, cand_scores, cand_tokens, cand_parents, self.num_draft)
        slots, out = self.verify(reqs, tree, it)
        paths, bonus, result = self.accept(reqs, tree, out)
        kept = self.keep_accepted(reqs, slots, paths)
        self.draft_extend(reqs, tree, paths, bonus, kept, out.hidden_states, it)
        return result

    def _rows(self, reqs: list[Req]) -> torch.Tensor:
        return torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=self.device)

    def _positions(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device).clamp_(max=self.max_position)

    def _tree_batch(
        self,
        mode: ForwardMode,
        reqs: list[Req],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        tree_masks: list[torch.Tensor],
        hidden: Optional[torch.Tensor],
    ) -> ForwardBatch:
        """Each request's new tokens sit right after its KV (kv_len = L-1) and see the whole
        prefix plus the columns its tree mask [new, new_total] allows (new_total: the same
        for every request, the batch's tree_cols)."""
        ext = [m.shape[0] for m in tree_masks]
        seq = [r.kv_len + m.shape[1] for r, m in zip(reqs, tree_masks)]
        mask = torch.cat(tree_masks)
        return ForwardBatch(
            mode=mode,
            batch_size=len(reqs),
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=self._rows(reqs),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=self.device),
            extend_seq_lens=torch.tensor(ext, dtype=torch.int64, device=self.device),
            seq_lens_cpu=seq,
            extend_seq_lens_cpu=ext,
            custom_mask=mask.to(self.device),
            capture_hidden_mode=CaptureHiddenMode.FULL,
            spec_info=SpecInput(hidden) if hidden is not None else None,
        )

    def draft(
        self, reqs: list[Req], states: list[DraftState], it: SpecIterationPlan
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft candidates [bs, M] (scores, tokens, parent candidate), M = topk + (steps-1) topk^2."""
        bs, k = len(reqs), self.topk
        scores = torch.stack([s.topk_p for s in states])
        tokens = torch.stack([s.topk_index for s in states])
        hidden = torch.stack([s.hidden for s in states]).repeat_interleave(k, dim=0)
        cand_scores, cand_tokens = [scores], [tokens]
        cand_parents = [torch.full((bs, k), -1, dtype=torch.int64, device=self.device)]
        if self.steps == 1:
            return scores, tokens, cand_parents[0]
        # Scratch slots: step t's inputs of request b at row positions kv_len + t*k + j.
        width = (self.steps - 1) * k
        scratch = self.kv.alloc(bs * width).view(bs, width)
        for b, req in enumerate(reqs):
            self.req_to_token_pool.write(req.req_pool_idx, req.kv_len, scratch[b])
        input_cand = torch.arange(k, device=self.device).expand(bs, k)  # candidate number of each input
        # Tree mask of step t, [bs, k, (t+1)k], built on the device (no host sync between steps).
        itself = torch.eye(k, dtype=torch.bool, device=self.device).expand(bs, k, k)
        ancestors = itself
        arange_bs = torch.arange(bs, device=self.device).view(-1, 1)
        for t in range(self.steps - 1):
            fb = self._tree_batch(
                ForwardMode.DRAFT_DECODE,
                reqs,
                tokens.flatten(),
                self._positions([r.kv_len + t for r in reqs for _ in range(k)]),
                scratch[:, t * k : (t + 1) * k].flatten(),
                list(ancestors),
                hidden,
            )
            out = self._forward(self.draft_runner, fb, SubForward.DRAFT_STEP, it)
            child_p, child_tok = torch.topk(torch.softmax(out.next_token_logits, dim=-1), k, dim=-1)
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
            hidden = out.hidden_states.view(bs, k, -1)[arange_bs, parent_input].flatten(0, 1)
            ancestors = torch.cat([ancestors[arange_bs, parent_input], itself], dim=2)
        self.kv.allocator.free(scratch.flatten())
        return torch.cat(cand_scores, 1), torch.cat(cand_tokens, 1), torch.cat(cand_parents, 1)

    def verify(self, reqs: list[Req], tree: VerifyTree, it: SpecIterationPlan) -> tuple[torch.Tensor, LogitsProcessorOutput]:
        """Target forward over every request's tree; returns its slots [bs, n] and output."""
        n = self.num_draft
        slots = self.kv.alloc(len(reqs) * n).view(len(reqs), n)
        for b, req in enumerate(reqs):
            self.req_to_token_pool.write(req.req_pool_idx, req.kv_len, slots[b])
        fb = self._tree_batch(
            ForwardMode.TARGET_VERIFY,
            reqs,
            torch.tensor(tree.tokens, dtype=torch.int64, device=self.device).flatten(),
            self._positions([r.kv_len + d for r, depths in zip(reqs, tree.depths) for d in depths]),
            slots.flatten(),
            [tree.ancestor_mask(b) for b in range(len(reqs))],
            None,
        )
        return slots, self._forward(self.target.runner, fb, SubForward.TARGET_VERIFY, it)

    def accept(
        self, reqs: list[Req], tree: VerifyTree, out: LogitsProcessorOutput
    ) -> tuple[list[list[int]], list[int], GenerationResult]:
        """Walk each tree; returns accepted nodes per request, bonus tokens and the result."""
        bs, n = len(reqs), self.num_draft
        logits = out.next_token_logits
        vocab = logits.shape[-1]
        # Penalties see the tokens generated before this cycle.
        info = SamplingBatchInfo.from_requests(
            [r.sampling_params for r in reqs for _ in range(n)],
            [(r.origin_input_ids, r.output_ids) for r in reqs for _ in range(n)],
            [None] * (bs * n),
            vocab,
            self.device,
        )
        logits = info.apply_penalties(logits)
        node_tok = torch.tensor(tree.tokens, dtype=torch.int64, device=self.device)  # [bs, n]
        parent_rows = torch.tensor(tree.parents, dtype=torch.int64, device=self.device).clamp_(min=0)
        parent_rows = parent_rows + torch.arange(bs, device=self.device).view(-1, 1) * n
        if info.all_greedy:
            target_tok = logits.argmax(dim=-1)
            child_prob = (target_tok[parent_rows] == node_tok).float().tolist()
            uniforms = [[0.0] * n] * bs
            paths = [walk_tree(tree.parents[b], child_prob[b], uniforms[b])[0] for b in range(bs)]
            finals = [b * n + (p[-1] if p else 0) for b, p in enumerate(paths)]
            bonus = target_tok[finals].tolist()
        else:
            probs = Sampler.filtered_probs(logits, info)
            child_prob = probs[parent_rows, node_tok].tolist()
            uniforms = self._uniforms(reqs, n).tolist()
            walks = [walk_tree(tree.parents[b], child_prob[b], uniforms[b]) for b in range(bs)]
            paths = [w[0] for w in walks]
            finals = [b * n + (p[-1] if p else 0) for b, p in enumerate(paths)]
            residual = probs[finals].clone()
            for b, (_, rejected) in enumerate(walks):
                residual[b, [tree.tokens[b][c] for c in rejected]] = 0.0
            residual /= residual.sum(dim=-1, keepdim=True)
            generators = [self.target.generators.get(r.rid) for r in reqs]
            bonus = Sampler._draw(residual, generators if any(generators) else None).tolist()
        emitted = [[tree.tokens[b][c] for c in paths[b]] + [bonus[b]] for b in range(bs)]
        result = GenerationResult(
            next_token_ids=emitted,
            kv_written=[len(p) + 1 for p in paths],
            accepted_draft_tokens=[len(p) for p in paths],
        )
        if any(r.return_logprob for r in reqs):
            self._logprobs(reqs, logits, paths, emitted, result)
        if self.detect_nan:
            self._flag_non_finite(logits.view(bs, n, -1), result)
        return paths, bonus, result

    @staticmethod
    def _flag_non_finite(logits: torch.Tensor, result: GenerationResult) -> None:
        """--enable-nan-detection: a request whose verify logits are not finite emits only
        NAN_TOKEN_ID, which the scheduler turns into an error finish (never sampled silently)."""
        bad = (~torch.isfinite(logits).all(dim=-1)).any(dim=-1).tolist()
        for b, is_bad in enumerate(bad):
            if is_bad:
                result.next_token_ids[b] = [NAN_TOKEN_ID]

    def _uniforms(self, reqs: list[Req], n: int) -> torch.Tensor:
        u = torch.rand((len(reqs), n), device=self.device)
        for b, req in enumerate(reqs):
            gen = self.target.generators.get(req.rid)
            if gen is not None:
                u[b] = torch.rand(n, generator=gen, device=self.device)
        return u

    def _logprobs(
        self, reqs: list[Req], logits: torch.Tensor, paths: list[list[int]], emitted: list[list[int]], result: GenerationResult
    ) -> None:
        """Logprob of each emitted token under the target logits (after penalties) of the node before it."""
        n = self.num_draft
        rows = [b * n + node for b, p in enumerate(paths) for node in [0] + p]
        toks = [t for e in emitted for t in e]
        logprobs = torch.log_softmax(logits[rows], dim=-1)
        chosen = logprobs[torch.arange(len(rows), device=self.device), torch.tensor(toks, device=self.device)].tolist()
        top_n = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        tops = [t.tolist() for t in torch.topk(logprobs, top_n, dim=-1)] if top_n else None
        result.logprobs, result.top_logprobs = [], []
        i = 0
        for req, e in zip(reqs, emitted):
            result.logprobs.append([(chosen[i + j], tok) for j, tok in enumerate(e)])
            k = req.top_logprobs_num
            result.top_logprobs.append(
                [list(zip(tops[0][i + j][:k], tops[1][i + j][:k])) for j in range(len(e))] if tops and k else []
            )
            i += len(e)

    def keep_accepted(self, reqs: list[Req], slots: torch.Tensor, paths: list[list[int]]) -> list[torch.Tensor]:
        """Move the root's and accepted nodes' slots to positions kv_len.. ; free the others."""
        keep = torch.zeros(slots.shape, dtype=torch.bool)
        kept = []
        for b, (req, path) in enumerate(zip(reqs, paths)):
            nodes = [0] + path
            keep[b, nodes] = True
            kept.append(slots[b, nodes])
            self.req_to_token_pool.write(req.req_pool_idx, req.kv_len, kept[-1])
        self.kv.allocator.free(slots[keep.to(slots.device).logical_not()])
        return kept

    def draft_extend(
        self,
        reqs: list[Req],
        tree: VerifyTree,
        paths: list[list[int]],
        bonus: list[int],
        kept: list[torch.Tensor],
        target_hidden: torch.Tensor,
        it: SpecIterationPlan,
    ) -> None:
        """Draft catches up on the emitted tokens: position kv_len + j consumes emitted token j
        with the target hidden state of the node before it. Each request runs steps + 1 rows
        (a size known before acceptance); rows past its accepted + 1 are pads that come after
        every real row (so no real row sees them, causally) and write the dummy KV slot."""
        n, width = self.num_draft, self.sizes.draft_extend_rows
        ids, positions, hidden_rows, last_rows, out_slots = [], [], [], [], []
        for b, (req, path) in enumerate(zip(reqs, paths)):
            nodes, pad = [0] + path, width - len(path) - 1
            ids += [tree.tokens[b][c] for c in path] + [bonus[b]] + [0] * pad
            positions += range(req.kv_len, req.kv_len + width)
            hidden_rows += [b * n + node for node in nodes] + [b * n + nodes[-1]] * pad
            last_rows.append(b * width + len(nodes) - 1)
            pads = kept[b].new_full((pad,), _DUMMY_SLOT)
            self.req_to_token_pool.write(req.req_pool_idx, req.kv_len + len(nodes), pads)
            out_slots += [kept[b], pads]
        ext = [width] * len(reqs)
        seq = [r.kv_len + width for r in reqs]
        fb = ForwardBatch(
            mode=ForwardMode.DRAFT_EXTEND,
            batch_size=len(reqs),
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions=self._positions(positions),
            out_cache_loc=torch.cat(out_slots),
            req_pool_indices=self._rows(reqs),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=self.device),
            extend_seq_lens=torch.tensor(ext, dtype=torch.int64, device=self.device),
            seq_lens_cpu=seq,
            extend_seq_lens_cpu=ext,
            capture_hidden_mode=CaptureHiddenMode.LAST,
            logits_indices=torch.tensor(last_rows, dtype=torch.int64, device=self.device),
            spec_info=SpecInput(target_hidden[torch.tensor(hidden_rows, dtype=torch.int64, device=self.device)]),
        )
        out = self._forward(self.draft_runner, fb, SubForward.DRAFT_EXTEND, it)
        self._store_states(reqs, out, list(range(len(reqs))))
