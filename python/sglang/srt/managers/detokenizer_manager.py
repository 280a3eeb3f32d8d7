"""The detokenizer process: BatchTokenIDOut (new token ids) -> BatchStrOut (new text).

Decoding is incremental: for each request we keep its output ids so far, the text already
confirmed and two offsets into the ids; every step decodes only a short window, so the cost
per token stays constant, and a window whose text ends in an incomplete UTF-8 character
('\ufffd') is held back until the next token completes it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import zmq

from sglang.srt.managers.io_struct import BatchStrOut, BatchTokenIDOut
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.utils.zmq_utils import shared_context

logger = logging.getLogger(__name__)

# Requests whose finish we never saw (e.g. lost on a crash) must not grow the table forever.
_MAX_TRACKED_REQUESTS = 1 << 16
_REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DecodeState:
    ids: list[int] = field(default_factory=list)  # the request's output ids so far
    text: str = ""  # confirmed text of ids[:read_offset]
    surr_offset: int = 0  # start of the context window decoded together with new ids
    read_offset: int = 0  # ids before this offset are in `text`


def trim_matched_stop(text: str, finished_reason: Optional[dict[str, Any]], no_stop_trim: bool) -> str:
    """Cut a finished request's text before the stop string it matched."""
    if no_stop_trim or not finished_reason or finished_reason.get("type") != "stop":
        return text
    matched = finished_reason.get("matched")
    if isinstance(matched, str):
        pos = text.find(matched)
        if pos != -1:
            return text[:pos]
    return text


class WindowDecoder:
    """Decodes one window of ids. A tokenizer backed by the `tokenizers` library decodes
    through its Rust backend directly when its decode is exactly the backend's (no clean-up of
    tokenization spaces, which transformers applies in Python afterwards;
    spaces_between_special_tokens only changes Python tokenizers): a third of transformers'
    per-call cost. Not the backend's decode_batch: it spreads a batch over a thread pool whose
    threads cost more CPU than the decoding they share."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.backend = backend if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False) else None

    def decode(self, ids: list[int], skip_special_tokens: bool, spaces_between_special_tokens: bool) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens
        )


class IncrementalDetokenizer:
    """Per-request incremental decoding of the new ids each message brings."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoder = WindowDecoder(tokenizer) if tokenizer is not None else None
        self.states: OrderedDict[str, DecodeState] = OrderedDict()

    def step(
        self,
        rid: str,
        new_ids: list[int],
        offset: int,
        finished_reason: Optional[dict[str, Any]],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        no_stop_trim: bool = False,
    ) -> str:
        """new_ids: the request's output ids from position `offset` on. Returns the text they
        complete (the whole text once finished)."""
        finished = finished_reason is not None
        state = self.states.pop(rid, None) or DecodeState()
        if offset != len(state.ids):  # messages of one request arrive in order, from one scheduler
            logger.error("Request %s: output ids from %d, but %d seen", rid, offset, len(state.ids))
        state.ids[offset:] = new_ids
        ids = state.ids
        if finished and not no_stop_trim and isinstance((finished_reason or {}).get("matched"), int):
            ids = ids[:-1]  # a matched stop token is not part of the text
        options = (skip_special_tokens, spaces_between_special_tokens)
        prefix = self.decoder.decode(ids[state.surr_offset : state.read_offset], *options)
        window = self.decoder.decode(ids[state.surr_offset :], *options)
        new_text = window[len(prefix) :]
        if finished:
            return trim_matched_stop(state.text + new_text, finished_reason, no_stop_trim)
        confirmed = ""
        if new_text and not new_text.endswith(_REPLACEMENT_CHAR):
            confirmed = new_text
            state.text, state.surr_offset, state.read_offset = state.text + new_text, state.read_offset, len(ids)
        self.states[rid] = state
        while len(self.states) > _MAX_TRACKED_REQUESTS:
            self.states.popitem(last=False)
        return confirmed

    def handle(self, recv: BatchTokenIDOut) -> BatchStrOut:
        if self.tokenizer is None:  # --skip-tokenizer-init: token ids only
            texts = [""] * len(recv.rids)
        else:
            texts = [
                self.step(
                    rid,
                    recv.output_ids[i],
                    recv.output_offsets[i],
                    recv.finished_reasons[i],
                    recv.skip_special_tokens[i],
                    recv.spaces_between_special_tokens[i],
                    recv.no_stop_trim[i],
                )
                for i, rid in enumerate(recv.rids)
            ]
        return BatchStrOut(output_strs=texts, **recv.batch_out_fields())


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs) -> None:
    from sglang.srt.utils.hf_transformers_utils import get_server_tokenizer
    from sglang.srt.utils.process import watch_parent

    watch_parent()
    logging.basicConfig(level=server_args.log_level.upper(), format="[%(asctime)s Detokenizer] %(message)s")
    detokenizer = IncrementalDetokenizer(get_server_tokenizer(server_args))
    ctx = shared_context(2)
    recv_from_scheduler = ctx.socket(zmq.PULL)
    recv_from_scheduler.bind(port_args.detokenizer_ipc_name)
    send_to_tokenizer = ctx.socket(zmq.PUSH)
    send_to_tokenizer.connect(port_args.tokenizer_ipc_name)
    while True:
        recv = recv_from_scheduler.recv_pyobj()
        if isinstance(recv, BatchTokenIDOut):
            send_to_tokenizer.send_pyobj(detokenizer.handle(recv))
        else:
            logger.error("Detokenizer got an unknown message: %r", type(recv))
