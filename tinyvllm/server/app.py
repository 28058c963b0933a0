"""The FastAPI app: routes, API-key check, CORS, OpenAI-style errors; serving.py streams.

Handlers only translate: request body -> (prompt(s), SamplingParams) -> EngineLoop -> events ->
OpenAI JSON. Every failure a client can cause is a 400 with an OpenAI error body, raised before
the response starts (so a streaming client gets a real status code, not an error mid-stream)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinyvllm.engine.intake import check_token_ids
from tinyvllm.engine.stats import StatsLogger
from tinyvllm.errors import InvalidRequestError
from tinyvllm.server import responses as R
from tinyvllm.server.encoding import PromptEncoder
from tinyvllm.server.engine_loop import EngineFailure, EngineLoop
from tinyvllm.server.guard import DEFAULT_MAX_BODY_BYTES, RequestGuard, key_matches
from tinyvllm.server.metrics import EngineMetrics
from tinyvllm.server.protocol import ChatCompletionRequest, CompletionRequest
from tinyvllm.server.responses_api import add_responses_route
from tinyvllm.server.serving import serve
from tinyvllm.server.structured_request import RequestPreparer
from tinyvllm.server.utility import add_utility_routes

log = logging.getLogger("tinyvllm.server")
STATS_DRAIN_S = 1.0           # how often the event loop folds the engine's StepStats in
MAX_LOGGED_PROMPT_CHARS = 200


@dataclass(frozen=True)
class ServerSettings:
    model_names: tuple[str, ...]    # what /v1/models lists and requests may name; [0] is the default
    api_key: str | None = None      # when set, every /v1 route needs "Authorization: Bearer KEY"
    model_path: str | None = None   # /v1/models "root"
    allowed_origins: tuple[str, ...] = ()   # CORS; none: no CORS headers, preflights get 405
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    log_requests: bool = True               # one INFO line per request
    log_stats: bool = True                  # StepStats -> /metrics and the 5 s log line
    stats_log_interval_s: float = 5.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES   # larger request bodies get a 413, unread
    enable_docs: bool = False               # FastAPI's /docs, /redoc and /openapi.json


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type_, code, param


def build_app(engine_loop: EngineLoop, settings: ServerSettings) -> FastAPI:
    """The engine loop starts with the app and stops (aborting what is in flight) with it."""
    engine = engine_loop.engine
    context_limit = engine.engine_config.context_limit(engine.model_config)
    metrics = EngineMetrics(settings.model_names[0], context_limit, cache_info(engine))
    stats_logger = StatsLogger(settings.stats_log_interval_s)
    encoder = PromptEncoder(engine)       # tokenizing off the event loop and the engine thread
    if settings.log_stats:
        engine_loop.add_stats_listener(metrics.record)
        engine_loop.add_stats_listener(stats_logger.record)

    async def fold_stats():
        while True:
            await asyncio.sleep(STATS_DRAIN_S)
            try:
                engine_loop.drain_stats()
                stats_logger.maybe_log()
            except Exception:   # a bug here must not end the stats for good
                log.exception("stats update failed")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        ticker = asyncio.ensure_future(fold_stats()) if settings.log_stats else None
        try:
            yield
        finally:
            if ticker is not None:
                ticker.cancel()
            engine_loop.stop()
            encoder.close()

    docs = settings.enable_docs
    app = FastAPI(title="tinyvllm", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.engine_loop, app.state.settings, app.state.metrics = engine_loop, settings, metrics
    # API key, body size, JSON depth: before any body is read (server/guard.py). Added before
    # CORS, so CORS wraps it and its refusals carry CORS headers too.
    app.add_middleware(RequestGuard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=list(settings.allowed_methods),
                           allow_headers=list(settings.allowed_headers),
                           allow_credentials=settings.allow_credentials)
    _install_error_handlers(app)

    def require_api_key(request: Request) -> None:
        """RequestGuard has checked already; this keeps a route safe on its own. Starlette
        decodes header bytes as latin-1, so encoding back gives the bytes the client sent."""
        if settings.api_key is None:
            return
        if not key_matches(request.headers.get("authorization", "").encode("latin-1"),
                           settings.api_key):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           "invalid_request_error", code="invalid_api_key")

    def check_model(name: str | None) -> str:
        """The model name to answer with: the one asked for, or by default the first."""
        if name is None:
            return settings.model_names[0]
        if name not in settings.model_names:
            served = ", ".join(f"`{n}`" for n in settings.model_names)
            raise APIError(404, f"The model `{name}` does not exist; this server serves {served}",
                           "invalid_request_error", code="model_not_found", param="model")
        return name

    def prompt_ids_of_chat(messages, add_generation_prompt: bool = True,
                           add_special_tokens: bool = False, tools: list | None = None) -> list[int]:
        return chat_prompt_ids(engine.tokenizer, messages, add_generation_prompt, add_special_tokens, tools)

    prepare = RequestPreparer(engine, encoder, prompt_ids_of_chat, context_limit)

    def log_request(request_id: str, prompts: list, params) -> None:
        if settings.log_requests and log.isEnabledFor(logging.INFO):
            shown = [p[:MAX_LOGGED_PROMPT_CHARS] if isinstance(p, str) else f"<{len(p)} token ids>"
                     for p in prompts]
            log.info("Received request %s: prompt: %r, params: %s", request_id,
                     shown[0] if len(shown) == 1 else shown, params)

    async def health():
        if not engine_loop.healthy:
            raise APIError(503, "engine loop is not healthy", "server_error")
        return {"status": "ok"}

    app.add_api_route("/health", health, methods=["GET"])
    add_utility_routes(app, engine_loop, metrics if settings.log_stats else None, check_model,
                       prompt_ids_of_chat, health, encoder)

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def list_models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "tinyvllm",
            "root": settings.model_path or name, "parent": None, "max_model_len": context_limit}
            for name in settings.model_names]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(require_api_key)])
    async def retrieve_model(model_id: str):
        check_model(model_id)
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "tinyvllm",
                "root": settings.model_path or model_id, "parent": None, "max_model_len": context_limit}

    @app.post("/v1/completions", dependencies=[Depends(require_api_key)])
    async def completions(body: CompletionRequest, request: Request):
        model = check_model(body.model)
        prompts = body.prompts()
        vocab = engine.model_config.vocab_size
        for prompt in prompts:
            if isinstance(prompt, list) and prompt:
                check_token_ids(prompt, vocab)
        params = body.sampling_params(default_max_tokens=16,  # OpenAI's default for completions
                                      defaults=engine.default_sampling_fields)
        await prepare.check_constraint(params, body)
        ident = R.ResponseIdentity(f"cmpl-{uuid.uuid4().hex}", model, chat=False)
        log_request(ident.id, prompts, params)
        prompts = await encoder.prompts(prompts)
        return await serve(engine_loop, request, ident, prompts, params, bool(body.stream),
                           body.wants_usage_chunk, echo=bool(body.echo))

    @app.post("/v1/chat/completions", dependencies=[Depends(require_api_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        model = check_model(body.model)
        # max_tokens defaults to the context left, as vLLM's
        prompt_ids, params, plan = await prepare.chat(body, body.template_messages(), body.tools, body.tool_choice)
        ident = R.ResponseIdentity(f"chatcmpl-{uuid.uuid4().hex}", model, chat=True)
        log_request(ident.id, [prompt_ids], params)
        return await serve(engine_loop, request, ident, [prompt_ids], params, bool(body.stream),
                           body.wants_usage_chunk, tools=plan)

    add_responses_route(app, engine_loop, check_model, prepare, require_api_key)

    return app


def cache_info(engine) -> dict[str, str]:
    """The labels of tinyvllm:cache_config_info (vLLM's names)."""
    config = engine.engine_config
    return {"block_size": str(config.block_size), "num_gpu_blocks": str(engine.block_manager.num_blocks),
            "gpu_memory_utilization": str(config.gpu_memory_utilization)}


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, tools: list | None = None) -> list[int]:
    """The model's chat template (or --chat-template's) -> token ids, by default ending with the
    assistant header so the model answers: the one place the server renders a conversation.
    Tokenized here rather than in the engine because the default max_tokens of a chat request
    (the rest of the context) depends on the prompt's length. The template writes its own
    BOS; add_special_tokens (a /tokenize option) adds the tokenizer's on top, as vLLM does.
    tools: the template's `tools` (a template that renders tools itself)."""
    extra = {} if tools is None else {"tools": tools}
    if not add_special_tokens:
        return tokenizer.encode_chat(messages, add_generation_prompt, **extra)
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt, **extra),
                            add_special_tokens=True)


