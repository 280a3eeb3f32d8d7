"""The HTTP server: FastAPI routes over one TokenizerManager, and `launch_server`.

Every error response, including validation of malformed bodies, unknown routes and a
missing API key, is an OpenAI-style JSON body {"error": {"message", "type", "code"}}.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import signal
import threading
import time
import urllib.request
from typing import Any, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from sglang.srt.entrypoints.admin_protocol import ProfileRequest
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from sglang.srt.entrypoints.openai.serving_base import error_response, sse_response, start_stream
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from sglang.srt.managers.io_struct import ProfileReq
from sglang.srt.managers.scheduler_heartbeat import stalled_schedulers
from sglang.srt.managers.tokenizer_manager import (
    GenerateReqInput,
    RequestError,
    TokenizerManager,
    final_output,
    incremental_outputs,
)
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20
HEALTH_GENERATE_TIMEOUT_S = 30.0
# Probes and scrapers reach these without the API key (as upstream SGLang).
_OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
# Server arguments that no endpoint returns.
_SECRET_SERVER_ARGS = frozenset({"api_key"})


async def _profile_response(tokenizer_manager: TokenizerManager, req: ProfileReq) -> Response:
    ok, message = await tokenizer_manager.profile(req)
    return PlainTextResponse(message + "\n") if ok else error_response(message, 400)


def create_app(tokenizer_manager: TokenizerManager, scheduler_info: dict[str, Any]) -> FastAPI:
    server_args = tokenizer_manager.server_args
    app = FastAPI()
    serving_chat = OpenAIServingChat(tokenizer_manager)
    serving_completion = OpenAIServingCompletion(tokenizer_manager)
    _install_error_handlers(app)
    app.add_middleware(RequestGuard, api_key=server_args.api_key)

    # Set once the warm-up generation succeeded (or was skipped): until then /health answers 503,
    # so a client (or a readiness probe) that waits for 200 never reaches a server starting up.
    app.state.warmed_up = threading.Event()

    @app.get("/health")
    async def health() -> Response:
        if tokenizer_manager.dead_reason is not None:
            return error_response(f"Unhealthy: {tokenizer_manager.dead_reason}", 503)
        stalled = stalled_schedulers(tokenizer_manager.run_dir, server_args.scheduler_stall_timeout)
        if stalled:
            name, seconds = stalled[0]
            return error_response(f"Unhealthy: scheduler {name} has not finished an iteration for {seconds:.1f} s", 503)
        if not app.state.warmed_up.is_set():
            return error_response("The server is starting: its warm-up request has not finished", 503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
        try:
            await asyncio.wait_for(final_output(tokenizer_manager.generate_request(obj)), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return error_response("Generation did not finish in time", 503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {"model_path": server_args.model_path, "tokenizer_path": server_args.tokenizer_path, "is_generation": True}

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        states = await tokenizer_manager.get_internal_state()
        public_args = {k: v for k, v in dataclasses.asdict(server_args).items() if k not in _SECRET_SERVER_ARGS}
        return {**public_args, **scheduler_info, "internal_states": states}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await tokenizer_manager.flush_cache():
            return PlainTextResponse("Cache flushed.\n")
        return error_response("Cache not flushed: requests are running", 400)

    @app.post("/start_profile")
    async def start_profile(body: Optional[ProfileRequest] = None) -> Response:
        options = body.model_dump() if body is not None else {}
        return await _profile_response(tokenizer_manager, ProfileReq("start", **options))

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        return await _profile_response(tokenizer_manager, ProfileReq("stop"))

    @app.post("/generate")
    async def generate(obj: GenerateReqInput, request: Request) -> Response:
        if obj.stream:
            outputs = tokenizer_manager.generate_request(obj, request)
            if server_args.stream_output:
                outputs = incremental_outputs(outputs)
            return sse_response(await start_stream(outputs))
        result = await final_output(tokenizer_manager.generate_request(obj, request))
        if result is None:
            return error_response("Client disconnected", 499)
        return JSONResponse(result)

    def model_card() -> ModelCard:
        return ModelCard(
            id=server_args.served_model_name, root=server_args.model_path, max_model_len=tokenizer_manager.context_len
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")  # :path: served names may hold slashes (org/model)
    async def retrieve_model(model_id: str) -> Response:
        if model_id not in (server_args.served_model_name, server_args.model_path):
            return error_response(
                f"The model {model_id!r} does not exist; this server serves {server_args.served_model_name!r}", 404
            )
        return JSONResponse(model_card().model_dump())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving_completion.handle(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving_chat.handle(body, request)

    if tokenizer_manager.metrics is not None:
        collector = tokenizer_manager.metrics

        @app.get("/metrics")
        async def metrics() -> Response:
            collector.set_rank_states(await tokenizer_manager.get_internal_state())  # per-rank gauges, pulled now
            return Response(collector.render(), media_type=collector.content_type)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        reason = first.get("msg", "invalid request").removeprefix("Value error, ")  # pydantic's prefix for a ValueError
        message = f"{where}: {reason}" if where else reason
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # it may quote a lone surrogate
        logger.info("Rejected %s %s: %s", request.method, request.url.path, message)
        return error_response(message, 400)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError) -> JSONResponse:
        logger.info("Rejected %s %s: %s", request.method, request.url.path, exc)
        return error_response(str(exc), exc.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)


class RequestGuard:
    """API key and body size, checked before any route runs. Plain ASGI: Starlette's
    BaseHTTPMiddleware would pass every chunk of every stream through a memory channel and
    extra tasks (a quarter of the HTTP process's time per streamed token)."""

    def __init__(self, app: ASGIApp, api_key: Optional[str]):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(Headers(scope=scope), needs_key=scope["path"] not in _OPEN_PATHS)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, headers: Headers, needs_key: bool) -> Optional[JSONResponse]:
        if (
            needs_key
            and self.expected is not None
            and not hmac.compare_digest(headers.get("authorization", "").encode("latin-1"), self.expected)
        ):
            return error_response("Invalid or missing API key", 401, "authentication_error")
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return error_response(f"The request body is larger than {MAX_BODY_BYTES} bytes", 413)
        return None


