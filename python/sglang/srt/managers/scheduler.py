"""The scheduler process: one per rank. Each iteration fits on one screen:
receive requests, pick a batch (prefill first, else decode), run it, process results.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Optional

import torch
import zmq

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.sampler import Sampler, SamplingBatchInfo
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SchedulerReady,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import PrefillAdder, order_waiting
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.utils.hf_transformers_utils import get_tokenizer, resolve_model_path

logger = logging.getLogger(__name__)

DECODE_LOG_INTERVAL = 40
_IDLE_POLL_MS = 100


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
        self.tp_rank, self.dp_rank = tp_rank, dp_rank
        model_path = resolve_model_path(server_args.model_path)
        self.model_config = ModelConfig(
            model_path,
            context_length=server_args.context_length,
            dtype=server_args.dtype,
            device=server_args.device,
            trust_remote_code=server_args.trust_remote_code,
        )
        self.tokenizer = get_tokenizer(resolve_model_path(server_args.tokenizer_path), server_args.trust_remote_code)
        self.eos_ids = _eos_ids(self.model_config.hf_config, self.tokenizer)
        self.runner = ModelRunner(self.model_config, server_args, gpu_id, tp_rank, server_args.tp_size)
        self.device = self.runner.device
        self.context_len = self.model_config.context_len
        self.max_running_requests = self.runner.max_running_requests
        self.allocator = self.runner.token_allocator
        self.req_to_token_pool = self.runner.req_to_token_pool
        self.tree_cache = None if server_args.disable_radix_cache else RadixCache(self.allocator)
        self.chunk_size = None if server_args.chunked_prefill_size == -1 else server_args.chunked_prefill_size
        self.sampler = Sampler()

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.generators: dict[str, torch.Generator] = {}
        self.num_generated_since_log = 0
        self.decode_steps = 0
        self.last_log_time = time.monotonic()
        self.last_gen_throughput = 0.0
        self.forward_started_at: Optional[float] = None

        ctx = zmq.Context(2)
        self.recv_from_tokenizer = ctx.socket(zmq.PULL)
        self.recv_from_tokenizer.connect(port_args.scheduler_input_ipc_name)
        self.send_to_detokenizer = ctx.socket(zmq.PUSH)
        self.send_to_detokenizer.connect(port_args.detokenizer_ipc_name)
        self.send_to_tokenizer = ctx.socket(zmq.PUSH)
        self.send_to_tokenizer.connect(port_args.tokenizer_ipc_name)

    @property
    def max_req_input_len(self) -> int:
        return min(self.context_len - 1, self.allocator.size - 1)

    # ------------------------------------------------------------------ loop
    def event_loop(self) -> None:
        while True:
            self.recv_requests(block=not (self.waiting or self.running or self.chunked_req))
            batch = self.get_next_batch()
            if batch is not None:
                self.run_and_process(batch)

    def recv_requests(self, block: bool) -> None:
        if block and not self.recv_from_tokenizer.poll(_IDLE_POLL_MS):
            return
        while True:
            try:
                msg = self.recv_from_tokenizer.recv_pyobj(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            self.handle_message(msg)

    def handle_message(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort_request(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            self.send_to_tokenizer.send_pyobj(FlushCacheReqOutput(self.flush_cache()))
        elif isinstance(msg, GetInternalStateReq):
            self.send_to_tokenizer.send_pyobj(GetInternalStateReqOutput(self.internal_state()))
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
        )
        if not req.origin_input_ids or len(req.origin_input_ids) > self.max_req_input_len:
            req.finished_reason = {
                "type": "abort",
                "message": f"Input length {len(req.origin_input_ids)} must be in [1, {self.max_req_input_len}]",
            }
            self.stream_output([req])
            return
        if msg.sampling_params.sampling_seed is not None:
            g = torch.Generator(device=self.device)
            g.manual_seed(msg.sampling_params.sampling_seed)
            self.generators[req.rid] = g
        self.waiting.append(req)

    def abort_request(self, rid: str) -> None:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finished_reason = {"type": "abort"}
                self.release(req)
                self.stream_output([req])
                return
        for req in self.running + ([self.chunked_req] if self.chunked_req else []):
            if req.rid == rid:
                req.to_abort = True

    # ------------------------------------------------------------------ batching
    def get_next_batch(self) -> Optional[ScheduleBatch]:
        self.drop_aborted()
        batch = self.get_prefill_batch()
        if batch is None and self.running:
            batch = self.get_decode_batch()
        return batch

    def drop_aborted(self) -> None:
        aborted = [r for r in self.running if r.to_abort]
        if self.chunked_req is not None and self.chunked_req.to_abort:
            aborted.append(self.chunked_req)
            self.chunked_req = None
        for req in aborted:
            req.finished_reason = {"type": "abort"}
            if req in self.running:
                self.running.remove(req)
            self.release(req)
        if aborted:
            self.stream_output(aborted)

    def free_kv_tokens(self) -> int:
        evictable = self.tree_cache.evictable_size if self.tree_cache else 0
        return self.allocator.available_size() + evictable

    def get_prefill_batch(self) -> Optional[ScheduleBatch]:
        if self.chunked_req is None and not self.waiting:
            return None
        free_slots = self.max_running_requests - len(self.running) - (1 if self.chunked_req else 0)
        adder = PrefillAdder(
            self.server_args.max_prefill_tokens,
            self.chunk_size,
            self.free_kv_tokens(),
            min(free_slots, self.req_to_token_pool.available_size()),
        )
        reserve = len(self.running)
        if self.chunked_req is not None:
            adder.try_add(self.chunked_req, already_has_slot=True, reserve_decode=reserve)
        self.match_prefixes(self.waiting)
        for req in order_waiting(self.waiting, self.server_args.schedule_policy, lambda r: r.cached_tokens):
            if not adder.try_add(req, reserve_decode=reserve):
                break
        if not adder.reqs:
            return None
        for req in adder.reqs:
            if req.req_pool_idx is None:
                self.waiting.remove(req)
                self.claim_prefix(req)
        self.chunked_req = adder.chunked_req
        out_cache_loc = self.alloc_slots(adder.reqs, [r.extend_len for r in adder.reqs])
        return ScheduleBatch.for_extend(adder.reqs, out_cache_loc)

    def match_prefixes(self, reqs: list[Req]) -> None:
        """Look up each waiting request's cached prefix (at least one token stays to extend)."""
        for req in reqs:
            if self.tree_cache is None:
                continue
            slots, node = self.tree_cache.match_prefix(req.all_ids[:-1])
            req.cached_tokens, req.last_node = len(slots), node
            req.prefix_slots = slots

    def claim_prefix(self, req: Req) -> None:
        req.req_pool_idx = self.req_to_token_pool.alloc()
        if self.tree_cache is not None:
            self.tree_cache.inc_lock_ref(req.last_node)
            n = len(req.prefix_slots)
            self.req_to_token_pool.write(req.req_pool_idx, 0, req.prefix_slots.to(self.device))
            req.kv_len = req.cache_prefix_len = n

    def get_decode_batch(self) -> Optional[ScheduleBatch]:
        while self.free_kv_tokens() < len(self.running) and len(self.running) > 1:
            self.retract(self.running[-1])
        out_cache_loc = self.alloc_slots(self.running, [1] * len(self.running))
        return ScheduleBatch.for_decode(list(self.running), out_cache_loc)

    def retract(self, req: Req) -> None:
        """Out of KV for decoding: send the newest request back to the queue (it re-prefills)."""
        logger.warning("KV cache full: retracting request %s", req.rid)
        self.running.remove(req)
        self.release(req)
        req.kv_len = req.cache_prefix_len = 0
        self.waiting.insert(0, req)

    def alloc_slots(self, reqs: list[Req], counts: list[int]) -> torch.Tensor:
        """KV slots for each request's next counts[i] tokens, written into req_to_token."""
        total = sum(counts)
        if self.allocator.available_size() < total and self.tree_cache is not None:
            self.tree_cache.evict(total - self.allocator.available_size())
        slots = self.allocator.alloc(total)
        if slots is None:
            raise RuntimeError(f"KV cache exhausted: need {total}, have {self.allocator.available_size()}")
        offset = 0
        for req, n in zip(reqs, counts):
            self.req_to_token_pool.write(req.req_pool_idx, req.kv_len, slots[offset : offset + n])
            offset += n
        return slots

    def release(self, req: Req) -> None:
        """Return a finished/aborted/retracted request's KV: to the prefix cache or the allocator."""
        if req.req_pool_idx is None:
            return
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].to("cpu")
        if self.tree_cache is not None:
            cached = self.tree_cache.insert(req.all_ids[: req.kv_len], slots)
            self.allocator.free(slots[req.cache_prefix_len : cached])
            self.tree_cache.dec_lock_ref(req.last_node)
        else:
            self.allocator.free(slots)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None

    # ------------------------------------------------------------------ run
    def run_and_process(self, batch: ScheduleBatch) -> None:
        self.forward_started_at = time.monotonic()
        fb = batch.to_forward_batch(self.device)
        output = self.runner.forward(fb)
        for req, n in zip(batch.reqs, batch.extend_lens):
            req.kv_len += n
        sampling_reqs = [r for r in batch.reqs if r.kv_len == r.seq_len]
        rows = [i for i, r in enumerate(batch.reqs) if r.kv_len == r.seq_len]
        if sampling_reqs:
            self.sample_and_append(sampling_reqs, output.next_token_logits[rows])
        self.forward_started_at = None
        if batch.mode == ForwardMode.EXTEND:
            self.log_prefill(batch)
            for req in batch.reqs:
                if req is not self.chunked_req and req.kv_len == req.seq_len - 1 and not req.finished:
                    self.running.append(req)
        else:
            self.log_decode(batch)
        finished = [r for r in batch.reqs if r.finished]
        for req in finished:
            if req in self.running:
                self.running.remove(req)
            self.release(req)
            self.generators.pop(req.rid, None)
        self.stream_output([r for r in batch.reqs if r.finished or (r.stream and r is not self.chunked_req)])

    def sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        zero_budget = [r for r in reqs if r.sampling_params.max_new_tokens == 0]
        for req in zero_budget:
            req.finished_reason = {"type": "length", "length": 0}
        if zero_budget:
            keep = [i for i, r in enumerate(reqs) if not r.finished]
            reqs, logits = [reqs[i] for i in keep], logits[keep]
            if not reqs:
                return
        info = SamplingBatchInfo.from_requests(
            [r.sampling_params for r in reqs],
            [(r.origin_input_ids, r.output_ids) for r in reqs],
            [self.generators.get(r.rid) for r in reqs],
            logits.shape[-1],
            self.device,
        )
        want_logprob = any(r.return_logprob for r in reqs)
        top_n = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        out = self.sampler(logits, info, want_logprob, top_n)
        next_ids = out.next_token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        tops = [t.tolist() for t in out.top_logprobs] if out.top_logprobs is not None else None
        for i, (req, tok) in enumerate(zip(reqs, next_ids)):
            req.output_ids.append(tok)
            if req.return_logprob:
                req.output_token_logprobs.append((logprobs[i], tok))
                if req.top_logprobs_num:
                    k = req.top_logprobs_num
                    req.output_top_logprobs.append(list(zip(tops[0][i][:k], tops[1][i][:k])))
            req.check_finished(self.eos_ids, self.context_len, self.stop_tail_text(req))
        self.num_generated_since_log += len(reqs)

    def stop_tail_text(self, req: Req) -> Optional[str]:
        stops = req.sampling_params.stop
        if not stops:
            return None
        n = max(len(s) for s in stops) + 1
        return self.tokenizer.decode(req.output_ids[-n:])

    # ------------------------------------------------------------------ output
    def stream_output(self, reqs: list[Req]) -> None:
        if not reqs:
            return
        self.send_to_detokenizer.send_pyobj(
            BatchTokenIDOut(
                rids=[r.rid for r in reqs],
                output_ids=[list(r.output_ids) for r in reqs],
                finished_reasons=[r.finished_reason for r in reqs],
                prompt_tokens=[len(r.origin_input_ids) for r in reqs],
                completion_tokens=[len(r.output_ids) for r in reqs],
                cached_tokens=[r.cached_tokens for r in reqs],
                skip_special_tokens=[r.sampling_params.skip_special_tokens for r in reqs],
                spaces_between_special_tokens=[r.sampling_params.spaces_between_special_tokens for r in reqs],
                no_stop_trim=[r.sampling_params.no_stop_trim for r in reqs],
                output_token_logprobs=[list(r.output_token_logprobs) if r.return_logprob else None for r in reqs],
                output_top_logprobs=[list(r.output_top_logprobs) if r.return_logprob else None for r in reqs],
                spec_verify_ct=[r.spec_verify_ct for r in reqs],
            )
        )

    def token_usage(self) -> float:
        return 1.0 - self.free_kv_tokens() / self.allocator.size

    def log_prefill(self, batch: ScheduleBatch) -> None:
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            len(batch.reqs),
            len(batch.input_ids),
            sum(p for r, p in zip(batch.reqs, batch.prefix_lens) if p == r.cached_tokens),
            self.token_usage(),
            len(self.running),
            len(self.waiting),
        )

    def log_decode(self, batch: ScheduleBatch) -> None:
        self.decode_steps += 1
        if self.decode_steps % DECODE_LOG_INTERVAL:
            return
        now = time.monotonic()
        self.last_gen_throughput = self.num_generated_since_log / max(now - self.last_log_time, 1e-6)
        self.num_generated_since_log, self.last_log_time = 0, now
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
            "#queue-req: %d",
            len(batch.reqs),
            self.allocator.size - self.free_kv_tokens(),
            self.token_usage(),
            self.last_gen_throughput,
            len(self.waiting),
        )

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> bool:
        if self.running or self.waiting or self.chunked_req:
            return False
        if self.tree_cache is not None:
            self.tree_cache.reset()
        self.allocator.clear()
        return True

    def internal_state(self) -> dict:
        return {
            "dp_rank": self.dp_rank or 0,
            "avg_spec_accept_length": None,
            "max_total_num_tokens": self.allocator.size,
            "available_kv_tokens": self.free_kv_tokens(),
            "last_gen_throughput": self.last_gen_throughput,
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
        }

    def start_watchdog(self) -> None:
        timeout = self.server_args.watchdog_timeout

        def watch() -> None:
            while True:
                time.sleep(min(timeout / 4, 5.0))
                started = self.forward_started_at
                if started is not None and time.monotonic() - started > timeout:
                    logger.error("Scheduler watchdog: a forward has run for more than %.0f s; exiting.", timeout)
                    os.kill(os.getppid(), signal.SIGTERM)
                    os._exit(1)

        threading.Thread(target=watch, daemon=True, name="watchdog").start()


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


