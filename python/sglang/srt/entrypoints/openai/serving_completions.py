"""POST /v1/completions."""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi.responses import JSONResponse, Response

from sglang.srt.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from sglang.srt.entrypoints.openai.serving_base import (
    OpenAIServingBase,
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
        if request.echo and request.logprobs is not None:
            raise RequestError("echo together with logprobs is not supported")
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
            logprobs = self._logprobs(out["meta_info"], 0, len(echo)) if request.logprobs is not None else None
            choices.append(CompletionChoice(index=i, text=echo + out["text"], logprobs=logprobs, finish_reason=reason, matched_stop=matched))
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

    def _logprobs(self, meta: dict[str, Any], start: int, offset: int) -> CompletionLogprobs:
        """Logprobs of output tokens [start:], text offsets counted from `offset`."""
        tokens = meta.get("output_token_logprobs", [])[start:]
        tops = meta.get("output_top_logprobs", [])[start:]
        out = CompletionLogprobs()
        for k, (lp, tid, _) in enumerate(tokens):
            text = self.token_text(tid)
            out.tokens.append(text)
            out.token_logprobs.append(lp)
            out.text_offset.append(offset)
            offset += len(text)
            if k < len(tops) and tops[k]:
                out.top_logprobs.append({self.token_text(t): v for v, t, _ in tops[k]})
        return out

    async def _stream_chunks(self, request: CompletionRequest, outputs: AsyncIterator[dict]) -> AsyncIterator[dict]:
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        sent_text, sent_tokens = 0, 0
        echo = pending_echo = self._echo_prefix(request, 0)
        last: Optional[dict] = None
        async with contextlib.aclosing(outputs):  # closing the stream aborts the request
            async for out in outputs:
                last = out
                meta = out["meta_info"]
                reason, matched = finish_reason(meta)
                delta = pending_echo + out["text"][sent_text:]
                n_tokens = len(meta.get("output_token_logprobs", []))
                if not delta and reason is None:
                    continue  # nothing new to say (e.g. an incomplete UTF-8 character)
                pending_echo = ""
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._logprobs(meta, sent_tokens, len(echo) + sent_text).model_dump()
                sent_text, sent_tokens = len(out["text"]), n_tokens
                choice = {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched}
                yield {"id": rid, "object": "text_completion", "created": created, "model": request.model, "choices": [choice]}
            if request.include_usage and last is not None:
                yield {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": request.model,
                    "choices": [],
                    "usage": usage([last]).model_dump(),
                }
