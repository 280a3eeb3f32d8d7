"""A scheduler stand-in for testing the TokenizerManager, the detokenizer logic and the HTTP
layer without a model: a thread that answers every request with a fixed reply.

It speaks the real ZMQ protocol (io_struct messages) and runs the real
IncrementalDetokenizer, so everything above the scheduler is exercised as in production.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import zmq

from sglang.srt.managers.detokenizer_manager import IncrementalDetokenizer
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    ProfileReq,
    ProfileReqOutput,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.scheduler_profiler import SchedulerProfiler
from sglang.srt.server_args import PortArgs
from sglang.srt.utils.zmq_utils import shared_context

MAX_TOTAL_TOKENS = 1000
STREAM_STEP_S = 0.005


@dataclass
class FakeScheduler:
    """Replies with `reply` (one token per step) then EOS; honours max_new_tokens and stop strings.

    `hold` keeps requests unfinished until released (to test aborts)."""

    port_args: PortArgs
    tokenizer: object
    reply: str = "Hello, 世界!"
    hold: bool = False
    received: list[TokenizedGenerateReqInput] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    _sent: dict[str, int] = field(default_factory=dict)  # output ids already sent, per request

    def __post_init__(self) -> None:
        self._ctx = shared_context(1)
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.connect(self.port_args.scheduler_input_ipc_name)
        self._send = self._ctx.socket(zmq.PUSH)
        self._send.connect(self.port_args.tokenizer_ipc_name)
        self._detok = IncrementalDetokenizer(self.tokenizer)
        self.profiler = SchedulerProfiler("TP0")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._recv.close(linger=0)
        self._send.close(linger=0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._recv.poll(50):
                continue
            msg = self._recv.recv_pyobj()
            if isinstance(msg, TokenizedGenerateReqInput):
                self.received.append(msg)
                if not self.hold:
                    self._generate(msg)
            elif isinstance(msg, AbortReq):
                self.aborted.append(msg.rid)
            elif isinstance(msg, FlushCacheReq):
                self._send.send_pyobj(FlushCacheReqOutput(True))
            elif isinstance(msg, ProfileReq):
                self._send.send_pyobj(ProfileReqOutput(*self.profiler.handle(msg)))
            elif isinstance(msg, GetInternalStateReq):
                state = {
                    "dp_rank": 0,
                    "avg_spec_accept_length": None,
                    "max_total_num_tokens": MAX_TOTAL_TOKENS,
                    "available_kv_tokens": MAX_TOTAL_TOKENS,
                    "last_gen_throughput": 0.0,
                }
                self._send.send_pyobj(GetInternalStateReqOutput(state))

    def _generate(self, req: TokenizedGenerateReqInput) -> None:
        params = req.sampling_params
        eos = self.tokenizer.eos_token_id
        tokens = self.tokenizer.encode(self.reply, add_special_tokens=False) + [eos]
        out: list[int] = []
        finished: Optional[dict] = None
        if params.max_new_tokens == 0:
            self._emit(req, out, {"type": "length", "length": 0})
            return
        while finished is None:
            out.append(tokens[len(out)])
            text = self.tokenizer.decode(out)
            matched = next((s for s in params.stop if s in text), None)
            if out[-1] == eos:
                finished = {"type": "stop", "matched": eos}
            elif matched is not None:
                finished = {"type": "stop", "matched": matched}
            elif len(out) >= params.max_new_tokens:
                finished = {"type": "length", "length": len(out)}
            if req.stream or finished is not None:
                self._emit(req, out, finished)
            if req.stream:
                time.sleep(STREAM_STEP_S)  # lets the consumer see separate chunks

    def _emit(self, req: TokenizedGenerateReqInput, out: list[int], finished: Optional[dict]) -> None:
        """Send the outputs new since the request's previous message (as the scheduler does)."""
        start = self._sent.get(req.rid, 0)
        self._sent[req.rid] = len(out)
        new = out[start:]
        logprobs = [(-0.5, t) for t in new] if req.return_logprob else None
        tops = [[(-0.5, t), (-1.5, 0)][: req.top_logprobs_num] for t in new] if req.return_logprob else None
        p = req.sampling_params
        batch = BatchTokenIDOut(
            rids=[req.rid],
            output_ids=[new],
            output_offsets=[start],
            finished_reasons=[finished],
            prompt_tokens=[len(req.input_ids)],
            completion_tokens=[len(out)],
            cached_tokens=[0],
            skip_special_tokens=[p.skip_special_tokens],
            spaces_between_special_tokens=[p.spaces_between_special_tokens],
            no_stop_trim=[p.no_stop_trim],
            output_token_logprobs=[logprobs],
            output_top_logprobs=[tops],
            input_token_logprobs=[self._input_logprobs(req) if req.return_logprob and not start else None],
            input_top_logprobs=[self._input_top_logprobs(req) if req.return_logprob and not start else None],
            spec_verify_ct=[0],
        )
        self._send.send_pyobj(self._detok.handle(batch))

    @staticmethod
    def _input_ids_from_start(req: TokenizedGenerateReqInput) -> list[int]:
        start = len(req.input_ids) - 1 if req.logprob_start_len == -1 else req.logprob_start_len
        return req.input_ids[start:]

    def _input_logprobs(self, req: TokenizedGenerateReqInput) -> list[tuple[Optional[float], int]]:
        """As the scheduler sends them: the first prompt token from the start without a logprob."""
        first, *rest = self._input_ids_from_start(req)
        return [(None, first)] + [(-0.25, t) for t in rest]

    def _input_top_logprobs(self, req: TokenizedGenerateReqInput) -> list[Optional[list[tuple[float, int]]]]:
        if not req.top_logprobs_num:
            return []
        return [None] + [[(-0.25, t), (-1.25, 0)][: req.top_logprobs_num] for t in self._input_ids_from_start(req)[1:]]