def configure_logger(server_args: ServerArgs, prefix: str = "") -> None:
    fmt = f"[%(asctime)s{prefix}] %(message)s"
    logging.basicConfig(level=server_args.log_level.upper(), format=fmt, datefmt="%Y-%m-%d %H:%M:%S", force=True)


def run_scheduler_process(
    server_args: ServerArgs,
    port_args: PortArgs,
    gpu_id: int,
    tp_rank: int,
    dp_rank: Optional[int],
    pipe_writer,
) -> None:
    prefix = (f" DP{dp_rank}" if dp_rank is not None else "") + f" TP{tp_rank}"
    configure_logger(server_args, prefix)
    from sglang.srt.utils.process import watch_parent

    watch_parent()
    torch.manual_seed(server_args.random_seed)
    try:
        scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, dp_rank)
    except Exception as e:  # report the cause to the launcher instead of dying silently
        logger.exception("Scheduler failed to start")
        pipe_writer.send(SchedulerReady(dp_rank or 0, tp_rank, 0, 0, 0, error=f"{type(e).__name__}: {e}"))
        return
    pipe_writer.send(
        SchedulerReady(
            dp_rank or 0,
            tp_rank,
            scheduler.allocator.size,
            scheduler.max_req_input_len,
            scheduler.context_len,
        )
    )
    scheduler.start_watchdog()
    try:
        scheduler.event_loop()
    except Exception:
        logger.exception("Scheduler crashed")
        os.kill(os.getppid(), signal.SIGTERM)
        raise
