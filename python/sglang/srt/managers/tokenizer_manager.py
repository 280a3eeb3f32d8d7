"""TokenizerManager: lives in the HTTP/Engine process, on its asyncio loop.

It validates and tokenizes requests, sends them to the scheduler side, and turns the
detokenizer's BatchStrOut messages into SGLang-shaped output dicts for each waiting
request. Invariants:
- a request is fully validated (and tokenized) before anything is sent, so nothing
  malformed reaches the scheduler;
- every request that leaves `generate_request` unfinished (client gone, task cancelled,
  generator closed) is aborted on the scheduler side, freeing its KV at once; every
  wrapper that re-yields outputs closes what it wraps (contextlib.aclosing) so that a
  close reaches the request now, not at garbage collection;
- outputs are cumulative snapshots (text, ids, logprobs so far), so a consumer that
  misses an intermediate snapshot loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import zmq
import zmq.asyncio
from pydantic import ConfigDict

from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    ProfileReq,
    ProfileReqOutput,
    SchedulerReady,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.request_validation import ValidatedRequest
from sglang.srt.metrics.collector import MetricsCollector
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.utils.zmq_utils import shared_async_context, shared_context

logger = logging.getLogger(__name__)

# A send to the scheduler waits at most this long for a connected peer (then the request fails).
_SEND_TIMEOUT_MS = 5000

# How often a request with nothing sent yet checks whether its HTTP client went away.
_DISCONNECT_POLL_S = 0.25
_CONTROL_TIMEOUT_S = 60.0
# Detokenizer messages handled in one go before the consumers run (bounds the pause they see).
_MAX_DRAINED = 64
# Texts longer than this many characters are tokenized off the event loop.
_INLINE_TOKENIZE_CHARS = 16384


class RequestError(ValueError):
    """A request the server refuses; `status_code` is the HTTP status to answer with."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code


