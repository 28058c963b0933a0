"""The FastAPI app: routes, API-key check, OpenAI-style errors, SSE streaming.

Handlers only translate: request body -> (prompt, SamplingParams) -> EngineLoop.submit -> events
-> OpenAI JSON. Every failure a client can cause is a 400 with an OpenAI error body, raised before
the response starts (so a streaming client gets a real status code, not an error mid-stream)."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import uuid
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinyvllm.errors import InvalidRequestError
from tinyvllm.server import responses as R
from tinyvllm.server.engine_loop import EngineFailure, EngineLoop, RequestStream
from tinyvllm.server.protocol import ChatCompletionRequest, CompletionRequest, RequestValueError

log = logging.getLogger("tinyvllm.server")


@dataclass(frozen=True)
class ServerSettings:
    model_name: str                 # what /v1/models lists and requests must name
    api_key: str | None = None      # when set, every /v1 route needs "Authorization: Bearer KEY"


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type_, code, param


def build_app(engine_loop: EngineLoop, settings: ServerSettings) -> FastAPI:
    """The engine loop starts with the app and stops (aborting what is in flight) with it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.stop()

    app = FastAPI(title="tinyvllm", lifespan=lifespan)
    app.state.engine_loop = engine_loop
    app.state.settings = settings
    engine = engine_loop.engine
    context_limit = engine.engine_config.context_limit(engine.model_config)
    _install_error_handlers(app)

    def require_api_key(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                  settings.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           "invalid_request_error", code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != settings.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                           f"`{settings.model_name}`", "invalid_request_error",
                           code="model_not_found", param="model")

    @app.get("/health")
    async def health():
        if not engine_loop.healthy:
            raise APIError(503, "engine loop is not healthy", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def list_models():
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": 0, "owned_by": "tinyvllm",
            "max_model_len": context_limit}]}

    @app.post("/v1/completions", dependencies=[Depends(require_api_key)])
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompt = body.single_prompt()
        if isinstance(prompt, list):
            vocab = engine.model_config.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise RequestValueError(f"prompt token ids must be in [0, {vocab})", "prompt")
        params = body.sampling_params(default_max_tokens=16)  # OpenAI's default for completions
        ident = R.ResponseIdentity(f"cmpl-{uuid.uuid4().hex}", settings.model_name, chat=False)
        return await _serve(engine_loop, request, ident, prompt, params, body)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_api_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        prompt_ids = chat_prompt_ids(engine.tokenizer, body.template_messages())
        room = context_limit - len(prompt_ids)
        if room < 1:
            raise RequestValueError(f"the conversation is {len(prompt_ids)} tokens; this model's "
                                    f"context is {context_limit}", "messages")
        params = body.sampling_params(default_max_tokens=room)  # as vLLM: fill the context
        ident = R.ResponseIdentity(f"chatcmpl-{uuid.uuid4().hex}", settings.model_name, chat=True)
        return await _serve(engine_loop, request, ident, prompt_ids, params, body)

    return app


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The model's chat template -> token ids, ending with the assistant header so the model
    answers. Tokenized here rather than in the engine because the default max_tokens of a chat
    request (the rest of the context) depends on the prompt's length."""
    return tokenizer.encode_chat(messages)


async def _serve(engine_loop: EngineLoop, request: Request, ident: R.ResponseIdentity,
                 prompt, params, body):
    stream = await engine_loop.submit(ident.id, prompt, params)   # 400 here if the engine refuses
    if body.stream:
        return _EngineStreamingResponse(engine_loop, stream,
                                        _sse_events(stream, ident, body.wants_usage_chunk))
    collect = asyncio.ensure_future(_collect(stream))
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not collect.done():          # the client left (or we were cancelled): free its blocks
            collect.cancel()
            engine_loop.abort(ident.id)
    if not collect.done() or collect.cancelled():
        return JSONResponse(R.error_body("client disconnected"), status_code=499)
    text, last = collect.result()      # re-raises EngineFailure -> 500
    return R.full_response(ident, text, last.finish_reason, last.num_prompt_tokens,
                           last.num_generated_tokens)


async def _collect(stream: RequestStream):
    parts = []
    while True:
        event = await stream.next_event()
        parts.append(event.delta_text)
        if event.finished:
            return "".join(parts), event


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be http.disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EngineStreamingResponse(StreamingResponse):
    """A text/event-stream response that aborts its request however the response ends early:
    client disconnect (Starlette cancels the send loop), a send error, or server shutdown.
    This lives here rather than in the generator's `finally` because a generator that never
    started (client gone before the first chunk) never runs its `finally`."""

    def __init__(self, engine_loop: EngineLoop, stream: RequestStream, events):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.engine_loop, self.stream = engine_loop, stream

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.stream.finished:
                self.engine_loop.abort(self.stream.request_id)


async def _sse_events(stream: RequestStream, ident: R.ResponseIdentity, include_usage: bool):
    """The response body: every event the stream has pending goes out as one body chunk (SSE
    allows several `data:` events per chunk), so a stream that fell behind the engine catches up
    in one write instead of one write per token."""
    encode = R.StreamEncoder(ident, include_usage)
    if ident.chat:   # OpenAI opens a chat stream with the role and empty content
        yield encode.event("", first=True)
    while True:
        try:
            events = await stream.next_events()
        except EngineFailure as e:
            yield R.sse(R.error_body(str(e), "server_error", code=e.code)).encode() + SSE_DONE
            return
        parts = []
        for event in events:
            if event.finished:
                parts.append(encode.event(event.delta_text, event.finish_reason))
                if include_usage:
                    parts.append(encode.usage(event.num_prompt_tokens, event.num_generated_tokens))
                parts.append(SSE_DONE)
                yield b"".join(parts)
                return
            if event.delta_text:
                parts.append(encode.text(event.delta_text))
        if parts:
            yield parts[0] if len(parts) == 1 else b"".join(parts)


SSE_DONE = R.SSE_DONE.encode()


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
