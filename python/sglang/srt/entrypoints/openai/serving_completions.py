"""POST /v1/completions."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Optional

from fastapi.responses import JSONResponse, Response

from sglang.srt.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from sglang.srt.entrypoints.openai.serving_base import (
    OpenAIServingBase,
    StreamedChoices,
    error_response,
    finish_reason,
    sse_response,
    start_stream,
    usage,
)
from sglang.srt.managers.tokenizer_manager import GenerateReqInput, RequestError, final_output


class OpenAIServingCompletion(OpenAIServingBase):
    async def handle(self, request: CompletionRequest, raw_request) -> Response:
        self.check_model(request.model)
        if request.suffix:
            raise RequestError("suffix is not supported")
        if request.best_of not in (None, 1):
            raise RequestError("best_of must be 1")
        obj = self._to_generate_input(request)
        if request.stream:
            if obj.is_batch:
                raise RequestError("stream=True is not supported with several prompts")
            outputs = await start_stream(self.generate(obj, raw_request))
            return sse_response(self._stream_chunks(request, outputs))
        result = await final_output(self.generate(obj, raw_request))
        if result is None:
            return error_response("Client disconnected", 499)
        outputs = result if isinstance(result, list) else [result]  # prompt-major, n samples each
        choices = []
        for i, out in enumerate(outputs):
            reason, matched = finish_reason(out["meta_info"])
            echo = self._echo_prefix(request, i // request.n)
            logprobs = self._logprobs(request, out["meta_info"], 0, len(echo), request.echo)
            choices.append(
                CompletionChoice(index=i, text=echo + out["text"], logprobs=logprobs, finish_reason=reason, matched_stop=matched)
            )
        response = CompletionResponse(model=request.model, choices=choices, usage=usage(outputs, request.n))
        return JSONResponse(response.model_dump())

    def _to_generate_input(self, request: CompletionRequest) -> GenerateReqInput:
        prompt = request.prompt
        is_ids = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], str)
        return GenerateReqInput(
            text=None if is_ids else prompt,
            input_ids=prompt if is_ids else None,
            sampling_params=request.sampling_params(request.max_tokens, request.min_tokens),
            stream=request.stream,
            return_logprob=request.logprobs is not None,
            # echo: the prompt's logprobs too, from its first token
            logprob_start_len=0 if request.echo and request.logprobs is not None else -1,
            top_logprobs_num=request.logprobs or 0,
        )

    def _echo_prefix(self, request: CompletionRequest, index: int) -> str:
        if not request.echo:
            return ""
        prompt = request.prompt
        if isinstance(prompt, str):
            return prompt
        item = prompt[index] if isinstance(prompt[0], (str, list)) else prompt
        return item if isinstance(item, str) else self.tm.tokenizer.decode(item)

    def _logprobs(
        self, request: CompletionRequest, meta: dict[str, Any], start: int, offset: int, with_prompt: bool
    ) -> Optional[CompletionLogprobs]:
        """Logprobs of output tokens [start:], text offsets counted from `offset` (None unless
        asked for); with_prompt (echo): the prompt tokens' first, their offsets counted from 0."""
        if request.logprobs is None:
            return None
        out = CompletionLogprobs()
        if with_prompt:
            self._append_logprobs(out, meta["input_token_logprobs"], meta["input_top_logprobs"], 0)
        self._append_logprobs(out, meta["output_token_logprobs"][start:], meta["output_top_logprobs"][start:], offset)
        return out

    def _append_logprobs(self, out: CompletionLogprobs, tokens: list, tops: list, offset: int) -> None:
        """(logprob, id, text) triples and their top logprobs (an entry None: none), text offsets from `offset`."""
        for k, (lp, tid, _) in enumerate(tokens):
            text = self.token_text(tid)
            out.tokens.append(text)
            out.token_logprobs.append(lp)
            out.text_offset.append(offset)
            offset += len(text)
            if k < len(tops):
                out.top_logprobs.append(None if tops[k] is None else self._top_by_text(tops[k]))

    def _top_by_text(self, top: list) -> dict[str, float]:
        """Top logprobs (largest first) keyed by token text: of tokens with the same text, the largest."""
        by_text: dict[str, float] = {}
        for v, t, _ in top:
            by_text.setdefault(self.token_text(t), v)
        return by_text

    async def _stream_chunks(self, request: CompletionRequest, outputs: AsyncIterator[dict]) -> AsyncIterator[dict]:
        """Chunks of every choice (n > 1: each sample's, with its index); the echo and the
        prompt's logprobs go with a choice's first chunk."""
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo = self._echo_prefix(request, 0)
        choices = StreamedChoices()

        def chunk(items: list[dict], **extra) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": request.model, "choices": items, **extra}

        async with contextlib.aclosing(outputs):  # closing the stream aborts the request
            async for out in outputs:
                index, sent_text, sent_tokens = choices.receive(out)
                first = index not in choices.sent
                meta = out["meta_info"]
                reason, matched = finish_reason(meta)
                delta = (echo if first else "") + out["text"][sent_text:]
                if not delta and reason is None:
                    continue  # nothing new to say (e.g. an incomplete UTF-8 character)
                logprobs = self._logprobs(request, meta, sent_tokens, len(echo) + sent_text, first and request.echo)
                choices.mark_sent(index, out)
                yield chunk(
                    [
                        {
                            "index": index,
                            "text": delta,
                            "logprobs": None if logprobs is None else logprobs.model_dump(),
                            "finish_reason": reason,
                            "matched_stop": matched,
                        }
                    ]
                )
            if request.include_usage and choices.latest:
                yield chunk([], usage=choices.usage(request.n).model_dump())