def launch_server(server_args: ServerArgs) -> None:
    """Start the subprocesses and serve HTTP until SIGINT/SIGTERM; leave no process behind.
    Raises RuntimeError if it stopped because a subprocess died."""
    from sglang.srt.entrypoints.engine import _launch_subprocesses, run_worker_node

    if server_args.node_rank > 0:
        run_worker_node(server_args)
        return
    tokenizer_manager, scheduler_info, subprocesses = _launch_subprocesses(server_args)

    def on_subprocess_death(reason: str) -> None:
        logger.error("%s; shutting the server down.", reason)
        tokenizer_manager.mark_dead(reason)
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn shuts down; `finally` ends the rest

    subprocesses.start_monitor(on_subprocess_death)
    app = create_app(tokenizer_manager, scheduler_info)
    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        log_level=server_args.log_level,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    threading.Thread(target=_warm_up_and_announce, args=(server, server_args, app.state.warmed_up), daemon=True).start()
    try:
        server.run()
    finally:
        subprocesses.shutdown()
        tokenizer_manager.close()
    if tokenizer_manager.dead_reason is not None:
        raise RuntimeError(tokenizer_manager.dead_reason)


def _warm_up_and_announce(server: uvicorn.Server, server_args: ServerArgs, warmed_up: threading.Event) -> None:
    """Once uvicorn listens, run one tiny generation through HTTP (unless --skip-server-warmup),
    then announce readiness (or shut down if the engine cannot generate)."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    if server_args.skip_server_warmup:
        logger.info("Warm-up skipped (--skip-server-warmup); the server is ready.")
        warmed_up.set()
        return
    headers = {"Content-Type": "application/json"}
    if server_args.api_key:
        headers["Authorization"] = f"Bearer {server_args.api_key}"
    body = json.dumps({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
    host = "127.0.0.1" if server_args.host in ("0.0.0.0", "::") else server_args.host
    request = urllib.request.Request(f"http://{host}:{server_args.port}/generate", body, headers)
    try:
        with urllib.request.urlopen(request, timeout=server_args.watchdog_timeout) as response:
            response.read()
    except Exception as e:
        logger.error("Warm-up request failed (%s); shutting down.", e)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    warmed_up.set()
    logger.info("The server is fired up and ready to roll!")