def _install_error_handlers(app: FastAPI) -> None:
    def reply(status: int, message: str, type_: str, param=None, code=None) -> JSONResponse:
        return JSONResponse(R.error_body(message, type_, param, code), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            detail = errors[0].get("ctx", {}).get("error", "")
            return reply(400, f"request body is not valid JSON: {detail}", "invalid_request_error")
        param, message = describe_validation_error(errors)
        if param is None:   # the body is not a JSON object at all; the usual cause is a missing header
            message = "request body must be a JSON object (send Content-Type: application/json)"
        return reply(400, message, "invalid_request_error", param)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, exc: InvalidRequestError):
        param = getattr(exc, "param", None)
        if param is None:   # SamplingParams.validate() names the field in its message
            found = re.match(r"invalid sampling parameter (\w+)=", str(exc))
            param = found and found.group(1)
        return reply(400, str(exc), "invalid_request_error", param)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return reply(exc.status, str(exc), exc.type, exc.param, exc.code)

    @app.exception_handler(EngineFailure)
    async def engine_failure(request: Request, exc: EngineFailure):
        return reply(exc.status, str(exc), "server_error", code=exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return reply(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        # a bug: the traceback goes to the log (Starlette re-raises it to uvicorn), the client
        # gets an OpenAI error body without it
        return reply(500, "internal server error (the server log has the details)", "server_error",
                     code="internal_error")


def describe_validation_error(errors: list[dict]) -> tuple[str | None, str]:
    """(param, message) for the first bad field. Pydantic reports a value that matches no member
    of a union once per member, with the member's type in the location ("prompt", "str"); those
    are folded into one "expected one of" message."""
    def split(loc):
        fields = [str(p) for p in loc if p != "body"]
        first_tag = next((i for i, p in enumerate(fields) if _is_type_tag(p)), len(fields))
        return ".".join(fields[:first_tag]) or None, fields[first_tag:first_tag + 1]

    param, tags = split(errors[0].get("loc", ()))
    if not tags:
        return param, f"{param or 'request body'}: {errors[0].get('msg', 'invalid value')}"
    members = []
    for err in errors:
        p, t = split(err.get("loc", ()))
        if p == param and t and t[0] not in members:
            members.append(t[0])
    return param, f"{param}: invalid value; expected one of: {', '.join(members)}"


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or "[" in part