class GenerateReqInput(ValidatedRequest):
    """The native /generate request (also built by Engine.generate and the OpenAI layer)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    rid: Optional[Union[str, list[str]]] = None
    stream: bool = False
    return_logprob: bool = False
    # First prompt position of meta_info's input_token_logprobs (-1: the last prompt token).
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False

    @property
    def is_batch(self) -> bool:
        return isinstance(self.text, list) or (bool(self.input_ids) and isinstance(self.input_ids[0], list))

    def split(self) -> list[GenerateReqInput]:
        """One single request per prompt (a single request returns itself)."""
        if not self.is_batch:
            if isinstance(self.rid, list):
                raise RequestError("rid must be a string for a single prompt")
            return [self]
        prompts = self.text if self.text is not None else self.input_ids
        n = len(prompts)
        if n == 0:
            raise RequestError("The batch of prompts is empty")
        params, rids = self.sampling_params, self.rid
        if isinstance(params, list) and len(params) != n:
            raise RequestError(f"sampling_params has {len(params)} entries for {n} prompts")
        if rids is not None and (not isinstance(rids, list) or len(rids) != n):
            raise RequestError(f"rid must be a list of {n} ids for a batch of {n} prompts")
        key = "text" if self.text is not None else "input_ids"
        return [
            self.model_copy(
                update={
                    key: prompts[i],
                    "sampling_params": params[i] if isinstance(params, list) else params,
                    "rid": rids[i] if rids is not None else None,
                }
            )
            for i in range(n)
        ]


@dataclass
class ReqState:
    """A request's outputs so far, accumulated from the detokenizer's per-message deltas; a
    consumer takes a snapshot when it wakes (so a slow consumer costs no copies per message)."""

    stream: bool
    stops: list[str]
    return_text_in_logprobs: bool
    created: float = field(default_factory=time.monotonic)
    first_token_at: Optional[float] = None  # set by MetricsCollector.on_output
    event: asyncio.Event = field(default_factory=asyncio.Event)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: Optional[list] = None  # (logprob, id, text) triples when asked for
    top_logprobs: Optional[list] = None
    input_token_logprobs: Optional[list] = None  # set once, from the first message
    input_top_logprobs: Optional[list] = None
    meta: Optional[dict[str, Any]] = None  # of the latest message
    finished: bool = False
    error: Optional[str] = None

    def snapshot(self) -> dict[str, Any]:
        """SGLang's cumulative output dict: text (a partial stop held back while unfinished),
        ids and meta_info (with the logprobs so far)."""
        meta = dict(self.meta)
        if self.token_logprobs is not None:
            meta["input_token_logprobs"] = self.input_token_logprobs  # never changed once set
            meta["input_top_logprobs"] = self.input_top_logprobs
            meta["output_token_logprobs"] = list(self.token_logprobs)
            meta["output_top_logprobs"] = list(self.top_logprobs)
        text = self.text if self.finished else hold_back_partial_stop(self.text, self.stops)
        return {"text": text, "output_ids": list(self.output_ids), "meta_info": meta}


class _ReplyCollector:
    """Sends one control request at a time and waits for `expected` replies."""

    def __init__(self, expected: int):
        self.expected = expected
        self.lock = asyncio.Lock()
        self.replies: list[Any] = []
        self.done = asyncio.Event()

    async def request(self, send: Callable[[Any], None], msg: Any) -> list[Any]:
        async with self.lock:
            self.replies, self.done = [], asyncio.Event()
            send(msg)
            await asyncio.wait_for(self.done.wait(), _CONTROL_TIMEOUT_S)
            return self.replies

    def add(self, reply: Any) -> None:
        self.replies.append(reply)
        if len(self.replies) >= self.expected:
            self.done.set()


def hold_back_partial_stop(text: str, stops: list[str]) -> str:
    """Drop a tail of `text` that may be the start of a stop string, so that streamed
    text is always a prefix of the final (stop-trimmed) text."""
    cut = 0
    for stop in stops:
        for k in range(min(len(stop), len(text) + 1) - 1, 0, -1):
            if text.endswith(stop[:k]):
                cut = max(cut, k)
                break
    return text[: len(text) - cut] if cut else text


async def final_output(outputs: AsyncIterator[Any]) -> Any:
    """The last item of `outputs` (None if the client went away before the end)."""
    last = None
    async with contextlib.aclosing(outputs):
        async for last in outputs:  # noqa: B007  (the loop keeps the last item)
            pass
    return last


async def incremental_outputs(outputs: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """Turn cumulative snapshots into deltas (--stream-output): only the new text, ids and
    logprobs of each chunk (per sample "index" when n > 1); the prompt's logprobs in the first."""
    sent: dict[int, tuple[int, int]] = {}  # index -> (text, ids) already sent
    async with contextlib.aclosing(outputs):
        async for out in outputs:
            index = out.get("index", 0)
            sent_text, sent_ids = sent.get(index, (0, 0))
            meta = dict(out["meta_info"])
            for key in ("output_token_logprobs", "output_top_logprobs"):
                if key in meta:
                    meta[key] = meta[key][sent_ids:]
            for key in ("input_token_logprobs", "input_top_logprobs"):
                if key in meta and index in sent:
                    meta[key] = []
            delta = {"text": out["text"][sent_text:], "output_ids": out["output_ids"][sent_ids:], "meta_info": meta}
            yield {**out, **delta}
            sent[index] = len(out["text"]), len(out["output_ids"])


