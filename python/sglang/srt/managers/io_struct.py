"""Typed messages exchanged over ZMQ between the processes (pickled dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from sglang.srt.sampling.sampling_params import SamplingParams


@dataclass
class TokenizedGenerateReqInput:
    """TokenizerManager -> (DataParallelController ->) Scheduler."""

    rid: str
    input_text: Optional[str]
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # -1: output logprobs only
    # Set by the DataParallelController when it dispatches to a DP rank.
    dp_rank: Optional[int] = None


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool


@dataclass
class ProfileReq:
    """Start or stop the torch profiler on every rank."""

    action: str  # "start" or "stop"
    output_dir: Optional[str] = None
    num_steps: Optional[int] = None  # stop by itself after this many forward iterations
    activities: Optional[list[str]] = None  # "CPU" and/or "GPU" (default both)


@dataclass
class ProfileReqOutput:
    success: bool
    message: str


@dataclass
class GetInternalStateReq:
    pass


@dataclass
class GetInternalStateReqOutput:
    """One per DP rank: dp_rank, avg_spec_accept_length, max_total_num_tokens, ..."""

    internal_state: dict[str, Any]


@dataclass(kw_only=True)
class BatchOut:
    """What both output messages carry per request (every list aligns with rids): the token
    ids generated since its previous message, which start at its output position
    output_offsets[i] (every message carries only what is new, so a long stream costs the
    same per token as a short one), its usage counts and logprobs."""

    rids: list[str]
    output_ids: list[list[int]]
    output_offsets: list[int]
    finished_reasons: list[Optional[dict[str, Any]]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    # Per request: list of (logprob, token_id) for each new token, and top logprobs.
    output_token_logprobs: list[Optional[list[tuple[float, int]]]] = field(default_factory=list)
    output_top_logprobs: list[Optional[list[list[tuple[float, int]]]]] = field(default_factory=list)
    # Per request, in its first message only (else None): SGLang's input_token_logprobs
    # ((logprob or None, token id) from logprob_start_len on) and input_top_logprobs.
    input_token_logprobs: list[Optional[list[tuple[Optional[float], int]]]] = field(default_factory=list)
    input_top_logprobs: list[Optional[list[Optional[list[tuple[float, int]]]]]] = field(default_factory=list)
    spec_verify_ct: list[int] = field(default_factory=list)

    def batch_out_fields(self) -> dict[str, Any]:
        """This message's BatchOut fields by name (the same objects, not copies)."""
        return {f.name: getattr(self, f.name) for f in fields(BatchOut)}


@dataclass(kw_only=True)
class BatchTokenIDOut(BatchOut):
    """Scheduler -> DetokenizerManager: new tokens of every request that advanced, with the
    request's detokenization options."""

    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]


@dataclass(kw_only=True)
class BatchStrOut(BatchOut):
    """DetokenizerManager -> TokenizerManager, per request: the text decoded since its previous
    message (a finished request: its whole text, the matched stop trimmed), and the new ids
    and logprobs as in BatchTokenIDOut."""

    output_strs: list[str]


@dataclass
class DecodeIterationTime:
    """Entry rank -> its attention-TP peers, with the requests it broadcasts: the wall time of
    the previous iteration, which ran a decode cycle and nothing else (--speculative-adaptive
    measures its tiers' costs with it, the same value on every rank)."""

    us: int


@dataclass
class SchedulerReady:
    """Scheduler -> launcher at startup: capacity figures for /get_server_info."""

    dp_rank: int
    tp_rank: int
    max_total_num_tokens: int
    max_req_input_len: int
    context_len: int
    error: Optional[str] = None
