"""The routes vLLM serves besides the OpenAI ones, with vLLM's request and response shapes:

    GET/POST /ping      as /health: 200 while the engine loop is healthy, else 503
    GET  /version       {"version": "..."}
    POST /tokenize      {"prompt": str} or {"messages": [...]} -> {"count", "max_model_len",
                        "tokens", "token_strs"}; messages go through the same chat template
                        (and the same tokenization) as /v1/chat/completions
    POST /detokenize    {"tokens": [int, ...]} -> {"prompt": str}
    GET  /metrics       Prometheus text (server/metrics.py); 404 with --disable-log-stats

As in vLLM, only /v1 routes need the API key."""
from __future__ import annotations

import json
from typing import Optional

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinyvllm import __version__
from tinyvllm.errors import RequestValueError
from tinyvllm.server.protocol import ChatMessage


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: Optional[str] = None
    return_token_strs: bool = False


class TokenizeCompletionRequest(_Body):
    prompt: str
    add_special_tokens: bool = True          # the BOS, as a completion prompt gets


class TokenizeChatRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False         # the template writes its own BOS
    # accepted only when absent or empty: the server's template is the one chat completions use
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict] = None
    tools: Optional[list] = None

    def refuse_unsupported(self) -> None:
        for name, why in (("continue_final_message", "is not supported"),
                          ("chat_template", "per request is not supported: start the server "
                                            "with --chat-template"),
                          ("chat_template_kwargs", "are not supported"),
                          ("tools", "are not supported")):
            if getattr(self, name):
                raise RequestValueError(f"{name} {why}", name)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: Optional[str] = None
    tokens: list[int]


async def _parse(request: Request, model: type[BaseModel], raw: dict | None = None):
    """The body as `model`, with the same 400s as the FastAPI-validated routes."""
    if raw is None:
        raw = await _json(request)
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


async def _json(request: Request):
    try:
        return json.loads(await request.body())
    except ValueError as e:
        raise RequestValueError(f"request body is not valid JSON: {e}") from None


def add_utility_routes(app: FastAPI, engine_loop, metrics, check_model, chat_prompt_ids,
                       health, encoder) -> None:
    """encoder: the server's PromptEncoder (server/encoding.py), so /tokenize encodes off the
    event loop too."""
    engine = engine_loop.engine
    tokenizer, vocab = engine.tokenizer, engine.model_config.vocab_size
    context_limit = engine.engine_config.context_limit(engine.model_config)

    for method in ("GET", "POST"):   # a route a method: each gets its own OpenAPI operation id
        app.add_api_route("/ping", health, methods=[method])

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        if metrics is None:
            raise StarletteHTTPException(404, "metrics are off: the server runs with --disable-log-stats")
        engine_loop.drain_stats()          # everything the engine has done up to now
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        raw = await _json(request)
        chat = isinstance(raw, dict) and "messages" in raw
        body = await _parse(request, TokenizeChatRequest if chat else TokenizeCompletionRequest, raw)
        check_model(body.model)
        if chat:
            body.refuse_unsupported()
            ids = await encoder.chat(chat_prompt_ids, [m.as_template_message() for m in body.messages],
                                     body.add_generation_prompt, body.add_special_tokens,
                                     fit_context=False)
        else:
            ids = await encoder.text(body.prompt, body.add_special_tokens)
        strs = [tokenizer.backend.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": context_limit, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _parse(request, DetokenizeRequest)
        check_model(body.model)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise RequestValueError(f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}
