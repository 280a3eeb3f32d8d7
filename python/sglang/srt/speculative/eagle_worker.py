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
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.eagle_utils import VerifyTree, build_verify_tree, select_step_inputs, walk_tree
from sglang.srt.speculative.spec_info import DraftState, SpecInput
from sglang.srt.speculative.spec_plan import SpecIterationPlan, SpecSizes, SubForward
from sglang.srt.utils.transfer import to_device, to_host, upload

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
                tree_cols = self.sizes.draft_tree_widths[draft_steps]
                draft_steps += 1
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
            input_ids=upload([ids], self.device)[0],
            capture_hidden_mode=CaptureHiddenMode.LAST,
            spec_info=SpecInput(out.hidden_states),
        )
        draft_out = self._forward(self.draft_runner, draft_fb, SubForward.DRAFT_EXTEND_PREFILL, it)
        self._store_states([batch.reqs[i] for i in ready], draft_out, ready)
        return result

    def _store_states(self, reqs: list[Req], out: LogitsProcessorOutput, rows: list[int]) -> None:
        """Keep the draft's top-k guesses and hidden state at each request's last position
        (rows: ascending rows of out, one per request)."""
        if not reqs:
            return
        logits, hidden = out.next_token_logits, out.hidden_states
        if len(rows) < logits.shape[0]:  # else rows are all rows, in order
            rows_t = upload([rows], self.device)[0]
            logits, hidden = logits[rows_t], hidden[rows_t]
        topk_p, topk_index = torch.topk(torch.softmax(logits, dim=-1), self.topk, dim=-1)
        for j, req in enumerate(reqs):
            self.states[req.rid] = DraftState(topk_p[j], topk_index[j], hidden[j])

    # ------------------------------------------------------------------ decode cycle
    def forward_decode(self, batch: ScheduleBatch, it: SpecIterationPlan) -> GenerationResult:
        reqs = batch.reqs
        states = [self.states[r.rid] for r in reqs]
        cand_scores, cand_tokens, cand_parents = self.draft(reqs, states, it)
        tree = build_verify_tree(batch.input_ids, cand_scores, cand_tokens, cand_parents, self.num_draft)
        slots, out = self.verify(reqs, tree, it)
        paths, bonus, result = self.accept(reqs, tree, out)
        out_cache_loc = self.keep_accepted(reqs, slots, paths)
        self.draft_extend(reqs, tree, paths, bonus, out_cache_loc, out.hidden_states, it)
        return result

    def _positions(self, values: list[int]) -> list[int]:
        return [min(v, self.max_position) for v in values]

    def _tree_batch(
        self,
        mode: ForwardMode,
        reqs: list[Req],
        input_ids: torch.Tensor | list[int],
        positions: list[int],
        out_cache_loc: torch.Tensor,
        tree_mask: torch.Tensor,
        hidden: Optional[torch.Tensor],
    ) -> ForwardBatch:
        """Each request's new tokens sit right after its KV (kv_len = L-1) and see the whole
        prefix plus the columns its tree mask [bs, new, tree_cols] allows. Host values (the
        input ids too when given as a list) reach the device through one upload."""
        bs, new, cols = tree_mask.shape
        ext = [new] * bs
        seq = [r.kv_len + cols for r in reqs]
        host_ids = input_ids if isinstance(input_ids, list) else []
        ids, pos, rows, seq_t, ext_t = upload(
            [host_ids, self._positions(positions), [r.req_pool_idx for r in reqs], seq, ext], self.device
        )
        return ForwardBatch(
            mode=mode,
            batch_size=bs,
            input_ids=ids if isinstance(input_ids, list) else input_ids,
            positions=pos,
            out_cache_loc=out_cache_loc,
            req_pool_indices=rows,
            seq_lens=seq_t,
            extend_seq_lens=ext_t,
            seq_lens_cpu=seq,
            extend_seq_lens_cpu=ext,
            custom_mask=to_device(tree_mask.flatten(0, 1), self.device),
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
        scratch_host = self.kv.alloc(bs * width)
        scratch = self.kv.write_after_kv(reqs, [width] * len(reqs), scratch_host).view(bs, width)
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
                [r.kv_len + t for r in reqs for _ in range(k)],
                scratch[:, t * k : (t + 1) * k].flatten(),
                ancestors,
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
        self.kv.allocator.free(scratch_host)
        return torch.cat(cand_scores, 1), torch.cat(cand_tokens, 1), torch.cat(cand_parents, 1)

    def verify(self, reqs: list[Req], tree: VerifyTree, it: SpecIterationPlan) -> tuple[torch.Tensor, LogitsProcessorOutput]:
        """Target forward over every request's tree; returns its slots [bs, n] (host) and output."""
        n = self.num_draft
        slots = self.kv.alloc(len(reqs) * n)
        fb = self._tree_batch(
            ForwardMode.TARGET_VERIFY,
            reqs,
            [tok for toks in tree.tokens for tok in toks],
            [r.kv_len + d for r, depths in zip(reqs, tree.depths) for d in depths],
            self.kv.write_after_kv(reqs, [n] * len(reqs), slots),
            tree.ancestor_masks(),
            None,
        )
        return slots.view(len(reqs), n), self._forward(self.target.runner, fb, SubForward.TARGET_VERIFY, it)

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
        # Row of each node's parent (the root's own row stands in for its missing parent).
        parent_rows = [[b * n + max(p, 0) for p in parents] for b, parents in enumerate(tree.parents)]
        if info.all_greedy:  # one read: the target's argmax at every node
            (target_tok,) = to_host(logits.argmax(dim=-1))
            child_prob = [
                [float(target_tok[r] == tok) for r, tok in zip(rows, toks)]
                for rows, toks in zip(parent_rows, tree.tokens)
            ]
            paths = [walk_tree(tree.parents[b], child_prob[b], [0.0] * n)[0] for b in range(bs)]
            bonus = [target_tok[b * n + (p[-1] if p else 0)] for b, p in enumerate(paths)]
        else:
            parent_t, node_t = upload(
                [[r for rows in parent_rows for r in rows], [t for toks in tree.tokens for t in toks]], self.device
            )
            probs = Sampler.filtered_probs(logits, info)
            child_prob, uniforms = to_host(probs[parent_t, node_t].view(bs, n), self._uniforms(reqs, n))
            walks = [walk_tree(tree.parents[b], child_prob[b], uniforms[b]) for b in range(bs)]
            paths = [w[0] for w in walks]
            finals = [b * n + (p[-1] if p else 0) for b, p in enumerate(paths)]
            rejected = [(b, tree.tokens[b][c]) for b, (_, cands) in enumerate(walks) for c in cands]
            finals_t, rej_rows, rej_toks = upload(
                [finals, [b for b, _ in rejected], [tok for _, tok in rejected]], self.device
            )
            residual = probs[finals_t]  # a copy
            residual[rej_rows, rej_toks] = 0.0
            residual /= residual.sum(dim=-1, keepdim=True)
            generators = [self.target.generators.get(r.rid) for r in reqs]
            (bonus,) = to_host(Sampler._draw(residual, generators if any(generators) else None))
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
        rows_t, toks_t = upload([rows, [t for e in emitted for t in e]], self.device)
        logprobs = torch.log_softmax(logits[rows_t], dim=-1)
        top_n = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        top = torch.topk(logprobs, top_n, dim=-1) if top_n else ()
        chosen, *tops = to_host(logprobs[torch.arange(len(rows), device=self.device), toks_t], *top)
        result.logprobs, result.top_logprobs = [], []
        i = 0
        for req, e in zip(reqs, emitted):
            result.logprobs.append([(chosen[i + j], tok) for j, tok in enumerate(e)])
            k = req.top_logprobs_num
            result.top_logprobs.append(
                [list(zip(tops[0][i + j][:k], tops[1][i + j][:k])) for j in range(len(e))] if tops and k else []
            )
            i += len(e)

    def keep_accepted(self, reqs: list[Req], slots: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """Move the root's and accepted nodes' slots (host, [bs, n]) to positions kv_len.. and
        free the others. Positions past them, up to the draft extend's rows per request, get
        the dummy slot (the draft extend's pad rows write there). Returns the draft extend's
        out_cache_loc [bs * rows], on the device."""
        n, width = slots.shape[1], self.sizes.draft_extend_rows
        flat = slots.flatten()
        dummy = flat.numel()  # index of the dummy slot appended below
        kept = [[b * n + node for node in [0] + path] for b, path in enumerate(paths)]
        src = [i for k in kept for i in k + [dummy] * (width - len(k))]
        written = torch.cat([flat, torch.tensor([_DUMMY_SLOT])])[torch.tensor(src)]
        keep = torch.zeros(dummy, dtype=torch.bool)
        keep[torch.tensor([i for k in kept for i in k])] = True
        self.kv.allocator.free(flat[~keep])
        return self.kv.write_after_kv(reqs, [width] * len(reqs), written)

    def draft_extend(
        self,
        reqs: list[Req],
        tree: VerifyTree,
        paths: list[list[int]],
        bonus: list[int],
        out_cache_loc: torch.Tensor,
        target_hidden: torch.Tensor,
        it: SpecIterationPlan,
    ) -> None:
        """Draft catches up on the emitted tokens: position kv_len + j consumes emitted token j
        with the target hidden state of the node before it. Each request runs steps + 1 rows
        (a size known before acceptance); rows past its accepted + 1 are pads that come after
        every real row (so no real row sees them, causally) and write the dummy KV slot."""
        n, width = self.num_draft, self.sizes.draft_extend_rows
        ids, positions, hidden_rows, last_rows = [], [], [], []
        for b, (req, path) in enumerate(zip(reqs, paths)):
            nodes, pad = [0] + path, width - len(path) - 1
            ids += [tree.tokens[b][c] for c in path] + [bonus[b]] + [0] * pad
            positions += range(req.kv_len, req.kv_len + width)
            hidden_rows += [b * n + node for node in nodes] + [b * n + nodes[-1]] * pad
            last_rows.append(b * width + len(nodes) - 1)
        ext = [width] * len(reqs)
        seq = [r.kv_len + width for r in reqs]
        ids_t, pos_t, rows_t, seq_t, ext_t, last_t, hidden_t = upload(
            [ids, self._positions(positions), [r.req_pool_idx for r in reqs], seq, ext, last_rows, hidden_rows],
            self.device,
        )
        fb = ForwardBatch(
            mode=ForwardMode.DRAFT_EXTEND,
            batch_size=len(reqs),
            input_ids=ids_t,
            positions=pos_t,
            out_cache_loc=out_cache_loc,
            req_pool_indices=rows_t,
            seq_lens=seq_t,
            extend_seq_lens=ext_t,
            seq_lens_cpu=seq,
            extend_seq_lens_cpu=ext,
            capture_hidden_mode=CaptureHiddenMode.LAST,
            logits_indices=last_t,
            spec_info=SpecInput(target_hidden[hidden_t]),
        )
        out = self._forward(self.draft_runner, fb, SubForward.DRAFT_EXTEND, it)
        self._store_states(reqs, out, list(range(len(reqs))))
