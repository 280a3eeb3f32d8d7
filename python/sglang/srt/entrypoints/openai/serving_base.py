"""What the OpenAI completions and chat endpoints share: model check, errors, SSE, finish reasons."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any, Optional

import orjson
from fastapi.responses import JSONResponse, StreamingResponse

from sglang.srt.entrypoints.openai.protocol import UsageInfo, error_body
from sglang.srt.managers.tokenizer_manager import GenerateReqInput, RequestError, TokenizerManager


def error_response(message: str, status_code: int = 400, err_type: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, err_type), status_code=status_code)


def sse(payload: Any) -> bytes:
    """One server-sent event. orjson: the encoding is a large share of the HTTP process's
    time per streamed token (the /generate chunks repeat the output so far)."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body however the response ends. When the client goes away Starlette
    cancels the send and leaves the body suspended at a yield; only closing it aborts the
    request at once (left to garbage collection, the request would run to its end)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def sse_response(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Stream `chunks` as server-sent events ending with [DONE]; an error after the
    stream started is sent as one error event."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield sse(chunk)
        except RequestError as e:
            yield sse(error_body(str(e), e.status_code))
        yield b"data: [DONE]\n\n"

    return ClosingStreamingResponse(body(), media_type="text/event-stream")


async def start_stream(outputs: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """Pull the first output now, so that validation errors become a plain HTTP error
    response instead of an event inside a 200 stream. A client gone before the first output
    gets a 499 (the outputs end without one)."""
    try:
        first = await outputs.__anext__()
    except StopAsyncIteration:
        raise RequestError("Client disconnected", 499) from None

    async def rest() -> AsyncIterator[dict[str, Any]]:
        async with contextlib.aclosing(outputs):
            yield first
            async for out in outputs:
                yield out

    return rest()


def finish_reason(meta: dict[str, Any]) -> tuple[Optional[str], Any]:
    """OpenAI finish_reason and the matched stop (string or token id) of an output."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None, None
    return reason["type"], reason.get("matched")


def usage(outputs: list[dict[str, Any]], n: int = 1) -> UsageInfo:
    """Token counts of the outputs: prompt i's n samples (outputs i*n ..) count its prompt once."""
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outputs[::n])
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class StreamedChoices:
    """Per choice of a stream (a sample's "index", 0 without one): how much of its text and of
    its output logprobs the chunks sent so far carry, and its latest output."""

    def __init__(self) -> None:
        self.sent: dict[int, tuple[int, int]] = {}
        self.latest: dict[int, dict[str, Any]] = {}

    def receive(self, out: dict[str, Any]) -> tuple[int, int, int]:
        """The output's choice index, and the text length and logprob count sent for it so far."""
        index = out.get("index", 0)
        self.latest[index] = out
        return (index, *self.sent.get(index, (0, 0)))

    def mark_sent(self, index: int, out: dict[str, Any]) -> None:
        self.sent[index] = len(out["text"]), len(out["meta_info"].get("output_token_logprobs", []))

    def usage(self, n: int) -> UsageInfo:
        """Every choice's tokens, the prompt counted once."""
        return usage([self.latest[i] for i in sorted(self.latest)], n)


class OpenAIServingBase:
    def __init__(self, tokenizer_manager: TokenizerManager):
        self.tm = tokenizer_manager
        args = tokenizer_manager.server_args
        self.model_names = {args.served_model_name, args.model_path}
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_token)

    def _decode_token(self, token_id: int) -> str:
        return self.tm.tokenizer.decode([token_id])

    def check_model(self, model: str) -> None:
        if self.tm.tokenizer is None:
            raise RequestError(
                "The OpenAI endpoints need a tokenizer; this server runs with --skip-tokenizer-init: use /generate with input_ids"
            )
        if model not in self.model_names:
            raise RequestError(
                f"The model {model!r} does not exist; this server serves {self.tm.server_args.served_model_name!r}", 404
            )

    def generate(self, obj: GenerateReqInput, raw_request) -> AsyncIterator[Any]:
        # raw_request is polled until a first chunk goes out; then a gone client cancels the stream.
        return self.tm.generate_request(obj, raw_request)