async def merge_streams(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(i, item) for the items of every stream i, as they arrive. Closing the merge (or a stream
    failing) closes every stream."""
    nexts = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while nexts:
            done, _ = await asyncio.wait(nexts, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=nexts.get):
                i = nexts.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                nexts[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, item
    finally:
        for task in nexts:
            task.cancel()
        await asyncio.gather(*nexts, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, tokenizer=None):
        self.server_args = server_args
        self.run_dir = port_args.run_dir  # the schedulers' heartbeat files
        from sglang.srt.utils.hf_transformers_utils import get_config, get_server_tokenizer

        if tokenizer is None:
            tokenizer = get_server_tokenizer(server_args)
        self.tokenizer = tokenizer  # None under --skip-tokenizer-init
        if tokenizer is None:
            self.vocab_size = get_config(server_args.model_path, server_args.trust_remote_code).vocab_size
        else:
            self.vocab_size = len(tokenizer)
        # Set from the first SchedulerReady (set_scheduler_info) before serving.
        self.context_len = 0
        self.max_req_input_len = 0

        self._send_ctx = shared_context(1)
        self.send_to_scheduler = self._send_ctx.socket(zmq.PUSH)
        self.send_to_scheduler.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self.send_to_scheduler.bind(port_args.scheduler_input_ipc_name)
        self._recv_ctx = shared_async_context(1)
        self.recv_from_detokenizer = self._recv_ctx.socket(zmq.PULL)
        self.recv_from_detokenizer.bind(port_args.tokenizer_ipc_name)
        # The same socket without asyncio's futures: drains what is already queued, cheaply.
        self._drain_from_detokenizer = zmq.Socket.shadow(self.recv_from_detokenizer.underlying)

        self.rid_to_state: dict[str, ReqState] = {}
        self.metrics = MetricsCollector(server_args.served_model_name) if server_args.enable_metrics else None
        self.dead_reason: Optional[str] = None
        self._sample_group_ranks = itertools.cycle(range(server_args.dp_size))  # DP rank of each n > 1 group
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._handle_task: Optional[asyncio.Task] = None
        self._collectors: dict[type, _ReplyCollector] = {
            FlushCacheReqOutput: _ReplyCollector(server_args.dp_size),
            GetInternalStateReqOutput: _ReplyCollector(server_args.dp_size),
            ProfileReqOutput: _ReplyCollector(server_args.dp_size),
        }

    def set_scheduler_info(self, ready: SchedulerReady) -> None:
        self.context_len = ready.context_len
        self.max_req_input_len = ready.max_req_input_len

    # ------------------------------------------------------------------ requests
    async def generate_request(self, obj: GenerateReqInput, request=None) -> AsyncIterator[dict[str, Any]]:
        """Yield output dicts: every snapshot when streaming, else only the final one.
        A batch yields one list of final outputs. `request` is the HTTP request (to
        notice a client that went away)."""
        self._ensure_handle_loop()
        if self.dead_reason is not None:
            raise RequestError(f"The server is not healthy: {self.dead_reason}", 503)
        singles = obj.split()
        if obj.is_batch and obj.stream:
            raise RequestError("stream=True is not supported for a batch of prompts")
        tokenized = [await self._tokenize_one(o) for o in singles]  # all validated before any is sent
        if len({t.rid for t in tokenized}) != len(tokenized):
            raise RequestError("Duplicate rid in the batch")
        if any(t.sampling_params.n > 1 for t in tokenized):
            if obj.stream:  # each sample's snapshots, marked with its "index", as they come
                samples = await self._samples(tokenized[0], singles[0], request)
                streams = [self._run_one(t, singles[0], request) for t in samples]
                async with contextlib.aclosing(merge_streams(streams)) as outputs:
                    async for i, out in outputs:
                        yield {**out, "index": i}
                return
            groups = await asyncio.gather(*(self._sample_outputs(t, o, request) for t, o in zip(tokenized, singles)))
            yield [out for group in groups for out in group]  # prompt-major: prompt i's samples at i*n ..
            return
        if not obj.is_batch:
            # aclosing: closing this generator must close (and so abort) the request at once.
            async with contextlib.aclosing(self._run_one(tokenized[0], singles[0], request)) as outputs:
                async for out in outputs:
                    yield out
            return
        results = await asyncio.gather(*(final_output(self._run_one(t, o, request)) for t, o in zip(tokenized, singles)))
        yield list(results)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. A long text is tokenized on a worker thread, so that the event
        loop goes on serving other requests (and /health) meanwhile."""
        if len(text) <= _INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self._encode_long, text, add_special_tokens)

    def _encode_long(self, text: str, add_special_tokens: bool) -> list[int]:
        """A Rust tokenizer's encode_batch releases the GIL (encode does not), and a text too
        long for any request is refused before its ids become a Python list (which would hold
        the GIL for as long as the list takes to build: 0.7 s for 10 MB)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        (encoding,) = backend.encode_batch([text], add_special_tokens=add_special_tokens)  # what encode runs
        self.check_input_len(len(encoding))
        return encoding.ids

    def check_input_len(self, n: int) -> None:
        if n > self.max_req_input_len:
            raise RequestError(
                f"The input ({n} tokens) is longer than the model's context length allows "
                f"({self.max_req_input_len} input tokens, context length {self.context_len})"
            )

    async def _tokenize_one(self, obj: GenerateReqInput) -> TokenizedGenerateReqInput:
        if (obj.text is None) == (obj.input_ids is None):
            raise RequestError("Exactly one of text and input_ids must be given")
        if self.tokenizer is None:
            self._check_token_ids_only(obj)
        if obj.text is not None:
            if not obj.text:
                raise RequestError("The prompt is empty")
            input_ids = await self.encode(obj.text)
        else:
            input_ids = list(obj.input_ids)
            if not input_ids:
                raise RequestError("input_ids is empty")
            bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"input_ids contains token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        n = len(input_ids)
        self.check_input_len(n)
        params_dict = dict(obj.sampling_params or {})
        if "max_new_tokens" in params_dict and params_dict["max_new_tokens"] is None:
            params_dict["max_new_tokens"] = self.context_len - n  # "until the context is full"
        try:
            params = SamplingParams.from_dict(params_dict)
            params.verify(self.vocab_size)
        except (TypeError, ValueError) as e:
            raise RequestError(f"Invalid sampling_params: {e}") from None
        if "max_new_tokens" in params_dict and n + params.max_new_tokens > self.context_len:
            raise RequestError(
                f"Requested {n} prompt tokens + {params.max_new_tokens} max_new_tokens exceeds "
                f"the model's context length of {self.context_len} tokens"
            )
        if not 0 <= obj.top_logprobs_num <= self.vocab_size:
            raise RequestError(f"top_logprobs_num must be in [0, {self.vocab_size}], got {obj.top_logprobs_num}")
        if not -1 <= obj.logprob_start_len < n:
            raise RequestError(f"logprob_start_len must be -1 or in [0, {n}) for {n} prompt tokens, got {obj.logprob_start_len}")
        rid = obj.rid or uuid.uuid4().hex
        if rid in self.rid_to_state:
            raise RequestError(f"A request with rid {rid!r} is already running")
        return TokenizedGenerateReqInput(
            rid=rid,
            input_text=obj.text,
            input_ids=input_ids,
            sampling_params=params,
            stream=obj.stream,
            return_logprob=obj.return_logprob,
            top_logprobs_num=obj.top_logprobs_num if obj.return_logprob else 0,
            logprob_start_len=obj.logprob_start_len,
        )

    @staticmethod
    def _check_token_ids_only(obj: GenerateReqInput) -> None:
        """Under --skip-tokenizer-init nothing can be encoded or decoded."""
        needs = [
            name
            for name, used in (
                ("text", obj.text is not None),
                ("sampling_params.stop", bool((obj.sampling_params or {}).get("stop"))),
                ("return_text_in_logprobs", obj.return_text_in_logprobs),
            )
            if used
        ]
        if needs:
            raise RequestError(f"{needs[0]} needs a tokenizer; this server runs with --skip-tokenizer-init: send input_ids")

    async def _sample_outputs(self, req: TokenizedGenerateReqInput, obj: GenerateReqInput, request) -> list[Any]:
        """The final outputs of the `n` samples of one prompt."""
        samples = await self._samples(req, obj, request)
        return list(await asyncio.gather(*(final_output(self._run_one(s, obj, request)) for s in samples)))

    async def _samples(self, req: TokenizedGenerateReqInput, obj: GenerateReqInput, request) -> list[TokenizedGenerateReqInput]:
        """The `n` single-sample requests of one prompt, to send. The prompt is prefilled once
        first (a request of 0 new tokens) so that its KV is in the prefix cache when the samples
        start; all of them go to one DP rank, whose cache holds it."""
        params, n = req.sampling_params, req.sampling_params.n
        dp_rank = next(self._sample_group_ranks) if self.server_args.dp_size > 1 else None
        if n > 1 and not self.server_args.disable_radix_cache:
            prefill = replace(
                req,
                rid=f"{req.rid}-prefill",
                return_logprob=False,
                top_logprobs_num=0,
                dp_rank=dp_rank,
                sampling_params=replace(params, max_new_tokens=0, min_new_tokens=0, n=1),
            )
            await final_output(self._run_one(prefill, obj, request))
        seed = params.sampling_seed
        return [
            replace(
                req,
                rid=f"{req.rid}-{i}" if n > 1 else req.rid,
                dp_rank=dp_rank,
                sampling_params=replace(params, n=1, sampling_seed=None if seed is None else seed + i),
            )
            for i in range(n)
        ]

    async def _run_one(self, req: TokenizedGenerateReqInput, obj: GenerateReqInput, request) -> AsyncIterator[dict]:
        state = ReqState(obj.stream, list(req.sampling_params.stop), obj.return_text_in_logprobs)
        if req.rid in self.rid_to_state:  # checked again: another request may have taken it while this one was tokenized
            raise RequestError(f"A request with rid {req.rid!r} is already running")
        self.rid_to_state[req.rid] = state
        if self.server_args.log_requests:
            logger.info("Request %s: %d prompt tokens, %s", req.rid, len(req.input_ids), req.sampling_params)
        if not self._send_to_scheduler(req):
            state.error = "The scheduler is not reachable"
            state.event.set()
        streaming = False  # set once a chunk went out: then a gone client cancels or closes the stream
        try:
            while True:
                if request is None or streaming:
                    await state.event.wait()
                elif not await self._wait_or_gone(state, request):
                    logger.info("Client of request %s disconnected; aborting it", req.rid)
                    return
                state.event.clear()
                if state.error is not None:
                    raise RequestError(state.error, 503)
                if state.finished:
                    reason = state.meta["finish_reason"]
                    if self.server_args.log_requests:
                        meta = state.meta
                        logger.info(
                            "Finished %s: finish_reason=%s, prompt_tokens=%d, completion_tokens=%d, latency=%.3f s",
                            req.rid,
                            reason,
                            meta["prompt_tokens"],
                            meta["completion_tokens"],
                            meta["e2e_latency"],
                        )
                    if reason.get("type") == "abort" and reason.get("message"):
                        # Refused by the scheduler (400), or failed there (status_code, e.g. NaN logits).
                        raise RequestError(reason["message"], reason.get("status_code", 400))
                    yield state.snapshot()
                    return
                if state.stream:
                    streaming = True
                    yield state.snapshot()
        finally:
            if not state.finished:
                self.abort_request(req.rid)
            self.rid_to_state.pop(req.rid, None)

    @staticmethod
    async def _wait_or_gone(state: ReqState, request) -> bool:
        """Wait for the request's next output, checking every _DISCONNECT_POLL_S whether its
        HTTP client went away (False then). Until a first chunk is sent nothing would fail on
        a closed connection, so this polling is how a queued or non-streamed request notices."""
        while True:
            try:
                await asyncio.wait_for(state.event.wait(), _DISCONNECT_POLL_S)
                return True
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return False

    def _send_to_scheduler(self, msg) -> bool:
        """Bounded: a PUSH socket whose peer has died would otherwise block the event loop forever."""
        if self.dead_reason is not None:
            return False
        try:
            self.send_to_scheduler.send_pyobj(msg)
            return True
        except zmq.Again:
            logger.warning("Could not send %s: the scheduler is not reachable", type(msg).__name__)
            return False

    def abort_request(self, rid: str) -> None:
        if self.rid_to_state.pop(rid, None) is not None:
            logger.info("Aborted request %s", rid)
            if self.metrics is not None:
                self.metrics.num_aborted_requests.inc()
            self._send_to_scheduler(AbortReq(rid))

    # ------------------------------------------------------------------ control
    async def flush_cache(self) -> bool:
        self._ensure_handle_loop()
        replies = await self._collectors[FlushCacheReqOutput].request(self._send_to_scheduler, FlushCacheReq())
        return all(r.success for r in replies)

    async def get_internal_state(self) -> list[dict[str, Any]]:
        """One dict per DP rank, ordered by dp_rank."""
        self._ensure_handle_loop()
        collector = self._collectors[GetInternalStateReqOutput]
        replies = await collector.request(self._send_to_scheduler, GetInternalStateReq())
        return sorted((r.internal_state for r in replies), key=lambda s: s.get("dp_rank", 0))

    async def profile(self, req: ProfileReq) -> tuple[bool, str]:
        """Start or stop the torch profiler on every rank; fails if any DP rank refused."""
        self._ensure_handle_loop()
        replies = await self._collectors[ProfileReqOutput].request(self._send_to_scheduler, req)
        failed = [r.message for r in replies if not r.success]
        return (False, failed[0]) if failed else (True, replies[0].message)

    def mark_dead(self, reason: str) -> None:
        """A subprocess died: fail every waiting request and refuse new ones. Thread-safe."""
        self.dead_reason = reason
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, reason)

    def _fail_all(self, reason: str) -> None:
        for state in self.rid_to_state.values():
            state.error = reason
            state.event.set()

    def close(self) -> None:
        """Release the sockets; call when the loop is not running (after serving)."""
        self.rid_to_state.clear()  # requests finalized later must not send on closed sockets
        task, loop = self._handle_task, self._loop
        if task is not None and not task.done() and not loop.is_closed() and not loop.is_running():
            task.cancel()
            loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        self.send_to_scheduler.close(linger=0)
        self.recv_from_detokenizer.close(linger=0)

    # ------------------------------------------------------------------ receiving
    def _ensure_handle_loop(self) -> None:
        if self._handle_task is None:
            self._loop = asyncio.get_running_loop()
            self._handle_task = self._loop.create_task(self._handle_loop())

    async def _handle_loop(self) -> None:
        while True:
            for recv in await self._recv_queued():
                self._handle_message(recv)

    async def _recv_queued(self) -> list[Any]:
        """The next message and every one queued behind it (up to _MAX_DRAINED). All of them
        are handled before any consumer runs, so a consumer that fell behind the schedulers
        takes the outputs gathered meanwhile as one chunk: under load the HTTP process writes
        fewer, larger chunks instead of falling further behind."""
        msgs = [await self.recv_from_detokenizer.recv_pyobj()]
        while len(msgs) < _MAX_DRAINED:
            try:
                msgs.append(self._drain_from_detokenizer.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                break
        return msgs

    def _handle_message(self, recv: Any) -> None:
        if isinstance(recv, BatchStrOut):
            self._handle_batch_str_out(recv)
        elif type(recv) in self._collectors:
            self._collectors[type(recv)].add(recv)
        else:
            logger.error("TokenizerManager got an unknown message: %r", type(recv))

    def _handle_batch_str_out(self, recv: BatchStrOut) -> None:
        for i, rid in enumerate(recv.rids):
            state = self.rid_to_state.get(rid)
            if state is None:  # aborted or already finished
                continue
            finished_reason = recv.finished_reasons[i]
            if recv.output_offsets[i] != len(state.output_ids):  # messages of a request arrive in order
                logger.error("Request %s: outputs from %d, but %d seen", rid, recv.output_offsets[i], len(state.output_ids))
            # A finished request's message carries its whole text (the matched stop trimmed).
            state.text = recv.output_strs[i] if finished_reason is not None else state.text + recv.output_strs[i]
            state.output_ids[recv.output_offsets[i] :] = recv.output_ids[i]
            meta: dict[str, Any] = {
                "id": rid,
                "finish_reason": finished_reason,
                "prompt_tokens": recv.prompt_tokens[i],
                "completion_tokens": recv.completion_tokens[i],
                "cached_tokens": recv.cached_tokens[i],
                "e2e_latency": time.monotonic() - state.created,
            }
            if recv.output_token_logprobs and recv.output_token_logprobs[i] is not None:
                if state.token_logprobs is None:
                    state.token_logprobs, state.top_logprobs = [], []
                state.token_logprobs += self._logprob_triples(recv.output_token_logprobs[i], state)
                tops = recv.output_top_logprobs[i] if recv.output_top_logprobs else None
                state.top_logprobs += [self._logprob_triples(t, state) for t in (tops or [])]
            if recv.input_token_logprobs and recv.input_token_logprobs[i] is not None:
                state.input_token_logprobs = self._logprob_triples(recv.input_token_logprobs[i], state)
                tops = recv.input_top_logprobs[i]
                state.input_top_logprobs = [t if t is None else self._logprob_triples(t, state) for t in tops]
            if self.server_args.speculative_algorithm is not None and recv.spec_verify_ct:
                meta["spec_verify_ct"] = recv.spec_verify_ct[i]
            if self.metrics is not None:
                self.metrics.on_output(state, meta)
            state.meta = meta
            state.finished = finished_reason is not None
            if state.stream or state.finished:  # a non-streaming consumer wants the end alone
                state.event.set()

    def _logprob_triples(self, pairs: list[tuple[float, int]], state: ReqState) -> list[tuple[float, int, Optional[str]]]:
        """SGLang's (logprob, token_id, token_text or None) triples."""
        if not state.return_text_in_logprobs:
            return [(lp, tid, None) for lp, tid in pairs]
        return [(lp, tid, self.tokenizer.decode([tid])) for lp, tid in pairs]
