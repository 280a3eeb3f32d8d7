"""The scheduler process: one per rank. Each iteration fits on one screen:
receive requests, pick a batch (prefill first, else decode), run it, process results.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional

import torch
import zmq

from sglang.srt.batch.forward_batch_info import ForwardMode
from sglang.srt.batch.req_kv import ReqKVManager
from sglang.srt.batch.schedule_batch import Req, ScheduleBatch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.collective_trace import CollectiveRecorder
from sglang.srt.distributed.parallel_state import initialize_model_parallel, set_collective_recorder
from sglang.srt.distributed.scheduler_comm import (
    CollectiveMismatch,
    GlobalPlan,
    LocalPlan,
    SchedulerComm,
    init_distributed,
)
from sglang.srt.managers.dp_load import LoadReporter
from sglang.srt.managers.dp_prefill_align import PrefillHold, prefill_allowed
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    DecodeIterationTime,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    ProfileReq,
    ProfileReqOutput,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.schedule_policy import PrefillAdder, order_waiting
from sglang.srt.managers.scheduler_balance import IterationBalance
from sglang.srt.managers.scheduler_heartbeat import IterationHeartbeat
from sglang.srt.managers.scheduler_phases import IterationPhases
from sglang.srt.managers.scheduler_profiler import SchedulerProfiler
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.tp_worker import GenerationResult, LaunchedStep, TpModelWorker
from sglang.srt.sampling.sampler import NAN_TOKEN_ID
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.speculative.adaptive import AdaptiveTiers, figures_of_plan
from sglang.srt.speculative.eagle_worker import EAGLEWorker, LaunchedMixed, target_runner_setup
from sglang.srt.utils.hf_transformers_utils import get_server_tokenizer, resolve_model_path
from sglang.srt.utils.zmq_utils import shared_context

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 100
# What one request's (or control message's) own bad data raises while it is taken in.
_REQUEST_DATA_ERRORS = (TypeError, ValueError, OverflowError, OSError)


class Scheduler:
    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        gpu_id: int,
        tp_rank: int,
        dp_rank: Optional[int],
    ):
        self.server_args = server_args
        self.tp_rank = tp_rank
        self.comm = self.init_distributed(port_args, tp_rank, dp_rank)
        # Under DP attention the DP rank follows from the TP rank; replicas are given theirs.
        self.dp_rank = tp_rank // server_args.attn_tp_size if server_args.enable_dp_attention else dp_rank
        model_path = resolve_model_path(server_args.model_path)
        self.model_config = ModelConfig(
            model_path,
            context_length=server_args.context_length,
            dtype=server_args.dtype,
            device=server_args.device,
            trust_remote_code=server_args.trust_remote_code,
        )
        self.tokenizer = get_server_tokenizer(server_args)  # None: stop strings are refused upstream
        self.eos_ids = _eos_ids(self.model_config.hf_config, self.tokenizer)
        speculative = server_args.speculative_algorithm is not None
        # A speculative worker's target runner is sized and captured for its cycles.
        runner_setup = target_runner_setup(server_args) if speculative else ()
        target = TpModelWorker(server_args, self.model_config, gpu_id, tp_rank, *runner_setup)
        self.runner = runner = target.runner
        self.context_len = self.model_config.context_len
        self.max_running_requests = runner.max_running_requests
        self.allocator = runner.token_allocator
        self.req_to_token_pool = runner.req_to_token_pool
        self.tree_cache = None if server_args.disable_radix_cache else RadixCache(self.allocator)
        self.kv = ReqKVManager(self.req_to_token_pool, self.allocator, self.tree_cache)
        target.kv = self.kv
        self.worker = target
        self.spec_worker = None
        if speculative:
            self.worker = self.spec_worker = EAGLEWorker(server_args, target, gpu_id, tp_rank)
        # --speculative-adaptive: each decode cycle's tier (draft steps), decided alike on every rank.
        self.adaptive = AdaptiveTiers.from_server_args(server_args) if server_args.speculative_adaptive else None
        # Start of the latest iteration that ran a decode cycle alone, and the agreed wall time
        # of the previous iteration (0: not such an iteration), for the adaptive tiers' costs.
        self.timed_iteration_started: Optional[float] = None
        self.decode_iteration_us = 0
        # Under DP attention prefill is always chunked so that it fits the gathered buffer.
        no_chunking = server_args.chunked_prefill_size == -1 and not server_args.enable_dp_attention
        self.chunk_size = None if no_chunking else runner.prefill_token_budget()

        # Overlap scheduling: the next step is scheduled and queued while the device still runs
        # this one (whose tokens the next decode step reads on the device; a speculative cycle
        # reads its roots and KV lengths from the request states the previous cycle left there).
        self.overlap = not server_args.disable_overlap_schedule
        self.in_flight: Optional[tuple[ScheduleBatch, LaunchedStep]] = None

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.num_generated_since_log = 0
        self.decode_steps = 0
        self.mixed_prefill_batches = 0  # --enable-mixed-chunk: prefills that carried running requests
        self.last_log_time = time.monotonic()
        self.last_gen_throughput = 0.0
        # Speculative decoding: tokens produced by verify steps and the number of such steps.
        self.spec_tokens_total = self.spec_steps_total = 0
        self.spec_tokens_since_log = self.spec_steps_since_log = 0
        self.forward_started_at: Optional[float] = None

        self.globally_idle = True
        self.iterations = 0
        self.decode_streak = 0  # decode batches launched since the last prefill batch
        self.last_plan: Optional[GlobalPlan] = None  # the previous iteration's (DP attention)
        self.prefill_hold = PrefillHold(server_args.dp_prefill_align_iters)
        self.balance = IterationBalance()
        self.phases = IterationPhases()
        dp_label = f"DP{self.dp_rank}-" if self.dp_rank is not None else ""
        self.profiler = SchedulerProfiler(f"{dp_label}TP{tp_rank}")
        self.heartbeat = IterationHeartbeat(port_args.run_dir, f"{dp_label}TP{tp_rank}")
        # Only the entry rank of each DP rank talks to the other processes.
        self.recv_from_tokenizer = self.send_to_detokenizer = self.send_to_tokenizer = None
        self.load_reporter: Optional[LoadReporter] = None
        if self.comm.is_entry_rank:
            ctx = shared_context(2)
            if server_args.dp_size > 1 and server_args.load_balance_method != "round_robin":
                self.load_reporter = LoadReporter(port_args.dp_load_ipc_name, self.dp_rank, ctx)
            self.recv_from_tokenizer = ctx.socket(zmq.PULL)
            dp_input = server_args.dp_size > 1
            self.recv_from_tokenizer.connect(
                port_args.dp_input_ipc_names[self.dp_rank] if dp_input else port_args.scheduler_input_ipc_name
            )
            self.send_to_detokenizer = ctx.socket(zmq.PUSH)
            self.send_to_detokenizer.connect(port_args.detokenizer_ipc_name)
            self.send_to_tokenizer = ctx.socket(zmq.PUSH)
            self.send_to_tokenizer.connect(port_args.tokenizer_ipc_name)
        # --debug-collectives: what the model's collectives moved, compared after each iteration.
        self.collective_recorder: Optional[CollectiveRecorder] = None
        if server_args.debug_collectives and server_args.tp_size > 1:
            self.collective_recorder = CollectiveRecorder()
            set_collective_recorder(self.collective_recorder)

    def init_distributed(self, port_args: PortArgs, tp_rank: int, dp_rank: Optional[int]) -> SchedulerComm:
        """torch.distributed over the ranks of this model replica, then the model-parallel groups."""
        args = self.server_args
        if args.tp_size > 1:
            replica = 0 if args.enable_dp_attention or dp_rank is None else dp_rank
            addr = args.dist_init_addr or f"127.0.0.1:{port_args.nccl_ports[replica]}"
            # Collectives time out only well after the watchdog, so a rank stuck waiting on a
            # frozen peer is reported by the watchdog, not by a backend timeout that races it.
            collective_timeout_s = 2 * args.watchdog_timeout
            init_distributed(args.device, args.tp_size, tp_rank, f"tcp://{addr}", collective_timeout_s, args.ranks_share_gpu)
            initialize_model_parallel(
                args.tp_size,
                tp_rank,
                dp_size=args.dp_size,
                enable_dp_attention=args.enable_dp_attention,
                ipc_only=args.ranks_share_gpu,
            )
        return SchedulerComm(args.tp_size, tp_rank, args.attn_tp_size, args.enable_dp_attention)

    @property
    def max_req_input_len(self) -> int:
        """A prompt leaves room in the KV pool for its first decode step (a speculative cycle's slots)."""
        return min(self.context_len - 1, self.allocator.size - self.worker.decode_kv_need_per_req())

    # ------------------------------------------------------------------ loop
    def event_loop(self) -> None:
        while True:
            self.run_iteration()
            self.heartbeat.beat()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req or self.in_flight or self.kv.pending_reads)

    def run_iteration(self) -> None:
        self.iterations += 1
        started = time.perf_counter()
        self.phases.begin()
        measured = self.take_decode_iteration_time(started)
        own = self.recv_requests(block=not self.has_work() and self.globally_idle)
        if measured and self.comm.attn_tp_size > 1:
            own.append(DecodeIterationTime(measured))  # the entry rank's time reaches its peers
        self.decode_iteration_us = measured if self.comm.attn_tp_size == 1 else 0
        msgs = self.comm.broadcast_requests(own)
        for msg in msgs:
            self.handle_message(msg)
        if not self.can_overlap():
            self.finish_in_flight()
        batch, plan = self.get_next_batch(), None
        if self.comm.dp_attention:
            batch, plan = self.agree_on_plan(batch)
        self.balance.observe(
            len(batch.input_ids) if batch else 0,
            plan.global_num_tokens if plan else None,
            bool(self.running),
            batch is not None and (batch.decode_part is not None or batch.mixed_decode_rows > 0),
        )
        previous, self.in_flight = self.in_flight, None
        if batch is not None:
            launch_started = time.perf_counter()
            self.in_flight = (batch, self.launch(batch, plan))
            self.phases.add("launch", time.perf_counter() - launch_started)
            self.profiler.step()
        if self.adaptive is not None and self.adaptive.timed is not None and batch is not None:
            self.timed_iteration_started = started
        if previous is not None:
            self.process(*previous)
        if not self.overlap:
            self.finish_in_flight()
        if self.in_flight is None:  # nothing queued after the pending reads: they arrive at once
            self.kv.complete_reads()
        if self.load_reporter is not None:
            self.load_reporter.count_received(msgs)
            self.load_reporter.report(self.waiting + self.running + ([self.chunked_req] if self.chunked_req else []))
        if self.collective_recorder is not None:
            self.comm.check_collective_traces(self.collective_recorder.take())
        self.phases.end(started)

    def can_overlap(self) -> bool:
        """Whether the next batch may be scheduled before the step in flight reaches the host:
        not when sampling reads the output so far (penalties) or when decoding may have to
        retract a request (both need every token on the host)."""
        if not self.overlap:
            return False
        if any(r.sampling_params.has_penalties for r in self.running):
            return False
        return self.free_kv_tokens() >= self.worker.decode_kv_need_per_req() * len(self.running)

    def finish_in_flight(self) -> None:
        if self.in_flight is not None:
            step, self.in_flight = self.in_flight, None
            self.process(*step)

    def recv_requests(self, block: bool) -> list:
        """Drain the entry rank's socket (waiting briefly when there is nothing to do)."""
        if self.recv_from_tokenizer is None or (block and not self.recv_from_tokenizer.poll(_IDLE_POLL_MS)):
            return []
        msgs = []
        while True:
            try:
                msgs.append(self.recv_from_tokenizer.recv_pyobj(zmq.NOBLOCK))
            except zmq.ZMQError:
                return msgs

    def take_decode_iteration_time(self, now: float) -> int:
        """The previous iteration's wall time in microseconds when it ran a decode cycle alone
        (--speculative-adaptive), else 0."""
        started, self.timed_iteration_started = self.timed_iteration_started, None
        return 0 if started is None else max(1, int((now - started) * 1e6))

    def agree_on_plan(self, batch: Optional[ScheduleBatch]) -> tuple[Optional[ScheduleBatch], Optional[GlobalPlan]]:
        """The one all-gather of the iteration: every rank learns every DP rank's token count
        (and, with speculation, the phases and sizes of every sub-forward, see spec_plan.py).
        A rank without work runs an IDLE batch so that each collective is issued everywhere."""
        self.forward_started_at = time.monotonic()
        spec_trials = self.adaptive.plan_trials() if self.adaptive else ()
        local = LocalPlan(
            num_tokens=len(batch.input_ids) if batch else 0,
            num_reqs=len(batch.reqs) if batch else 0,
            is_extend=int(batch is not None and batch.mode == ForwardMode.EXTEND),
            alongside_decode_reqs=len(batch.alongside_decode.reqs) if batch and batch.alongside_decode else 0,
            has_work=int(self.has_work()),
            prompt_logprobs=int(batch is not None and bool(batch.input_logprob_rows)),
            prefill_wait=self.prefill_hold.report(
                wants_prefill=bool(self.waiting),
                prefilled=batch is not None and batch.mode == ForwardMode.EXTEND,
                continues_chunk=self.chunked_req is not None,
            ),
            spec_trials=spec_trials,
            spec_cycle_us=self.decode_iteration_us,
        )
        plan = self.last_plan = self.comm.gather_plan(local)
        self.forward_started_at = None
        self.globally_idle = not plan.any_work
        if plan.all_idle:
            if self.adaptive is not None:
                self.adaptive.absorb(figures_of_plan(plan))
            return None, None
        batch = batch or ScheduleBatch.idle()
        batch.global_num_tokens = plan.global_num_tokens
        batch.global_forward_mode = ForwardMode.EXTEND if plan.any_extend else ForwardMode.DECODE
        batch.global_num_reqs = plan.prefill_graph_reqs if plan.any_extend else None
        if self.server_args.debug_collectives:
            descriptor = {"global_num_tokens": plan.global_num_tokens}
            if self.spec_worker is not None:
                steps = self.adaptive.preview(figures_of_plan(plan)) if self.adaptive else None
                descriptor["sub_forwards"] = self.spec_worker.planned_sub_forwards(plan, steps)
            self.comm.check_agreement(
                descriptor, {"mode": int(batch.mode), "input_ids": batch.input_ids, "seq_lens": batch.seq_lens}
            )
        return batch, plan

    def handle_message(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            self.add_request(msg)
        elif isinstance(msg, DecodeIterationTime):
            self.decode_iteration_us = msg.us
        elif isinstance(msg, AbortReq):
            self.abort_request(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            self.finish_in_flight()
            self.reply(FlushCacheReqOutput(self.flush_cache()))
        elif isinstance(msg, GetInternalStateReq):
            self.reply(GetInternalStateReqOutput(self.internal_state()))
        elif isinstance(msg, ProfileReq):
            try:  # a bad option (type, directory) fails this request, not the scheduler
                self.reply(ProfileReqOutput(*self.profiler.handle(msg)))
            except _REQUEST_DATA_ERRORS as e:
                self.reply(ProfileReqOutput(False, f"Cannot profile: {type(e).__name__}: {e}"))
        else:
            logger.error("Scheduler got an unknown message: %r", type(msg))

    def add_request(self, msg: TokenizedGenerateReqInput) -> None:
        req = Req(
            msg.rid,
            list(msg.input_ids),
            msg.sampling_params,
            stream=msg.stream,
            return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
            logprob_start_len=msg.logprob_start_len,
        )
        if not req.origin_input_ids or len(req.origin_input_ids) > self.max_req_input_len:
            self.refuse(req, f"Input length {len(req.origin_input_ids)} must be in [1, {self.max_req_input_len}]")
            return
        # The TokenizerManager validated the request already; checked again here, a request
        # whose own data is bad (sampling parameters, seed, token ids) fails alone.
        try:
            msg.sampling_params.verify(self.model_config.vocab_size)
            if min(req.origin_input_ids) < 0 or max(req.origin_input_ids) >= self.model_config.vocab_size:
                raise ValueError(f"input_ids must be in [0, {self.model_config.vocab_size})")
            if not -1 <= req.logprob_start_len < len(req.origin_input_ids):
                raise ValueError(f"logprob_start_len must be -1 or in [0, {len(req.origin_input_ids)})")
            self.worker.add_request(req)
        except _REQUEST_DATA_ERRORS as e:
            self.worker.remove_request(req)
            self.refuse(req, f"Invalid request: {e}")
            return
        self.waiting.append(req)

    def refuse(self, req: Req, message: str) -> None:
        """Finish a request that never ran with an error (a 400 for its client)."""
        logger.info("Refused request %s: %s", req.rid, message)
        req.finished_reason = {"type": "abort", "message": message}
        req.return_logprob = False  # its fields may be what was refused
        self.stream_output([req])

    def abort_request(self, rid: str) -> None:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finished_reason = {"type": "abort"}
                self.finish(req)
                self.stream_output([req])
                return
        for req in self.running + ([self.chunked_req] if self.chunked_req else []):
            if req.rid == rid:
                req.to_abort = True

    # ------------------------------------------------------------------ batching
    def get_next_batch(self) -> Optional[ScheduleBatch]:
        self.drop_aborted()
        batch = self.get_prefill_batch() if self.may_prefill() else None
        if batch is None and self.running:
            batch = self.get_decode_batch()
        if batch is not None:
            self.decode_streak = self.decode_streak + 1 if batch.mode == ForwardMode.DECODE else 0
        return batch

    def may_prefill(self) -> bool:
        """--num-continuous-decode-steps N > 1: while requests decode, a new prefill waits until
        they have decoded N steps in a row since the last one (a chunked prompt goes on).
        N = 1: requests that wait are prefilled at once, as without the flag. Under DP attention
        the ranks also align their prefills (dp_prefill_align.py)."""
        if self.chunked_req is not None:
            return True
        if self.comm.dp_attention and not prefill_allowed(self.last_plan, self.server_args.dp_prefill_align_iters):
            return False
        steps = self.server_args.num_continuous_decode_steps
        return steps == 1 or not self.running or self.decode_streak >= steps

    def drop_aborted(self) -> None:
        aborted = [r for r in self.running if r.to_abort]
        if self.chunked_req is not None and self.chunked_req.to_abort:
            aborted.append(self.chunked_req)
            self.chunked_req = None
        for req in aborted:
            req.finished_reason = {"type": "abort"}
            self.finish(req)
        if aborted:
            self.stream_output(aborted)

    def free_kv_tokens(self) -> int:
        return self.kv.free_kv_tokens()

    def get_prefill_batch(self) -> Optional[ScheduleBatch]:
        if self.chunked_req is None and not self.waiting:
            return None
        mixed = self.mixable_running()
        free_slots = self.max_running_requests - len(self.running) - (1 if self.chunked_req else 0)
        adder = PrefillAdder(
            self.server_args.max_prefill_tokens - len(mixed),
            None if self.chunk_size is None else self.chunk_size - len(mixed),
            self.free_kv_tokens(),
            min(free_slots, self.req_to_token_pool.available_size()),
        )
        reserve = len(self.running) * self.worker.decode_kv_need_per_req()
        if self.chunked_req is not None:
            adder.try_add(self.chunked_req, already_has_slot=True, reserve_decode=reserve)
        for req in self.waiting:
            self.kv.match_prefix(req)
        for req in order_waiting(self.waiting, self.server_args.schedule_policy, lambda r: r.cached_tokens):
            if not adder.try_add(req, reserve_decode=reserve):
                break
        if not adder.reqs:
            return None
        for req in adder.reqs:
            if req.req_pool_idx is None:
                self.waiting.remove(req)
                self.kv.claim(req)
        self.chunked_req = adder.chunked_req
        for req in mixed:
            req.extend_len = 1
        reqs = mixed + adder.reqs
        out_cache_loc = self.kv.assign(reqs, [r.extend_len for r in reqs])
        future = self.in_flight[1].future_tokens() if self.in_flight and mixed else None
        batch = ScheduleBatch.for_extend(reqs, out_cache_loc, future, mixed_decode_rows=len(mixed))
        if self.spec_worker is not None and self.server_args.enable_mixed_chunk:
            # The prefill reserved the running requests' cycle slots (reserve_decode above).
            decodable = self.decodable_running()
            batch.alongside_decode = ScheduleBatch.for_decode(decodable) if decodable else None
        self.mixed_prefill_batches += bool(mixed) or batch.alongside_decode is not None
        return batch

    def mixable_running(self) -> list[Req]:
        """--enable-mixed-chunk without speculation: the running requests whose decode step
        joins the prefill's forward; none when their rows would leave the prefill no token of
        its budget. (Under speculation their cycle runs beside the prefill: alongside_decode.)"""
        if not self.server_args.enable_mixed_chunk or self.spec_worker is not None:
            return []
        reqs = self.decodable_running()
        budget = min(self.server_args.max_prefill_tokens, self.chunk_size or self.server_args.max_prefill_tokens)
        return reqs if len(reqs) < budget else []

    def get_decode_batch(self) -> Optional[ScheduleBatch]:
        need = self.worker.decode_kv_need_per_req()
        while self.free_kv_tokens() < need * len(self.running) and (self.kv.pending_reads or len(self.running) > 1):
            if self.kv.pending_reads:  # first take back what ended requests hold (waits for the step in flight)
                self.kv.complete_reads()
            else:
                self.retract(self.running[-1])
        lone = self.running[0] if self.running else None
        if lone is not None and not lone.in_flight and self.free_kv_tokens() < need:
            # Nothing left to retract: the one request has outgrown the KV pool.
            lone.finished_reason = {"type": "length", "length": len(lone.output_ids)}
            self.finish(lone)
            self.stream_output([lone])
            return None
        reqs = self.decodable_running()
        if not reqs:
            return None
        return ScheduleBatch.for_decode(reqs, self.in_flight[1].future_tokens() if self.in_flight else None)

    def decodable_running(self) -> list[Req]:
        """The running requests a decode step takes: not one whose step in flight may be its
        last (by length), which waits for that step."""
        return [r for r in self.running if not (r.in_flight and self.may_end_by_length(r))]

    def may_end_by_length(self, req: Req) -> bool:
        """Whether the request may be done once its steps in flight arrive, whatever their
        tokens are (a plain step brings one token, a speculative cycle up to steps + 1)."""
        most = req.in_flight * self.worker.max_tokens_per_step()
        outputs = len(req.output_ids) + most
        seq_len = len(req.origin_input_ids) + outputs  # without the property calls
        return outputs >= req.sampling_params.max_new_tokens or seq_len >= self.context_len

    def retract(self, req: Req) -> None:
        """Out of KV for decoding: send the newest request back to the queue (it re-prefills)."""
        logger.warning("KV cache full: retracting request %s", req.rid)
        self.running.remove(req)
        self.kv.release(req)
        req.kv_len = req.cache_prefix_len = 0
        self.waiting.insert(0, req)

    # ------------------------------------------------------------------ run
    def launch(self, batch: ScheduleBatch, plan: Optional[GlobalPlan]) -> LaunchedStep:
        """Queue the batch's forward; its KV positions count at once, its tokens are in flight."""
        self.forward_started_at = time.monotonic()
        if self.spec_worker is not None:
            steps = self.spec_tier(batch, plan)
            step = self.spec_worker.launch(batch, plan, steps)
            if plan is not None and self.server_args.debug_collectives:
                self.check_sub_forwards(plan, steps)
        else:
            step = self.worker.launch(batch)
        self.forward_started_at = None
        for part, part_step in _launched_parts(batch, step):
            if part_step.kv_known_at_launch:
                for req, written in zip(part.reqs, part_step.result.kv_written):
                    req.kv_len += written
            for i in part_step.sampled_rows:
                part.reqs[i].in_flight += 1
        return step

    def spec_tier(self, batch: ScheduleBatch, plan: Optional[GlobalPlan]) -> Optional[int]:
        """--speculative-adaptive: the tier (draft steps) of this iteration's decode cycles, from
        every DP rank's figures in the plan, or from this DP group's own (None: the one tier)."""
        if self.adaptive is None:
            return None
        if plan is not None:  # every rank's time is the same iteration's: the largest counts
            cycle_us = max(p.spec_cycle_us for p in plan.per_rank)
            return self.adaptive.next_tier(figures_of_plan(plan), cycle_us, decode_only=not plan.any_extend)
        decode = batch.decode_part
        decode_reqs = len(decode.reqs) if decode is not None else 0
        figures = self.adaptive.local_figures(decode_reqs)
        return self.adaptive.next_tier(figures, self.decode_iteration_us, decode_only=batch.mode == ForwardMode.DECODE)

    def process(self, batch: ScheduleBatch, step: LaunchedStep) -> None:
        """Wait for the step's tokens and hand them to their requests (a prefill's and the
        decode cycle beside it, each to its own batch's). A request that finished (or was
        aborted) while the step ran drops its token."""
        self.forward_started_at = time.monotonic()
        wait_started = time.perf_counter()
        parts = [(part, part_step, part_step.resolve()) for part, part_step in _launched_parts(batch, step)]
        self.kv.complete_reads()  # queued before this iteration's launch: behind the steps just waited for
        resolved_at = time.perf_counter()
        self.phases.add("wait", resolved_at - wait_started)
        self.forward_started_at = None
        out: list[Req] = []
        for part, part_step, result in parts:
            out += self.take_results(part, part_step, result)
        self.stream_output(out)
        self.phases.add("process", time.perf_counter() - resolved_at)

    def take_results(self, batch: ScheduleBatch, step: LaunchedStep, result: GenerationResult) -> list[Req]:
        """Hand a resolved step's tokens to its batch's requests; those with output to send."""
        for i in step.sampled_rows:
            batch.reqs[i].in_flight -= 1
        live = [i for i, r in enumerate(batch.reqs) if not r.finished]
        if not step.kv_known_at_launch:  # a speculative cycle's KV positions arrive with its tokens
            for i in live:
                batch.reqs[i].kv_len += result.kv_written[i]
        for i in live:
            self.append_tokens(batch.reqs[i], result, i)
        if batch.mode == ForwardMode.EXTEND:
            self.log_prefill(batch)
            self.running += [
                r for r in batch.reqs if r.output_ids and r is not self.chunked_req and not r.finished and r not in self.running
            ]
        elif batch.mode == ForwardMode.DECODE:
            if self.adaptive is not None and result.draft_steps is not None:  # a verify cycle
                self.adaptive.observe(result.draft_steps, result.accepted_draft_tokens)
            self.log_decode(batch, result)
        out = []
        for i in live:
            req = batch.reqs[i]
            if req.finished:
                self.finish(req)
                out.append(req)
            elif req.stream and result.next_token_ids[i] and self.due_for_streaming(req):
                out.append(req)
        return out

    def due_for_streaming(self, req: Req) -> bool:
        """--stream-interval N: a streaming request's new tokens go out once N have gathered; its
        first token goes out at once, the rest with its finish at the latest."""
        return req.streamed_len == 0 or len(req.output_ids) - req.streamed_len >= self.server_args.stream_interval

    def check_sub_forwards(self, plan: GlobalPlan, steps: Optional[int]) -> None:
        """--debug-collectives: the speculative sub-forwards this rank ran are exactly the planned
        ones (kinds, every DP rank's rows at the tier of `steps`), and its own rows match its entry."""
        planned = self.spec_worker.planned_sub_forwards(plan, steps)
        ran = [(kind, rows) for kind, rows, _ in self.spec_worker.trace]
        own = [local == rows[self.dp_rank] for _, rows, local in self.spec_worker.trace]
        if ran != planned or not all(own):
            raise CollectiveMismatch(
                f"--debug-collectives: DP{self.dp_rank} TP{self.tp_rank} ran sub-forwards {self.spec_worker.trace}, "
                f"planned {planned}"
            )

    def append_tokens(self, req: Req, result: GenerationResult, i: int) -> None:
        """Append the step's prompt logprobs, then its tokens one by one, stopping at the first
        stop condition."""
        if result.input_logprobs:
            req.input_token_logprobs += result.input_logprobs[i]
            req.input_top_logprobs += result.input_top_logprobs[i]
        if req.sampling_params.max_new_tokens == 0 and req.kv_len == req.seq_len:
            req.finished_reason = {"type": "length", "length": 0}
            return
        for j, tok in enumerate(result.next_token_ids[i]):
            if tok == NAN_TOKEN_ID:  # --enable-nan-detection: this step's logits were not finite
                logger.error("NaN or inf in the logits of request %s; finishing it with an error", req.rid)
                req.finished_reason = {"type": "abort", "message": "NaN or inf in the model's logits", "status_code": 500}
                # Its KV may hold NaN (masked attention still spreads NaN values): never cache it.
                self.kv.truncate(req, req.cache_prefix_len)
                break
            req.output_ids.append(tok)
            if result.logprobs:
                req.output_token_logprobs.append(result.logprobs[i][j])
                if req.top_logprobs_num:
                    req.output_top_logprobs.append(result.top_logprobs[i][j])
            self.num_generated_since_log += 1
            req.check_finished(self.eos_ids, self.context_len, self.stop_tail_text(req))
            if req.finished:
                break
        if result.accepted_draft_tokens is not None:
            req.spec_verify_ct += 1
            self.spec_tokens_since_log += result.accepted_draft_tokens[i] + 1
            self.spec_steps_since_log += 1
        # Only tokens before the newest one have KV (and the tokens in flight, whose forward
        # is queued); drop KV of tokens cut by a stop.
        if req.output_ids:
            self.kv.truncate(req, req.full_len - 1)

    def finish(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        self.kv.release(req)
        self.worker.remove_request(req)

    def stop_tail_text(self, req: Req) -> Optional[str]:
        stops = req.sampling_params.stop
        if not stops:
            return None
        n = max(len(s) for s in stops) + 1
        return self.tokenizer.decode(req.output_ids[-n:])

    # ------------------------------------------------------------------ output
    def reply(self, msg) -> None:
        if self.send_to_tokenizer is not None:
            self.send_to_tokenizer.send_pyobj(msg)

    def stream_output(self, reqs: list[Req]) -> None:
        """Send each request's outputs new since its previous message."""
        if not reqs or self.send_to_detokenizer is None:
            return
        starts = [r.streamed_len for r in reqs]
        for r in reqs:
            r.streamed_len = len(r.output_ids)
        self.send_to_detokenizer.send_pyobj(
            BatchTokenIDOut(
                rids=[r.rid for r in reqs],
                output_ids=[r.output_ids[s:] for r, s in zip(reqs, starts)],
                output_offsets=starts,
                finished_reasons=[r.finished_reason for r in reqs],
                prompt_tokens=[len(r.origin_input_ids) for r in reqs],
                completion_tokens=[len(r.output_ids) for r in reqs],
                cached_tokens=[r.cached_tokens for r in reqs],
                skip_special_tokens=[r.sampling_params.skip_special_tokens for r in reqs],
                spaces_between_special_tokens=[r.sampling_params.spaces_between_special_tokens for r in reqs],
                no_stop_trim=[r.sampling_params.no_stop_trim for r in reqs],
                output_token_logprobs=[r.output_token_logprobs[s:] if r.return_logprob else None for r, s in zip(reqs, starts)],
                output_top_logprobs=[r.output_top_logprobs[s:] if r.return_logprob else None for r, s in zip(reqs, starts)],
                # A request's first message carries its prompt logprobs (complete: it has finished
                # its prefill, or it ends without output).
                input_token_logprobs=[_input_logprobs(r) if r.return_logprob and not s else None for r, s in zip(reqs, starts)],
                input_top_logprobs=[_input_top_logprobs(r) if r.return_logprob and not s else None for r, s in zip(reqs, starts)],
                spec_verify_ct=[r.spec_verify_ct for r in reqs],
            )
        )

    def token_usage(self) -> float:
        return 1.0 - self.free_kv_tokens() / self.allocator.size

    def log_prefill(self, batch: ScheduleBatch) -> None:
        mixed = batch.mixed_decode_rows
        decoding = mixed or (len(batch.alongside_decode.reqs) if batch.alongside_decode else 0)
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, #running-req: %d, #queue-req: %d%s",
            len(batch.reqs) - mixed,
            len(batch.input_ids) - mixed,
            sum(p for r, p in zip(batch.reqs[mixed:], batch.prefix_lens[mixed:]) if p == r.cached_tokens),
            self.token_usage(),
            len(self.running),
            len(self.waiting),
            f", #mixed-decode: {decoding}" if decoding else "",
        )

    def log_decode(self, batch: ScheduleBatch, result: GenerationResult) -> None:
        self.decode_steps += 1
        if self.decode_steps % self.server_args.decode_log_interval:
            return
        now = time.monotonic()
        self.last_gen_throughput = self.num_generated_since_log / max(now - self.last_log_time, 1e-6)
        self.num_generated_since_log, self.last_log_time = 0, now
        spec = ""
        if self.spec_steps_since_log:
            spec = f"accept len: {self.spec_tokens_since_log / self.spec_steps_since_log:.2f}, "
            spec += self.adaptive.log_text() if self.adaptive else ""
            self.spec_tokens_total += self.spec_tokens_since_log
            self.spec_steps_total += self.spec_steps_since_log
            self.spec_tokens_since_log = self.spec_steps_since_log = 0
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, %s%s%sgen throughput (token/s): %.2f, #queue-req: %d",
            len(batch.reqs),
            self.allocator.size - self.free_kv_tokens(),
            self.token_usage(),
            spec,
            self.balance.log_text(),
            self.phases.take_log_text(),
            self.last_gen_throughput,
            len(self.waiting),
        )

    def reset_spec_stats(self) -> None:
        """Speculation's statistics start from zero (and adaptive tiers from the starting tier)."""
        self.spec_tokens_total = self.spec_steps_total = 0
        self.spec_tokens_since_log = self.spec_steps_since_log = 0
        if self.adaptive is not None:
            self.adaptive.reset()

    def avg_spec_accept_length(self) -> Optional[float]:
        """Mean tokens per request per verify step since startup (None without speculation)."""
        steps = self.spec_steps_total + self.spec_steps_since_log
        if self.server_args.speculative_algorithm is None:
            return None
        return (self.spec_tokens_total + self.spec_tokens_since_log) / steps if steps else 0.0

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> bool:
        if self.running or self.waiting or self.chunked_req:
            return False
        self.kv.complete_reads()
        if self.tree_cache is not None:
            self.tree_cache.reset()
        self.allocator.clear()
        return True

    def internal_state(self) -> dict:
        return {
            "dp_rank": self.dp_rank or 0,
            "avg_spec_accept_length": self.avg_spec_accept_length(),
            "max_total_num_tokens": self.allocator.size,
            "available_kv_tokens": self.free_kv_tokens(),
            "last_gen_throughput": self.last_gen_throughput,
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "pid": os.getpid(),
            "weight_bytes": self.runner.weight_bytes,
            "iterations": self.iterations,
            "plan_all_gathers": self.comm.num_plan_gathers,
            "gathered_buffer_bytes": _nbytes(self.runner.gathered_buffer),
            "cuda_graph_replays": sum(g.num_replays for g in self.graph_runners()),
            "cuda_graph_capture_mib": self.cuda_graph_capture_mib(),
            "prefill_wait_iterations": self.prefill_hold.total_held_iters,  # DP attention: held or without room
            "mixed_prefill_batches": self.mixed_prefill_batches,
            **self.balance.internal_state(),
            **(self.adaptive.internal_state() if self.adaptive else {}),
        }

    def graph_runners(self) -> list:
        """The CUDA graph runners of this rank's model runners (target and draft)."""
        runners = [self.runner, getattr(self.spec_worker, "draft_runner", None)]
        return [r.graph_runner for r in runners if r is not None and r.graph_runner is not None]

    def cuda_graph_capture_mib(self) -> dict[str, float]:
        """GPU memory the graphs took at capture, per speculative tier (key "0" outside speculation)."""
        mib: dict[str, float] = {}
        for graphs in self.graph_runners():
            for steps, used in graphs.capture_mib.items():
                mib[str(steps)] = mib.get(str(steps), 0.0) + used
        return mib

    def start_watchdog(self) -> None:
        timeout = self.server_args.watchdog_timeout

        def watch() -> None:
            while True:
                time.sleep(min(timeout / 4, 5.0))
                started = self.forward_started_at
                if started is not None and time.monotonic() - started > timeout:
                    # The launcher watches its children and takes the server down.
                    logger.error("Scheduler watchdog: stuck for more than %.0f s in one step; exiting.", timeout)
                    os._exit(1)

        threading.Thread(target=watch, daemon=True, name="watchdog").start()


def _launched_parts(batch: ScheduleBatch, step) -> list[tuple[ScheduleBatch, LaunchedStep]]:
    """(batch, step) of each forward an iteration queued: a prefill with its running
    requests' decode cycle beside it (LaunchedMixed) is two."""
    if isinstance(step, LaunchedMixed):
        assert batch.alongside_decode is not None
        return [(batch, step.prefill), (batch.alongside_decode, step.cycle)]
    return [(batch, step)]


def _input_logprobs(req: Req) -> list[tuple[Optional[float], int]]:
    """SGLang's input_token_logprobs: prompt tokens from logprob_start_len on, the first with
    logprob None (the logits before it are not computed)."""
    return [(None, req.origin_input_ids[req.input_logprob_start])] + req.input_token_logprobs


def _input_top_logprobs(req: Req) -> list[Optional[list[tuple[float, int]]]]:
    return [None] + req.input_top_logprobs if req.top_logprobs_num else []


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _eos_ids(hf_config, tokenizer) -> set[int]:
    ids: set[int] = set()
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
