"""POST /v1/chat/completions: the tokenizer's chat template, then the generate path."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Optional

from fastapi.responses import JSONResponse, Response

from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChoiceLogprobs,
    DeltaMessage,
    TopLogprob,
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


class OpenAIServingChat(OpenAIServingBase):
    async def handle(self, request: ChatCompletionRequest, raw_request) -> Response:
        self.check_model(request.model)
        self._check_unsupported(request)
        obj = GenerateReqInput(
            input_ids=await self.apply_chat_template(request),
            sampling_params=request.sampling_params(request.max_completion_tokens or request.max_tokens, request.min_tokens),
            stream=request.stream,
            return_logprob=request.logprobs,
            top_logprobs_num=request.top_logprobs or 0,
        )
        if request.stream:
            outputs = await start_stream(self.generate(obj, raw_request))
            return sse_response(self._stream_chunks(request, outputs))
        result = await final_output(self.generate(obj, raw_request))
        outputs = result if isinstance(result, list) else [result]  # a list of n samples when n > 1
        if result is None or None in outputs:
            return error_response("Client disconnected", 499)
        choices = []
        for i, out in enumerate(outputs):
            reason, matched = finish_reason(out["meta_info"])
            choices.append(
                ChatCompletionChoice(
                    index=i,
                    message=ChatMessageOut(content=out["text"]),
                    logprobs=self._logprobs(out["meta_info"], 0) if request.logprobs else None,
                    finish_reason=reason,
                    matched_stop=matched,
                )
            )
        response = ChatCompletionResponse(model=request.model, choices=choices, usage=usage(outputs, request.n))
        return JSONResponse(response.model_dump())

    @staticmethod
    def _check_unsupported(request: ChatCompletionRequest) -> None:
        if request.tools:
            raise RequestError("tools are not supported")
        if request.response_format is not None and request.response_format.type != "text":
            raise RequestError(f"response_format {request.response_format.type!r} is not supported")
        if request.top_logprobs is not None and not request.logprobs:
            raise RequestError("top_logprobs needs logprobs=true")
        if request.max_tokens is not None and request.max_completion_tokens is not None:
            raise RequestError("Give only one of max_tokens and max_completion_tokens")

    async def apply_chat_template(self, request: ChatCompletionRequest) -> list[int]:
        try:
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        except ValueError as e:
            raise RequestError(str(e)) from None
        tokenizer = self.tm.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("The model has no chat template; use /v1/completions")
        try:
            prompt = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **(request.chat_template_kwargs or {})
            )
        except Exception as e:  # template errors (e.g. roles the template rejects) are the client's
            raise RequestError(f"Could not apply the chat template: {e}") from None
        # The template already contains the special tokens (BOS etc.).
        return await self.tm.encode(prompt, add_special_tokens=False)

    def _logprobs(self, meta: dict[str, Any], start: int) -> ChoiceLogprobs:
        tokens = meta.get("output_token_logprobs", [])[start:]
        tops = meta.get("output_top_logprobs", [])[start:]
        content = []
        for k, (lp, tid, _) in enumerate(tokens):
            text = self.token_text(tid)
            top = [
                TopLogprob(token=self.token_text(t), logprob=v, bytes=list(self.token_text(t).encode()))
                for v, t, _ in (tops[k] if k < len(tops) else [])
            ]
            content.append(ChatTokenLogprob(token=text, logprob=lp, bytes=list(text.encode()), top_logprobs=top))
        return ChoiceLogprobs(content=content)

    async def _stream_chunks(self, request: ChatCompletionRequest, outputs: AsyncIterator[dict]) -> AsyncIterator[dict]:
        """A role chunk per choice, then the chunks of every choice (n > 1: each sample's, with its index)."""
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(choice: Optional[ChatStreamChoice], **extra) -> dict:
            c = ChatCompletionChunk(id=rid, created=created, model=request.model, choices=[choice] if choice else [], **extra)
            return c.model_dump()

        choices = StreamedChoices()
        async with contextlib.aclosing(outputs):  # closing the stream aborts the request
            for index in range(request.n):
                yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
            async for out in outputs:
                index, sent_text, sent_tokens = choices.receive(out)
                meta = out["meta_info"]
                reason, matched = finish_reason(meta)
                delta = out["text"][sent_text:]
                if not delta and reason is None:
                    continue
                logprobs = self._logprobs(meta, sent_tokens) if request.logprobs else None
                choices.mark_sent(index, out)
                yield chunk(
                    ChatStreamChoice(
                        index=index,
                        delta=DeltaMessage(content=delta),
                        logprobs=logprobs,
                        finish_reason=reason,
                        matched_stop=matched,
                    )
                )
            if request.include_usage and choices.latest:
                yield chunk(None, usage=choices.usage(request.n))
